"""Soak: many steps of a dynamic workload under a tight budget; is memory flat and is time flat?

A training run lasts months of steps. Whatever the engine keeps per step (history, records of
tensors that outlive their step, host arena slabs, plan cache entries) shows here as a slope. Every
``--every`` steps it samples the process's RSS, the host arena (in use, reserved), the records the
engine tracks (and the ``Record`` objects alive in the process, found by the garbage collector),
the length of ``eng.history`` and the median step time of the last window, and writes them to
``benchmarks/results/soak-<device>.json`` (and ``.png`` with matplotlib). Flat is the target.

The workload is ``moe`` (variable length and top-k routing: the operator sequence changes almost
every step) at the ``tiny`` size by default, so that 10,000 steps take minutes on a small CPU; the
budget is ``--fraction`` (20%) of the largest natural activation peak of a sample of its steps.
The batches of a chunk are built up front and kept alive while it runs, as a data set held in
memory would be: their input tensors outlive the steps that saved them.

Not run in CI (it takes minutes):  python benchmarks/soak.py --steps 10000
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import chameleon_swap as cs  # noqa: E402
from chameleon_swap.runtime.executor import Record  # noqa: E402
from chameleon_swap.workloads import get_workload  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def record_objects() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is Record)


def natural_budget(wl, model, batches, fraction: float, device) -> int:
    """``fraction`` of the largest saved-activation peak of ``batches`` with no budget."""
    peak = 0
    m = copy.deepcopy(model)
    with cs.Chameleon(None, device=device, min_tensor_bytes=0) as eng:
        for b in batches:
            if b.train:
                with eng.step():
                    wl.run(m, b)
                peak = max(peak, eng.last_step.peak_resident_bytes)
    return int(peak * fraction)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="moe")
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--every", type=int, default=100, help="sample every N steps")
    p.add_argument("--fraction", type=float, default=0.2, help="budget: share of the peak")
    p.add_argument("--chunk", type=int, default=500, help="batches built (and kept) at once")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device("cpu")
    wl = get_workload(a.workload, a.size)
    model = wl.build(device, seed=a.seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    budget = natural_budget(wl, model, wl.batches(64, device, seed=a.seed), a.fraction, device)
    samples, times = [], []
    t_start = time.perf_counter()
    with cs.Chameleon(budget, device=device, min_tensor_bytes=0) as eng:
        step = 0
        while step < a.steps:
            batches = wl.batches(min(a.chunk, a.steps - step), device, seed=a.seed + 1 + step)
            for b in batches:
                t0 = time.perf_counter()
                with eng.step():
                    wl.run(model, b)
                if b.train and b.optimizer_step:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                times.append(time.perf_counter() - t0)
                step += 1
                if step % a.every == 0 or step == a.steps:
                    s = {"step": step, "rss_bytes": rss_bytes(),
                         "host_bytes_in_use": eng.host_bytes_in_use,
                         "host_bytes_reserved": eng.host_bytes_reserved,
                         "resident_bytes": eng.resident_bytes,
                         "records_alive": eng.records_alive,
                         "record_objects": record_objects(),
                         "history_len": len(eng.history),
                         "step_seconds_median": statistics.median(times[-a.every:]),
                         "elapsed_seconds": time.perf_counter() - t_start}
                    samples.append(s)
                    print(f"step {step}: rss {s['rss_bytes'] / 2**20:.1f} MiB, host "
                          f"{s['host_bytes_in_use']}/{s['host_bytes_reserved']} B, records "
                          f"{s['records_alive']} ({s['record_objects']} objects), step "
                          f"{s['step_seconds_median'] * 1e3:.1f} ms", flush=True)
            del batches
        totals = eng.totals.as_dict()
    payload = {"benchmark": "soak", "environment": C.environment(device),
               "config": {**vars(a), "budget_bytes": budget, "workload_config": wl.config_dict()},
               "totals": totals, "samples": samples, "summary": summarize(samples)}
    out = Path(a.out) if a.out else C.RESULTS
    md = soak_markdown(payload)
    path = C.write_results("soak", device, payload, md, out)
    if C.have_matplotlib():
        plot(samples, path.with_suffix(".png"), payload["config"])
    print(md)
    return payload


def summarize(samples: list) -> dict:
    """First sample after warm-up (10% of the run) against the last: flat means these agree."""
    if not samples:
        return {}
    warm = samples[min(len(samples) - 1, max(1, len(samples) // 10))]
    last = samples[-1]
    keys = ("rss_bytes", "host_bytes_reserved", "host_bytes_in_use", "records_alive",
            "record_objects", "step_seconds_median")
    return {k: {"after_warmup": warm[k], "last": last[k],
                "max_after_warmup": max(s[k] for s in samples if s["step"] >= warm["step"])}
            for k in keys}


def soak_markdown(payload: dict) -> str:
    rows = [[k, v["after_warmup"], v["last"], v["max_after_warmup"]]
            for k, v in payload["summary"].items()]
    cfg = payload["config"]
    return (f"# soak: {cfg['steps']} steps of {cfg['workload']} ({cfg['size']}) at "
            f"{cfg['fraction']:.0%} of the natural peak ({cfg['budget_bytes']} B)\n\n"
            + C.markdown_table(["figure", "after warm-up", "last", "max after warm-up"], rows))


def plot(samples: list, path: Path, cfg: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [s["step"] for s in samples]
    fig, ax = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    ax[0, 0].plot(steps, [s["rss_bytes"] / 2**20 for s in samples])
    ax[0, 0].set_ylabel("process RSS (MiB)")
    ax[0, 1].plot(steps, [s["host_bytes_reserved"] / 2**20 for s in samples], label="reserved")
    ax[0, 1].plot(steps, [s["host_bytes_in_use"] / 2**20 for s in samples], label="in use")
    ax[0, 1].set_ylabel("host arena (MiB), between steps")
    ax[0, 1].legend()
    ax[1, 0].plot(steps, [s["records_alive"] for s in samples], label="tracked by the engine")
    ax[1, 0].plot(steps, [s["record_objects"] for s in samples], label="Record objects alive")
    ax[1, 0].set_ylabel("records")
    ax[1, 0].legend()
    ax[1, 1].plot(steps, [s["step_seconds_median"] * 1e3 for s in samples])
    ax[1, 1].set_ylabel(f"median step time (ms, per {cfg['every']} steps)")
    for a in ax[1]:
        a.set_xlabel("step")
    for a in ax.flat:
        a.set_ylim(bottom=0)
    fig.suptitle(f"soak: {cfg['workload']} ({cfg['size']}), budget {cfg['fraction']:.0%} of the "
                 f"natural peak, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
