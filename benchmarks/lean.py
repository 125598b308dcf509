"""What a lean step costs against the executor's path at the same budget, step for step.

    python benchmarks/lean.py [--device cuda] [--config 256x8] [--rounds 30] [--warmup 3]
                              [--fraction 0.75] [--emulate-link h100|BW] [--quick] [--out DIR]

The emulated-link benchmark's HF Llama (``hybrid.py``'s configs and lengths), its budget a share
of the longest length's natural peak (75% by default, as there). The longest length is left
out: it never fits, and what it costs is ``hybrid.py``'s to measure. Of the others, on 256x8 at
75%, 256 tokens fit whole and 384 save 5 bytes more than the budget (384 is 75% of 512), so
their lean steps trip near the forward's end. Modes, one step each per round and length, in an
order that rotates every round; every engine lives through the run, with only the stepping
one's module hooks on (``paused_hooks``):

* ``none``: the plain step;
* ``hooks``: saved-tensor hooks that hand back what they get, the floor of any engine built on
  them;
* ``no budget``: ``Chameleon(None)``, whose every save takes the lean hooks (an engine that
  never moves);
* ``lean``: ``Chameleon(budget, model=model)``: a size the budget holds whole (within 2%) runs
  lean from its first block, once one of its steps ran every block kept on the executor's path;
* ``executor path``: the same engine with lean steps off: every save through the executor and
  the policy, as before lean steps existed;
* ``lean, no model`` and ``executor path, no model``: both again without ``model=`` (swapping
  only; a lean step starts at its second saved storage, its first, the token ids, keying its
  size).

Reported per length: each mode's step over the plain step's of the same round (median over the
timed rounds), in wall time and in the compute thread's CPU time, and how the lean engine's
timed steps ran (``StepStats.lean``). The first ``--warmup`` rounds are not timed (plans, and
each size's first step on the executor's path). Writes ``benchmarks/results/lean-<device>.json``
and a markdown table next to it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
import hybrid as H  # noqa: E402

import chameleon_swap as cs  # noqa: E402
from chameleon_swap.engine import paused_hooks  # noqa: E402

MODES = ("none", "hooks", "no budget", "lean", "executor path", "lean, no model",
         "executor path, no model")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    H.add_budget_arguments(p, fraction=0.75, warmup=3)
    p.add_argument("--rounds", type=int, default=None,
                   help="timed rounds, each mode once a length (default 30 on the CPU, 7 on a "
                        "GPU: 140 steps with the warm-up; hybrid.py's H100 steps of this model "
                        "averaged 0.6 s)")
    a = p.parse_args(argv)
    H.check_budget_arguments(p, a, rounds=(7, 30), quick_warmup=2)
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    model, cfg, lengths, step, natural = H.stepper(a, device)
    longest = max(lengths)
    timed_lengths = [T for T in lengths if T != longest]
    budget = int(natural * a.fraction)
    link = {} if a.emulate_link is None else {"emulate_link": a.link_bytes_per_s}
    engines = {"no budget": cs.Chameleon(None, device=device),
               "lean": cs.Chameleon(budget, device=device, model=model, **link),
               "executor path": cs.Chameleon(budget, device=device, model=model, **link),
               "lean, no model": cs.Chameleon(budget, device=device, **link),
               "executor path, no model": cs.Chameleon(budget, device=device, **link)}
    for m in ("executor path", "executor path, no model"):       # every step on the executor's
        off = engines[m]
        off._lean_ok = off._policy.modes.lean_sizes.on = False

    def run(mode: str, T: int):
        others = [e for m, e in engines.items() if m != mode]
        with paused_hooks(others):
            C.sync(device)
            w0, c0 = C.now(), time.thread_time()
            if mode == "none":
                loss = step(T)
            elif mode == "hooks":
                with torch.autograd.graph.saved_tensors_hooks(H._same, H._same):
                    loss = step(T)
            else:
                with engines[mode].step():
                    loss = step(T)
            C.sync(device)
            return loss, C.now() - w0, time.thread_time() - c0

    times = {(m, T): [] for m in MODES for T in timed_lengths}
    leans: dict = {T: [] for T in timed_lengths}           # the lean engines' steps
    leans_swap: dict = {T: [] for T in timed_lengths}
    exact = True
    rounds = a.warmup + a.rounds
    try:
        with C.progress(rounds * len(timed_lengths) * len(MODES),
                        f"lean steps, {a.config} on {C.device_name(device)}") as advance:
            for r in range(rounds):
                for T in timed_lengths:
                    order = list(MODES[r % len(MODES):] + MODES[:r % len(MODES)])
                    losses = {}
                    for m in order:
                        losses[m], wall, cpu = run(m, T)
                        if r >= a.warmup:
                            times[m, T].append((wall, cpu))
                        advance()
                    exact &= all(torch.equal(losses["none"], v) for v in losses.values())
                    if r >= a.warmup:
                        leans[T].append(engines["lean"].last_step.lean)
                        leans_swap[T].append(engines["lean, no model"].last_step.lean)
                        if any(engines[m].last_step.peak_resident_bytes > budget
                               for m in ("lean", "lean, no model")):
                            raise RuntimeError("a lean engine's step passed its budget")
    finally:
        for e in engines.values():
            e.close()
    per_length = {}
    for T in timed_lengths:
        base = times["none", T]
        per_length[str(T)] = {
            m: {"wall_vs_none": C.median(x[0] / b[0] for x, b in zip(times[m, T], base)),
                "cpu_vs_none": C.median(x[1] / b[1] for x, b in zip(times[m, T], base)),
                "median_wall_s": C.median(x[0] for x in times[m, T])}
            for m in MODES}
        per_length[str(T)]["lean steps"] = {k: leans[T].count(k) for k in sorted(set(leans[T]))}
        per_length[str(T)]["lean steps, no model"] = {k: leans_swap[T].count(k)
                                                      for k in sorted(set(leans_swap[T]))}
    payload = {"benchmark": "lean", "environment": C.environment(device),
               "config": {"model": a.config, "lengths": timed_lengths, "longest": longest,
                          "fraction": a.fraction, "budget_bytes": budget,
                          "natural_activation_peak_bytes": natural, "rounds": a.rounds,
                          "warmup": a.warmup, "emulated_link": a.emulate_link,
                          "emulated_link_bytes_per_s": a.link_bytes_per_s,
                          "threads": torch.get_num_threads()},
               "losses_bitwise_equal_across_modes": exact, "per_length": per_length}
    md = markdown(payload)
    path = C.write_results("lean", device, payload, md, a.out)
    print(md)
    print(f"wrote {path}")
    return 0 if exact else 1


def markdown(payload: dict) -> str:
    c, env = payload["config"], payload["environment"]
    rows = []
    for T, res in payload["per_length"].items():
        ran = {m: ", ".join(f"{k or 'executor path'} {n}" for k, n in res[key].items())
               for m, key in (("lean", "lean steps"), ("lean, no model", "lean steps, no model"))}
        for m in MODES:
            rows.append([T, m, res[m]["wall_vs_none"], res[m]["cpu_vs_none"],
                         res[m]["median_wall_s"] * 1e3, ran.get(m, "")])
    return (f"# Lean steps against the executor's path\n\n{env['device_name']}, torch "
            f"{env['torch']}, commit {env['commit']}; HF Llama {c['model']}, budget "
            f"{cs.format_bytes(c['budget_bytes'])} ({c['fraction']:.0%} of {c['longest']} "
            f"tokens' peak), link {C.link_words(c)}, {c['rounds']} timed rounds "
            f"after {c['warmup']}; each mode's step over the plain step's of the same round "
            f"(median); losses bitwise equal across modes: "
            f"{payload['losses_bitwise_equal_across_modes']}.\n\n"
            + C.markdown_table(["tokens", "mode", "wall x none", "CPU x none", "step ms",
                                "lean engine's steps"], rows))


if __name__ == "__main__":
    sys.exit(main())
