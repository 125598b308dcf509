"""Generate docs/PIPELINE.md (and docs/pipeline/*.png) from the pipeline simulator.

    python docs/make_pipeline.py

Every number in PIPELINE.md comes from ``chameleon_swap.sim.pipeline`` (the model behind
``chameleon-swap simulate --pp``) at the settings written next to it. Nothing is typed in by hand.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from chameleon_swap.config import format_bytes  # noqa: E402
from chameleon_swap.sim import hardware  # noqa: E402
from chameleon_swap.sim.models import preset  # noqa: E402
from chameleon_swap.sim.pipeline import simulate_pipeline  # noqa: E402
from chameleon_swap.sim.report import table  # noqa: E402

DOCS = ROOT / "docs"
FIGS = DOCS / "pipeline"
HARDWARE = ("h100-sxm", "h100-pcie", "h200", "a100-80gb", "ascend-910b")
# The paper's setting (arXiv 2503.03182): LLaMA2-70B-shaped layers, PP8 x TP8, layers varied.
MODEL, TP, PP, MICRO, SEQ = "llama-70b", 8, 8, 32, 4096
LAYER_STEP, MAX_LAYERS = 16, 960        # 16: every schedule's stage count divides it
COMPARABLE = 0.95                       # "comparable throughput": >= 95% of 1F1B's efficiency
CLAIM_SIZE, CLAIM_SPEED = 2.4, 1.5
METHODS = (("1f1b", "none"), ("1f1b", "recompute"), ("1f1b", "engine"), ("1f1b", "hybrid"),
           ("interleaved", "engine"), ("interleaved", "hybrid"), ("chronos", "none"),
           ("chronos", "engine"), ("chronos", "hybrid"))
LINK_SHARES = (1.0, 0.25, 0.1, 0.05)    # the host link each GPU gets, as a share of the profile's


def _cfg(layers: int = 80):
    return preset(MODEL, seq=SEQ, tp=TP).replace(layers=layers)


def _name(schedule: str, mode: str) -> str:
    return schedule + {"none": "", "recompute": " + full recompute", "engine": " + engine",
                       "hybrid": " + hybrid"}[mode]


def sweep_one(hw, sched: str, mode: str) -> dict:
    """Per layer count that fits: the result (tokens/s, per-rank figures)."""
    rows = {}
    for layers in range(LAYER_STEP, MAX_LAYERS + 1, LAYER_STEP):
        res = simulate_pipeline(_cfg(layers), hw, PP, MICRO, sched, mode)
        if not res.fits:
            break
        rows[layers] = res
    return rows


def sweep(hw) -> dict:
    """Per method, per layer count that fits: the result."""
    return {(sched, mode): sweep_one(hw, sched, mode) for sched, mode in METHODS}


def efficiency(res, layers: int) -> float:
    """Tokens/s times layers: proportional to the model FLOP/s a step reaches."""
    return res.tokens_per_second * layers


def claims(hw) -> tuple:
    runs = sweep(hw)
    base = runs["1f1b", "none"]
    base_layers = max(base)
    ref_eff = efficiency(base[base_layers], base_layers)
    rec = runs["1f1b", "recompute"]
    rec_layers = max(rec)
    rows = []
    for key, fits in runs.items():
        if not fits:
            rows.append([_name(*key), 0, None, None, None])
            continue
        largest = max(fits)
        comparable = max((n for n, r in fits.items() if efficiency(r, n) >= COMPARABLE * ref_eff),
                         default=None)
        at_rec = fits.get(rec_layers)
        speed = (at_rec.tokens_per_second / rec[rec_layers].tokens_per_second) if at_rec else None
        rows.append([_name(*key), largest, comparable,
                     None if comparable is None else f"{comparable / base_layers:.2f}x",
                     None if speed is None else f"{speed:.2f}x"])
    eng = max(runs["chronos", "engine"], default=0)
    return rows, base_layers, rec_layers, eng


def reading(hw, eng_layers: int) -> str:
    """Why the engine stops where it does: model states alone at the next size up."""
    nxt = simulate_pipeline(_cfg(eng_layers + LAYER_STEP), hw, PP, MICRO, "chronos", "engine")
    states = max(r.state_bytes for r in nxt.ranks)
    if states <= hw.usable_bytes:
        return (f"On {hw.name} the largest model of the engine (and of hybrid) is bounded by "
                f"its activation budget: "
                f"at {eng_layers + LAYER_STEP} layers the model states take "
                f"{format_bytes(states)} of {format_bytes(hw.usable_bytes)} and what is left does "
                f"not hold one block's activations.")
    return (f"On {hw.name} the largest model of the engine (and of hybrid) is bounded by "
            f"model states, not by activations: at {eng_layers + LAYER_STEP} layers a rank's weights, gradients and "
            f"optimizer states alone take {format_bytes(states)} of "
            f"{format_bytes(hw.usable_bytes)} usable. Once activations can go to the host they "
            f"no longer bound the size; going further needs the model states off the device too "
            f"(ChronosPipe's Chronos-Offload also moves weights, gradients and optimizer "
            f"states; here weights leave only inside a step, see below) or sharded (ZeRO).")


def per_rank(hw) -> str:
    rows = []
    for sched, mode in METHODS:
        res = simulate_pipeline(_cfg(), hw, PP, MICRO, sched, mode)
        peaks = [r.activation_peak_bytes for r in res.ranks]
        rows.append([_name(sched, mode), f"{res.step_seconds:.3f}", f"{res.bubble_fraction:.1%}",
                     format_bytes(max(peaks)), format_bytes(min(peaks)),
                     format_bytes(res.max_total_bytes),
                     format_bytes(max(r.offloaded_bytes for r in res.ranks)),
                     f"{max(r.recomputed_fraction for r in res.ranks):.0%}"])
    return table(["method", "step s", "bubble", "act peak (max rank)", "act peak (min rank)",
                  "most memory on a rank", "most moved out by a rank",
                  "most recomputed by a rank"], rows, markdown=True)


def slow_links(hw) -> str:
    """Engine, hybrid and 1F1B + full recompute at the deepest model recompute fits, with the
    host link each GPU gets cut (eight GPUs sharing a host's memory and PCIe switches)."""
    import dataclasses
    layers = max(sweep_one(hw, "1f1b", "recompute"))
    rec = simulate_pipeline(_cfg(layers), hw, PP, MICRO, "1f1b", "recompute")
    rows = []
    for share in LINK_SHARES:
        link = dataclasses.replace(hw, h2d_bytes_per_s=hw.h2d * share,
                                   d2h_bytes_per_s=hw.d2h * share,
                                   measured_h2d_bytes_per_s=None, measured_d2h_bytes_per_s=None)
        for sched in ("1f1b", "interleaved", "chronos"):
            eng, hyb = (simulate_pipeline(_cfg(layers), link, PP, MICRO, sched, m)
                        for m in ("engine", "hybrid"))
            rows.append([f"{link.h2d / 1e9:.1f}" if sched == "1f1b" else "", sched,
                         f"{eng.step_seconds:.2f}", f"{hyb.step_seconds:.2f}",
                         f"{eng.step_seconds / hyb.step_seconds:.2f}x",
                         f"{rec.step_seconds / hyb.step_seconds:.2f}x",
                         f"{max(r.recomputed_fraction for r in hyb.ranks):.0%}",
                         format_bytes(max(r.offloaded_bytes for r in hyb.ranks))])
    head = (f"{layers} layers (the deepest 1F1B + full recompute fits on {hw.name}; "
            f"{rec.step_seconds:.2f} s a step there), each rank's budget what memory leaves.\n\n")
    return head + table(["host link GB/s", "schedule", "engine step s", "hybrid step s",
                         "hybrid vs engine", "hybrid vs 1F1B + recompute",
                         "most recomputed by a rank", "most moved out by a rank"], rows,
                        markdown=True)


def figure(hw, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, sched in zip(axes, ("1f1b", "chronos")):
        res = simulate_pipeline(_cfg(), hw, PP, MICRO, sched, "none")
        for r, curve in enumerate(res.curves):
            t, level = zip(*curve)
            ax.step(t, [x / 2**30 for x in level], where="post", label=f"rank {r}", lw=1)
        ax.set_title(f"{sched}: step {res.step_seconds:.2f} s")
        ax.set_xlabel("seconds into the step")
    axes[0].set_ylabel("saved activations (GiB)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{MODEL} (80 layers), TP{TP} PP{PP}, {MICRO} micro-batches of {SEQ} tokens, "
                 f"{hw.name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


INTRO = """# Pipeline parallelism: memory as a cache (ChronosPipe's claims, checked)

Generated by `python docs/make_pipeline.py` from `chameleon_swap.sim.pipeline` (the model behind
`chameleon-swap simulate --pp N --micro-batches M --schedule 1f1b|interleaved|chronos`).

ChronosPipe (arXiv 2503.03182) reports that treating device memory as a cache lets a pipeline
train a **2.4x larger model at comparable throughput**, and reaches **1.5x the throughput of
1F1B with recomputation**. Here the same questions are put to the simulator with this project's
mechanisms: PyTorch's 1F1B, full recomputation, our V-shaped Chronos order (`chronos`: two
stages per rank, `r` and `2P-1-r`, full backwards; see `chameleon_swap/parallel/schedules.py`),
and the schedule-aware engine on every rank (`PipelineChameleon`: offloads the activations whose
backward is farthest away in the rank's schedule, copies back in the order the backwards need).
"hybrid" is the engine with recomputation per stage: under the same budget, each rank recomputes
the blocks of the micro-batches whose copies its host link could not hide in its busy time and
swaps the rest (`chameleon_swap/sim/pipeline_plan.py`; the simulator only, not yet a runtime
policy).

**Settings.** {model}-shaped layers (hidden 8192, 64 heads, 8 kv heads, ffn 28672, vocab 32000),
bf16, FlashAttention, sequence {seq}, micro-batch 1, {micro} micro-batches per step, TP{tp} (with
sequence parallelism) x PP{pp}, Adam with mixed precision (16 bytes of model state per parameter,
not sharded). The model is made deeper in steps of {step} layers up to {max_layers}. A model fits
when, on every rank, model states + activation peak + workspace fit in the device's usable
memory; with the engine the rank's activation budget is what that leaves, it must hold at least
one block's activations, and the host must hold what is out. "Comparable throughput": model
FLOP/s (tokens/s x layers) at least {comparable:.0%} of 1F1B's at the largest model 1F1B fits.
Copies overlap the rank's compute; only what the link cannot move within the rank's busy time is
exposed. Left out: the optimizer step, data-parallel collectives, weight offload (implemented
inside a step, see the last section; not in this model), and overlap of point-to-point transfers.
"""

WEIGHTS = """## Weight offload inside a step (`offload_weights=True`)

`PipelineChameleon(schedule, budget, offload_weights=True)` also keeps each stage's block weights
in host memory between their uses inside a step (`chameleon_swap.weights.WeightOffload`, on
every stage of the rank; blocks are `find_blocks` of the stage's module, else its children). At
the step's start each block's parameters are copied to a pinned host buffer (one copy-out per
step: weights do not change inside it); a block's weights come back just before its forward and
just before its backward (when the gradient reaches its outputs), the next block's (forward
order in forward, reverse in backward) on the copy stream meanwhile, and leave once its forward
has run and once its parameters' gradients have accumulated. Releasing frees the parameters'
storages in place, so what autograd saved (weights and views of them) holds no device memory
until the block comes back. Gradients stay bit-for-bit those without it. Between steps every
parameter is on the device: the optimizer and the user see a plain model, so gradients and
optimizer states are as without it and the model states' bound above is unchanged; what it
frees is weight memory while activations are alive, which is at most two blocks' weights
(`WeightStepStats.peak_held_bytes`) plus, early in the step, blocks whose copy-out has not
finished yet (`StepStats.weight_peak_bytes` counts those too). It needs full backwards
(1F1B, GPipe, interleaved 1F1B, Chronos; zero-bubble schedules that split weight gradients are
refused) and no parameter shared between blocks or with the rest of the stage. A weight read
where no hook on a block's outputs saw its backward begin (an output inside an object the
offload cannot look into, an auxiliary loss kept on the module) brings its block back first:
saved tensors that share a parameter's storage are marked at save time and fetched at unpack,
and a gradient about to accumulate into a released parameter fetches its block. The simulator
above does not model it.
"""


def main() -> None:
    FIGS.mkdir(parents=True, exist_ok=True)
    parts = [INTRO.format(model=MODEL, seq=SEQ, micro=MICRO, tp=TP, pp=PP, step=LAYER_STEP,
                          max_layers=MAX_LAYERS, comparable=COMPARABLE)]
    h100 = hardware.load("h100-sxm")
    parts.append(f"## Per-rank memory, 80 layers on h100-sxm\n\n{per_rank(h100)}\n")
    figure(h100, FIGS / "memory-h100-sxm.png")
    parts.append("![per-rank activations over one step](pipeline/memory-h100-sxm.png)\n")
    parts.append(
        "Under 1F1B rank 0 holds a micro-batch's activations for each of the 8 stages and rank 7 "
        "for one; the V order gives every rank the first rank's load (its rank 0 pairs the first "
        "stage, waiting long, with the last, coming straight back), with a smaller bubble from "
        "its finer stages. With nothing moved, the V does not lower the largest rank's peak; "
        "what it changes is that every rank has activations whose backward is far away, which "
        "the engine moves out first.\n")
    parts.append("## Swap or recompute: when the host link cannot keep up\n")
    parts.append(slow_links(h100) + "\n")
    parts.append(
        "At h100-sxm's own link the engine hides every copy in the rank's compute, so hybrid "
        "recomputes nothing and equals the engine (the claims below). Where eight GPUs share a "
        "host's memory and PCIe switches each gets less: the engine then stalls on the copies, "
        "while hybrid recomputes the blocks the link cannot carry and keeps the rest moving. "
        "Hybrid is never predicted slower than the engine, nor than full recomputation where that "
        "fits the budget.\n")
    parts.append("## The claims, per hardware profile\n")
    for name in HARDWARE:
        hw = hardware.load(name)
        rows, base, rec, eng = claims(hw)
        parts.append(f"### {name}\n\n1F1B fits {base} layers; 1F1B + full recompute fits {rec}.\n")
        parts.append(table(["method", "largest model (layers)",
                            "largest at comparable throughput", "size vs 1F1B (claim 2.4x)",
                            f"throughput vs 1F1B + recompute at {rec} layers (claim 1.5x)"],
                           rows, markdown=True) + "\n")
        parts.append(reading(hw, eng) + "\n")
    parts.append(WEIGHTS)
    (DOCS / "PIPELINE.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
