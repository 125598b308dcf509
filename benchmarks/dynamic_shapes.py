"""A length schedule that grows and shrinks: does a new size stall on host memory?

    python benchmarks/dynamic_shapes.py [--device cuda] [--lengths 8192,16384,...] [--fraction 0.25]
                                        [--alloc-delay S] [--steady 3] [--out DIR]

Issue 19: the host arena used to grow inside the step, doubling in one pinned allocation; on an
H100 host a step that pinned 16-32 GiB took 8.8-26 s where the plain step took 0.2-0.5 s. Now it
grows ahead of use on a background thread, in bounded chunks. This script runs one schedule of
sequence lengths (default on the GPU 8k, 16k, 12k, 16k, 4k, 12k, 16k tokens; on the CPU the same
shape scaled down) twice, side by side in one process:

* ``none``: the plain step, no engine;
* ``swap``: a Chameleon engine whose budget is ``--fraction`` of the natural peak of the longest
  length, so every step moves activations to host memory;
* ``swap inline``: the same engine with its arena's growing ahead turned off (``_pool.ahead =
  False``): slabs are allocated inside the step, as before issue 19, for comparison (its step
  times are given as multiples of ``swap``'s steady step: its own steady steps may wait too).

After the schedule, each mode runs ``--steady`` more steps of every length; their median is that
length's steady step. Per schedule step it reports: step time as a multiple of the same mode's
steady step of that length, ``host_allocated_bytes``, ``host_wait_seconds`` and
``host_deferred_moves`` (copy-outs put off because no host buffer was ready; from StepStats),
and the wait as a fraction of the step's compute (the ``none`` steady step of that length). Then
the schedule's total against ``none``'s.

On the CPU allocating is fast (pages are not touched, nothing is pinned), so the allocator is
slowed on purpose through the testing hook ``CHAMELEON_SWAP_TEST_HOST_ALLOC_DELAY`` (seconds per
GiB, ``--alloc-delay``; default 2 on the CPU, 0 on CUDA where pinning is really slow).
Targets (issue 19): on the CPU no step after the first waits for host memory longer than 10% of
its compute; on an H100 no step after the first takes more than 1.5x its steady step.

Writes ``benchmarks/results/dynamic_shapes-<device>.json`` (environment, config, per-step rows,
medians) and a markdown table next to it. Losses of the two modes are compared bit for bit.
Estimate on an H100 (hidden 3072, 12 layers): 7 + 7 x 3 steps per mode at 0.2-1.2 s.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import chameleon_swap as cs  # noqa: E402
from chameleon_swap.copy import host_pool  # noqa: E402
from chameleon_swap.workloads import Llama, LlamaConfig  # noqa: E402

GPU_LENGTHS = "8192,16384,12288,16384,4096,12288,16384"
CPU_LENGTHS = "1024,2048,1536,2048,512,1536,2048"
GPU_MODEL = dict(vocab_size=32000, dim=3072, n_layers=12, n_heads=24, n_kv_heads=8,
                 max_seq_len=16384)
CPU_MODEL = dict(vocab_size=512, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=2048)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    C.add_threads_argument(p)
    p.add_argument("--lengths", default=None,
                   help=f"comma-separated sequence lengths (default GPU {GPU_LENGTHS}; "
                        f"CPU {CPU_LENGTHS})")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--fraction", type=float, default=0.25,
                   help="budget as a fraction of the longest length's natural peak")
    p.add_argument("--alloc-delay", type=float, default=None,
                   help="seconds per GiB the host allocator sleeps (testing hook; default 2 on "
                        "the CPU, 0 on CUDA)")
    p.add_argument("--steady", type=int, default=3, help="steps per length after the schedule")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    C.check_counts(p, a, ("steady", "batch"), non_negative=())
    cuda = str(a.device).startswith("cuda")
    try:
        a.lengths = [int(x) for x in (a.lengths or (GPU_LENGTHS if cuda else CPU_LENGTHS))
                     .split(",")]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers; got {a.lengths!r}")
    if not a.lengths or min(a.lengths) <= 0:
        p.error("--lengths must be positive integers")
    if not 0 < a.fraction <= 1:
        p.error(f"--fraction must be in (0, 1]; got {a.fraction}")
    if a.alloc_delay is None:
        a.alloc_delay = 0.0 if cuda else 2.0
    if a.alloc_delay < 0:
        p.error(f"--alloc-delay must be >= 0 seconds per GiB; got {a.alloc_delay}")
    return a


def batch(cfg: dict, B: int, T: int, seed: int, device) -> tuple:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(cfg["vocab_size"], (B, T + 1), generator=g)
    return t[:, :-1].to(device), t[:, 1:].to(device)


def natural_peak(model, b, device) -> int:
    """Saved-activation bytes of one plain step (distinct storages)."""
    seen, total = set(), [0]

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in seen and not isinstance(t, torch.nn.Parameter):
            seen.add(s.data_ptr())
            total[0] += s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*b).backward()
    model.zero_grad(set_to_none=True)
    return total[0]


def run_mode(mode: str, model, cfg: dict, a, device, budget) -> dict:
    def step(eng, T: int, seed: int):
        model.zero_grad(set_to_none=True)
        b = batch(cfg, a.batch, T, seed, device)

        def go():
            if eng is None:
                loss = model(*b)
                loss.backward()
                return loss.detach()
            with eng.step():
                loss = model(*b)
                loss.backward()
            return loss.detach()
        loss, dt, _ = C.timed(device, go)
        s = eng.last_step if eng is not None else None
        return dict(length=T, seconds=dt, loss=float(loss),
                    host_allocated_bytes=s.host_allocated_bytes if s else 0,
                    host_wait_seconds=s.host_wait_seconds if s else 0.0,
                    host_deferred_moves=s.host_deferred_moves if s else 0,
                    offloaded_bytes=s.offloaded_bytes if s else 0)

    eng = cs.Chameleon(budget, device=device) if mode != "none" else None
    if mode == "swap inline":
        eng._pool.ahead = False
    try:
        rows = [step(eng, T, i) for i, T in enumerate(a.lengths)]
        steady = {T: C.median(step(eng, T, 1000 + j)["seconds"] for j in range(a.steady))
                  for T in sorted(set(a.lengths))}
    finally:
        if eng is not None:
            eng.close()
    return dict(rows=rows, steady=steady)


def main(argv=None) -> dict:
    a = parse_args(argv)
    C.apply_threads(a)
    os.environ[host_pool.ALLOC_DELAY_ENV] = repr(a.alloc_delay)
    device = torch.device(a.device)
    cfg = dict(GPU_MODEL if device.type == "cuda" else CPU_MODEL)
    cfg["max_seq_len"] = max(cfg["max_seq_len"], max(a.lengths))
    torch.manual_seed(0)
    base = Llama(LlamaConfig(**cfg)).to(device)
    peak = natural_peak(copy.deepcopy(base), batch(cfg, a.batch, max(a.lengths), 0, device),
                        device)
    budget = int(peak * a.fraction)
    out = {}
    for mode in ("none", "swap", "swap inline"):
        out[mode] = run_mode(mode, copy.deepcopy(base), cfg, a, device,
                             budget if mode != "none" else None)
    none, swap, inline = out["none"], out["swap"], out["swap inline"]
    table, per_step = [], []
    for i, (n, s, v) in enumerate(zip(none["rows"], swap["rows"], inline["rows"])):
        T = s["length"]
        compute = none["steady"][T]
        row = dict(step=i, length=T, none_x_steady=n["seconds"] / none["steady"][T],
                   swap_x_steady=s["seconds"] / swap["steady"][T],
                   swap_seconds=s["seconds"], none_seconds=n["seconds"],
                   host_allocated_bytes=s["host_allocated_bytes"],
                   host_wait_seconds=s["host_wait_seconds"],
                   wait_over_compute=s["host_wait_seconds"] / compute,
                   host_deferred_moves=s["host_deferred_moves"],
                   offloaded_bytes=s["offloaded_bytes"],
                   # Against swap's steady step: inline's own "steady" steps can wait as well
                   # (a slab grown in the step is trimmed at its end and grown again).
                   inline_x_steady=v["seconds"] / swap["steady"][T],
                   inline_host_allocated_bytes=v["host_allocated_bytes"],
                   inline_host_wait_seconds=v["host_wait_seconds"],
                   losses_identical=n["loss"] == s["loss"] == v["loss"])
        per_step.append(row)
        table.append([i, T, row["none_x_steady"], row["swap_x_steady"],
                      row["host_allocated_bytes"] / 2**20, row["host_wait_seconds"] * 1e3,
                      row["wait_over_compute"], row["host_deferred_moves"], row["inline_x_steady"],
                      row["inline_host_wait_seconds"] * 1e3,
                      "yes" if row["losses_identical"] else "no"])
    total_none = sum(r["seconds"] for r in none["rows"])
    total_swap = sum(r["seconds"] for r in swap["rows"])
    total_inline = sum(r["seconds"] for r in inline["rows"])
    later = per_step[1:]
    summary = dict(total_none_seconds=total_none, total_swap_seconds=total_swap,
                   total_ratio=total_swap / total_none, total_inline_seconds=total_inline,
                   total_inline_ratio=total_inline / total_none,
                   max_wait_over_compute_after_first=max((r["wait_over_compute"] for r in later),
                                                         default=0.0),
                   max_swap_x_steady_after_first=max((r["swap_x_steady"] for r in later),
                                                     default=0.0),
                   median_swap_x_steady=C.median(r["swap_x_steady"] for r in per_step))
    payload = dict(environment=C.environment(device),
                   config=dict(lengths=a.lengths, batch=a.batch, fraction=a.fraction,
                               budget_bytes=budget, natural_peak_bytes=peak, model=cfg,
                               alloc_delay_s_per_gib=a.alloc_delay, steady_steps=a.steady,
                               threads=a.threads),
                   steps=per_step, steady_seconds={m: {str(k): v for k, v in out[m]["steady"]
                                                       .items()} for m in out},
                   summary=summary)
    md = ("# dynamic_shapes\n\n" + C.markdown_table(
        ["step", "length", "none x steady", "swap x steady", "host alloc MiB", "host wait ms",
         "wait / compute", "deferred", "inline x swap steady", "inline wait ms", "losses identical"], table)
          + f"\nTotal: swap {total_swap:.3f} s, none {total_none:.3f} s "
            f"({summary['total_ratio']:.2f}x); swap inline {total_inline:.3f} s "
            f"({summary['total_inline_ratio']:.2f}x). Max wait / compute after the first step: "
            f"{summary['max_wait_over_compute_after_first']:.3f}; max swap x steady after the "
            f"first step: {summary['max_swap_x_steady_after_first']:.2f}.\n")
    path = C.write_results("dynamic_shapes", device, payload, md, a.out)
    print(md)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
