"""Recovery under torchrun (parallel/elastic.py, examples/elastic_train.py): several agents on
localhost (c10d rendezvous, gloo, one process each); one agent's process group is killed in the
forward, the backward, the optimizer step or a checkpoint save (written in the background,
committed a step later). Each run completes with the same data order (sample ids recorded:
nothing skipped or repeated, the global batch kept), never loads a half-written checkpoint,
applies the recovery planner's answer for each world size (3 ranks keep everything; the
survivors, with more samples each, get a smaller budget and swap and recompute), and its losses
after recovery equal bit for bit those of a failure-free run from the same checkpoint with the
same final layout."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import contextlib
import importlib.util

from chameleon_swap.elastic import Checkpoints, GlobalBatches, engine_for
from chameleon_swap.sim.hardware import load as load_hardware
from chameleon_swap.sim.restart import plan_restart

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "elastic_train.py"
STEPS, GLOBAL_BATCH, SAMPLES = 6, 12, 72
# Device memory per rank the planner assumes: enough to keep everything on 3 ranks (4 samples
# each), not on 2 (6) or 1 (12), where it answers with a smaller budget and recomputation.
DEVICE_MEMORY = 5_500_000

pytestmark = pytest.mark.distributed


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tmp: Path, agents: int, nnodes: str, kill: str = "", steps: int = STEPS,
              timeout: float = 150) -> None:
    """``agents`` torchrun agents (agent 0 hosts the c10d store), each in a session of its own;
    waits for all of them; every agent but a killed one must succeed."""
    port, procs = _port(), []
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               CS_ELASTIC_KILL=kill)
    for a in range(agents):
        conf = (f"is_host={int(a == 0)},last_call_timeout=3,keep_alive_interval=1,"
                f"keep_alive_max_attempt=2,join_timeout=30")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
               "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tmp.name, "--rdzv-conf",
               conf, "--monitor-interval", "0.2", str(SCRIPT), "--ckpt", str(tmp / "ckpt"),
               "--records", str(tmp / "log"), "--steps", str(steps), "--global-batch",
               str(GLOBAL_BATCH), "--samples", str(SAMPLES), "--device-memory",
               str(DEVICE_MEMORY)]
        out = open(tmp / f"agent{a}.txt", "w")
        procs.append(subprocess.Popen(cmd, env=dict(env, CS_AGENT=str(a)), stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        if a == 0:
            time.sleep(0.5)             # the host's store first
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        pytest.fail(f"torchrun agents did not finish:\n{_logs(tmp, agents)}")
    killed = int(kill.rsplit(":", 1)[1]) if kill else None
    failed = [a for a, p in enumerate(procs) if a != killed and p.returncode != 0]
    if failed:
        pytest.fail(f"torchrun agents {failed} failed:\n{_logs(tmp, agents)}")


def _logs(tmp: Path, agents: int) -> str:
    return "\n".join((tmp / f"agent{a}.txt").read_text()[-2000:] for a in range(agents))


def _records(tmp: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / "log" / name).read_text().splitlines()]


def _final(records: list[dict]) -> dict:
    """Per step, the records of the last start of the worker group that ran it (``start``: the
    example counts every start; torchrun's restart count misses a group re-formed because
    another node left)."""
    last: dict = {}
    for r in records:
        if r["start"] >= last.get(r["step"], (-1, None))[0]:
            if r["start"] > last.get(r["step"], (-1, None))[0]:
                last[r["step"]] = (r["start"], [])
            last[r["step"]][1].append(r)
    return {s: rs for s, (_, rs) in last.items()}


def _reference(run: Path, tmp: Path, world: int) -> tuple[dict, dict]:
    """Failure-free on ``world`` ranks from ``run``'s step-2 checkpoint (committed before its
    failure, never rewritten after), with ``run``'s first start's losses of steps 1-2: losses by
    step, and the plan it applied."""
    for s in (0, 2):
        shutil.copytree(run / "ckpt" / f"step-{s}", tmp / "ckpt" / f"step-{s}")
    (tmp / "log").mkdir()
    first = [r for r in _records(run, "losses.jsonl") if r["start"] == 0 and r["step"] <= 2]
    assert [r["step"] for r in first] == [1, 2]
    (tmp / "log" / "losses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    _torchrun(tmp, world, str(world))
    plans = _records(tmp, "plans.jsonl")
    assert plans[-1]["world"] == world and plans[-1]["resumed_from"] == 2
    return {r["step"]: r["loss"] for r in _records(tmp, "losses.jsonl")}, plans[-1]["plan"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``_reference`` by final world size, run once for all the kills that end on it, from the
    first such kill run's checkpoint: the others compare with it their own steps 1-2 (separate
    runs, equal bit for bit) and steps 3-6 from their equal checkpoint."""
    done: dict = {}

    def get(run: Path, world: int) -> tuple[dict, dict]:
        if world not in done:
            done[world] = _reference(run, tmp_path_factory.mktemp("elastic-ref"), world)
        return done[world]
    return get


def _example():
    """examples/elastic_train.py as a module, and its arguments in the tests' runs."""
    spec = importlib.util.spec_from_file_location("elastic_train", SCRIPT)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex, ex.parse_args(["--ckpt", "-", "--records", "-", "--device-memory",
                              str(DEVICE_MEMORY)])


def _planned(world: int) -> dict:
    """The planner's answer the example should apply on ``world`` ranks, asked here."""
    ex, args = _example()
    return plan_restart(ex.planner_model(ex.make_model(args), args),
                        load_hardware(args.hardware), world, GLOBAL_BATCH,
                        DEVICE_MEMORY).as_dict()


# Checkpoints at steps 2, 4, 6, each committed at the end of the next step: a kill in step 4 or
# in the commit of step 4's checkpoint (4:save, during step 5) resumes from step 2.
@pytest.mark.parametrize("point", ["4:forward", "4:backward", "4:optimizer", "4:save"])
def test_kill_one_agent_and_recover(tmp_path, reference, point):
    tmp_path = tmp_path / "run"
    tmp_path.mkdir()
    _torchrun(tmp_path, 3, "2:3", kill=f"{point}:2")
    losses = _final(_records(tmp_path, "losses.jsonl"))
    samples = _final(_records(tmp_path, "samples.jsonl"))
    assert sorted(losses) == sorted(samples) == list(range(1, STEPS + 1))
    # A restart happened, on fewer ranks, from the step-2 checkpoint: the one of step 4 that
    # was being written when the agent died (4:save) was never loaded. (The survivors usually
    # re-form 2 ranks; torchrun may also restart again and continue on 1.)
    after = [s for s, rs in losses.items() if rs[0]["start"] > 0]
    assert after == list(range(3, STEPS + 1))
    worlds = {samples[s][0]["world"] for s in after}
    assert len(worlds) == 1 and worlds <= {1, 2}
    world = worlds.pop()
    # Each start asked the planner for its world and applied the answer: the engine's budget
    # in every step is the plan's. The survivors take more samples each: a smaller budget,
    # under which the engine moves activations (3 ranks keep everything).
    plans = _records(tmp_path, "plans.jsonl")
    assert [p["start"] for p in plans] == list(range(len(plans))) and len(plans) > 1
    assert plans[0]["world"] == 3
    assert plans[-1]["world"] == world and plans[-1]["resumed_from"] == 2
    # 4:save: step 4's checkpoint was written (by the killed rank at least) but not committed.
    assert plans[-1]["ignored_incomplete"] == ([4] if point == "4:save" else [])
    for p in plans:
        assert p["plan"] == _planned(p["world"])
        assert p["engine_budget_bytes"] == p["plan"]["budget_bytes"]
    first, last = plans[0]["plan"], plans[-1]["plan"]
    assert first["mode"] == "none" and last["recompute"]
    assert last["budget_bytes"] < first["budget_bytes"]
    by_start = {p["start"]: p["plan"] for p in plans}
    for s, rs in losses.items():
        plan = by_start[rs[0]["start"]]
        assert (rs[0]["budget_bytes"], rs[0]["mode"]) == (plan["budget_bytes"], plan["mode"])
    # (Under the survivors' budget the engine moves or recomputes: which, is the planner's.)
    assert all(losses[s][0]["offloaded_bytes"] + losses[s][0]["recomputed_bytes"] > 0
               for s in after)
    # Bit for bit the failure-free run from the same checkpoint with the same final layout
    # (which the planner gives the same answer).
    ref_losses, ref_plan = reference(tmp_path, world)
    assert {s: losses[s][0]["loss"] for s in losses} == ref_losses
    assert ref_plan == last
    # Nothing skipped or repeated, the global batch kept.
    data = GlobalBatches(SAMPLES, GLOBAL_BATCH, seed=1)
    seen: list[int] = []
    for s, rs in sorted(samples.items()):
        ids = [i for r in sorted(rs, key=lambda r: r["rank"]) for i in r["ids"]]
        assert len(ids) == GLOBAL_BATCH and sorted(ids) == sorted(data.batch(s - 1))
        seen += ids
    assert len(seen) == len(set(seen)) == STEPS * GLOBAL_BATCH
    assert Checkpoints(tmp_path / "ckpt").steps() == [0, 2, 4, 6]
    assert not list((tmp_path / "ckpt").glob("*.tmp"))


# ------------------------------------------------------------------------------ in one process
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_half_written_checkpoint_is_invisible(tmp_path):
    ck = Checkpoints(tmp_path)
    w = torch.arange(4.0)
    ck.save({"w": w}, 1)
    (tmp_path / "step-3.tmp").mkdir()               # a save that died before its rename
    assert ck.latest() == 1 and ck.steps() == [1] and ck.incomplete() == [3]
    state = {"w": torch.zeros(4)}
    assert ck.load(state) == 1 and torch.equal(state["w"], w)
    with pytest.raises(ValueError, match="step"):
        ck.load(state, 3)


def test_global_batches_independent_of_world_size():
    data = GlobalBatches(40, 8, seed=3)
    for step in range(12):                          # across an epoch boundary
        for world in (1, 2, 4, 8):
            shards = [data.shard(step, r, world) for r in range(world)]
            assert sorted(i for s in shards for i in s) == sorted(data.batch(step))
    epoch = [i for s in range(5) for i in data.batch(s)]
    assert sorted(epoch) == list(range(40))
    with pytest.raises(ValueError, match="world"):
        data.shard(0, 0, 9)
    with pytest.raises(ValueError, match="global_batch"):
        GlobalBatches(4, 8)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_background_save_visible_only_once_committed(tmp_path):
    ck = Checkpoints(tmp_path)
    w = torch.arange(1000.0)
    ck.save({"w": w}, 2)
    written = []
    ck.save({"w": w}, 4, on_written=lambda: written.append(4), blocking=False)
    w.add_(1)                                      # training goes on while it is written
    assert ck.pending == 4 and ck.latest() == 2 and not written
    assert ck.commit() == 4 and written == [4]
    assert ck.pending is None and ck.steps() == [2, 4] and ck.commit() is None
    state = {"w": torch.zeros(1000)}
    ck.load(state)
    assert torch.equal(state["w"], torch.arange(1000.0))    # the state as it was at save
    ck.save({"w": w}, 6, blocking=False)
    ck.close()                                     # commits what is pending
    assert ck.steps() == [2, 4, 6]
    with pytest.raises(TypeError, match="blocking"):
        ck.save({"w": w}, 8, blocking="no")


def test_engine_for_applies_the_plan():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    plan = {"world": 1, "dp": 1, "pp": 1, "tp": 1, "budget_bytes": 4096, "recompute": False}
    with engine_for(plan, model, device="cpu") as eng:
        assert eng.budget_bytes == 4096
    with pytest.raises(ValueError, match="world of 2"):
        engine_for(dict(plan, world=2, dp=2), model)
    with pytest.raises(ValueError, match="data parallel"):
        engine_for(dict(plan, dp=1, pp=2), model)
    with pytest.raises(ValueError, match="model="):
        engine_for(dict(plan, recompute=True))
    with pytest.raises(ValueError, match="budget_bytes"):
        engine_for({"world": 1, "dp": 1, "pp": 1, "tp": 1, "recompute": False})
    with pytest.raises(TypeError, match="plan"):
        engine_for([1])


def test_planned_engine_keeps_losses_and_gradients_bit_exact():
    """The example's model and step on one rank under the planner's answer for one rank (the
    smallest budget, recomputation allowed) against the same steps without an engine."""
    ex, args = _example()
    plan = _planned(1)
    assert plan["recompute"]
    ids = GlobalBatches(SAMPLES, GLOBAL_BATCH, seed=1).batch(0)
    xs, ys = (torch.stack(t) for t in zip(*(ex.sample(i, args.seq) for i in ids)))
    runs = []
    for use_engine in (False, True):
        model = ex.make_model(args)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        eng = engine_for(plan, model, device="cpu") if use_engine else None
        out = []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with eng.step() if eng else contextlib.nullcontext():
                logits = model(xs)
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), ys.reshape(-1), reduction="sum")
                loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            opt.step()
        if eng:
            assert eng.budget_bytes == plan["budget_bytes"]
            assert eng.last_step.offloaded_bytes + eng.last_step.recomputed_bytes > 0
            eng.close()
        runs.append(out)
    for (l0, g0), (l1, g1) in zip(*runs):
        assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
