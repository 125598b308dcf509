"""The demo's comparison leg: keep, swap or recompute, against gradient checkpointing.

The question a user deciding whether to adopt the library asks: is it better than
``model.gradient_checkpointing_enable()`` at the memory I have? A Hugging Face Llama built from a
small config trains on a schedule of sequence lengths, four ways side by side on the same
batches from the same weights (the order rotates every step, so drift affects each alike):

* ``none``: the plain step;
* ``gradient checkpointing``: ``gradient_checkpointing_enable()`` (non-reentrant), every layer
  recomputed: what users do today;
* ``swap only``: ``Chameleon(budget)``: saved activations swapped to the host, nothing recomputed;
* ``chameleon model=``: ``Chameleon(budget, model=model)``: per block, keep, swap or recompute.

The budget is a quarter of the natural saved-activation peak at the longest length. On the CPU
the engines' copies run on an emulated link (``emulate_link=``) set to an H100's ratio of bytes
to compute: there a 16k-token Llama 4096x8 step saves 30.4 GiB in a 0.172 s forward while the
pinned link moves 54 GB/s (measured by the project on one H100), so the link carries about
``H100_LINK_SHARE`` of what the forward saves per second. Without it a CPU copy is a memcpy the
step hides, and swapping would look free. On CUDA the link is the real one.

The verdict: which leg took less time summed over the steps, and step for step the engine's time
over checkpointing's with an interval for its median (``paired``), which says whether the run
could tell the two apart at all on a machine whose speed swings.
"""
from __future__ import annotations

import copy
import gc
import math
import statistics
import time
from typing import Callable, Optional

import torch

from ..config import format_bytes
from .harness import _sync
from .records import median_interval, nan_max

LEGS = ("none", "gradient checkpointing", "swap only", "chameleon model=")
AGAIN = "none, again"           # CUDA: the plain step a second time, its own reproducibility
FRACTION = 0.25
REFERENCE_SLACK = 2.0           # a leg's loss differences against the plain step's own (CUDA)
# 54 GB/s against 30.4 GiB saved in 0.172 s of forward (an H100, HF Llama 4096x8 at 16k tokens).
H100_LINK_SHARE = 54e9 / (30.4 * 2**30 / 0.172)
CONFIDENCE = 0.95               # of the interval around the paired median (see ``paired``)
SIZES = {
    "tiny": dict(hidden=64, layers=4, heads=4, kv_heads=2, ffn=128, vocab=256, batch=2,
                 lengths=(32, 48, 64)),
    "cpu": dict(hidden=128, layers=8, heads=4, kv_heads=2, ffn=344, vocab=2048, batch=2,
                lengths=(96, 128, 160, 128, 96, 160)),
    "cuda": dict(hidden=2048, layers=16, heads=16, kv_heads=16, ffn=5504, vocab=32000, batch=1,
                 lengths=(4096, 8192, 6144, 8192, 4096, 6144)),
}


def available() -> Optional[str]:
    """None when the leg can run, else why not (transformers is in the ``bench`` extra)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "needs transformers: pip install 'chameleon-swap[bench]'"
    return None


def h100_link(forward: Callable[[], object], saved_bytes: int, tries: int = 3) -> float:
    """The emulated link, in bytes per second, at an H100's ratio of bytes to compute on this
    machine: ``H100_LINK_SHARE`` of what a forward saves per second of it. ``forward()`` runs one
    training forward (autograd recording, as in the H100's 0.172 s, its graph dropped on return)
    of the step that saves ``saved_bytes``; its time is the least of ``tries`` (the first warms
    up). A fixed bandwidth would not do: this project's CPU machines differ by up to 2.8x in
    compute from one session to the next (the emulated-link benchmark's plain 256-token step:
    about 290 ms on one, 105 ms on another), and the same link then swaps 1.6x or 4.3x the plain
    step at 25%."""
    if saved_bytes <= 0 or tries < 1:
        raise ValueError(f"h100_link needs saved_bytes > 0 and tries >= 1; got {saved_bytes}, "
                         f"{tries}")
    seconds = float("inf")
    with torch.enable_grad():
        for _ in range(tries):
            t0 = time.perf_counter()
            forward()
            seconds = min(seconds, time.perf_counter() - t0)
    return H100_LINK_SHARE * saved_bytes / max(seconds, 1e-6)


def _model(size: dict, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                      num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"],
                      intermediate_size=size["ffn"], vocab_size=size["vocab"],
                      max_position_embeddings=max(size["lengths"]), attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device).train()


def run_choice(device: torch.device, steps: int,
               advance: Callable[..., None] = lambda *a, **k: None, tiny: bool = False) -> dict:
    """Run the four legs for ``steps`` steps each; returns the summary the demo shows
    (``tiny``: the tests' model, seconds on a CPU)."""
    from ..engine import Chameleon, paused_hooks
    size = SIZES["tiny" if tiny else "cuda" if device.type == "cuda" else "cpu"]
    base = _model(size, device)
    lengths = [size["lengths"][i % len(size["lengths"])] for i in range(steps)]
    gen = torch.Generator().manual_seed(1)
    batches = {T: torch.randint(0, size["vocab"], (size["batch"], T + 1), generator=gen).to(device)
               for T in sorted(set(lengths))}
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))

    def loss_of(model, T):
        ids = batches[T]
        with autocast:
            return model(input_ids=ids[:, :-1], labels=ids[:, 1:], use_cache=False).loss

    def saved_peak(model, T) -> int:
        with Chameleon(None, device=device, min_tensor_bytes=0) as probe:
            with probe.step():
                loss_of(model, T).backward()
            model.zero_grad(set_to_none=True)
            return probe.last_step.peak_resident_bytes

    longest = max(lengths)
    natural = saved_peak(base, longest)
    budget = int(natural * FRACTION)
    link = h100_link(lambda: loss_of(base, longest), natural) if device.type == "cpu" else None

    # On CUDA some kernels (attention's backward among them) need not give the same bits twice:
    # the plain step then runs twice, and a leg that differs from it by no more than it differs
    # from itself is as exact as the GPU allows. On the CPU the plain step is bitwise repeatable.
    again = (AGAIN,) if device.type == "cuda" else ()
    models = {leg: copy.deepcopy(base) for leg in LEGS + again}
    gc_model = models["gradient checkpointing"]
    # transformers 5.24 calls gradient_checkpointing_enable deprecated (gone in v6) for this name.
    if hasattr(gc_model, "activation_checkpointing_enable"):
        gc_model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        gc_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    emulated = {} if link is None else {"emulate_link": link}
    engines = {"swap only": Chameleon(budget, device=device, **emulated),
               "chameleon model=": Chameleon(budget, device=device,
                                                model=models["chameleon model="], **emulated)}
    opts = {leg: torch.optim.SGD(m.parameters(), lr=1e-3) for leg, m in models.items()}
    per_step = []
    losses_identical = True
    # A full collection walks every object the process holds (about 400,000 with transformers
    # loaded: 130-180 ms on this project's CPU, two to three steps of a leg), and the one or two
    # that fall in these steps land on whichever leg allocates when the count runs over. The
    # setup's objects are frozen out of them (``gc.freeze``, as a training script may do once
    # its model is built), so that no leg pays for the size of the process. Where the caller
    # froze objects already, they are left as they are (unfreeze would thaw theirs too).
    ours = gc.get_freeze_count() == 0
    if ours:
        gc.collect()
        gc.freeze()
    try:
        for i, T in enumerate(lengths):
            order = LEGS[i % len(LEGS):] + LEGS[:i % len(LEGS)] + again
            row = {"step": i, "length": T}
            losses = {}
            for leg in order:
                m, eng = models[leg], engines.get(leg)
                # Each leg as it would run alone: no other engine's idle hooks on its module
                # calls (``engine.paused_hooks``: two idle engines cost checkpointing's step 3.6%).
                with paused_hooks([e for e in engines.values() if e is not eng]):
                    _sync(device)
                    t0 = time.perf_counter()
                    if eng is None:
                        loss = loss_of(m, T)
                        loss.backward()
                    else:
                        with eng.step():
                            loss = loss_of(m, T)
                            loss.backward()
                    _sync(device)
                if leg == AGAIN:
                    again_loss = loss.detach()
                    opts[leg].step()
                    opts[leg].zero_grad(set_to_none=True)
                    continue
                row[leg] = {"seconds": time.perf_counter() - t0, "loss": loss.item()}
                if eng is not None:
                    s = eng.last_step
                    row[leg].update(peak=s.peak_resident_bytes, block_modes=list(s.block_modes),
                                    plan_source=s.plan_source, stall=s.stall_seconds,
                                    moved=s.offloaded_bytes, planning=s.planning_seconds,
                                    beside=s.background_planning_seconds,
                                    step_s=s.step_seconds, predicted=s.predicted_step_seconds)
                    # The recompute ratios the mode planner holds after the step (model=): on
                    # an H100 a corrupted one made a size keep every block for good.
                    bm = getattr(eng._policy, "modes", None)
                    row[leg].update(full_ratio=getattr(bm, "full_seconds_ratio", None),
                                    sel_ratio=getattr(bm, "sel_seconds_ratio", None))
                opts[leg].step()
                opts[leg].zero_grad(set_to_none=True)
                losses[leg] = loss.detach()
                advance()
            losses_identical &= all(torch.equal(losses["none"], v) for v in losses.values())
            if again:
                row["reference_diff"] = abs(again_loss.item() - row["none"]["loss"])
            per_step.append(row)
    finally:
        if ours:
            gc.unfreeze()
        for eng in engines.values():
            eng.close()
    peaks = {"none": {T: saved_peak(base, T) for T in batches},
             "gradient checkpointing": {T: saved_peak(models["gradient checkpointing"], T)
                                        for T in batches}}
    return summarize(per_step, peaks, budget, natural, link, losses_identical, size, device)


def within_reference(per_step: list, leg: str, reference_max_diff: Optional[float]):
    """Whether ``leg``'s losses are as exact as the plain step's own (None where the plain step
    repeats bit for bit: then only bitwise equality counts).

    Each leg trains its own copy of the model with its own optimizer, so on a GPU whose backward
    kernels are not deterministic the legs' weights drift apart from the first update on, and so
    do two runs of the plain step: after that the losses compare random walks of one size. The
    second plain run gives one sample of that walk, and a leg as exact as the GPU allows exceeds
    one sample's maximum about half the time (the project's H100, 24 steps: the plain step's own
    largest difference 5.3e-4; checkpointing 4.8e-4, swap only 6.5e-4, the engine 6.1e-4, each
    leg above the reference's difference at 9 to 11 of the steps). So a leg is within when every
    difference is at most ``REFERENCE_SLACK`` times the reference's largest (NaN never is), and
    where the plain step repeated its first loss bit for bit (a forward from the same weights:
    on that H100 every leg's first loss equalled it), the leg's first loss does too."""
    if not reference_max_diff:
        return None
    diffs = [abs(r[leg]["loss"] - r["none"]["loss"]) for r in per_step]
    if any(math.isnan(d) for d in diffs) or max(diffs) > REFERENCE_SLACK * reference_max_diff:
        return False
    first = per_step[0]
    return not (first.get("reference_diff") == 0 and diffs[0] != 0)


def paired(per_step: list, leg: str, against: str) -> dict:
    """``leg``'s step time over ``against``'s, step by step: the legs run one after the other on
    the same batch, so a machine whose speed drifts (this project's shared CPU: one length's
    checkpointed step took 51-119 ms within one demo) slows both alike, and the ratio keeps what
    the legs themselves differ by. Their median and its interval (``median_interval``): where
    the interval holds 1, the run could not tell the two apart."""
    ratios = [r[leg]["seconds"] / r[against]["seconds"] for r in per_step]
    median, interval = median_interval(ratios, CONFIDENCE)
    return {"leg": leg, "against": against, "steps": len(ratios), "median_ratio": median,
            "interval": None if interval is None else list(interval),
            "confidence": CONFIDENCE}


def _paired_words(p: dict) -> str:
    lo, hi = p["interval"] or (None, None)
    where = ("too few steps for an interval" if lo is None else
             f"{p['confidence']:.0%} interval {lo:.2f}-{hi:.2f}: " + (
                 "within the step-to-step noise, the run cannot tell them apart" if lo <= 1 <= hi
                 else "beyond the step-to-step noise"))
    return (f"step for step (the same batch, back to back) {p['leg']} took "
            f"{p['median_ratio']:.2f}x {p['against']}'s time (median of {p['steps']} steps; "
            f"{where})")


def summarize(per_step: list, peaks: dict, budget: int, natural: int, link: Optional[float],
              losses_identical: bool, size: dict, device: torch.device) -> dict:
    timed = per_step[1:] if len(per_step) > 2 else per_step      # the first step sets up
    # The last half: the engine has made its first plans and measured what it learns from
    # (keep views, recompute figures, mixes that ran); what a long run pays per step.
    steady = per_step[len(per_step) // 2:]
    legs = {}
    for leg in LEGS:
        secs = [r[leg]["seconds"] for r in timed]
        none = [r["none"]["seconds"] for r in timed]
        if leg in peaks:
            peak = max(peaks[leg][r["length"]] for r in per_step)
        else:
            peak = max(r[leg]["peak"] for r in per_step)
        legs[leg] = {"median_step_s": statistics.median(secs),
                     "ratio_vs_none": sum(secs) / sum(none),
                     "steady_ratio_vs_none": (sum(r[leg]["seconds"] for r in steady)
                                              / sum(r["none"]["seconds"] for r in steady)),
                     "peak_saved_bytes": peak, "fits_budget": peak <= budget}
        if leg == "chameleon model=":
            legs[leg]["block_modes"] = [r[leg]["block_modes"] for r in per_step]
        if "planning" in timed[0][leg]:
            # The engine's end of step (learning, planning) is in its leg's seconds: its share.
            legs[leg]["planning_share"] = sum(r[leg]["planning"] for r in timed) / sum(secs)
            # Mode plans made in the planner process: beside the leg's seconds, on another core.
            legs[leg]["background_planning_share"] = (sum(r[leg]["beside"] for r in timed)
                                                      / sum(secs))
        legs[leg]["losses_max_diff"] = nan_max(abs(r[leg]["loss"] - r["none"]["loss"])
                                               for r in per_step)
    # Where the plain step differs from itself (CUDA), a leg can be no more exact than that
    # (``within_reference``).
    ref = [r["reference_diff"] for r in per_step if "reference_diff" in r]
    reference_max_diff = nan_max(ref) if ref else None
    for leg in LEGS:
        legs[leg]["losses_within_reference"] = within_reference(per_step, leg, reference_max_diff)
    gc, ours = legs["gradient checkpointing"], legs["chameleon model="]

    def compared(key: str) -> str:
        faster = gc[key] / ours[key]
        return (f"chameleon model= is {faster:.2f}x as fast as gradient checkpointing"
                if faster >= 1 else f"gradient checkpointing is {1 / faster:.2f}x as fast as "
                f"chameleon model=")
    first, last = compared("ratio_vs_none"), compared("steady_ratio_vs_none")
    subject = first.split(" is ")[0]
    if last.startswith(subject + " is "):         # "it": the same leg ahead in both halves
        last = "it" + last[len(subject):]
    verdict = (f"{first} over all {len(timed)} steps after the first; over the last "
               f"{len(steady)}, {last}; within a budget of {format_bytes(budget)} "
               f"({FRACTION:.0%} of the natural peak)")
    pair = paired(timed, "chameleon model=", "gradient checkpointing")
    verdict += "; " + _paired_words(pair)
    return {"model": f"HF Llama hidden {size['hidden']} x {size['layers']} layers, batch "
                     f"{size['batch']}, lengths {sorted(set(size['lengths']))}",
            "device": str(device), "budget_bytes": budget, "natural_peak_bytes": natural,
            "budget_fraction": FRACTION, "emulated_link_bytes_per_s": link,
            "losses_identical": bool(losses_identical),
            "reference_reproducible": None if reference_max_diff is None else
            reference_max_diff == 0, "reference_max_diff": reference_max_diff,
            "losses_exact": bool(losses_identical) or bool(reference_max_diff) and all(
                r["losses_within_reference"] for r in legs.values()),
            "legs": legs, "steps": per_step, "paired": pair,
            "verdict": verdict, "winner": max(LEGS[1:], key=lambda k: (
                legs[k]["fits_budget"], -legs[k]["ratio_vs_none"]))}


def table(choice: dict) -> list[str]:
    """The comparison as text lines: one row per leg, then the verdict."""
    link = choice["emulated_link_bytes_per_s"]
    head = (f"{choice['model']}; budget {format_bytes(choice['budget_bytes'])} "
            f"({choice['budget_fraction']:.0%} of {format_bytes(choice['natural_peak_bytes'])}); "
            + (f"emulated link {link / 1e6:.0f} MB/s (an H100's bytes-to-compute ratio)"
               if link else "the device's own link"))
    n = len(choice["steps"])
    last = f"last {n - n // 2}"
    lines = [head, f"  {'':24}{'step vs none':>14}{last:>12}{'saved peak':>14}  fits budget"]
    for leg, r in choice["legs"].items():
        lines.append(f"  {leg:24}{r['ratio_vs_none']:>13.2f}x"
                     f"{r.get('steady_ratio_vs_none', float('nan')):>11.2f}x"
                     f"{format_bytes(r['peak_saved_bytes']):>14}"
                     f"  {'yes' if r['fits_budget'] else 'no'}")
    shares = [f"{leg} {r['planning_share']:.0%}" for leg, r in choice["legs"].items()
              if r.get("planning_share") is not None]
    if shares:
        lines.append("  of which planning at step ends: " + ", ".join(shares)
                     + " of their time (steps after the first)")
    beside = [f"{leg} {r['background_planning_share']:.0%}" for leg, r in choice["legs"].items()
              if r.get("background_planning_share")]
    if beside:
        lines.append("  mode plans made beside the steps, in the planner process (another core): "
                     + ", ".join(beside) + " of their time")
    modes = choice["legs"]["chameleon model="]["block_modes"]
    lines.append("  block modes (keep, selective, full) per step: "
                 + " ".join(str(tuple(m)) for m in modes))
    ref = choice.get("reference_max_diff")
    if choice["losses_identical"] or not ref:
        lines.append(f"  losses identical across the four: "
                     f"{'yes' if choice['losses_identical'] else 'NO'}")
    else:
        lines.append(f"  losses: the plain step is not bitwise reproducible here (it differs "
                     f"from itself by up to {ref:.2g}); within {REFERENCE_SLACK:g}x that: "
                     + ", ".join(
                         f"{leg} {'yes' if r['losses_within_reference'] else 'NO'} "
                         f"({r['losses_max_diff']:.2g})"
                         for leg, r in choice["legs"].items() if leg != "none"))
    lines.append(choice["verdict"])
    return lines
