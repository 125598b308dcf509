"""Recovery from a lost rank: measured on the CPU under torchrun, and simulated at scale.

    python benchmarks/recovery.py [--steps 12] [--kill-step 7] [--skip-run] [--out DIR]

1. Measured (CPU, gloo): ``examples/elastic_train.py`` under 3 torchrun agents on localhost
   (c10d rendezvous), one agent's process group killed in the forward of ``--kill-step``. From
   rank 0's step records: the time to recover (from the last step finished before the failure
   to the first one finished after it, less one median step after), the steps lost (finished
   steps redone from the last complete checkpoint), throughput (samples/s, median step)
   before and after, and the runtime planner's answer (mode, per-rank budget) before and after,
   with what the engine moved under it.
2. Simulated (``chameleon_swap.sim.recovery``): Odyssey's setting (32 GPUs, 7B and 13B) and 256
   and 1024 GPUs, one rank lost and a whole replica's worth of ranks lost, each strategy's
   throughput over the horizon as a share of failure-free, and ours against rerouting-only and
   reconfigure-only.

Writes recovery-cpu.json and .md to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import markdown_table, write_results
from chameleon_swap.bench.env import git_commit
from chameleon_swap.sim.hardware import load as load_hardware
from chameleon_swap.sim.models import preset
from chameleon_swap.sim.recovery import Layout, plan_recovery

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 24

SETTINGS = [  # (label, model, dp, pp, tp, failures)
    ("32 GPUs", "llama-7b", 8, 4, 1),
    ("32 GPUs", "llama-13b", 4, 8, 1),
    ("256 GPUs", "llama-70b", 8, 8, 4),
    ("1024 GPUs", "llama-70b", 32, 8, 4),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured(steps: int, kill_step: int, dim: int, device_memory: int, hardware: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="cs-recovery-"))
    port, procs = _port(), []
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               CS_ELASTIC_KILL=f"{kill_step}:forward:2")
    for a in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3",
               "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench", "--rdzv-conf",
               f"is_host={int(a == 0)},last_call_timeout=3,keep_alive_interval=1,"
               f"keep_alive_max_attempt=2,join_timeout=60", "--monitor-interval", "0.2",
               str(ROOT / "examples" / "elastic_train.py"), "--ckpt", str(tmp / "ckpt"),
               "--records", str(tmp / "log"), "--steps", str(steps), "--every", "4",
               "--global-batch", str(GLOBAL_BATCH), "--samples", str(GLOBAL_BATCH * steps),
               "--dim", str(dim), "--device-memory", str(device_memory), "--hardware",
               hardware]
        procs.append(subprocess.Popen(cmd, env=dict(env, CS_AGENT=str(a)),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
        if a == 0:
            time.sleep(0.5)
    for p in procs:
        p.wait(timeout=300)
    recs = [json.loads(x) for x in (tmp / "log" / "losses.jsonl").read_text().splitlines()]
    before = [r for r in recs if r["attempt"] == 0]
    after = [r for r in recs if r["attempt"] > 0]
    if not after:
        raise SystemExit("no recovery was recorded: the kill did not happen")

    def med(rs):
        d = [b["time"] - a["time"] for a, b in zip(rs, rs[1:])]
        return statistics.median(d) if d else float("nan")
    step_before, step_after = med(before), med(after)
    gap = after[0]["time"] - before[-1]["time"]
    plans = [json.loads(x) for x in (tmp / "log" / "plans.jsonl").read_text().splitlines()]
    p0, p1 = plans[0]["plan"], plans[-1]["plan"]
    return {"world_before": before[0]["world"], "world_after": after[0]["world"],
            "planner_before": f"{p0['mode']}, budget {p0['budget_bytes']} B/rank",
            "planner_after": f"{p1['mode']}, budget {p1['budget_bytes']} B/rank",
            "offloaded_bytes_per_step_before": statistics.median(r["offloaded_bytes"]
                                                                 for r in before),
            "offloaded_bytes_per_step_after": statistics.median(r["offloaded_bytes"]
                                                                for r in after),
            "last_step_before_failure": before[-1]["step"],
            "resumed_after_step": after[0]["step"] - 1,
            "steps_lost": before[-1]["step"] - (after[0]["step"] - 1),
            "time_to_recover_seconds": gap - step_after,
            "step_seconds_before": step_before, "step_seconds_after": step_after,
            "samples_per_second_before": GLOBAL_BATCH / step_before,
            "samples_per_second_after": GLOBAL_BATCH / step_after}


def simulated(hardware: str, steps_to_repair: int) -> list[dict]:
    hw = load_hardware(hardware)
    rows = []
    for label, model, dp, pp, tp in SETTINGS:
        lay = Layout(dp, pp, tp, 4 * pp)
        for what, fail in (("1 rank", 1), ("one replica's stages 0..pp/2-1",
                                             [(pp + s) * tp for s in range(pp // 2)])):
            rec = plan_recovery(preset(model), hw, lay, fail, steps_to_repair)
            p = rec.plans
            ours = p["ours"]
            rows.append({
                "setting": label, "model": model, "layout": f"dp{dp} pp{pp} tp{tp}",
                "failure": what, "choice": ours.choice,
                "modes": ours.modes,
                "ours_share": ours.horizon_share,
                "rerouting_share": p["rerouting"].horizon_share if p["rerouting"].feasible
                else None,
                "reconfiguration_share": p["reconfiguration"].horizon_share
                if p["reconfiguration"].feasible else None,
                "ours_vs_rerouting": ours.horizon_share / p["rerouting"].horizon_share
                if p["rerouting"].feasible else None,
                "ours_vs_reconfiguration": ours.horizon_share / p["reconfiguration"].horizon_share
                if p["reconfiguration"].feasible else None,
                "recover_seconds": ours.recover_seconds,
                "peak_gib": ours.peak_bytes / 2**30})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--kill-step", type=int, default=7)
    ap.add_argument("--dim", type=int, default=64, help="the small Llama's hidden size")
    ap.add_argument("--device-memory", type=int, default=9_000_000,
                    help="bytes per rank the runtime planner assumes (default 9000000: 3 "
                         "ranks keep everything, 2 must swap)")
    ap.add_argument("--hardware", default="a100-80gb")
    ap.add_argument("--steps-to-repair", type=int, default=1000)
    ap.add_argument("--skip-run", action="store_true", help="only the simulated figures")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not 1 < a.kill_step < a.steps:
        raise SystemExit(f"--kill-step must be between 2 and --steps - 1; got {a.kill_step}")
    run = None if a.skip_run else measured(a.steps, a.kill_step, a.dim, a.device_memory,
                                             a.hardware)
    sim = simulated(a.hardware, a.steps_to_repair)
    payload = {"device": "cpu", "torch": torch.__version__, "commit": git_commit(),
               "config": vars(a), "measured": run, "simulated": sim}
    md = "# Recovery\n\n"
    if run:
        md += "## Measured (CPU, gloo, torchrun)\n\n" + markdown_table(
            ["quantity", "value"], [[k, v] for k, v in run.items()]) + "\n"
    md += (f"## Simulated ({a.hardware}, horizon {a.steps_to_repair} steps)\n\n"
           + markdown_table(["setting", "model", "layout", "failure", "ours", "modes",
                             "ours / failure-free", "rerouting", "reconfiguration",
                             "ours / rerouting", "ours / reconfig", "recover s"],
                            [[r["setting"], r["model"], r["layout"], r["failure"], r["choice"],
                              ",".join(r["modes"]), r["ours_share"],
                              r["rerouting_share"] if r["rerouting_share"] is not None else "-",
                              r["reconfiguration_share"]
                              if r["reconfiguration_share"] is not None else "-",
                              r["ours_vs_rerouting"] if r["ours_vs_rerouting"] else "-",
                              r["ours_vs_reconfiguration"] if r["ours_vs_reconfiguration"]
                              else "-", r["recover_seconds"]] for r in sim]))
    path = write_results("recovery", torch.device("cpu"), payload, md,
                         Path(a.out) if a.out else None)
    print(md)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
