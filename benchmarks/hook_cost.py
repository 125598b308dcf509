"""What the engine's hooks cost per saved tensor: per pack, per unpack, per step.

    python benchmarks/hook_cost.py [--device cuda] [--rounds 12] [--steps 10] [--quick] [--out DIR]

The model is a deep stack of small ``Linear`` + ``Tanh`` blocks: many saved tensors and little
compute per tensor, so what the hooks cost is most of what the engine adds (``Tanh`` saves its
output, which the next ``Linear`` saves again as its input: half the packs find their storage's
record already there, as in real models). It runs two ways, the same arithmetic and saves:

* ``modules``: calling the ``nn.Sequential``, so the engine's module hooks run too (two per call);
* ``functional``: the same weights through ``F.linear`` and ``torch.tanh``: no module call, so
  the figures are the saved-tensor hooks' alone.

Modes:

* ``none``: the plain step, with no engine alive (the engine's module hooks are global);
* ``identity hooks``: ``saved_tensors_hooks`` that return their argument, the floor of any
  approach built on those hooks;
* ``budget None``: the engine with no budget (nothing can move);
* ``budget unreached``: a budget of 10x the step's natural peak (nothing moves, but the policy
  watches every save);
* ``budget forces moves``: a quarter of the natural peak (tensors are copied out and back).

Every step is split into forward (its packs), backward (its unpacks) and the step's end (the
engine's ``step_end.finish_step``). Per pack: (forward - forward of ``none``) / packs; per unpack:
(backward - backward of ``none``) / unpacks; per saved tensor: (step - step of ``none``) / packs.
In the ``modules`` workload the forward figure also carries the module hooks.

Modes run in rounds, in rotating order; in each round every engine is created, warmed up, timed
and closed, so the baselines run with no engine alive. Writes
``benchmarks/results/hook_cost-<device>.json`` (environment, config, medians) and a markdown
table next to it; checks that every mode computed the same loss bit for bit.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import chameleon_swap as cs  # noqa: E402
from chameleon_swap.config import DEFAULT_MIN_TENSOR_BYTES  # noqa: E402

MODES = ("none", "identity hooks", "budget None", "budget unreached", "budget forces moves")
BUDGET_FACTOR = {"budget None": None, "budget unreached": 10.0, "budget forces moves": 0.25}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    C.add_threads_argument(p)
    p.add_argument("--rounds", type=int, default=12, help="rounds (each mode once per round)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode and round")
    p.add_argument("--depth", type=int, default=64, help="Linear + Tanh blocks")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="a tiny configuration (smoke run)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    C.apply_threads(a)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda was given but torch.cuda.is_available() is False")
    if a.quick:
        a.rounds, a.steps, a.warmup, a.depth = 2, 2, 1, 8
    C.check_counts(p, a, ("rounds", "steps", "depth", "dim", "batch"))
    return a


def build(a, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(a.depth):
        layers += [nn.Linear(a.dim, a.dim), nn.Tanh()]
    return nn.Sequential(*layers).to(device)


def functional(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The model's arithmetic with no module call (so no module hook fires)."""
    for layer in model:
        x = F.linear(x, layer.weight, layer.bias) if isinstance(layer, nn.Linear) else torch.tanh(x)
    return x


WORKLOADS = {"modules": lambda model, x: model(x), "functional": functional}


def count_saves(forward, model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(packs, unpacks) of one step, counted by identity hooks."""
    n = [0, 0]

    def pack(t):
        n[0] += 1
        return t

    def unpack(t):
        n[1] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = forward(model, x).square().mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return n[0], n[1]


def one_step(forward, model, x, device, mode: str, eng) -> tuple[float, float, float, torch.Tensor]:
    """(forward, backward, end) seconds and the loss of one step."""
    model.zero_grad(set_to_none=True)
    C.sync(device)
    if mode == "identity hooks":
        ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    elif eng is not None:
        ctx = eng.step()
    else:
        ctx = None
    t0 = C.now()
    if ctx is not None:
        ctx.__enter__()
    loss = forward(model, x).square().mean()
    C.sync(device)
    t1 = C.now()
    loss.backward()
    C.sync(device)
    t2 = C.now()
    if ctx is not None:
        ctx.__exit__(None, None, None)
    C.sync(device)
    t3 = C.now()
    return t1 - t0, t2 - t1, t3 - t2, loss.detach()


def measure(a, device, model, x, forward, advance) -> dict:
    """Every mode on one workload, in rotating rounds; a dict of results per mode."""
    packs, unpacks = count_saves(forward, model, x)
    with cs.Chameleon(None, device=device) as probe:
        with probe.step():
            forward(model, x).square().mean().backward()
        natural = probe.last_step.peak_resident_bytes
    model.zero_grad(set_to_none=True)
    budgets = {m: None if f is None else int(natural * f) for m, f in BUDGET_FACTOR.items()}
    samples = {m: {"forward": [], "backward": [], "end": [], "step": []} for m in MODES}
    last, losses = {}, []
    for r in range(a.rounds):
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
            eng = cs.Chameleon(budgets[mode], device=device) if mode in budgets else None
            try:
                for i in range(a.warmup + a.steps):
                    fwd, bwd, end, loss = one_step(forward, model, x, device, mode, eng)
                    losses.append(loss)
                    if i >= a.warmup:
                        for k, v in (("forward", fwd), ("backward", bwd), ("end", end),
                                     ("step", fwd + bwd + end)):
                            samples[mode][k].append(v)
                    advance()
                if eng is not None:
                    last[mode] = eng.last_step
            finally:
                if eng is not None:
                    eng.close()
    med = {m: {k: C.median(v) for k, v in s.items()} for m, s in samples.items()}
    base = med["none"]
    results = {}
    for m in MODES:
        d = med[m]
        r = {f"median_{k}_ms": v * 1e3 for k, v in d.items()}
        r["us_per_pack"] = (d["forward"] - base["forward"]) / packs * 1e6
        r["us_per_unpack"] = (d["backward"] - base["backward"]) / unpacks * 1e6
        r["step_us_per_saved_tensor"] = (d["step"] - base["step"]) / packs * 1e6
        r["step_ratio_vs_none"] = d["step"] / base["step"]
        if m in last:
            s = last[m]
            r.update(budget_bytes=s.budget_bytes, last_profile_mode=s.profile_mode,
                     last_offloaded_bytes=s.offloaded_bytes,
                     last_peak_resident_bytes=s.peak_resident_bytes)
        results[m] = r
    return {"packs_per_step": packs, "unpacks_per_step": unpacks,
            "natural_activation_peak_bytes": natural,
            "losses_bitwise_equal_across_modes": all(torch.equal(losses[0], v) for v in losses),
            "modes": results}


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    model = build(a, device)
    x = torch.randn(a.batch, a.dim, generator=torch.Generator().manual_seed(1)).to(device)
    total = len(WORKLOADS) * a.rounds * len(MODES) * (a.warmup + a.steps)
    with C.progress(total, f"hook_cost on {C.device_name(device)}") as advance:
        results = {w: measure(a, device, model, x, f, advance) for w, f in WORKLOADS.items()}
    equal = all(r["losses_bitwise_equal_across_modes"] for r in results.values())
    config = {"model": f"Sequential of {a.depth} x (Linear({a.dim}, {a.dim}) + Tanh)",
              "depth": a.depth, "dim": a.dim, "batch": a.batch, "rounds": a.rounds,
              "steps_per_round": a.steps, "warmup_per_round": a.warmup,
              "min_tensor_bytes": DEFAULT_MIN_TENSOR_BYTES}
    payload = {"benchmark": "hook_cost", "environment": C.environment(device), "config": config,
               "losses_bitwise_equal": bool(equal), "results": results}
    env = payload["environment"]
    md = (f"# hook_cost on {env['device_name']}\n\n"
          f"torch {env['torch']}, commit {env['commit']}, {config['model']}, batch {a.batch}; "
          f"medians of {a.rounds * a.steps} steps in {a.rounds} rotating rounds; losses bitwise "
          f"equal across modes: {equal}. Costs per pack, unpack and saved tensor are differences "
          "from `none`; in `modules` they include the engine's module hooks, and with moves the "
          "copies.\n")
    for w, res in results.items():
        rows = [[m, r["median_step_ms"], r["step_ratio_vs_none"], r["median_forward_ms"],
                 r["median_backward_ms"], r["median_end_ms"], r["us_per_pack"], r["us_per_unpack"],
                 r["step_us_per_saved_tensor"], r.get("last_profile_mode", "-")]
                for m, r in res["modes"].items()]
        md += (f"\n## {w}: {res['packs_per_step']} packs, {res['unpacks_per_step']} unpacks per "
               f"step; natural activation peak {cs.format_bytes(res['natural_activation_peak_bytes'])}"
               "\n\n" + C.markdown_table(["mode", "step ms", "x none", "fwd ms", "bwd ms", "end ms",
                                         "us/pack", "us/unpack", "step us/saved", "profile"], rows))
    path = C.write_results("hook_cost", device, payload, md, a.out)
    print(md)
    print(f"wrote {path}")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
