"""Keep, swap or recompute: the hybrid engine against recomputation and swapping alone.

    python benchmarks/hybrid.py [--device cuda] [--config 4096x8] [--quick] [--out DIR]
    python benchmarks/hybrid.py --emulate-link h100 [--config 256x8] [--label after]  # CPU

``--emulate-link BW`` (CPU only) runs the engines' copies at that bandwidth
(``Chameleon(emulate_link=BW)``: a copy is done when a link of that bandwidth would have carried
its bytes; only a step that waits for one waits), so a 2-core
CPU shows a GPU's ratio of bytes to compute: on an H100, swap only at 25% costs about 2x the
plain step (its pinned link moves about 54 GB/s). ``--emulate-link h100`` sets BW to that ratio
on the machine at hand, measured when the model is built: 0.28 of what the longest length's
forward saves per second of it (54 GB/s against 30.4 GiB saved in a 0.172 s forward, as measured
by the project on an H100; ``chameleon_swap.bench.choice.h100_link``, the demo's rule too). A
fixed BW reproduces the ratio on one machine only: 130 MB/s was chosen on 2026-11-27, where
swap@25% read 1.92-2.36x the plain step in four runs (140 MB/s 1.72-2.04x in six, 150-160 MB/s
1.69-1.79x, 200 MB/s 1.34-1.55x), and ran every emulated run since; on 2026-11-29 the machine
ran the plain 256-token step of 256x8 in 105 ms where earlier runs read about 290, and the same
130 MB/s swapped 4.31x the plain step at 25%; the ratio rule gave 281 MB/s there (the forward at
512 tokens saved 90 MB in 91 ms), where swap@25% read 2.17x. The results then also say, per
hybrid step, what its plan predicted against what it measured, and the files are named
``hybrid-emulated[-LABEL]-cpu.*``. On any device each hybrid step's row says how long its end
spent making mode plans (``plan_s``), and each hybrid engine's planner state the total
(``planning_s``) against its steps' (``trained_s``).

A Hugging Face ``LlamaForCausalLM`` built from a config (SDPA attention, fp32 weights; bf16
autocast on CUDA), trained on a schedule of sequence lengths. Modes, interleaved step by step in
one process (the order rotates every repetition, so drift and warm-up affect each alike):

* ``none``: the plain step;
* ``full-recompute``: non-reentrant ``torch.utils.checkpoint`` around every decoder layer, what
  Hugging Face's ``gradient_checkpointing_enable()`` does (applied here from outside, so the same
  model object serves every mode);
* ``selective-recompute``: PyTorch's selective activation checkpointing around every decoder
  layer, keeping matmul and attention outputs;
* ``hooks`` (CPU only): the plain step under ``saved_tensors_hooks`` that hand back what they
  get: the floor of any engine built on those hooks, as autograd keeps a hooked saved tensor
  (in the first two runs on this project's 2-core CPU, 0.98-1.01x the plain step step for step:
  what an engine costs above it is its own);
* ``swap@P``: ``Chameleon(budget=P x natural peak)``, swap only;
* ``hybrid@P``: ``Chameleon(budget=P x natural peak, model=model)``: keep, swap or recompute.

Budgets P are 25%, 50% and 75% of the natural saved-activation peak at the longest length.
Reported per mode: step time median and total (first steps and new lengths included), peak device
memory (CUDA ``max_memory_allocated`` above the step's start; on the CPU the bench meter's count of
what the step allocates, from one metered step at the longest length), bytes moved, bytes
recomputed, block modes; and whether every loss was bit-for-bit the plain step's. Step for step
too (``paired_ratio_vs_none``, and each engine's ``paired_vs`` every other mode): the median of a
mode's step over another's at the same length in the same round, run back to back, which a
machine that speeds up or slows down over the run leaves alone (the plain medians do not: on
this project's shared CPU whole runs moved by 0.05-0.14x). Off CUDA, what each recomputation
keeps after its forward at each length (``kept_bytes_per_length``, the bench meter's live bytes)
and whether the budget holds it (``fits_per_length``; "(over)" in the per-length table): 256x8's
selective recomputation keeps 26.9, 40.3 and 53.8 MiB at 256, 384 and 512 tokens, over the 50%
budget's 42.9 at 512, where issue 18's 50% target compares the hybrid with it.

Time on one H100 (``--device cuda``, default config): 5 modes x 3 budgets x (2 + 4) steps x 3
lengths, 270 steps; their times summed to 166 s when the project ran it there, about 3 minutes
with the model's set-up. ``--quick`` halves the steps, ``--fractions 0.25`` runs one budget. On 2
CPU cores the default CPU config (256x4) took about 1.5 minutes and 256x8 about 2.5 before the
``hooks`` peer; 256x8 takes about 3 with it. 256x8 has the
GPU config's eight blocks: at 25% the budget holds what recomputing every block saves and one
block more (9.6 MiB of 21.5 at 512 tokens, a block 9.5), where 256x4's holds 7.6 of 11.4 and
no block can stay without copies.

Writes ``benchmarks/results/hybrid-<device>.json`` (environment, config, medians, ratios), a
markdown table next to it and a PNG.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import chameleon_swap as cs  # noqa: E402
from chameleon_swap.engine import paused_hooks  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75)
# hidden x layers -> lengths of the schedule, as measured on an H100 by the project.
GPU_CONFIGS = {"2048x16": (4096, 8192, 16384, 12288), "4096x8": (8192, 16384, 12288),
               "8192x4": (6144, 8192, 7168)}
CPU_CONFIGS = {"256x4": (256, 512, 384), "256x8": (256, 512, 384), "128x2": (64, 128, 96)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    C.add_threads_argument(p)
    p.add_argument("--config", default=None,
                   help=f"hidden x layers: {', '.join(GPU_CONFIGS)} (GPU), "
                        f"{', '.join(CPU_CONFIGS)} (CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed steps per mode and budget")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode and budget")
    p.add_argument("--quick", action="store_true", help="fewer steps, a smaller CPU model")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--emulate-link", default=None, metavar="BW",
                   help="CPU only: the engines' copies run at this bandwidth (e.g. 130MB/s), or "
                        "'h100': at an H100's ratio of bytes to compute, measured here")
    p.add_argument("--label", default=None, help="added to the results' file name (e.g. before)")
    p.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS), metavar="F,F",
                   help="budgets as shares of the natural peak, each in (0, 1] "
                        "(default: %(default)s; fewer fit a short GPU lease)")
    a = p.parse_args(argv)
    C.check_emulated_link(p, a, gpu=a.device != "cpu")
    raw = a.fractions
    try:
        a.fractions = tuple(float(x) for x in raw.split(","))
    except ValueError:
        a.fractions = ()
    if not a.fractions or not all(0 < f <= 1 for f in a.fractions):
        p.error(f"--fractions takes shares of the natural peak in (0, 1], separated by commas "
                f"(e.g. 0.25,0.5); got {raw!r}")
    C.apply_threads(a)
    cuda = a.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda was given but torch.cuda.is_available() is False")
    configs = GPU_CONFIGS if cuda else CPU_CONFIGS
    if a.config is None:
        a.config = "4096x8" if cuda else ("128x2" if a.quick else "256x4")
    if a.config not in configs:
        p.error(f"--config must be one of {', '.join(configs)} on {'cuda' if cuda else 'cpu'}; "
                f"got {a.config!r}")
    if a.reps is None:
        a.reps = 2 if a.quick else 4
    C.check_counts(p, a, ("reps",))
    return a


def build(a, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, layers = (int(x) for x in a.config.split("x"))
    cuda = device.type == "cuda"
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 128 if cuda else hidden // 32),
                      intermediate_size=int(hidden * 8 / 3) // 64 * 64 or 64,
                      vocab_size=32000 if cuda else 2048, max_position_embeddings=32768,
                      attn_implementation="sdpa", use_cache=False)
    cfg.num_key_value_heads = cfg.num_attention_heads
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)
    model.train()
    return model, cfg


@contextlib.contextmanager
def checkpointed(model, selective: bool, first: Optional[int] = None):
    """Non-reentrant checkpointing around every decoder layer (the ``first`` ones only, where
    given) for one step: full, or selective (PyTorch's selective checkpointing keeping matmul
    and attention outputs)."""
    from torch.utils.checkpoint import checkpoint

    from chameleon_swap.bench.baselines import _selective_context
    extra = {"context_fn": _selective_context} if selective else {}
    layers = list(model.model.layers)[:first]
    saved = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        inner = layer.forward

        def fwd(*args, _f=inner, **kwargs):
            return checkpoint(_f, *args, use_reentrant=False, **extra, **kwargs)
        layer.forward = fwd
    try:
        yield
    finally:
        for layer, f in zip(layers, saved):
            if f is None:
                del layer.forward
            else:
                layer.forward = f



def add_budget_arguments(p, fraction: float, warmup: int) -> None:
    """The arguments of the scripts that step this model at one budget (``lean.py``,
    ``mixes.py``) but their own modes' and ``--rounds``; ``fraction`` and ``warmup``: the
    defaults of ``--fraction`` (checked by ``check_budget_arguments``) and ``--warmup``."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    C.add_threads_argument(p)
    p.add_argument("--config", default=None,
                   help=f"hidden x layers, as hybrid.py's: {', '.join(GPU_CONFIGS)} (GPU), "
                        f"{', '.join(CPU_CONFIGS)} (CPU)")
    p.add_argument("--fraction", type=float, default=fraction,
                   help="the budget as a share of the longest length's natural peak, in (0, 1]")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed rounds first")
    p.add_argument("--emulate-link", default=None, metavar="BW",
                   help="CPU only: the engines' copies run at this bandwidth, or 'h100' (the "
                        "default): at an H100's ratio of bytes to compute, measured here")
    p.add_argument("--quick", action="store_true", help="a small model, few rounds (smoke run)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder (default benchmarks/results)")

def check_budget_arguments(p, a, rounds: tuple[int, int], quick_warmup: int) -> None:
    """What the scripts that step this model at one budget (``lean.py``, ``mixes.py``) check and
    default alike: ``--fraction`` in (0, 1], a CUDA device that is there, the emulated link
    (``h100`` by default on the CPU), ``--config`` (4096x8 on a GPU, 256x8 on the CPU; with
    ``--quick`` 128x2 on the CPU, three rounds after ``quick_warmup``), ``--rounds`` (``rounds``:
    the GPU's default, the CPU's), the threads."""
    if not 0 < a.fraction <= 1:
        p.error(f"--fraction must be a share of the natural peak in (0, 1]; got {a.fraction}")
    cuda = a.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda was given but torch.cuda.is_available() is False")
    C.check_emulated_link(p, a, gpu=cuda)
    if not cuda and a.emulate_link is None:
        a.emulate_link = C.H100_LINK
    configs = GPU_CONFIGS if cuda else CPU_CONFIGS
    if a.quick:
        a.config = a.config or ("4096x8" if cuda else "128x2")
        a.rounds, a.warmup = 3, quick_warmup
    a.config = a.config or ("4096x8" if cuda else "256x8")
    if a.rounds is None:
        a.rounds = rounds[0] if cuda else rounds[1]
    if a.config not in configs:
        p.error(f"--config must be one of {', '.join(configs)} on {'cuda' if cuda else 'cpu'}; "
                f"got {a.config!r}")
    C.check_counts(p, a, ("rounds",))
    C.apply_threads(a)


def stepper(a, device):
    """The model of ``a.config`` and what those scripts step it with: ``(model, cfg, lengths,
    step, natural)``, the lengths sorted, ``step(T)`` one training step of a batch of ``T``
    tokens (bf16 autocast on CUDA) returning its loss, and the longest length's natural
    activation peak. Sets ``a.link_bytes_per_s``, what the engines' ``emulate_link=`` gets."""
    model, cfg = build(a, device)
    lengths = sorted(set(GPU_CONFIGS.get(a.config) or CPU_CONFIGS[a.config]))
    gen = torch.Generator().manual_seed(1)
    batches = {T: torch.randint(0, cfg.vocab_size, (1, T + 1), generator=gen).to(device)
               for T in lengths}
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else contextlib.nullcontext())

    def step(T: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        ids = batches[T]
        with autocast:
            loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        return loss.detach()

    with cs.Chameleon(None, device=device) as probe:
        with probe.step():
            step(max(lengths))
        natural = probe.last_step.peak_resident_bytes
    model.zero_grad(set_to_none=True)
    longest = batches[max(lengths)]
    a.link_bytes_per_s = C.link_bandwidth(
        a.emulate_link, lambda: model(input_ids=longest[:, :-1], labels=longest[:, 1:]), natural)
    return model, cfg, lengths, step, natural

def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    model, cfg = build(a, device)
    lengths = GPU_CONFIGS.get(a.config) or CPU_CONFIGS[a.config]
    gen = torch.Generator().manual_seed(1)
    batches = {T: torch.randint(0, cfg.vocab_size, (1, T + 1), generator=gen).to(device)
               for T in set(lengths)}
    def loss_of(T: int) -> torch.Tensor:
        ids = batches[T]
        with (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
              else contextlib.nullcontext()):
            return model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss

    longest = max(lengths)
    with cs.Chameleon(None, device=device) as probe:
        with probe.step():
            loss_of(longest).backward()
        natural = probe.last_step.peak_resident_bytes
    model.zero_grad(set_to_none=True)
    a.link_bytes_per_s = C.link_bandwidth(a.emulate_link, lambda: loss_of(longest), natural)

    def run(mode: str, engines: dict, T: int) -> torch.Tensor:
        # Each mode as it would run alone: no other engine's idle global module hooks on its
        # module calls (``chameleon_swap.engine.paused_hooks``; measured, two idle engines cost
        # the CPU demo's checkpointed step 3.6%).
        with paused_hooks([e for m, e in engines.items() if m != mode]):
            return _run(mode, engines, T)

    def _run(mode: str, engines: dict, T: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        if mode == "none":
            loss = loss_of(T)
            loss.backward()
        elif mode == "hooks":
            with torch.autograd.graph.saved_tensors_hooks(_same, _same):
                loss = loss_of(T)
                loss.backward()
        elif mode in ("full-recompute", "selective-recompute"):
            with checkpointed(model, selective=mode == "selective-recompute"):
                loss = loss_of(T)
                loss.backward()
        else:
            with engines[mode].step():
                loss = loss_of(T)
                loss.backward()
        return loss.detach()

    peers = ["none"] + (["hooks"] if device.type == "cpu" else []) + [
        "full-recompute", "selective-recompute"]
    # What each recomputation keeps for backward per length, against which a budget's targets
    # are read: one metered forward each (not on CUDA, where a lease's minutes go to the timed
    # steps). Selective checkpointing keeps outputs of its own; the budget may not hold them at
    # every length.
    kept = ({} if device.type == "cuda" else
            {m: {str(T): kept_after_forward(lambda: loss_of(T), model, m) for T in lengths}
             for m in ("full-recompute", "selective-recompute")})
    results: dict = {}
    losses_equal = True
    steps = a.warmup + a.reps
    total = len(a.fractions) * steps * (len(peers) + 2) * len(lengths)
    with C.progress(total, f"hybrid {a.config} on {C.device_name(device)}") as advance:
        for f in a.fractions:
            budget = int(natural * f)
            tag = f"{int(f * 100)}%"
            link = {} if a.emulate_link is None else {"emulate_link": a.link_bytes_per_s}
            engines = {f"swap@{tag}": cs.Chameleon(budget, device=device, **link),
                       f"hybrid@{tag}": cs.Chameleon(budget, device=device, model=model, **link)}
            modes = peers + list(engines)
            rec = {m: {"times": [], "all": [], "stats": [], "peaks": [], "timed_lengths": []}
                   for m in modes}
            for rep in range(steps):
                for T in lengths:
                    order = modes[rep % len(modes):] + modes[:rep % len(modes)]
                    losses = {}
                    for m in order:
                        planned = planning_seconds(engines.get(m))
                        losses[m], dt, peak = C.timed(device, lambda: run(m, engines, T))
                        rec[m]["all"].append(dt)
                        if rep >= a.warmup:
                            rec[m]["times"].append(dt)
                            rec[m]["timed_lengths"].append(T)
                        if peak is not None:
                            rec[m]["peaks"].append(peak)
                        if m in engines:
                            rec[m]["stats"].append(engines[m].last_step)
                            rec[m].setdefault("visits", []).append(T)
                            rec[m].setdefault("walls", []).append(dt)
                            after = planning_seconds(engines[m])
                            rec[m].setdefault("plans", []).append(
                                None if after is None else after - planned)
                            rec[m].setdefault("ratios", []).append(learnt_ratios(engines[m]))
                        advance()
                    losses_equal &= all(torch.equal(losses["none"], v) for v in losses.values())
            if device.type != "cuda":
                for m in modes:
                    rec[m]["peaks"].append(metered_peak(lambda: run(m, engines, longest), device))
            results[tag] = summarize(rec, modes, engines, budget)
            for m, per_length in kept.items():
                results[tag][m]["kept_bytes_per_length"] = per_length
                results[tag][m]["fits_per_length"] = {T: n <= budget
                                                      for T, n in per_length.items()}
            # Each budget's results as it ends: a run stopped early (a short lease, a crash)
            # keeps the budgets it finished, in the file and in the log.
            print(f"{tag}: " + ", ".join(
                f"{m} {r['ratio_vs_none']:.2f}x" + (f" {tuple(r['block_modes'])}"
                                                   if r.get("block_modes") else "")
                for m, r in results[tag].items()), flush=True)
            path, payload = save(a, cfg, device, lengths, natural, losses_equal, results)
            # Closed after the budget is written: on an H100 the engines' close (their pinned
            # host memory given back) outlasted a lease's limit after the 75% budget's last
            # step, and that budget's results were lost.
            for e in engines.values():
                e.close()
    env = payload["environment"]
    md = markdown(payload)
    if C.have_matplotlib():
        plot(results, path.with_suffix(".png"), f"{a.config} on {env['device_name']}")
    print(md)
    print(f"wrote {path}")
    return 0 if losses_equal else 1


def _same(t):
    return t


def save(a, cfg, device, lengths, natural: int, losses_equal: bool, results: dict):
    """Write what has run so far (JSON and markdown); returns (path, payload)."""
    payload = {"benchmark": "hybrid", "environment": C.environment(device),
               "config": {"model": "LlamaForCausalLM", "hidden": cfg.hidden_size,
                          "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
                          "ffn": cfg.intermediate_size, "vocab": cfg.vocab_size,
                          "lengths": list(lengths), "batch": 1, "reps": a.reps,
                          "warmup": a.warmup, "fractions": list(a.fractions),
                          "autocast": "bf16" if device.type == "cuda" else None,
                          "threads": torch.get_num_threads(),
                          "emulated_link": a.emulate_link,
                          "emulated_link_bytes_per_s": a.link_bytes_per_s},
               "natural_activation_peak_bytes": natural,
               "losses_bitwise_equal_across_modes": bool(losses_equal), "results": results}
    name = "hybrid" if a.emulate_link is None else "hybrid-emulated"
    name += f"-{a.label}" if a.label else ""
    return C.write_results(name, device, payload, markdown(payload), a.out), payload


def kept_after_forward(forward, model, mode: str) -> int:
    """Bytes a forward under ``mode``'s recomputation (``full-recompute`` or
    ``selective-recompute``) leaves allocated for backward (the bench meter's live bytes when it
    returns: what the budget bounds; the plain forward's equals the engine's count of its saved
    bytes)."""
    from chameleon_swap.bench.meter import MemoryMeter
    with checkpointed(model, selective=mode == "selective-recompute"):
        with MemoryMeter(next(model.parameters()).device, record_curve=False) as m:
            loss = forward()
            live = m.live_bytes
    del loss
    return live


def metered_peak(step, device) -> int:
    from chameleon_swap.bench.meter import MemoryMeter
    with MemoryMeter(device, record_curve=False) as m:
        step()
    return m.peak_bytes


def paired(times: list, against: list) -> Optional[float]:
    """The median of ``times[i] / against[i]``: two modes' steps of one length in one round
    (the run's order), None where there are none."""
    ratios = [t / a for t, a in zip(times, against) if a > 0]
    return C.median(ratios) if ratios else None


def summarize(rec: dict, modes: list, engines: dict, budget: int) -> dict:
    none = C.median(rec["none"]["times"])
    out = {}
    for m in modes:
        r = rec[m]
        med = C.median(r["times"])
        by_length: dict = {}
        for T, dt in zip(r["timed_lengths"], r["times"]):
            by_length.setdefault(T, []).append(dt)
        row = {"median_step_s": med, "ratio_vs_none": med / none,
               "paired_ratio_vs_none": paired(r["times"], rec["none"]["times"]),
               "total_s": sum(r["all"]),
               "peak_device_bytes": max(r["peaks"]) if r["peaks"] else None,
               "median_step_s_per_length": {str(T): C.median(v)
                                            for T, v in sorted(by_length.items())}}
        if m in engines:
            s = r["stats"]
            row.update(budget_bytes=budget,
                       max_peak_resident_bytes=max(v.peak_resident_bytes for v in s),
                       budget_held=all(v.peak_resident_bytes <= budget for v in s),
                       median_moved_bytes=int(C.median(v.offloaded_bytes for v in s)),
                       median_recomputed_bytes=int(C.median(v.recomputed_bytes for v in s)),
                       median_recompute_s=C.median(v.recompute_seconds for v in s),
                       median_stall_s=C.median(v.stall_seconds for v in s),
                       block_modes=list(s[-1].block_modes),
                       steps=[dict(prediction_row(T, v, w, p), **q) for T, v, w, p, q in
                              zip(r["visits"], s, r["walls"], r["plans"], r["ratios"])],
                       planner=planner_state(engines[m]))
            # Against every other mode, step for step: the same length in the same round,
            # run back to back, so the machine's drift over the run divides out.
            row["paired_vs"] = {o: paired(r["times"], rec[o]["times"])
                                for o in modes if o != m}
        out[m] = row
    return out


def planner_state(engine) -> Optional[dict]:
    """What the engine's block-mode planner held at the end (with ``model=``; None without): the
    link it plans with, the selective and full-recompute ratios it measured, and per step size
    its plan (block modes, predicted step), whether the size had a keep view of its own, its
    compute correction and memory margin, and the mixes that ran there with their low-median
    step times. For reading a GPU run afterwards: why a size runs the mix it runs."""
    pol = engine._policy
    bm = getattr(pol, "modes", None)
    if bm is None or not getattr(bm, "plans", None):
        return None
    sizes = {}
    for key, plan in sorted(bm.plans.items()):
        view = bm.views.get(key)
        ids = view.block_ids if view is not None else sorted(plan.modes)
        pred = plan.hybrid.predicted           # (None where the plan has no prediction)
        sizes[str(key)] = {
            "input_bytes": plan.input_bytes, "modes": list(plan.hybrid.counts()),
            "predicted_s": pred and float(pred.total_seconds),
            "predicted_stall_s": pred and float(pred.stall_seconds),
            "moved_bytes": pred and int(pred.moved_bytes), "own_view": view is not None,
            "view_forward_s": view and sum(b.forward_seconds for b in view.blocks),
            "stand_in": bool(plan.stand_in), "compute_scale": bm.compute_scale.get(key, 1.0),
            "margin_bytes": bm.margin.get(key, 0), "visits": bm.visits.get(key, 0),
            "ran": [{"modes": list(mix), "low_median_s": t}
                    for mix, t in bm.measured(key, list(ids)).items()]}
    d2h, h2d = pol.link()
    return {"link_bytes_per_s": [float(d2h), float(h2d)], "sel_bytes_ratio": bm.sel_bytes_ratio,
            "sel_seconds_ratio": bm.sel_seconds_ratio, "full_seconds_ratio": bm.full_seconds_ratio,
            "warm": bool(bm.warm), "planning_s": bm.planning_seconds,
            "trained_s": bm.trained_seconds, "sizes": sizes}


def learnt_ratios(engine) -> dict:
    """After a step: the full and selective recompute ratios the planner holds (None where not
    measured, or without ``model=``), and the step's recompute and stall seconds, its host waits
    and host bytes allocated (pinned inside the step on CUDA): per step, where
    a ratio was learnt and from what (a GPU run read full recomputation at twice the kept
    forward, where the steps ran it at about once)."""
    bm = getattr(engine._policy, "modes", None)
    st = engine.last_step
    # The blocks' forward times in the keep view the step's size plans from (scaled to its
    # size), which the ratios are measured against: an H100 run's ratios read 16x where a skewed
    # first view was the one cause found, and that run kept nothing to tell.
    view = bm and bm.key is not None and bm._view_near(bm.input_bytes)
    blocks = view and [round(b.forward_seconds * bm.input_bytes / max(1, view.input_bytes), 6)
                       for b in view.blocks]
    return {"full_ratio": getattr(bm, "full_seconds_ratio", None),
            "sel_ratio": getattr(bm, "sel_seconds_ratio", None),
            "recompute_s": st.recompute_seconds, "stall_s": st.stall_seconds,
            "host_wait_s": st.host_wait_seconds, "host_allocated_bytes": st.host_allocated_bytes,
            "view_block_forward_s": blocks or None}


def planning_seconds(engine) -> Optional[float]:
    """Seconds the engine's block-mode planner has spent making mode plans so far (None for an
    engine without one: swap only, or an engine that predates the counter)."""
    if getattr(engine, "_runner", None) is None:          # (no model=: no mode plans)
        return None
    return getattr(getattr(engine._policy, "modes", None), "planning_seconds", None)


def prediction_row(T: int, st, wall: float, plan: Optional[float] = None) -> dict:
    """One engine step: its length, measured and predicted step time, the wall time the
    benchmark timed around it (``wall_s``: the step and its end, the policy's planning
    included; ``plan_s``: the mode plans made at its end, where the engine makes them), and
    where its plan came from (``predicted_step_seconds`` is None before the engine had one,
    and on engines that predate it), and whether it ran lean (``StepStats.lean``)."""
    pred = getattr(st, "predicted_step_seconds", None)
    return {"length": T, "step_s": st.step_seconds, "wall_s": wall, "predicted_s": pred,
            "plan_s": plan, "plan_source": st.plan_source, "block_modes": list(st.block_modes),
            "lean": getattr(st, "lean", "")}


def prediction_summary(results: dict) -> list:
    """Per hybrid budget and length: |measured / predicted - 1| at the third visit and later
    (median), the issue's "within three steps of a size" check; beside it the same of a
    prediction no model can beat by much on a noisy machine, each step predicted by the last
    one its length ran in the same mix (``noise_floor``, None where no such pair is)."""
    out = []
    for tag, res in results.items():
        steps = res.get(f"hybrid@{tag}", {}).get("steps", [])
        for T in sorted({s["length"] for s in steps}):
            seen = [s for s in steps if s["length"] == T]
            later = [abs(s["step_s"] / s["predicted_s"] - 1) for s in seen[2:] if s["predicted_s"]]
            if later:
                floor = noise_floor(seen)
                out.append({"budget": tag, "length": T, "visits": len(seen),
                            "median_error_from_visit_3": C.median(later),
                            "noise_floor": None if floor is None else C.median(floor)})
    return out


def noise_floor(seen: list) -> Optional[list]:
    """|step / the last earlier step in the same mix - 1| for each of a length's hybrid steps
    (``seen``, in order) from the third on, a first visit never the earlier one (it runs cold);
    None where none has such a step. On this project's 2-core CPU, over the six 256x8 runs of
    the twentieth session (130 and 140 MB/s): a median of 8.8% (254 steps), the engine's own
    predictions 9.8% (324), the low median of the mix's last three steps 9.2% (slow and fast
    spells last several steps: a steadier prediction gains nothing there)."""
    out = []
    for i in range(2, len(seen)):
        mix = seen[i]["block_modes"]
        prev = [s["step_s"] for s in seen[1:i] if s["block_modes"] == mix]
        if prev and prev[-1] > 0:
            out.append(abs(seen[i]["step_s"] / prev[-1] - 1))
    return out or None


def markdown(payload: dict) -> str:
    env, cfg = payload["environment"], payload["config"]
    rows = []
    for tag, res in payload["results"].items():
        for m, r in res.items():
            fmt = cs.format_bytes
            pr = r.get("paired_ratio_vs_none")
            rows.append([tag, m, r["median_step_s"] * 1e3, r["ratio_vs_none"],
                         "-" if pr is None else f"{pr:.3f}", r["total_s"],
                         fmt(r["peak_device_bytes"]) if r["peak_device_bytes"] is not None else "-",
                         fmt(r["max_peak_resident_bytes"]) if "budget_bytes" in r else "-",
                         fmt(r["median_moved_bytes"]) if "budget_bytes" in r else "-",
                         fmt(r["median_recomputed_bytes"]) if "budget_bytes" in r else "-",
                         str(tuple(r["block_modes"])) if r.get("block_modes") else "-"])
    peak_how = ("CUDA max_memory_allocated above the step's start" if env.get("device") != "cpu"
                and "cuda" in str(env.get("device")) else
                "the bench meter's count of what one step at the longest length allocates")
    link = C.link_words(cfg) if cfg.get("emulated_link") else None
    pred = prediction_summary(payload["results"])
    pred_md = ("" if not pred else "\n\nPredicted against measured (hybrid, from each length's "
               "third step on, median |measured / predicted - 1|; the noise floor: the same of "
               "each step predicted by the last one its length ran in the same mix):\n\n"
               + C.markdown_table(
                   ["budget", "length", "steps", "error", "noise floor"],
                   [[p["budget"], p["length"], p["visits"],
                     f"{p['median_error_from_visit_3'] * 100:.0f}%",
                     "-" if p.get("noise_floor") is None else f"{p['noise_floor'] * 100:.0f}%"]
                    for p in pred]))
    per_len = []
    for tag, res in payload["results"].items():
        none = res["none"].get("median_step_s_per_length", {})
        for m, r in res.items():
            got = r.get("median_step_s_per_length", {})
            fits = r.get("fits_per_length", {})
            if m != "none" and got and none:
                per_len.append([tag, m] + [f"{got[T] / none[T]:.2f}x"
                                           + ("" if fits.get(T, True) else " (over)")
                                           for T in none if T in got])
    lengths = list(payload["results"][next(iter(payload["results"]))]["none"].get(
        "median_step_s_per_length", {}))
    per_len_md = ("" if not per_len else "\n\nPer length (median step over the plain step's "
                  "median at the same length; (over): the recomputation keeps more after its "
                  "forward than the budget):\n\n" + C.markdown_table(
                      ["budget", "mode"] + [f"T={T}" for T in lengths], per_len))
    return (f"# hybrid on {env['device_name']}"
            f"{f', emulated link {link}' if link else ''}{C.delay_note(env)}\n\n"
            f"torch {env['torch']}, commit {env['commit']}; Hugging Face Llama hidden "
            f"{cfg['hidden']} x {cfg['layers']} layers, {cfg['heads']} heads, vocab {cfg['vocab']}, "
            f"lengths {cfg['lengths']}, batch 1, autocast {cfg['autocast']}; natural activation "
            f"peak {cs.format_bytes(payload['natural_activation_peak_bytes'])}; medians of "
            f"{cfg['reps']} interleaved steps per length; peak device = {peak_how}; block modes "
            f"= (keep, selective, full) of the last step; losses bitwise equal across modes: "
            f"{payload['losses_bitwise_equal_across_modes']}.\n\n"
            + C.markdown_table(["budget", "mode", "step ms", "x none", "paired x none",
                                "total s", "peak device", "peak resident", "moved",
                                "recomputed", "block modes"], rows)
            + per_len_md + paired_md(payload["results"]) + pred_md)


def paired_md(results: dict) -> str:
    """The engines' steps over each other mode's, step for step (``paired_vs``), a column per
    mode (swap and hybrid by name, without their budget)."""
    rows, peers = [], []
    for tag, res in results.items():
        for m, r in res.items():
            vs = {o.split("@")[0]: v for o, v in (r.get("paired_vs") or {}).items()}
            if vs:
                peers += [o for o in vs if o not in peers]
                rows.append((tag, m, vs))
    if not rows:
        return ""
    table = [[tag, m] + ["-" if vs.get(o) is None else f"{vs[o]:.3f}" for o in peers]
             for tag, m, vs in rows]
    return ("\n\nStep for step (the median of each engine step over the same length's step of "
            "another mode in the same round, run back to back: the machine's drift over the run "
            "divides out):\n\n" + C.markdown_table(["budget", "engine"] + peers, table))


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tags = list(results)
    modes = ["full-recompute", "selective-recompute", "swap", "hybrid"]
    colors = {"full-recompute": "#c66", "selective-recompute": "#e9a", "swap": "#47a",
              "hybrid": "#2a6"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.2
    for i, m in enumerate(modes):
        key = (lambda t: f"{m}@{t}") if m in ("swap", "hybrid") else (lambda t: m)
        ratios = [results[t][key(t)]["ratio_vs_none"] for t in tags]
        peaks = [(results[t][key(t)]["peak_device_bytes"] or 0) / 2**20 for t in tags]
        xs = [j + (i - 1.5) * width for j in range(len(tags))]
        ax1.bar(xs, ratios, width, label=m, color=colors[m])
        ax2.bar(xs, peaks, width, label=m, color=colors[m])
    none_peak = (results[tags[0]]["none"]["peak_device_bytes"] or 0) / 2**20
    ax1.axhline(1.0, color="k", lw=0.8)
    ax2.axhline(none_peak, color="k", lw=0.8, ls="--", label="none")
    for ax, ylabel in ((ax1, "step time / none (median)"), (ax2, "peak device memory (MiB)")):
        ax.set_xticks(range(len(tags)))
        ax.set_xticklabels([f"budget {t}" for t in tags])
        ax.set_ylabel(ylabel)
    ax2.legend(fontsize=7)
    fig.suptitle(f"keep / swap / recompute, {title}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
