"""The capped schedule: a cap on all device memory over lengths that change every step.

    python benchmarks/capped.py [--device cuda] [--cap 31GiB] [--repeats 2] [--out DIR]
    python benchmarks/capped.py --quick                       # the CPU, seconds (a stand-in)

Issue 18's last GPU target: under a cap the plain step does not fit, the engine with ``model=``
runs the schedule within 1.3x of the plain step's total. Measured by the project on an H100 at
c308ca2 (before the hybrid recomputed): HF Llama 4096x8, the schedule 16k/8k/12k/16k/4k/12k/16k
tokens, a cap of 31 GiB on all device memory (weights and gradients 7.2 GiB), the host arena
limited to 96 GiB: the engine only swapped, 1.1-1.4 s a step, where full recomputation ran 0.67 s.

Modes, interleaved step by step in one process on the same batches and the same model object (no
optimizer step, so every mode computes the same forward: losses compare bit for bit on a GPU too):

* ``none``: the plain step (it fits the GPU, not the cap: its own peak is reported);
* ``full-recompute``: non-reentrant checkpointing around every decoder layer;
* ``capped``: ``Chameleon(device_memory_limit=cap, model=model)``: keep, swap or recompute, each
  step's activation budget derived from the cap.

On the CPU there is no device memory to cap (``device_memory_limit`` is CUDA only), so ``capped``
takes a budget instead, ``--fraction`` of the longest length's natural saved-activation peak, with
the copies on the emulated link (``--emulate-link``): the same code runs end to end anywhere, and
the CPU's figures stand for nothing on a GPU.

Reported per mode: the schedule's total over every step (first ones included: what a run pays)
and its ratio to ``none``'s; per step its time, and for ``capped`` its block modes and plan source;
on CUDA each step's device peak (``max_memory_allocated``) and whether ``capped`` stayed under the
cap. Exit status 1 where a loss differed or the cap was exceeded.

Estimate on one H100: 7 lengths x 2 repeats x 3 modes, 0.1-1.4 s a step, about a minute with the
model's set-up and the first steps' pinning (the host arena pins inside the first steps).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import hybrid as H  # noqa: E402

import chameleon_swap as cs  # noqa: E402
from chameleon_swap.config import format_bytes, parse_size  # noqa: E402
from chameleon_swap.engine import paused_hooks  # noqa: E402

GPU_SCHEDULE = (16384, 8192, 12288, 16384, 4096, 12288, 16384)
CPU_SCHEDULE = {"256x4": (512, 256, 384, 512, 128, 384, 512),
                "128x2": (128, 64, 96, 128, 32, 96, 128)}
MODES = ("none", "full-recompute", "capped")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    C.add_threads_argument(p)
    p.add_argument("--cap", default="31GiB", help="CUDA: the cap on all device memory (default "
                   "%(default)s, as measured at c308ca2)")
    p.add_argument("--host-limit", default="96GiB",
                   help="CUDA: the engine's host_memory_limit (default %(default)s)")
    p.add_argument("--fraction", type=float, default=0.25,
                   help="CPU: the budget, a share of the longest length's natural peak in (0, 1]")
    p.add_argument("--emulate-link", default="130MB/s", metavar="BW",
                   help="CPU: the engine's copies run at this bandwidth (default %(default)s, "
                        "the link benchmarks/hybrid.py's CPU runs use: where swapping alone at "
                        "25%% costs about 2x the plain step, as on an H100)")
    p.add_argument("--repeats", type=int, default=2, help="passes over the schedule")
    p.add_argument("--quick", action="store_true", help="CPU: the smaller model (seconds)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default "
                   "benchmarks/results)")
    a = p.parse_args(argv)
    C.check_counts(p, a, ("repeats",), non_negative=())
    a.cuda = a.device.startswith("cuda")
    if a.cuda and not torch.cuda.is_available():
        p.error("--device cuda was given but torch.cuda.is_available() is False")
    if not 0 < a.fraction <= 1:
        p.error(f"--fraction takes a share of the natural peak in (0, 1]; got {a.fraction}")
    try:
        a.cap_bytes = parse_size(a.cap, "--cap")
        a.host_limit_bytes = parse_size(a.host_limit, "--host-limit")
        cs.config.parse_bandwidth(a.emulate_link, "--emulate-link")
    except (TypeError, ValueError) as exc:
        p.error(str(exc))
    a.config = "4096x8" if a.cuda else ("128x2" if a.quick else "256x4")
    a.schedule = GPU_SCHEDULE if a.cuda else CPU_SCHEDULE[a.config]
    a.emulate_link = None if a.cuda else a.emulate_link     # (hybrid.build reads the rest)
    C.apply_threads(a)
    return a


def engine(a, model, device, natural: int):
    if a.cuda:
        return cs.Chameleon(device=device, device_memory_limit=a.cap_bytes, model=model,
                            host_memory_limit=a.host_limit_bytes)
    return cs.Chameleon(int(natural * a.fraction), device=device, model=model,
                        emulate_link=a.emulate_link)


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    model, cfg = H.build(a, device)
    gen = torch.Generator().manual_seed(1)
    batches = {T: torch.randint(0, cfg.vocab_size, (1, T + 1), generator=gen).to(device)
               for T in sorted(set(a.schedule))}
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if a.cuda
                else contextlib.nullcontext())

    def loss_of(T: int) -> torch.Tensor:
        ids = batches[T]
        with autocast:
            return model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss

    with cs.Chameleon(None, device=device) as probe:
        with probe.step():
            loss_of(max(a.schedule)).backward()
        natural = probe.last_step.peak_resident_bytes
    model.zero_grad(set_to_none=True)
    eng = engine(a, model, device, natural)

    def run(mode: str, T: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        ctx = (eng.step() if mode == "capped" else H.checkpointed(model, selective=False)
               if mode == "full-recompute" else contextlib.nullcontext())
        # The peers as they would run alone: the engine's idle module hooks out meanwhile.
        with paused_hooks([] if mode == "capped" else [eng]), ctx:
            loss = loss_of(T)
            loss.backward()
        return loss.detach()

    rows: list[dict] = []
    equal = True
    total = a.repeats * len(a.schedule) * len(MODES)
    with C.progress(total, f"capped {a.config} on {C.device_name(device)}") as advance:
        try:
            for rep in range(a.repeats):
                for i, T in enumerate(a.schedule):
                    k = (rep * len(a.schedule) + i) % len(MODES)
                    row: dict = {"pass": rep, "step": i, "length": T}
                    losses = {}
                    for m in MODES[k:] + MODES[:k]:
                        losses[m], dt, peak = timed_peak(device, lambda: run(m, T))
                        row[m] = {"seconds": dt, "device_peak_bytes": peak}
                        if m == "capped":
                            s = eng.last_step
                            row[m].update(block_modes=list(s.block_modes),
                                          plan_source=s.plan_source, budget_bytes=s.budget_bytes,
                                          offloaded_bytes=s.offloaded_bytes,
                                          recomputed_bytes=s.recomputed_bytes,
                                          **memory_row(s))
                        advance()
                    equal &= all(torch.equal(losses["none"], v) for v in losses.values())
                    rows.append(row)
                # Written after each pass, before the engine closes (giving back tens of GiB of
                # pinned host memory takes a while): on an H100 lease all 42 steps ran within
                # the part's 100 s and the close outlasted it, so nothing was written.
                payload = summarize(a, cfg, device, natural, rows, equal)
                md = markdown(payload)
                path = C.write_results("capped", device, payload, md, a.out)
        finally:
            eng.close()
    print(md)
    print(f"wrote {path}")
    return 0 if equal and payload["cap_held"] is not False else 1


def timed_peak(device: torch.device, fn):
    """``C.timed``, with the step's absolute device peak on CUDA (what a cap bounds)."""
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    out, dt, above = C.timed(device, fn)
    return out, dt, None if above is None else base + above


def memory_row(s) -> dict:
    """How the cap's budget was derived for the step (None on the CPU, which takes a budget):
    the smallest budget in force, its predicted and measured transient, whether it missed, the
    safety factor and the fragmentation kept free after it, its stalls, host waits and the host
    memory it allocated (pinned inside the step on CUDA). A run whose budgets shrink can then
    say which part of the reserve grew."""
    return {k: getattr(s, k, None) for k in (
        "min_budget_bytes", "predicted_transient_bytes", "transient_bytes", "memory_tightened",
        "memory_safety", "fragmentation_kept_bytes", "stall_seconds", "host_wait_seconds",
        "host_allocated_bytes", "peak_resident_bytes")}


def summarize(a, cfg, device, natural: int, rows: list, equal: bool) -> dict:
    totals = {m: sum(r[m]["seconds"] for r in rows) for m in MODES}
    peaks = {m: [r[m]["device_peak_bytes"] for r in rows if r[m]["device_peak_bytes"]]
             for m in MODES}
    return {"benchmark": "capped", "environment": C.environment(device),
            "config": {"model": "LlamaForCausalLM", "hidden": cfg.hidden_size,
                       "layers": cfg.num_hidden_layers, "schedule": list(a.schedule),
                       "repeats": a.repeats, "cap_bytes": a.cap_bytes if a.cuda else None,
                       "host_limit_bytes": a.host_limit_bytes if a.cuda else None,
                       "budget_fraction": None if a.cuda else a.fraction,
                       "emulated_link": a.emulate_link,
                       "autocast": "bf16" if a.cuda else None,
                       "threads": torch.get_num_threads()},
            "natural_activation_peak_bytes": natural,
            "totals_s": totals, "ratio_vs_none": {m: totals[m] / totals["none"] for m in MODES},
            "max_device_peak_bytes": {m: max(v) if v else None for m, v in peaks.items()},
            "cap_held": (max(peaks["capped"]) <= a.cap_bytes) if a.cuda and peaks["capped"]
            else None,
            "losses_bitwise_equal_across_modes": bool(equal), "steps": rows}


def markdown(p: dict) -> str:
    env, cfg = p["environment"], p["config"]
    cap = (f"a cap of {format_bytes(cfg['cap_bytes'])} on all device memory"
           if cfg["cap_bytes"] else f"a budget of {cfg['budget_fraction']:.0%} of the natural "
           f"peak, copies on the emulated link ({cfg['emulated_link']}){C.delay_note(env)}: a "
           f"CPU stand-in")
    head = (f"# capped schedule on {env['device_name']}\n\ntorch {env['torch']}, commit "
            f"{env['commit']}; HF Llama {cfg['hidden']}x{cfg['layers']}, schedule "
            f"{'/'.join(str(t) for t in cfg['schedule'])} tokens x {cfg['repeats']}; {cap}; "
            f"losses bitwise equal across modes: {p['losses_bitwise_equal_across_modes']}; "
            f"cap held: {p['cap_held']}.\n\n")
    table = C.markdown_table(
        ["mode", "total s", "x none", "max device peak"],
        [[m, p["totals_s"][m], p["ratio_vs_none"][m],
          format_bytes(v) if (v := p["max_device_peak_bytes"][m]) else "-"] for m in MODES])
    steps = C.markdown_table(
        ["pass", "step", "tokens", "none s", "full s", "capped s", "capped modes", "source"],
        [[r["pass"], r["step"], r["length"], r["none"]["seconds"],
          r["full-recompute"]["seconds"], r["capped"]["seconds"],
          str(tuple(r["capped"]["block_modes"])), r["capped"]["plan_source"]]
         for r in p["steps"]])
    return head + table + "\n" + steps


if __name__ == "__main__":
    sys.exit(main())
