"""The ceiling of the mode space: every block mix forced, against the one the planner picks.

    python benchmarks/mixes.py [--device cuda] [--config 256x8] [--fraction 0.25]
                               [--kept 0,1,2,3,5] [--rounds 10] [--warmup 2]
                               [--emulate-link h100|BW] [--quick] [--out DIR]

Issue 18's targets are ratios to other modes (at 25% of the natural peak the hybrid at most
0.95x full recomputation's step). Whether a miss is the planner's choice or the budget's limit
is a question of what the best mix would have run: this script runs it. The emulated-link
benchmark's HF Llama (``hybrid.py``'s configs and lengths), its budget a share of the longest
length's natural peak, and per length, one step each per round in an order that rotates every
round:

* ``none``: the plain step; ``full``: torch's non-reentrant checkpoint around every layer;
* ``plan``: ``Chameleon(budget, model=model)``, the mix its planner picks;
* ``keep K``: the same engine with its blocks' modes forced, the last K blocks kept (moved as
  its swap plans choose) and the others recomputed in full. The last blocks' saves are the
  first backward needs, so they are the cheapest to keep. Forced by replacing the policy's
  per-block choice (``ChameleonPolicy.block_mode``): a what-if no public option offers. Every
  forced step must still hold the budget (the guard moves what the mix leaves over).
* with ``--alone``, ``alone K`` for each ``keep K``: torch's checkpoint around the same blocks
  ``keep K`` recomputes, no engine: the mix's recomputation alone, nothing moved and no
  bookkeeping (its kept blocks stay on the device: the budget is not held). ``keep K`` over it
  is what the engine's mechanism costs that mix (its saved-tensor hooks, moves, memmoves and
  plans), the part of the gap to full recomputation that a better choice of mix cannot close.

Reported per length: each mode's step over the plain step's and over full recomputation's of
the same round (medians over the timed rounds), whether every engine step held the budget, the
planner's mixes, and the best forced mix (chosen on the even timed rounds) with the plan's step
over it (read on the odd ones). Pooled over the lengths as issue 18 pools them (the median of
each step over full's of the same round and length): the plan's ratio, and the ceiling, the
best forced mix of each length read on the odd rounds (chosen and read on the same rounds, the
least of several noisy medians reads low). The first ``--warmup`` rounds are not timed (the
engines' first steps, a size's plans). Writes ``benchmarks/results/mixes-<device>.json`` (every
timed step's seconds too, ``times_s``), a markdown table and, with matplotlib, a plot.

On an H100 (4096x8, 25%) a step averaged about 0.6 s in ``hybrid.py``: the defaults there (4
rounds, 2 warm-up, 3 lengths, 8 modes) are 144 steps, about 2 minutes with the model's build.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import hybrid as H  # noqa: E402

import chameleon_swap as cs  # noqa: E402
from chameleon_swap.engine import paused_hooks  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.add_budget_arguments(p, fraction=0.25, warmup=2)
    p.add_argument("--kept", default="0,1,2,3,5",
                   help="the forced mixes: how many of the last blocks each keeps, the rest "
                        "recomputed in full (comma-separated counts; beyond the model's blocks: "
                        "all of them)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds, each mode once a length (default 10 on the CPU, 4 on a "
                        "GPU)")
    p.add_argument("--alone", action="store_true",
                   help="also each forced mix's recomputation alone (torch's checkpoint, no "
                        "engine): what the engine's mechanism costs each mix")
    a = p.parse_args(argv)
    try:
        a.kept = sorted({int(k) for k in a.kept.split(",")})
    except ValueError:
        p.error(f"--kept must be comma-separated block counts (e.g. 0,1,2); got {a.kept!r}")
    if any(k < 0 for k in a.kept):
        p.error(f"--kept counts must be 0 or more; got {a.kept}")
    H.check_budget_arguments(p, a, rounds=(4, 10), quick_warmup=1)
    return a


def forced(engine: cs.Chameleon, kept: int, n_blocks: int) -> cs.Chameleon:
    """``engine`` with its blocks' modes forced: the last ``kept`` kept, the rest full."""
    first_kept = n_blocks - kept
    engine._policy.block_mode = lambda b, input_bytes: "keep" if b >= first_kept else "full"
    return engine


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    model, cfg, lengths, step, natural = H.stepper(a, device)
    n_blocks = cfg.num_hidden_layers
    budget = int(natural * a.fraction)
    link = {} if a.emulate_link is None else {"emulate_link": a.link_bytes_per_s}
    kept = sorted({min(k, n_blocks) for k in a.kept})
    engines = {"plan": cs.Chameleon(budget, device=device, model=model, **link)}
    for k in kept:
        engines[f"keep {k}"] = forced(cs.Chameleon(budget, device=device, model=model, **link),
                                      k, n_blocks)
    alone = {f"alone {k}": n_blocks - k for k in kept} if a.alone else {}
    modes = ["none", "full", *engines, *alone]

    def run(mode: str, T: int):
        with paused_hooks([e for m, e in engines.items() if m != mode]):
            C.sync(device)
            w0 = C.now()
            if mode == "none":
                loss = step(T)
            elif mode == "full":
                with H.checkpointed(model, selective=False):
                    loss = step(T)
            elif mode in alone:
                with H.checkpointed(model, selective=False, first=alone[mode]):
                    loss = step(T)
            else:
                with engines[mode].step():
                    loss = step(T)
            C.sync(device)
            return loss, C.now() - w0

    times = {(m, T): [] for m in modes for T in lengths}
    ran: dict = {(m, T): set() for m in engines for T in lengths}   # block modes seen
    held = exact = True
    rounds = a.warmup + a.rounds
    try:
        with C.progress(rounds * len(lengths) * len(modes),
                        f"forced mixes, {a.config} on {C.device_name(device)}") as advance:
            for r in range(rounds):
                for T in lengths:
                    losses = {}
                    for m in modes[r % len(modes):] + modes[:r % len(modes)]:
                        losses[m], wall = run(m, T)
                        if r >= a.warmup:
                            times[m, T].append(wall)
                        advance()
                    exact &= all(torch.equal(losses["none"], v) for v in losses.values())
                    held &= all(e.last_step.peak_resident_bytes <= budget
                                for e in engines.values())
                    if r >= a.warmup:
                        for m, e in engines.items():
                            ran[m, T].add(tuple(e.last_step.block_modes))
    finally:
        for e in engines.values():
            e.close()
    payload = {"benchmark": "mixes", "environment": C.environment(device),
               "config": {"model": a.config, "lengths": lengths, "blocks": n_blocks,
                          "fraction": a.fraction, "budget_bytes": budget,
                          "natural_activation_peak_bytes": natural, "kept": kept,
                          "rounds": a.rounds, "warmup": a.warmup,
                          "emulated_link": a.emulate_link,
                          "emulated_link_bytes_per_s": a.link_bytes_per_s,
                          "threads": torch.get_num_threads(), "alone": a.alone},
               "losses_bitwise_equal_across_modes": exact, "budget_held": held,
               **summarize(times, modes, lengths, ran)}
    md = markdown(payload)
    path = C.write_results("mixes", device, payload, md, a.out)
    if C.have_matplotlib():
        plot(payload, path.with_suffix(".png"))
    print(md)
    print(f"wrote {path}")
    return 0 if exact and held else 1


def summarize(times: dict, modes: list, lengths: list, ran: dict) -> dict:
    """Per length and pooled: each mode's step over none's and full's of the same round
    (``ran``: (engine mode, length) -> the (keep, selective, full) counts its steps ran)."""
    per_length, pooled = {}, {m: [] for m in modes}
    for T in lengths:
        none, full = times["none", T], times["full", T]
        res = {}
        for m in modes:
            over_full = [x / f for x, f in zip(times[m, T], full)]
            pooled[m] += over_full
            res[m] = {"vs_none": C.median(x / b for x, b in zip(times[m, T], none)),
                      "vs_full": C.median(over_full),
                      "median_wall_s": C.median(times[m, T])}
        # The best forced mix is chosen on the even rounds and read on the odd ones: the least
        # of several noisy medians reads low, a held-out one does not.
        forced = [m for m in modes if m.startswith("keep ")]
        best = min(forced, key=lambda m: C.median(
            x / f for x, f in zip(times[m, T][::2], full[::2]))) if forced else None
        # What the mechanism costs each forced mix: its step over its recomputation alone.
        mechanism = {m: C.median(x / y for x, y in zip(times[m, T], times["alone " + m[5:], T]))
                     for m in forced if ("alone " + m[5:], T) in times}
        per_length[str(T)] = {
            "modes": res,
            "mechanism": mechanism,
            "block_modes": {m: sorted(list(x) for x in ran[m, T])
                            for m in modes if (m, T) in ran},
            "best_forced": best,
            "plan_over_best": (C.median(p / b for p, b in zip(times["plan", T][1::2],
                                                              times[best, T][1::2]))
                               if best else None)}
    ceiling = [x for T in lengths if (b := per_length[str(T)]["best_forced"])
               for x in (t / f for t, f in zip(times[b, T][1::2], times["full", T][1::2]))]
    return {"per_length": per_length,
            "times_s": {m: {str(T): times[m, T] for T in lengths} for m in modes},
            "pooled_vs_full": {m: C.median(v) for m, v in pooled.items()},
            "ceiling_vs_full": C.median(ceiling) if ceiling else None}


def markdown(payload: dict) -> str:
    c, env = payload["config"], payload["environment"]
    rows = []
    for T, res in payload["per_length"].items():
        for m, r in res["modes"].items():
            note = ""
            if m in res.get("mechanism", {}):
                note = f"{res['mechanism'][m]:.3f}x its recomputation alone"
            if m == res["best_forced"]:
                note = "best forced" + (f"; {note}" if note else "")
            elif m == "plan":
                note = "mixes " + ", ".join(str(tuple(x)) for x in res["block_modes"]["plan"])
                if res["plan_over_best"] is not None:
                    note += f"; {res['plan_over_best']:.3f}x the best forced (odd rounds)"
            rows.append([T, m, r["vs_none"], r["vs_full"], r["median_wall_s"] * 1e3, note])
    pooled = payload["pooled_vs_full"]
    return (f"# Forced block mixes against the planner's\n\n{env['device_name']}, torch "
            f"{env['torch']}, commit {env['commit']}; HF Llama {c['model']} ({c['blocks']} "
            f"blocks), budget {cs.format_bytes(c['budget_bytes'])} ({c['fraction']:.0%} of "
            f"{max(c['lengths'])} tokens' peak), link {C.link_words(c)}, "
            f"{c['rounds']} timed rounds after {c['warmup']}; each mode's step over the plain "
            f"step's and over full recomputation's of the same round (median); `keep K`: the "
            f"last K blocks kept, the rest recomputed in full"
            + ("; `alone K`: the same blocks recomputed by torch's checkpoint, no engine (the "
               "budget not held)" if c.get("alone") else "")
            + f". Losses bitwise equal across "
            f"modes: {payload['losses_bitwise_equal_across_modes']}; every engine step within "
            f"its budget: {payload['budget_held']}.\n\n"
            + C.markdown_table(["tokens", "mode", "x none", "x full", "step ms", ""], rows)
            + f"\nPooled over the lengths (each step over full's of its round): the plan "
            f"{pooled['plan']:.3f}x; the best forced mix of each length (chosen on the even "
            f"rounds), read on the odd ones: {payload['ceiling_vs_full']:.3f}x (the ceiling).\n")


def plot(payload: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    per = payload["per_length"]
    lengths = list(per)
    modes = [m for m in per[lengths[0]]["modes"] if m != "none"]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(modes) * len(lengths) / 2), 3.6))
    width = 0.8 / len(modes)
    forced = [m for m in modes if m.startswith("keep ")]
    alone = [m for m in modes if m.startswith("alone ")]
    colors = {"full": "#999", "plan": "#222",
              **{m: plt.cm.viridis(i / max(1, len(forced) - 1)) for i, m in enumerate(forced)},
              **{m: plt.cm.Pastel2(i % 8) for i, m in enumerate(alone)}}
    ys = []
    for i, m in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(lengths))]
        ys += [per[T]["modes"][m]["vs_full"] for T in lengths]
        ax.bar(xs, ys[-len(lengths):], width, label=m, color=colors[m])
    ax.set_ylim(min(ys) - 0.05, max(ys) + 0.05)     # the differences are a few percent
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([f"{T} tokens" for T in lengths])
    ax.set_ylabel("step / full recomputation's (median)")
    ax.legend(fontsize=7, ncol=2)
    c = payload["config"]
    fig.suptitle(f"forced mixes at {c['fraction']:.0%}, {c['model']} on "
                 f"{payload['environment']['device_name']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
