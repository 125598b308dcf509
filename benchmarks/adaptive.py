"""Adaptivity: guard vs static (frozen after warm-up) vs chameleon on dynamic operator sequences.

    python benchmarks/adaptive.py [--device cuda] [--steps 24] [--fraction 0.3] [--quick] [--out DIR]

Scenarios (each a seeded schedule of batches, the same for every policy):

* ``lengths``: the Llama-style model, sequence length cycling through four values;
* ``moe``: the top-2 routed MoE model (routing changes every batch) with two lengths;
* ``layer_drop``: the Llama-style model with random layers skipped on most steps;
* ``eval``: a steady length with a no_grad evaluation pass after every third training step.

For every step of a scenario, the plain step (``none``) and the three policies run on the same
batch, interleaved in rotating order, each policy with its own engine at the same budget
(``--fraction`` of the natural peak of the scenario's first batch). Reported per policy: median
step time and its ratio to ``none`` and to ``guard``, stalls, synchronous fetches, plan sources,
detailed (timed) steps, and the profiler's own time as a share of the step. Every loss is checked
bit for bit against ``none`` and every step against its budget.

Time with ``--device cuda`` (dim 1024, 8 layers, batch 8 x 1024, 24 steps of 4 scenarios, each
step run by none and the three policies: 384 steps): on one H100 the plain step took about 133 ms
and the engines 1.3-2.3x that at 30%, so about 0.9 s per scenario step, 90 s in all, plus each
engine's first step of each new shape (about a dozen, a second or two each at this size): 2 to 3
minutes, estimated; well inside a ten-minute GPU loan.
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import chameleon_swap as cs  # noqa: E402
from chameleon_swap.config import DEFAULT_MIN_TENSOR_BYTES  # noqa: E402
from chameleon_swap.engine import paused_hooks  # noqa: E402
from chameleon_swap.planning.swaps import plan as make_plan  # noqa: E402
from chameleon_swap.planning.timeline import Plan, simulate  # noqa: E402
from chameleon_swap.workloads import Llama, LlamaConfig, MoE, MoEConfig  # noqa: E402

POLICIES = ("guard", "static", "chameleon")
SCENARIOS = ("lengths", "moe", "layer_drop", "eval")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    C.add_threads_argument(p)
    p.add_argument("--steps", type=int, default=None, help="steps per scenario")
    p.add_argument("--fraction", type=float, default=0.3, help="budget / natural peak")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    C.apply_threads(a)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda was given but torch.cuda.is_available() is False")
    if not 0 <= a.fraction <= 1:
        p.error(f"--fraction must be between 0 and 1; got {a.fraction}")
    a.scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    for s in a.scenarios:
        if s not in SCENARIOS:
            p.error(f"--scenarios: unknown {s!r}; choose from {', '.join(SCENARIOS)}")
    cuda = a.device.startswith("cuda")
    a.size = (dict(dim=1024, layers=8, batch=8, seq=1024) if cuda else
              dict(dim=128, layers=4, batch=4, seq=128))
    if a.quick:
        a.size = dict(dim=64, layers=2, batch=2, seq=32)
    if a.steps is None:
        a.steps = 8 if a.quick else (24 if cuda else 16)
    if a.steps < 2:
        p.error("--steps must be at least 2")
    return a


def build(scenario: str, size: dict, device: torch.device):
    heads = max(2, size["dim"] // 64)
    common = dict(vocab_size=2048, dim=size["dim"], n_layers=size["layers"], n_heads=heads,
                  n_kv_heads=heads // 2, max_seq_len=2 * size["seq"])
    torch.manual_seed(0)
    if scenario == "moe":
        return MoE(MoEConfig(**common, n_experts=4, top_k=2)).to(device)
    return Llama(LlamaConfig(**common)).to(device)


def schedule(scenario: str, size: dict, steps: int, device: torch.device, vocab: int):
    """[(tokens, targets, train, keep_layers or None)] for each step."""
    rng = random.Random(1)
    g = torch.Generator().manual_seed(2)
    B, T, L = size["batch"], size["seq"], size["layers"]
    out = []
    for i in range(steps):
        train, keep = True, None
        if scenario == "lengths":
            t = [T, T // 2, (3 * T) // 2, (3 * T) // 4][i % 4]
        elif scenario == "moe":
            t = [T, T // 2][i % 2]
        elif scenario == "layer_drop":
            t = T
            keep = sorted(rng.sample(range(L), L - 1)) if rng.random() < 0.6 else list(range(L))
        else:
            t = T
            train = i % 4 != 3
        tok = torch.randint(0, vocab, (B, t + 1), generator=g).to(device)
        out.append((tok[:, :-1], tok[:, 1:], train, keep))
    return out


def one_step(model, full_layers, item, eng, others=()):
    """One step on ``eng`` (None: no engine), the engines in ``others`` but ``eng`` with their
    idle module hooks out meanwhile (``paused_hooks``: they slow every module call)."""
    with paused_hooks([o for o in others if o is not eng]):
        return _one_step(model, full_layers, item, eng)


def _one_step(model, full_layers, item, eng):
    x, y, train, keep = item
    if keep is not None:
        model.layers = nn.ModuleList([full_layers[k] for k in keep])
    model.zero_grad(set_to_none=True)
    ctx = eng.step() if eng is not None else _null()
    with ctx:
        if train:
            loss = model(x, y)
            loss.backward()
        else:
            with torch.no_grad():
                loss = model(x, y)
    if keep is not None:
        model.layers = nn.ModuleList(full_layers)
    return loss.detach()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run_scenario(name: str, a, device: torch.device, advance) -> dict:
    model = build(name, a.size, device)
    full = list(model.layers)
    items = schedule(name, a.size, a.steps, device, model.config.vocab_size)
    with cs.Chameleon(None, device=device) as probe:
        one_step(model, full, items[0], probe)
        natural = probe.last_step.peak_resident_bytes
    budget = int(natural * a.fraction)
    engines = {p: cs.Chameleon(budget, device=device, policy=p) for p in POLICIES}
    modes = ["none", *POLICIES]
    times = {m: [] for m in modes}
    stats = {p: [] for p in POLICIES}
    equal = True
    for i, item in enumerate(items):
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        losses = {}
        for m in order:
            C.sync(device)
            t0 = C.now()
            losses[m] = one_step(model, full, item, engines.get(m), engines.values())
            C.sync(device)
            times[m].append(C.now() - t0)
            if m in engines:
                stats[m].append(engines[m].last_step)
            advance()
        equal &= all(torch.equal(losses["none"], v) for v in losses.values())
    # Predicted stall on the chameleon engine's last profiled sequence: its plan vs no plan (what
    # the guard's forced copies amount to in the same timeline model).
    prof = engines["chameleon"]._profiler.last_profile
    predicted = None
    if prof is not None and prof.n_forward:
        d2h, h2d = engines["chameleon"]._bandwidth()
        tl = prof.to_timeline(d2h, h2d)
        predicted = {"no_plan_stall_s": simulate(tl, Plan(frozenset()), budget).stall_seconds,
                     "planned_stall_s": make_plan(tl, budget).predicted.stall_seconds,
                     "profile_detailed": prof.detailed}
    for e in engines.values():
        e.close()
    train_steps = [i for i, it in enumerate(items) if it[2]]
    none_med = C.median(times["none"][i] for i in train_steps)
    guard_med = C.median(times["guard"][i] for i in train_steps)
    res = {"natural_peak_bytes": natural, "budget_bytes": budget, "predicted": predicted,
           "losses_bitwise_equal": bool(equal), "none_median_step_s": none_med, "policies": {}}
    for p in POLICIES:
        s = stats[p]
        med = C.median(times[p][i] for i in train_steps)
        res["policies"][p] = {
            "median_step_s": med, "ratio_vs_none": med / none_med, "ratio_vs_guard": med / guard_med,
            "total_stall_s": sum(v.stall_seconds for v in s),
            "sync_fetches": sum(v.sync_fetches for v in s),
            "offloaded_bytes": sum(v.offloaded_bytes for v in s),
            "budget_held_every_step": all(v.peak_resident_bytes <= budget for v in s),
            "max_peak_resident_bytes": max(v.peak_resident_bytes for v in s),
            "plan_sources": dict(Counter(v.plan_source for v in s)),
            "detailed_steps": sum(v.profile_mode == "detailed" for v in s),
            "sequence_changes": sum(v.sequence_changed for v in s),
            "plan_overrides": sum(v.plan_overrides for v in s),
            "forced_offloads": sum(v.forced_offloads for v in s),
            "profiler_share_median": C.median(v.profiler_seconds / v.step_seconds
                                              for v in s if (v.step_seconds or 0) > 0),
            "step_s": times[p]}
    res["none_step_s"] = times["none"]
    return res


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    results = {}
    total = len(a.scenarios) * a.steps * (1 + len(POLICIES))
    with C.progress(total, f"adaptive on {C.device_name(device)}") as advance:
        for name in a.scenarios:
            results[name] = run_scenario(name, a, device, advance)
    profiling = profiling_cost(a, device)
    payload = {"benchmark": "adaptive", "environment": C.environment(device),
               "config": {**a.size, "steps": a.steps, "budget_fraction": a.fraction,
                          "scenarios": a.scenarios, "policies": list(POLICIES),
                          "min_tensor_bytes": DEFAULT_MIN_TENSOR_BYTES},
               "results": results, "profiling": profiling}
    rows = []
    for name, r in results.items():
        for p in POLICIES:
            q = r["policies"][p]
            rows.append([name, p, q["median_step_s"] * 1e3, q["ratio_vs_none"], q["ratio_vs_guard"],
                         q["total_stall_s"] * 1e3, q["sync_fetches"], cs.format_bytes(q["offloaded_bytes"]),
                         q["budget_held_every_step"], q["detailed_steps"],
                         " ".join(f"{k}:{v}" for k, v in sorted(q["plan_sources"].items())),
                         f"{100 * q['profiler_share_median']:.2f}%"])
    env = payload["environment"]
    md = (f"# adaptive on {env['device_name']}\n\n"
          f"torch {env['torch']}, commit {env['commit']}; {a.steps} steps per scenario, budget "
          f"{a.fraction:.0%} of each scenario's first-batch natural peak; medians over training "
          f"steps; losses bitwise equal to no engine: "
          f"{all(r['losses_bitwise_equal'] for r in results.values())}.\n\n"
          + C.markdown_table(["scenario", "policy", "step ms", "x none", "x guard", "stall ms",
                              "sync fetches", "moved out", "budget held", "timed steps",
                              "plan sources", "profiler share"], rows))
    md += "\nPredicted stall (timeline model, last profiled sequence of the chameleon engine):\n\n"
    md += C.markdown_table(["scenario", "no plan (guard-like) ms", "chameleon plan ms"],
                           [[n, r["predicted"]["no_plan_stall_s"] * 1e3,
                             r["predicted"]["planned_stall_s"] * 1e3]
                            for n, r in results.items() if r["predicted"]])
    pc = profiling
    md += ("\nProfiling cost on one Llama step (medians of interleaved runs, budget None):\n\n"
           + C.markdown_table(["mode", "step ms", "overhead vs none ms"],
                              [[m, pc[m] * 1e3, (pc[m] - pc["none"]) * 1e3]
                               for m in ("none", "torch.profiler", "engine lightweight",
                                         "engine detailed")])
           + f"\nProfiler's own host time per step: lightweight {pc['profiler_s_lightweight'] * 1e3:.3f} ms, "
             f"detailed {pc['profiler_s_detailed'] * 1e3:.3f} ms; detailed-mode cost is "
             f"{100 * pc['detailed_vs_torch_profiler_reduction']:.1f}% lower than torch.profiler's "
             "overhead on the same step (the paper reports 84.25%).\n")
    path = C.write_results("adaptive", device, payload, md, a.out)
    if C.have_matplotlib():
        plot(results, path.with_suffix(".png"), env["device_name"])
    print(md)
    print(f"wrote {path}")
    ok = all(r["losses_bitwise_equal"] and all(q["budget_held_every_step"]
                                               for q in r["policies"].values())
             for r in results.values())
    return 0 if ok else 1


def profiling_cost(a, device: torch.device, reps: int = 12) -> dict:
    """Step time with no engine, under torch.profiler, and with the engine (no budget: nothing
    moves) profiling lightly and in detail."""
    model = build("lengths", a.size, device)
    full = list(model.layers)
    item = schedule("lengths", a.size, 1, device, model.config.vocab_size)[0]
    light = cs.Chameleon(None, device=device, policy="guard")
    detail = cs.Chameleon(None, device=device, policy="guard")
    detail._policy.wants_detail = lambda: True          # time every save and first use
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)

    def torch_prof(_):
        with torch.profiler.profile(activities=acts):
            one_step(model, full, item, None)

    both = (light, detail)
    modes = {"none": lambda _: one_step(model, full, item, None, both),
             "torch.profiler": torch_prof,
             "engine lightweight": lambda _: one_step(model, full, item, light, both),
             "engine detailed": lambda _: one_step(model, full, item, detail, both)}
    times = {m: [] for m in modes}
    names = list(modes)
    for i in range(reps + 2):
        for m in names[i % 4:] + names[:i % 4]:
            C.sync(device)
            t0 = C.now()
            modes[m](None)
            C.sync(device)
            if i >= 2:
                times[m].append(C.now() - t0)
    out = {m: C.median(v) for m, v in times.items()}
    out["profiler_s_lightweight"] = C.median(s.profiler_seconds for s in light.history[2:])
    out["profiler_s_detailed"] = C.median(s.profiler_seconds for s in detail.history[2:])
    torch_over = max(1e-9, out["torch.profiler"] - out["none"])
    out["detailed_vs_torch_profiler_reduction"] = 1 - out["profiler_s_detailed"] / torch_over
    light.close()
    detail.close()
    return out


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2), squeeze=False)
    for ax, (name, r) in zip(axes[0], results.items()):
        ax.plot([t * 1e3 for t in r["none_step_s"]], label="none", color="#888")
        for p, color in zip(POLICIES, ("#c66", "#da3", "#369")):
            ax.plot([t * 1e3 for t in r["policies"][p]["step_s"]], label=p, color=color)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("ms")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"step time per policy, {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
