"""The engine on every rank of a pipeline (``chameleon_swap.parallel.pipeline``), CPU, gloo, 2 ranks.

A 4-block Llama is cut into stages and trained 3 steps, with a different sequence length every
step, under PyTorch's ``Schedule1F1B`` (2 stages, one per rank), under ``ScheduleChronos``
(4 stages in a V, two per rank) and under PyTorch's ``ScheduleInterleaved1F1B`` (4 stages round
robin; with no budget and at 0% only, to keep the job short), 4 micro-batches per step; once without the engine and once
with a ``PipelineChameleon`` on every rank holding a budget of 25% and of 0% of that rank's
natural peak. Every micro-batch's loss and every gradient must be ``torch.equal`` to the same
micro-batch accumulation run in one process (the stages' ops are the model's ops and each
stage's gradients accumulate in micro-batch order in both, so nothing reorders a reduction), and
every rank must hold its budget on every step and have moved bytes. The CPU copy engine's
workers are slowed down (as in test_distributed), so an unordered copy would read wrong bytes.

Weight offload (``offload_weights=True``) runs under 1F1B on an 8-block Llama (4 blocks a stage),
with no budget and at 0%: the same bitwise checks against that model's reference, and every rank
holds at most two blocks' weights fetched or run in the step at once.

One spawned job runs everything (two interpreters cost most of the time on a 2-core machine);
results or tracebacks come back through files; the assertions run here.
"""
from __future__ import annotations

import copy
import datetime
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chameleon_swap.workloads import Llama, LlamaConfig
from chameleon_swap.workloads.pipeline import llama_loss, split_llama

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="torch.distributed with the gloo backend is not available"),
]

WORLD = 2
MICRO = 4
JOB_TIMEOUT_S = 300
COLLECTIVE_TIMEOUT_S = 60
COPY_DELAY_S = "0.0005"
TINY = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64)
SEQ_LENS = (16, 24, 12)
SCHEDULES = ("1f1b", "chronos", "interleaved")
BUDGETS = {"none": None, "25%": 0.25, "0%": 0.0}
SHORT = ("interleaved",)         # PyTorch's interleaved 1F1B: no budget and 0% only (time)
WEIGHTS = dict(TINY, n_layers=8)  # weight offload: 4 blocks a stage, so "two blocks" bounds


def _batches():
    out = []
    for step, T in enumerate(SEQ_LENS):
        g = torch.Generator().manual_seed(step)
        t = torch.randint(TINY["vocab_size"], (2 * MICRO, T + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _model(cfg=None) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(**(cfg or TINY)))


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reference(cfg=None) -> list:
    """Per step: the micro-batch losses and the gradients of the accumulation in one process,
    scaled as PyTorch's schedules scale them (divided by the number of micro-batches)."""
    model = _model(cfg)
    stages = split_llama(model, 4)       # the same modules; running them in a row is the model
    out = []
    for x, y in _batches():
        model.zero_grad(set_to_none=True)
        losses = []
        for xm, ym in zip(x.tensor_split(MICRO), y.tensor_split(MICRO)):
            h = xm
            for s in stages:
                h = s(h)
            loss = llama_loss(h, ym)
            loss.backward()
            losses.append(loss.detach())
        for p in model.parameters():
            p.grad.div_(MICRO)
        out.append({"losses": losses, "grads": _grads(model)})
    return out


# ---------------------------------------------------------------------------- in the children
def _train(rank: int, schedule: str, budget, cfg=None, offload_weights=False) -> dict:
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                              ScheduleInterleaved1F1B)

    from chameleon_swap.parallel.pipeline import PipelineChameleon, ScheduleChronos, chronos_stage_indices

    model = _model(cfg)
    n_stages = WORLD if schedule == "1f1b" else 2 * WORLD
    parts = split_llama(model, n_stages)
    mine = ([rank] if schedule == "1f1b" else [rank, rank + WORLD] if schedule == "interleaved"
            else list(chronos_stage_indices(rank, WORLD)))
    eng = None
    res = {"losses": [], "grads": [], "stats": [], "budget": budget}
    try:
        for x, y in _batches():
            # A new sequence length needs new stages (PyTorch sizes its buffers once per stage);
            # the engine follows the new schedule with attach().
            stages = [PipelineStage(parts[i], i, n_stages, torch.device("cpu")) for i in mine]
            make = {"1f1b": lambda st: Schedule1F1B(st[0], MICRO, loss_fn=llama_loss),
                    "interleaved": lambda st: ScheduleInterleaved1F1B(st, MICRO,
                                                                      loss_fn=llama_loss),
                    "chronos": lambda st: ScheduleChronos(st, MICRO, loss_fn=llama_loss)}
            sched = make[schedule](stages)
            if eng is None:
                eng = PipelineChameleon(sched, budget, device="cpu", min_tensor_bytes=0,
                                        offload_weights=offload_weights)
            else:
                eng.attach(sched)
            model.zero_grad(set_to_none=True)
            losses: list = []
            with eng.step():
                sched.step(*([x] if rank == 0 else []), target=y, losses=losses)
            res["losses"].append([t.detach() for t in losses])
            res["grads"].append(_grads(model))
            res["stats"].append(eng.last_step.as_dict())
            if offload_weights:
                offs = list(eng.weight_offloads.values())
                res.setdefault("held", []).append(max(o.last_step.peak_held_bytes for o in offs))
                res["block_bytes"] = max(max(o.block_bytes) for o in offs)
                res.setdefault("back", []).append(all(
                    p.untyped_storage().nbytes() == p.numel() * p.element_size()
                    for p in model.parameters()))
        res["host_in_use"] = eng.engine.host_bytes_in_use
    finally:
        if eng is not None:
            eng.close()
    return res


def _child(rank: int, port: int, out_dir: str) -> None:
    import os
    os.environ["CHAMELEON_SWAP_TEST_COPY_DELAY"] = COPY_DELAY_S
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        for schedule in SCHEDULES:
            path = Path(out_dir) / f"{schedule}-{rank}.pt"
            try:
                runs = {"none": _train(rank, schedule, None)}
                natural = min(s["peak_resident_bytes"] for s in runs["none"]["stats"])
                for label, frac in BUDGETS.items():
                    if frac is not None and not (schedule in SHORT and label == "25%"):
                        runs[label] = _train(rank, schedule, int(natural * frac))
                torch.save({"runs": runs}, path)
            except Exception:
                torch.save({"error": traceback.format_exc()}, path)
                raise
        path = Path(out_dir) / f"weights-{rank}.pt"
        try:
            runs = {"none": _train(rank, "1f1b", None, WEIGHTS, offload_weights=True)}
            natural = min(s["peak_resident_bytes"] for s in runs["none"]["stats"])
            runs["0%"] = _train(rank, "1f1b", 0 * natural, WEIGHTS, offload_weights=True)
            torch.save({"runs": runs}, path)
        except Exception:
            torch.save({"error": traceback.format_exc()}, path)
            raise
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    ctx = mp.start_processes(_child, args=(_free_port(), str(out)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the pipeline job did not finish in {JOB_TIMEOUT_S} s (a hang?)")
    except mp.ProcessRaisedException:
        pass                             # the tracebacks are in the files; reported below
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    got = {}
    for schedule in SCHEDULES + ("weights",):
        for rank in range(WORLD):
            path = out / f"{schedule}-{rank}.pt"
            if not path.exists():
                pytest.fail(f"{schedule} rank {rank} wrote no results")
            data = torch.load(path, weights_only=False)
            if "error" in data:
                pytest.fail(f"{schedule} rank {rank} failed:\n{data['error']}")
            got[schedule, rank] = data["runs"]
    return got


@pytest.fixture(scope="module")
def ref():
    return reference()


# ---------------------------------------------------------------------------- the checks
def _last_rank(schedule: str) -> int:
    return 0 if schedule == "chronos" else WORLD - 1  # who holds the loss: the V ends on rank 0


CASES = [(s, label) for s in SCHEDULES for label in BUDGETS
         if not (s in SHORT and label == "25%")]


@pytest.mark.parametrize("schedule,label", CASES)
def test_losses_and_gradients_bitwise(results, ref, schedule, label):
    _assert_bitwise(results, ref, schedule, label)


def _assert_bitwise(results, ref, schedule, label):
    merged = [{} for _ in SEQ_LENS]
    for rank in range(WORLD):
        run = results[schedule, rank][label]
        for step, g in enumerate(run["grads"]):
            assert not merged[step].keys() & g.keys(), "two ranks hold the same parameter"
            merged[step].update(g)
    losses = results[schedule, _last_rank(schedule)][label]["losses"]
    for step, want in enumerate(ref):
        assert len(losses[step]) == MICRO
        for a, b in zip(want["losses"], losses[step]):
            assert torch.equal(a, b), f"step {step}: loss {a.item()} vs {b.item()}"
        assert merged[step].keys() == want["grads"].keys()
        for name, g in want["grads"].items():
            assert torch.equal(g, merged[step][name]), \
                f"step {step}: gradient of {name} differs " \
                f"(max abs diff {(g - merged[step][name]).abs().max()})"


@pytest.mark.parametrize("label", ["none", "0%"])
def test_weight_offload_bitwise_and_within_two_blocks(results, label):
    """offload_weights=True under 1F1B: every loss and gradient is the reference's; on every
    rank and step at most two blocks' weights fetched or run were on the device at once, every
    parameter was back after the step, and the activation budget (0%) still held."""
    _assert_bitwise(results, reference(WEIGHTS), "weights", label)
    for rank in range(WORLD):
        run = results["weights", rank][label]
        assert all(run["back"]), f"rank {rank}: a parameter was not back after a step"
        for step, (st, held) in enumerate(zip(run["stats"], run["held"])):
            assert 0 < held <= 2 * run["block_bytes"], (rank, step, held, run["block_bytes"])
            assert st["weight_peak_bytes"] >= held
            if label == "0%":
                assert st["peak_resident_bytes"] <= run["budget"]
                assert st["offloaded_bytes"] > 0
        assert run["host_in_use"] == 0


@pytest.mark.parametrize("schedule,label", [c for c in CASES if BUDGETS[c[1]] is not None])
def test_every_rank_holds_its_budget(results, schedule, label):
    for rank in range(WORLD):
        run = results[schedule, rank][label]
        budget = run["budget"]
        for step, st in enumerate(run["stats"]):
            assert st["budget_bytes"] == budget
            assert st["peak_resident_bytes"] <= budget, \
                f"{schedule} rank {rank} step {step}: peak {st['peak_resident_bytes']} > {budget}"
            assert st["offloaded_bytes"] > 0, "nothing moved: the test would not test the engine"
            assert st["plan_source"] == "schedule"
        assert run["host_in_use"] == 0


def test_per_rank_peaks(results):
    """The natural (no budget) per-rank peaks show what the schedules do to memory: under 1F1B the
    first rank holds more micro-batches than the last; the V spreads them more evenly."""
    peaks = {s: [max(st["peak_resident_bytes"] for st in results[s, r]["none"]["stats"])
                 for r in range(WORLD)] for s in ("1f1b", "chronos")}
    print("natural per-rank peaks (bytes):", peaks)
    one, v = peaks["1f1b"], peaks["chronos"]
    assert one[0] > one[-1]
    assert max(v) / min(v) < max(one) / min(one)


# ---------------------------------------------------------------------------- in one process
class _FakeStage:
    """What PipelineChameleon uses of a PipelineStage: index, rank and the two chunk methods."""

    def __init__(self, stage_index: int, group_rank: int = 0):
        self.stage_index, self.group_rank = stage_index, group_rank
        self.calls: list = []

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        self.calls.append(("F", fwd_chunk_id))
        return fwd_chunk_id

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                           last_backward=False):
        self.calls.append(("B", bwd_chunk_id))


class _FakeSchedule:
    def __init__(self, stage, order=None, n=3):
        self._stage, self._n_microbatches = stage, n
        if order is not None:
            self.pipeline_order = order


def test_attach_tags_actions_and_records_a_timeline():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    from chameleon_swap.parallel.pipeline import PipelineChameleon, schedule_positions
    F, B = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    stage = _FakeStage(0)
    order = {0: [_Action(0, F, 0), _Action(0, F, 1), _Action(0, B, 0), None, _Action(0, B, 1)]}
    sched = _FakeSchedule(stage, order, n=2)
    assert schedule_positions(sched) == {(0, 0): 2, (0, 1): 4}
    assert schedule_positions(_FakeSchedule(_FakeStage(3))) == {(3, 0): 0, (3, 1): 1, (3, 2): 2}
    original = stage.forward_one_chunk
    with PipelineChameleon(sched, "1MiB", device="cpu") as eng:
        pol = eng.engine.policy_object
        assert pol.positions == {(0, 0): 2, (0, 1): 4}
        with eng.step():
            assert stage.forward_one_chunk(1, ()) == 1          # runs the real method
            assert pol.current == (0, 1)
            stage.backward_one_chunk(0, last_backward=True)
            assert pol.current == (0, 0)
        assert [a for _, a, _ in eng.timeline] == ["0F1", "0B0"]
        assert stage.calls == [("F", 1), ("B", 0)]
        assert eng.last_step.plan_source == "schedule"
        with pytest.raises(RuntimeError, match="between steps"):
            with eng.step():
                eng.attach(sched)
    assert stage.forward_one_chunk == original                # close() unwraps


def test_clear_errors():
    from chameleon_swap.parallel.pipeline import PipelineChameleon, chronos_stage_indices
    assert chronos_stage_indices(1, 4) == (1, 6)
    with pytest.raises(ValueError, match="rank must be in"):
        chronos_stage_indices(4, 4)
    with pytest.raises(ValueError, match="do not pass policy="):
        PipelineChameleon(_FakeSchedule(_FakeStage(0)), policy="guard")
    with pytest.raises(TypeError, match="schedule must be a torch.distributed.pipelining"):
        PipelineChameleon(object(), device="cpu")
    with pytest.raises(TypeError, match="offload_weights must be True or False; got str"):
        PipelineChameleon(_FakeSchedule(_FakeStage(0)), device="cpu", offload_weights="yes")


def test_weight_offload_refuses_split_backwards():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    from chameleon_swap.parallel.pipeline import PipelineChameleon
    F, I, W = (_ComputationType.FORWARD, _ComputationType.BACKWARD_INPUT,
               _ComputationType.BACKWARD_WEIGHT)
    stage = _FakeStage(0)
    stage.submod = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    split = _FakeSchedule(stage, {0: [_Action(0, F, 0), _Action(0, I, 0), _Action(0, W, 0)]}, 1)
    with pytest.raises(ValueError, match="offload_weights=True needs a schedule with full "
                                         "backwards"):
        PipelineChameleon(split, device="cpu", offload_weights=True)
    whole = _FakeSchedule(stage, {0: [_Action(0, F, 0), _Action(0, I, 0)]}, 1)
    with PipelineChameleon(whole, device="cpu", offload_weights=True) as eng:
        (off,) = eng.weight_offloads.values()
        assert len(off.block_bytes) == 2          # no repeated blocks: the children
