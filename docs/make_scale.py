"""Generate docs/SCALE.md (and docs/scale/*.png) from the simulator's commands.

    python docs/make_scale.py [--quick]

Every number in SCALE.md comes from running ``chameleon-swap simulate | capacity | compare`` (in
process, with ``--json``) at the settings written next to it, or from the benchmark result files
under benchmarks/results/ (calibration, profiler cost). Nothing is typed in by hand.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from chameleon_swap import cli  # noqa: E402
from chameleon_swap.sim import hardware  # noqa: E402
from chameleon_swap.sim.models import family  # noqa: E402

import scale_traced  # noqa: E402  (docs/, next to this script)
from scale_runs import calibration_section, pipeline_section, runtime_claims_section  # noqa: E402

DOCS = ROOT / "docs"
FIGS = DOCS / "scale"
HARDWARE = ("h100-sxm", "h100-pcie", "h200", "a100-80gb", "ascend-910b")
CLAIM_SPEEDUP = 0.3894          # Chameleon's abstract: "up to 38.94%"
CLAIM_RATIO = 4.0               # "models up to 4x larger than hardware memory"
DP_SHARD = 8                    # ZeRO-1 over the 8 devices of a node: see SCALE.md
CAPACITY_MODEL = "llama-7b"
CAPACITY_POLICIES = "none,full-recompute,selective-recompute,sync-swap,guard,chameleon,hybrid"
# (seq, micro-batch, flash) settings of the speed comparison.
GRID = ((4096, 1, True), (4096, 4, True), (4096, 16, True), (16384, 1, True), (16384, 4, True),
        (32768, 1, True), (4096, 4, False))
# Settings where compare also runs hybrid (its planner searches mixes of block modes, which
# costs about a minute per setting and profile on a 2-core CPU).
HYBRID_GRID = ((16384, 1, True),)
NO_HYBRID = "chameleon,full-recompute,selective-recompute,none"
BOUND_SCENARIO = dict(model="llama-13b", tp=2, seq=4096, micro_batch=8)


def command(argv: list[str]) -> dict:
    """Run one CLI command with --json and return its object."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main([*argv, "--json"])
    if code != 0:
        raise RuntimeError(f"chameleon-swap {' '.join(argv)} exited {code}")
    return json.loads(buf.getvalue())


def shell(argv: list[str]) -> str:
    return "chameleon-swap " + " ".join(argv)


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return "\n".join(out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]) + "\n"


def gib(n) -> str:
    return f"{n / 2**30:.1f} GiB"


def log(msg: str) -> None:
    print(f"[make_scale] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ sections
def hardware_section(hws) -> list[str]:
    rows = []
    for hw in hws:
        rows.append([hw.name, hw.title, f"{hw.peak_flops.get('bf16', 0) / 1e12:.0f} x "
                     f"{hw.achievable_fraction:.2f}",
                     gib(hw.device_memory_bytes), f"{hw.memory_bandwidth_bytes_per_s / 1e12:.2f}",
                     f"{hw.link_name}, {hw.h2d_bytes_per_s / 1e9:.1f}; achieved "
                     f"{hw.h2d / 1e9:.1f} / {hw.d2h / 1e9:.1f}"
                     + (" (measured)" if hw.measured_h2d_bytes_per_s else ""),
                     f"{hw.interconnect_name}, {hw.interconnect_bytes_per_s / 1e9:.0f}",
                     gib(hw.host_memory_bytes), hw.confidence.split(":")[0] or "datasheet"])
    return ["## Hardware profiles\n",
            "From `src/chameleon_swap/sim/hardware/*.json`, where every figure names its source "
            "(vendor datasheets for the NVIDIA parts; for the Ascend 910B no Huawei datasheet "
            "could be consulted, so its figures are secondary and marked low confidence). Peak "
            "FLOP/s are dense (the datasheets' headline figures assume 2:4 sparsity and are twice "
            "as high). Link and interconnect rates are per direction.\n",
            table(["profile", "device", "dense BF16 TFLOP/s x achieved fraction", "memory",
                   "HBM TB/s", "host link GB/s (H2D / D2H achieved)", "interconnect GB/s", "host RAM / device", "figures"], rows),
            "Assumptions (stated in each file): matmuls reach 50% of peak (Narayanan et al. 2021 "
            "sustain 52% of A100 peak end to end), except on h100-sxm, where the fraction is "
            "fitted to measured step times and the host link is the measured pinned rate (see "
            "'Step times vs GPU measurements'); memory-bound kernels reach 80% of HBM bandwidth, "
            "copies 80% of the PCIe rate where not measured, collectives 80% of the "
            "interconnect; 2 GiB per device are reserved for the runtime; host RAM is 256 GiB per "
            "device (DGX H100/H200/A100: 2 TB for 8 GPUs). Model states take 16 bytes per "
            "parameter (mixed-precision Adam, Rajbhandari et al. 2020), of which the 12 optimizer "
            f"bytes are sharded over {DP_SHARD} data-parallel ranks (ZeRO-1) in every formula (`--model`) experiment "
            "below. The transient workspace is estimated as twice the largest saved tensor.\n"]


def capacity_section(hws) -> tuple[list[str], dict]:
    out = ["## Claim 1: models up to 4x larger than device memory\n",
           f"Setting: `{CAPACITY_MODEL}`, BF16, FlashAttention, tensor parallelism 1, ZeRO-1 over "
           f"{DP_SHARD} ranks; `capacity` grows the sequence (micro-batch 1) and the micro-batch "
           "(sequence 4096) until a policy no longer fits: model states + its activation peak + "
           "workspace within device memory (less the reserve), and what it swaps within host RAM. "
           "*Demand* is what the step would need with nothing swapped or recomputed (states + "
           "all saved activations + workspace + reserve); the ratio is demand / device memory.\n"]
    rows, verdict = [], {}
    for hw in hws:
        argv = ["capacity", "--hardware", hw.name, "--model", CAPACITY_MODEL, "--dp-shard",
                str(DP_SHARD), "--policies", CAPACITY_POLICIES,
                "--plot", str(FIGS / f"capacity-{hw.name}.png")]
        log(shell(argv))
        d = command(argv)["policies"]
        best = {}
        for p, row in d.items():
            pts = [(row[a]["demand_ratio"], a, row[a]) for a in ("seq", "micro_batch") if row[a]]
            best[p] = max(pts, key=lambda x: x[0]) if pts else None
        ch = best["chameleon"]
        bound = 1 + hw.host_memory_bytes / hw.device_memory_bytes
        limit = "-"
        if ch:
            limit = ("host RAM" if ch[2]["moved_bytes"] >= 0.9 * hw.host_memory_bytes
                     else "largest tensor + workspace on the device")
        rc = best["full-recompute"]
        verdict[hw.name] = (ch[0] if ch else 0.0, rc[0] if rc else 0.0,
                            ch[2]["tokens_per_second"] if ch else None,
                            rc[2]["tokens_per_second"] if rc else None,
                            best["hybrid"][0] if best.get("hybrid") else 0.0)

        def show(p):
            b = best.get(p)
            if not b:
                return "does not fit"
            v = b[2][b[1]]
            what = f"seq {v}" if b[1] == "seq" else f"micro-batch {v}"
            return f"{b[0]:.2f}x ({what}, {b[2]['tokens_per_second']:.0f} tok/s)"
        rows.append([hw.name, show("none"), show("chameleon"), show("hybrid"), show("guard"),
                     show("full-recompute"), show("sync-swap"), f"{bound:.2f}x", limit,
                     "**holds**" if ch and ch[0] >= CLAIM_RATIO else "does not hold"])
    out.append(table(["hardware", "none", "chameleon", "hybrid", "guard", "full recompute",
                      "sync swap", "swap bound 1 + host/device", "chameleon limited by",
                      "4x claim"], rows))
    out.append("Figures: " + ", ".join(f"[{hw.name}](scale/capacity-{hw.name}.png)"
                                       for hw in hws) + ".\n")
    return out, verdict


def compare_section(hws) -> tuple[list[str], dict]:
    out = ["## Claim 2: up to 38.94% faster than recomputation or higher-degree parallelism\n",
           "`compare` runs each approach at the smallest tensor-parallel degree (1, 2, 4, 8) at "
           "which it fits the device (equal memory: the same device), and reports tokens/s per "
           "device there: chameleon (swapping under the largest budget the device leaves), full "
           "recomputation (Chen et al. 2016; every layer's forward redone), selective "
           "recomputation (Korthikanti et al. 2022; attention core redone) and tensor "
           "parallelism alone (Megatron with sequence parallelism; no swapping, no "
           "recomputation: the *higher-degree parallelism*). Speedup = chameleon's tokens/s per "
           "device / the other's - 1. Counted only where memory binds, i.e. where tensor "
           "parallelism alone needs a higher degree than chameleon (elsewhere chameleon has "
           "nothing to swap and the comparison is with not recomputing at all). Every model is "
           f"a dense preset, BF16, ZeRO-1 over {DP_SHARD} ranks.\n"]
    best: dict = {}
    wins: dict = {}
    for hw in hws:
        best[hw.name] = {"vs_full_recompute": None, "vs_selective_recompute": None,
                         "vs_tensor_parallel": None, "hybrid_vs_full_recompute": None}
        wins[hw.name] = []
        for seq, mb, flash in GRID:
            argv = ["compare", "--hardware", hw.name, "--seq", str(seq), "--micro-batch",
                    str(mb), "--dp-shard", str(DP_SHARD)] + ([] if flash else ["--no-flash"])
            if (seq, mb, flash) == (4096, 4, True):
                argv += ["--plot", str(FIGS / f"compare-{hw.name}.png")]
            if (seq, mb, flash) not in HYBRID_GRID:
                argv += ["--approaches", NO_HYBRID]
            log(shell(argv))
            for row in command(argv)["models"]:
                setting = f"{row['model']}, seq {seq} x mb {mb}" + ("" if flash else ", no flash")
                # Only where memory binds: without swapping or recomputation (tensor
                # parallelism alone) the model needs a higher degree than chameleon uses.
                ch, tp_only = row["chameleon"], row["none"]
                if ch is None or (tp_only is not None and tp_only["tp"] <= ch["tp"]):
                    continue
                for k in best[hw.name]:
                    v = row[k]
                    if v is not None and (best[hw.name][k] is None or v > best[hw.name][k][0]):
                        best[hw.name][k] = (v, setting, row)
                if row["vs_full_recompute"] is not None:
                    wins[hw.name].append((row["model"], seq, mb, flash, row["vs_full_recompute"],
                                          row["chameleon"]["tp"], row["full-recompute"]["tp"]))
    hybrid_best: dict = {}
    rows, verdict = [], {}
    for name, b in best.items():
        cells = []
        for k in ("vs_full_recompute", "vs_selective_recompute", "vs_tensor_parallel",
                  "hybrid_vs_full_recompute"):
            v = b[k]
            cells.append("-" if v is None else f"{pct(v[0])} ({v[1]})")
        top = max((v[0] for k, v in b.items() if v is not None and not k.startswith("hybrid")),
                  default=None)
        verdict[name] = top
        hybrid_best[name] = b["hybrid_vs_full_recompute"][0] if b["hybrid_vs_full_recompute"] \
            else None
        rows.append([name, *cells, "**holds**" if top is not None and top >= CLAIM_SPEEDUP
                     else f"not reached (best {pct(top)})"])
    out.append(table(["hardware", "best vs full recompute", "best vs selective recompute",
                      "best vs higher-degree TP", "hybrid: best vs full recompute",
                      "38.94% claim (chameleon)"], rows))
    out.append("Hybrid (block modes with swapping) was run at "
               + "; ".join(f"seq {s} x micro-batch {m}" for s, m, _ in HYBRID_GRID)
               + " only: its planner searches mixes of block modes, about a minute per setting "
               "and profile here.\n")
    out.append("Settings searched: " + "; ".join(
        f"seq {s} x micro-batch {m}{'' if f else ' without FlashAttention'}" for s, m, f in GRID)
        + f"; models {', '.join(family())}.\n")
    out.append("Figures (seq 4096 x micro-batch 4): " + ", ".join(
        f"[{hw.name}](scale/compare-{hw.name}.png)" for hw in hws) + ".\n")
    return out, (verdict, wins, hybrid_best)


def crossover_section(wins: dict) -> list[str]:
    out = ["## Where swapping beats recomputation\n",
           "Chameleon vs full recomputation, tokens/s per device, each at its smallest fitting "
           "tensor-parallel degree (shown as tpC/tpR when they differ), where memory binds "
           "(tensor parallelism alone would need a higher degree); `+` means swapping is "
           "faster. Blank: one of the two does not fit at degree 8, or memory does not bind.\n"]
    for name, ws in wins.items():
        settings = sorted({(s, m, f) for _, s, m, f, *_ in ws}, key=lambda x: (not x[2], x[0], x[1]))
        models = [m for m in family() if any(w[0] == m for w in ws)]
        cell = {(w[0], w[1], w[2], w[3]): w for w in ws}
        rows = []
        for model in models:
            r = [model]
            for s, m, f in settings:
                w = cell.get((model, s, m, f))
                if w is None:
                    r.append("")
                else:
                    deg = "" if w[5] == w[6] else f" (tp{w[5]}/tp{w[6]})"
                    r.append(pct(w[4]) + deg)
            rows.append(r)
        header = ["model"] + [f"{s // 1024}k x {m}" + ("" if f else " no-flash")
                              for s, m, f in settings]
        faster = [w for w in ws if w[4] > 0]
        out.append(f"**{name}**: swapping is faster in {len(faster)} of {len(ws)} "
                   f"(model, setting) pairs where memory binds and both fit.\n")
        out.append(table(header, rows))
    return out


def bound_section(hws) -> list[str]:
    sc = BOUND_SCENARIO
    out = ["## Distance from the lower bound\n",
           f"`simulate --model {sc['model']} --tp {sc['tp']} --dp-shard {DP_SHARD} --seq "
           f"{sc['seq']} --micro-batch {sc['micro_batch']}` with the default budget (device "
           "memory left after model states, workspace and the reserve). The lower bound is the "
           "least time any swap schedule holding the budget can take: the natural peak's excess "
           "over the budget must leave the device, through the one D2H stream, by the end of "
           "forward, and come back through the H2D stream after it "
           "(`max(forward, E/d2h) + max(backward, E/h2d)`). Cells: step time / bound; "
           "`(over)` marks a policy whose peak does not fit the device, for which the bound does "
           "not apply.\n"]
    pols = ["none", "full-recompute", "selective-recompute", "sync-swap", "async-swap", "guard",
            "static", "chameleon", "hybrid"]
    cols, rows = {}, []
    for hw in hws:
        argv = ["simulate", "--model", sc["model"], "--hardware", hw.name, "--tp", str(sc["tp"]),
                "--dp-shard", str(DP_SHARD), "--seq", str(sc["seq"]), "--micro-batch",
                str(sc["micro_batch"]), "--policies", ",".join(pols)]
        log(shell(argv))
        cols[hw.name] = command(argv)
    for p in pols:
        r = [p]
        for hw in hws:
            d = cols[hw.name]
            x = d["policies"][p]
            r.append(f"{x['step_seconds'] / d['lower_bound_seconds']:.3f}"
                     + ("" if x["fits"] else " (over)"))
        rows.append(r)
    rows.append(["bound (s)"] + [f"{cols[hw.name]['lower_bound_seconds']:.3f}" for hw in hws])
    out.append(table(["policy"] + [hw.name for hw in hws], rows))
    def below(p):
        return [hw.name for hw in hws if cols[hw.name]["policies"][p]["step_seconds"]
                < cols[hw.name]["lower_bound_seconds"] and cols[hw.name]["policies"][p]["fits"]]
    beats, hyb = below("full-recompute"), below("hybrid")
    out.append("The bound is for schedules that swap; full recomputation moves nothing and "
               "pays a second forward instead, so it can in principle end below it: "
               + (f"here it does on {', '.join(beats)}." if beats else
                  "here it does not, on any profile.")
               + " Hybrid recomputes some blocks and swaps the rest, so it too can end below it: "
               + (f"here on {', '.join(hyb)}." if hyb else "here it does not.") + "\n")
    return out


def recovery_section() -> list[str]:
    """A pointer to the recovery planner's figures (kept in RECOVERY.md, from
    benchmarks/recovery.py)."""
    return ["## Recovery from lost ranks\n",
            "After ranks are lost, `chameleon-swap recover` simulates rerouting (Recycle-like), "
            "reconfiguration (Oobleck-like) and ours (either, with the engine's budget re-planned "
            "per rank) at 32, 256 and 1024 GPUs; method and figures in "
            "[RECOVERY.md](RECOVERY.md).\n"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="two profiles and fewer settings (a smoke test; SCALE.md is "
                         "written to docs/SCALE-quick.md)")
    a = ap.parse_args(argv)
    global GRID
    names = HARDWARE
    out_name = "SCALE.md"
    if a.quick:
        names, GRID, out_name = ("h100-sxm", "ascend-910b"), GRID[:2], "SCALE-quick.md"
    FIGS.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)                       # the configs are named relative to the repository
    hws = [hardware.load(n) for n in names]
    t0 = time.time()
    log("step times vs GPU measurements (traces the three H100 configs)")
    steps = scale_traced.steps_section(table, pct)
    traced_bytes = scale_traced.traced_bytes_section(table, gib)
    real, _ = scale_traced.traced_models_section(ROOT, hws, table, gib, command, log)
    traced_claims, tverdict = scale_traced.traced_claims_section(
        ROOT, hws, table, command, log, CLAIM_RATIO, CLAIM_SPEEDUP)
    cap, ratio = capacity_section(hws)
    cmp_, (speed, wins, hybrid_best) = compare_section(hws)
    cross = crossover_section(wins)
    bound = bound_section(hws)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    holds4 = [n for n, r in ratio.items() if r[0] >= CLAIM_RATIO]
    holds39 = [n for n, v in speed.items() if v is not None and v >= CLAIM_SPEEDUP]
    hspeed = hybrid_best
    pairs = [w for ws in wins.values() for w in ws]
    slower = [w for w in pairs if w[4] < 0]
    summary = [
        "# Scale by simulation\n",
        f"Generated by `python docs/make_scale.py` at commit {commit} in "
        f"{time.time() - t0:.0f} s, from `chameleon-swap simulate | capacity | compare` (the "
        "timeline cost model the planner uses; analytic traces of decoder-only transformers "
        "(`--model`, a formula for the saved bytes) and Hugging Face models traced on fake "
        "tensors (`--hf`, the bytes their code saves); see `src/chameleon_swap/sim/`). Do not "
        "edit by hand.\n",
        "## Verdicts\n",
        "- **Models up to 4x larger than device memory** (the step's memory demand, model states "
        "plus all saved activations, over device memory): "
        + (f"**holds** in simulation on {', '.join(holds4)}" if holds4 else
           "**does not hold** on any profile")
        + (f"; **does not hold** on {', '.join(n for n in ratio if n not in holds4)}"
           if holds4 and len(holds4) < len(ratio) else "")
        + f" ({CAPACITY_MODEL}, ZeRO-1 over {DP_SHARD}, longer sequences or larger micro-batches). "
        "Largest ratio reached by chameleon / by full recomputation (tokens/s there): "
        + "; ".join(f"{n} {c:.2f}x / {r:.2f}x ({tc:.0f} / {tr:.0f})" if tc and tr else
                    f"{n} {c:.2f}x / {r:.2f}x" for n, (c, r, tc, tr, _) in ratio.items())
        + ". With recomputation (hybrid, `Chameleon(model=...)`), what the device cannot keep "
        "no longer all goes to host RAM, and the ratio reaches "
        + ", ".join(f"{n} {v[4]:.2f}x" for n, v in ratio.items())
        + ". Swapping cannot pass 1 + host RAM / device memory (what it moves must fit in host "
        "RAM), so the claim needs about three times the device's memory in host RAM per device.\n",
        "- **Up to 38.94% faster than recomputation or higher-degree parallelism**: "
        + (f"**reached** on {', '.join(holds39)}" if holds39 else
           "**not reached** on any profile")
        + "; best speedup per profile (over full or selective recomputation or tensor "
        "parallelism alone): " + ", ".join(f"{n} {pct(v)}" for n, v in speed.items())
        + "; hybrid's best over full recomputation (at "
        + "; ".join(f"seq {q} x micro-batch {m}" for q, m, _ in HYBRID_GRID) + "): "
        + ", ".join(f"{n} {pct(v)}" for n, v in hspeed.items())
        + f". Chameleon is slower than full recomputation in {len(slower)} of {len(pairs)} "
        "(model, setting, profile) cases where memory binds and both fit: there the swap "
        "traffic outgrows the "
        "compute it hides behind. Its gain over full recomputation is bounded by the forward "
        "pass recomputation repeats (a third of the step's compute, plus the repeated "
        "tensor-parallel communication).\n",
        "- **On a traced Llama 3 8B** (fp32 weights under bf16 autocast, SGD; 'The claims on a "
        "traced model'): 4x larger " + ", ".join(
            f"{n} {'**holds**' if r >= CLAIM_RATIO else 'does not hold'} ({r:.2f}x)"
            for n, (r, _) in tverdict.items())
        + "; 38.94% faster than full recomputation " + ", ".join(
            f"{n} {'**holds**' if t is not None and t >= CLAIM_SPEEDUP else 'not reached'} "
            f"({pct(t)})" for n, (_, t) in tverdict.items())
        + " (best of chameleon and hybrid where memory binds).\n",
    ]
    doc = (summary + hardware_section(hws) + steps + traced_bytes + calibration_section() + cap
           + cmp_ + cross + bound + real + traced_claims + runtime_claims_section()
           + pipeline_section() + recovery_section())
    (DOCS / out_name).write_text("\n".join(doc))
    log(f"wrote {DOCS / out_name} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
