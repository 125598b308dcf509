"""Per-rank peak memory and step time of pipeline schedules with and without the engine.

    python benchmarks/pipeline.py [--world 2] [--reps 5] [--quick] [--out DIR]

Measured: a Llama cut into stages, trained on the CPU with ``torch.distributed.pipelining`` and
gloo, ``--world`` processes, in four modes run interleaved in each process (the order rotates
every repetition):

* ``1f1b``: PyTorch's ``Schedule1F1B``, nothing else;
* ``1f1b+recompute``: the same with every block under ``torch.utils.checkpoint`` (full recompute);
* ``1f1b+engine``: a ``PipelineChameleon`` on every rank, budget ``--fraction`` of the largest
  rank's natural 1F1B peak, the same budget on every rank;
* ``chronos+engine``: ``ScheduleChronos`` (two stages per rank in a V) with the same budget;
* ``1f1b+engine+weights``: ``1f1b+engine`` with ``offload_weights=True`` (each block's weights on
  the host between its uses inside the step; on its own copy of the stage, so the other modes
  never run its hooks); its rows also report the most weight bytes resident during a step.

Peaks are the engine's count of saved-activation bytes resident (for the modes without a budget,
one extra untimed step with an unbudgeted engine counts them); each repetition checks that every
mode computed the same losses bit for bit. On a CPU "device" and "host" are the same RAM: times
are the cost of the hooks and the copies, not a GPU forecast.

Simulated at scale: the same four methods and the hybrid mode (the engine with recomputation
where the link cannot hide the copies), under 1F1B and Chronos, on a 70B-shaped model, TP8 x PP8,
32 micro-batches of 4096 tokens, on h100-sxm (``chameleon_swap.sim.pipeline``), the budget what
memory leaves after model states, and, for comparison, a budget half the 1F1B first rank's
activation peak.

Writes ``benchmarks/results/pipeline-<device>.json``, a markdown table next to it and, with
matplotlib, ``pipeline-<device>.png``: per-rank resident activations over one step, per mode.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

MODES = ("1f1b", "1f1b+recompute", "1f1b+engine", "chronos+engine", "1f1b+engine+weights")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2, help="pipeline ranks (processes)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per mode")
    p.add_argument("--fraction", type=float, default=0.4,
                   help="budget: this share of the largest rank's natural 1F1B peak")
    p.add_argument("--micro-batches", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="a tiny configuration (smoke run)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    a = p.parse_args(argv)
    size = dict(dim=64, layers=4, seq=64, micro=2, reps=2) if a.quick else \
        dict(dim=256, layers=8, seq=256, micro=2, reps=5)
    a.size = size
    a.reps = a.reps if a.reps is not None else size["reps"]
    a.micro_batches = a.micro_batches or 2 * a.world
    C.check_counts(p, a, ("world", "reps", "micro_batches"), non_negative=())
    if 2 * a.world > a.size["layers"]:
        p.error(f"--world {a.world} needs {2 * a.world} layers for the Chronos V; the model has "
                f"{a.size['layers']}")
    if not 0 <= a.fraction <= 1:
        p.error(f"--fraction must be between 0 and 1; got {a.fraction}")
    return a


# ---------------------------------------------------------------------------- in the children
def _setup(a, rank: int):
    from chameleon_swap.workloads import Llama, LlamaConfig
    from chameleon_swap.workloads.pipeline import split_llama
    s = a.size
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=1024, dim=s["dim"], n_layers=s["layers"],
                              n_heads=max(1, s["dim"] // 64), n_kv_heads=max(1, s["dim"] // 128),
                              max_seq_len=s["seq"]))
    g = torch.Generator().manual_seed(1)
    t = torch.randint(1024, (s["micro"] * a.micro_batches, s["seq"] + 1), generator=g)
    return model, split_llama(model, a.world), split_llama(model, 2 * a.world), t[:, :-1], t[:, 1:]


def _checkpointed(stage):
    from torch.utils.checkpoint import checkpoint

    class Ckpt(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, *args):
            return checkpoint(self.block, *args, use_reentrant=False)
    stage.layers = torch.nn.ModuleList(Ckpt(b) for b in stage.layers)
    return stage


def _child(rank: int, a, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from chameleon_swap.parallel.pipeline import PipelineChameleon, ScheduleChronos, chronos_stage_indices
    from chameleon_swap.workloads.pipeline import llama_loss
    # The ranks share the machine's cores: one compute thread each unless there are more cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (2 * a.world)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a.world, timeout=datetime.timedelta(seconds=300))
    try:
        model, parts, vparts, x, y = _setup(a, rank)
        import copy
        rec_part = _checkpointed(copy.deepcopy(parts[rank]))
        w_part = copy.deepcopy(parts[rank])
        cpu = torch.device("cpu")
        M, W = a.micro_batches, a.world
        scheds = {
            "1f1b": Schedule1F1B(PipelineStage(parts[rank], rank, W, cpu), M, loss_fn=llama_loss),
            "1f1b+recompute": Schedule1F1B(PipelineStage(rec_part, rank, W, cpu), M,
                                           loss_fn=llama_loss),
            "chronos": ScheduleChronos([PipelineStage(vparts[i], i, 2 * W, cpu)
                                        for i in chronos_stage_indices(rank, W)], M,
                                       loss_fn=llama_loss),
        }
        scheds["1f1b+engine+weights"] = Schedule1F1B(PipelineStage(w_part, rank, W, cpu), M,
                                                      loss_fn=llama_loss)
        scheds["1f1b+engine"] = scheds["1f1b"]
        scheds["chronos+engine"] = scheds["chronos"]

        def step(mode, eng=None):
            model.zero_grad(set_to_none=True)
            rec_part.zero_grad(set_to_none=True)
            w_part.zero_grad(set_to_none=True)
            losses: list = []
            args = [x] if rank == 0 else []
            sched = scheds[mode]
            if eng is None:
                sched.step(*args, target=y, losses=losses)
            else:
                eng.attach(sched)
                with eng.step():
                    sched.step(*args, target=y, losses=losses)
                eng.detach()
            return [t.detach() for t in losses]

        # Natural peaks and memory over time with an unbudgeted engine (one untimed step each).
        probe = PipelineChameleon(scheds["1f1b"], None, device="cpu", min_tensor_bytes=0)
        natural, timelines = {}, {}
        for mode in ("1f1b", "1f1b+recompute", "chronos"):
            for _ in range(2):          # the first step of a schedule also sizes its buffers
                step(mode, probe)
            natural[mode] = probe.last_step.peak_resident_bytes
            timelines[mode] = probe.timeline
        probe.close()
        peaks = [None] * W
        dist.all_gather_object(peaks, natural["1f1b"])
        budget = int(max(peaks) * a.fraction)
        engines = {m: PipelineChameleon(scheds[m], budget, device="cpu", min_tensor_bytes=0,
                                        offload_weights=m.endswith("+weights"))
                   for m in ("1f1b+engine", "chronos+engine", "1f1b+engine+weights")}
        weight_bytes = sum(p.numel() * p.element_size() for p in w_part.parameters())
        times = {m: [] for m in MODES}
        stats = {m: [] for m in engines}
        same = True
        for rep in range(a.warmup + a.reps):
            order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
            losses = {}
            for m in order:
                dist.barrier()
                t0 = C.now()
                losses[m] = step(m, engines.get(m))
                dt = C.now() - t0
                if rep >= a.warmup:
                    times[m].append(dt)
                    if m in engines:
                        st = engines[m].last_step.as_dict()
                        offs = engines[m].weight_offloads.values()
                        st["weight_held_bytes"] = sum(o.last_step.peak_held_bytes for o in offs)
                        stats[m].append(st)
            # The loss lives on the rank of the last stage: rank W-1 under 1F1B, rank 0 in the V.
            held = {}
            for m in MODES:
                every = [None] * W
                dist.all_gather_object(every, losses[m])
                held[m] = next(v for v in every if v)
            ref = held["1f1b"]
            same &= all(len(v) == len(ref) and all(torch.equal(p, q) for p, q in zip(v, ref))
                        for v in held.values())
        for m, eng in engines.items():
            timelines[m] = eng.timeline
            eng.close()
        out = {"rank": rank, "budget": budget, "natural": natural, "times": times,
               "stats": stats, "losses_equal": same, "timelines": timelines,
               "weight_bytes": weight_bytes}
    except Exception:
        out = {"rank": rank, "error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))


# ---------------------------------------------------------------------------- in the parent
def simulated() -> dict:
    from chameleon_swap.sim.hardware import load
    from chameleon_swap.sim.models import preset
    from chameleon_swap.sim.pipeline import simulate_pipeline
    hw = load("h100-sxm")
    cfg = preset("llama-70b", seq=4096, tp=8)
    base = simulate_pipeline(cfg, hw, 8, 32, "1f1b", "none")
    half = base.ranks[0].activation_peak_bytes // 2
    runs = {"1f1b": ("1f1b", "none", None), "1f1b+recompute": ("1f1b", "recompute", None),
            "1f1b+engine": ("1f1b", "engine", None), "chronos+engine": ("chronos", "engine", None),
            "1f1b+hybrid": ("1f1b", "hybrid", None), "chronos+hybrid": ("chronos", "hybrid", None),
            "1f1b+engine@half": ("1f1b", "engine", half),
            "chronos+engine@half": ("chronos", "engine", half),
            "1f1b+hybrid@half": ("1f1b", "hybrid", half),
            "chronos+hybrid@half": ("chronos", "hybrid", half)}
    out = {"settings": "llama-70b shape, 80 layers, TP8 x PP8, 32 micro-batches of 1 x 4096, "
                       "bf16, h100-sxm; @half: budget half the 1F1B first rank's activation peak"}
    for name, (sched, mode, budget) in runs.items():
        r = simulate_pipeline(cfg, hw, 8, 32, sched, mode, budget)
        out[name] = {"step_seconds": r.step_seconds, "bubble": r.bubble_fraction,
                     "activation_peak_bytes": [x.activation_peak_bytes for x in r.ranks],
                     "total_bytes": [x.total_bytes for x in r.ranks],
                     "offloaded_bytes": [x.offloaded_bytes for x in r.ranks],
                     "stall_seconds": [x.stall_seconds for x in r.ranks],
                     "recomputed_fraction": [x.recomputed_fraction for x in r.ranks]}
    return out


def _spawn(a) -> list:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_child, args=(a, port, tmp), nprocs=a.world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(a.world)]
    for r in ranks:
        if "error" in r:
            raise RuntimeError(f"rank {r['rank']} failed:\n{r['error']}")
    return ranks


def markdown(a, ranks: list, sim: dict) -> str:
    rows = []
    for m in MODES:
        for r in ranks:
            peak = (max(s["peak_resident_bytes"] for s in r["stats"][m]) if m in r["stats"]
                    else r["natural"][m])
            weights = r["weight_bytes"] / 2**20
            wpeak = wheld = weights
            if m.endswith("+weights"):
                wpeak = max(s["weight_peak_bytes"] for s in r["stats"][m]) / 2**20
                wheld = max(s["weight_held_bytes"] for s in r["stats"][m]) / 2**20
            rows.append([m if r["rank"] == 0 else "", r["rank"], peak / 2**20,
                         r["budget"] / 2**20 if m in r["stats"] else "-", wpeak, wheld,
                         C.median(r["times"][m]) * 1e3,
                         C.median(r["times"][m]) / C.median(r["times"]["1f1b"])])
    text = (f"# pipeline on {ranks[0]['device_name']}\n\n{a.world} ranks (gloo), "
            f"{a.micro_batches} micro-batches of {a.size['micro']} x {a.size['seq']} tokens, "
            f"Llama dim {a.size['dim']}, {a.size['layers']} layers; medians of {a.reps} "
            f"repetitions; load average {ranks[0]['load']:.1f} at the end; losses identical in "
            f"every mode: "
            f"{'yes' if all(r['losses_equal'] for r in ranks) else 'NO'}\n\n")
    text += C.markdown_table(["mode", "rank", "peak MiB", "budget MiB", "weights MiB",
                              "weights held MiB", "step ms", "vs 1f1b"], rows)
    text += ("\n\"weights MiB\": the stage's parameters, all on the device without offload; "
             "with `+weights`, the most block weight bytes resident at once during the step "
             "(`StepStats.weight_peak_bytes`: at the step's start, blocks whose copy-out is still "
             "running are counted, while activations are still few). \"weights held MiB\": of "
             "those, the blocks fetched or run in the step (`peak_held_bytes`, at most two blocks "
             "per stage), which is what sits beside the activations later in the step; the "
             "non-block parameters (embedding, head) stay on the device and are not counted "
             "with `+weights`.\n")
    text += f"\n## Simulated at scale\n\n{sim['settings']}\n\n"
    srows = [[k, v["step_seconds"], f"{v['bubble']:.1%}",
              " / ".join(f"{b / 2**30:.1f}" for b in v["activation_peak_bytes"]),
              max(v["offloaded_bytes"]) / 2**30, f"{max(v['recomputed_fraction']):.0%}",
              max(v["stall_seconds"])]
             for k, v in sim.items() if k != "settings"]
    text += C.markdown_table(["method", "step s", "bubble", "activation peak per rank (GiB)",
                              "most moved out (GiB)", "most recomputed", "most stall s"], srows)
    return text


def plot(ranks: list, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = ("1f1b", "1f1b+recompute", "1f1b+engine", "chronos+engine")
    fig, axes = plt.subplots(1, len(shown), figsize=(4 * len(shown), 3.4), sharey=True)
    for ax, m in zip(axes, shown):
        key = m if m in ranks[0]["timelines"] else m.split("+")[0]
        for r in ranks:
            tl = r["timelines"][key]
            ax.step([0] + [t for t, _, _ in tl], [0] + [b / 2**20 for _, _, b in tl],
                    where="post", label=f"rank {r['rank']}")
        if m.endswith("engine"):
            ax.axhline(ranks[0]["budget"] / 2**20, color="k", ls=":", lw=1, label="budget")
        ax.set_title(m)
        ax.set_xlabel("seconds into the step")
    axes[0].set_ylabel("saved activations resident (MiB)")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device("cpu")
    ranks = _spawn(a)
    env = C.environment(device)
    env["load_average_at_end"] = os.getloadavg()[0]
    ranks[0]["device_name"] = env["device_name"]
    ranks[0]["load"] = env["load_average_at_end"]
    sim = simulated()
    payload = {"environment": env,
               "config": {"world": a.world, "micro_batches": a.micro_batches, "reps": a.reps,
                          "warmup": a.warmup, "fraction": a.fraction, **a.size},
               "ranks": [{k: v for k, v in r.items() if k != "timelines"} for r in ranks],
               "medians_ms": {m: [C.median(r["times"][m]) * 1e3 for r in ranks] for m in MODES},
               "simulated": sim}
    md = markdown(a, ranks, sim)
    path = C.write_results("pipeline", device, payload, md, a.out)
    if C.have_matplotlib():
        plot(ranks, path.with_suffix(".png"))
    print(md)
    return 0 if all(r["losses_equal"] for r in ranks) else 1


if __name__ == "__main__":
    sys.exit(main())
