"""Calibrate the simulator against real runs of the bench workloads.

    python benchmarks/calibrate_sim.py [--device cpu] [--workloads llama-varlen,moe,...]
        [--size small] [--steps 8] [--repeats 3] [--fractions 0.5,0.25] [--threads 1,2]
        [--quick] [--out DIR]

For each workload a reference engine records traces (no budget, every slot timed) while the
none/guard/static/chameleon engines run the same batches side by side; the simulator then predicts
each engine's step time and peak from the reference traces (``chameleon_swap.sim.calibrate``).
Reported per workload: the median (and worst) relative error of step time and of peak, against
the targets of issue 5 (median step-time error <= 10%, peak error <= 5%), and per policy and budget.
On the CPU the copy engine's worker threads share the cores with compute; a GPU's copy engines do
not share its SMs, and the timeline models copies as free to overlap. So the CPU calibration runs
compute on ``cores - 1`` threads first (one core left to the copies), then on all cores, and
reports both. Writes ``results/calibrate_sim-<device>.{json,md,png}``.

With ``--device cuda`` the defaults are cut to fit a GPU lent for ten minutes: llama-varlen at
size ``gpu`` only, 6 batches, 2 measured passes, one budget (half the natural peak): 3 passes x 6
batches x 5 engines (reference, none, three policies) = 90 steps. Estimated on one H100 from steps
measured there (about 0.4 s plain, 1.2-1.35x for the engine at half the peak; an engine's first
step of each of the four lengths pins its host buffers, 8-15 s measured at a quarter of the peak,
so about half that here): about 45 s of steady steps, up to 100 s of first steps, 20 s to build
and probe: 2 to 3 minutes, not measured. Each policy's engine keeps its own pinned buffers (about
15 GB each at that size), which is also why one budget, not two. The CPU defaults (five
workloads, 8 batches, 3 passes, budgets 50% and 25%) at size ``gpu`` would take well over half an
hour; name them explicitly for that.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

from chameleon_swap.sim.calibrate import FRACTIONS, POLICIES, calibrate  # noqa: E402

WORKLOADS = ("llama-varlen", "moe", "layerdrop", "mixed", "video-dit")
DEFAULTS = dict(workloads=",".join(WORKLOADS), steps=8, repeats=3,
                fractions=",".join(map(str, FRACTIONS)))
# On CUDA (size gpu): what fits a ten-minute loan of one H100 (the module docstring's estimate).
CUDA_DEFAULTS = dict(workloads="llama-varlen", steps=6, repeats=2, fractions="0.5")
STEP_TARGET, PEAK_TARGET = 0.10, 0.05


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workloads", default=None,
                   help=f"comma-separated (default: {DEFAULTS['workloads']}; on CUDA: "
                        f"{CUDA_DEFAULTS['workloads']})")
    p.add_argument("--size", default=None,
                   help="workload size (default: small on CPU, gpu on CUDA)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"batches (default: {DEFAULTS['steps']}; on CUDA: "
                        f"{CUDA_DEFAULTS['steps']})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"measured passes (default: {DEFAULTS['repeats']}; on CUDA: "
                        f"{CUDA_DEFAULTS['repeats']})")
    p.add_argument("--fractions", default=None,
                   help=f"budgets as fractions of the natural peak (default: "
                        f"{DEFAULTS['fractions']}; on CUDA: {CUDA_DEFAULTS['fractions']})")
    p.add_argument("--threads", default=None,
                   help="comma-separated compute thread counts to run with (default on the CPU: "
                        "cores - 1, then all cores; on CUDA: torch's default)")
    p.add_argument("--quick", action="store_true", help="tiny workloads, 2 steps, 1 repeat")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda was given but torch.cuda.is_available() is False")
    defaults = CUDA_DEFAULTS if a.device.startswith("cuda") else DEFAULTS
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    try:
        a.fractions = [float(f) for f in a.fractions.split(",") if f.strip()]
    except ValueError:
        p.error(f"--fractions must be comma-separated numbers in (0, 1]; got {a.fractions!r}")
    if not a.fractions or not all(0 < f <= 1 for f in a.fractions):
        p.error(f"--fractions must be comma-separated numbers in (0, 1]; got {a.fractions!r}")
    if a.size is None:
        a.size = "gpu" if a.device.startswith("cuda") else "small"
    if a.quick:
        a.size, a.steps, a.repeats = "tiny", 2, 1
    if a.steps < 1 or a.repeats < 1:
        p.error("--steps and --repeats must be positive")
    cores = torch.get_num_threads()
    if a.threads is None:
        a.threads = [cores] if a.device.startswith("cuda") else sorted({max(1, cores - 1), cores})
    else:
        try:
            a.threads = [int(t) for t in a.threads.split(",") if t.strip()]
        except ValueError:
            a.threads = []
        if not a.threads or min(a.threads) < 1:
            p.error(f"--threads must be comma-separated positive ints; got {a.threads!r}")
    return a


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    env = C.environment(device)       # before running: the commit whose code is measured
    runs = {}
    with C.progress(len(a.threads) * len(a.workloads) * (a.repeats + 1) * a.steps,
                    "calibrating") as advance:
        for n in a.threads:
            torch.set_num_threads(n)
            runs[n] = {w: calibrate(w, size=a.size, steps=a.steps, repeats=a.repeats,
                                    fractions=tuple(a.fractions), policies=POLICIES,
                                    device=a.device, advance=advance) for w in a.workloads}
    payload = {"benchmark": "calibrate_sim", "environment": env,
               "config": {"workloads": a.workloads, "size": a.size, "steps": a.steps,
                          "repeats": a.repeats, "fractions": a.fractions, "threads": a.threads,
                          "policies": list(POLICIES),
                          "targets": {"median_step_error": STEP_TARGET,
                                      "median_peak_error": PEAK_TARGET}},
               "medians": {str(n): {w: {k: v for k, v in r["summary"].items() if k != "by_config"}
                                    for w, r in res.items()} for n, res in runs.items()},
               "results": {str(n): res for n, res in runs.items()}}
    md = [f"# calibrate_sim on {env['device_name']}\n",
          f"torch {env['torch']}, commit {env['commit']}; workloads at size {a.size!r}, "
          f"{a.steps} batches, {a.repeats} measured passes after one warm-up pass (medians per "
          f"batch), budgets {', '.join(f'{f:.0%}' for f in a.fractions)} of each schedule's "
          f"largest natural peak. Predictions: `chameleon_swap.sim` from the reference engine's "
          f"traces (no budget, every slot timed) and the measured copy bandwidth.\n",
          "Error = |predicted - measured| / measured per batch (training steps only). Targets: "
          f"median step-time error <= {STEP_TARGET:.0%}, peak error <= {PEAK_TARGET:.0%}.\n"]
    if device.type == "cpu":
        md.append("CPU only: no GPU was available for this run, so there is no GPU calibration. "
                  "On the CPU, 'device' and 'host' are both RAM, and the copy engine's worker "
                  "threads share the cores with compute, which the timeline (copies overlap "
                  "compute for free, as on a GPU's copy engines) does not model. Hence a run "
                  "with one core left to the copies, then one with compute on every core.\n")
    for n, results in runs.items():
        md.append(f"## {n} compute thread{'s' if n > 1 else ''}\n")
        rows = []
        for w, r in results.items():
            s = r["summary"]
            ok = (s["median_step_error"] is not None and s["median_step_error"] <= STEP_TARGET
                  and s["median_peak_error"] is not None and s["median_peak_error"] <= PEAK_TARGET)
            rows.append([w, pct(s["median_step_error"]), pct(s["max_step_error"]),
                         pct(s["median_peak_error"]), pct(s["max_peak_error"]),
                         "yes" if ok else "no"])
        md.append(C.markdown_table(["workload", "median step error", "worst step error",
                                    "median peak error", "worst peak error", "within targets"],
                                   rows))
        for w, r in results.items():
            md.append(f"\n### {w} ({n} thread{'s' if n > 1 else ''})\n")
            rows = []
            for k, v in r["summary"]["by_config"].items():
                rows.append([k, pct(v["median_step_error"]), pct(v["median_peak_error"]),
                             1e3 * v["median_measured_step_s"], 1e3 * v["median_predicted_step_s"],
                             1e3 * v["median_measured_stall_s"],
                             1e3 * v["median_predicted_stall_s"],
                             v["median_measured_moved_bytes"] / 2**20,
                             v["median_predicted_moved_bytes"] / 2**20])
            md.append(C.markdown_table(["policy@budget", "step error", "peak error",
                                        "measured step ms", "predicted step ms",
                                        "measured stall ms", "predicted stall ms",
                                        "measured moved MiB", "predicted moved MiB"], rows))
    path = C.write_results("calibrate_sim", device, payload, "\n".join(md), a.out)
    if C.have_matplotlib():
        plot(runs[a.threads[0]], path.with_suffix(".png"))
    print("\n".join(md))
    print(f"wrote {path}", file=sys.stderr)
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    for w, r in results.items():
        rows = r["rows"]
        a.scatter([1e3 * x["measured_step_s"] for x in rows],
                  [1e3 * x["predicted_step_s"] for x in rows], s=10, label=w)
        b.scatter([x["measured_peak_bytes"] / 2**20 for x in rows],
                  [x["predicted_peak_bytes"] / 2**20 for x in rows], s=10, label=w)
    for ax, unit in ((a, "step ms"), (b, "peak MiB")):
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xlabel(f"measured {unit}")
        ax.set_ylabel(f"predicted {unit}")
        ax.legend(fontsize=7)
    fig.suptitle("simulator vs measurement, per batch and policy@budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
