"""The engine under data parallelism: DDP and FSDP2 on CPU (gloo, world size 2).

LESSONS 3: "The offload stream was not ordered against other streams (tensor-parallel
collectives), giving a worse loss (torchtune #2683). The copy stream waits on an event recorded at
save time; test under DDP and FSDP2." These tests are that check on CPU: the CPU copy engine's
worker threads stand in for the copy streams (slowed down here, so a copy that is not ordered
against the compute and the collectives reads or writes the wrong bytes instead of passing by
luck), and the collectives are real gloo ones between two processes.

* DDP: each rank trains the same tiny Llama (same seed) for 3 steps on its own batches, with a
  different sequence length every step, once without the engine and once with it at 20% and at 0%
  of the natural peak. Losses and the gradients after the allreduce must be ``torch.equal``, every
  step must hold its budget, and the engine must actually have moved bytes.
* FSDP2: the same with ``fully_shard`` applied per block and to the root, comparing each rank's
  local gradient shard. FSDP2 frees the unsharded parameters after forward and all-gathers them
  again in backward; the engine must never move parameters (they are skipped, not counted), so the
  activation bytes it saw must be exactly those of the unsharded model for the same batch.

All the distributed work happens in ONE spawned job (starting two interpreters, importing torch
and FSDP costs most of the time on a 2-core machine); each scenario records its results or its
traceback per rank in a file, and the assertions run here in the parent, so failures show in
pytest. The job has a deadline: a hang fails the tests instead of blocking CI.
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

import chameleon_swap as cs
from chameleon_swap.workloads import Llama, LlamaConfig

from _helpers import assert_bitwise, grads, train_step

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="torch.distributed with the gloo backend is not available"),
]

WORLD = 2
JOB_TIMEOUT_S = 180          # the whole spawned job; it takes ~10-20 s on 2 cores
COLLECTIVE_TIMEOUT_S = 60    # a rank stuck in a collective fails instead of waiting forever
COPY_DELAY_S = "0.001"       # CHAMELEON_SWAP_TEST_COPY_DELAY in the children: copies run late
TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
SEQ_LENS = (16, 24, 12)      # one per step; rank r adds 4 * r
BUDGETS = {"20%": 0.2, "0%": 0.0}
SCENARIOS = ("ddp", "fsdp2")


# ---------------------------------------------------------------------------- in the children
def _batch(cfg: LlamaConfig, rank: int, step: int):
    T = SEQ_LENS[step] + 4 * rank
    g = torch.Generator().manual_seed(1000 * rank + step)
    t = torch.randint(cfg.vocab_size, (2, T + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def _natural(model: torch.nn.Module, batches) -> list:
    """Per batch, the unbudgeted engine's stats on a plain (not distributed) copy: no collectives."""
    out = []
    for b in batches:
        m = copy.deepcopy(model)
        with cs.Chameleon(None, device="cpu", min_tensor_bytes=0) as eng:
            train_step(m, b, eng)
            out.append(eng.last_step.as_dict())
    return out


def _train(wrapped: torch.nn.Module, inner: torch.nn.Module, batches, budget, use_engine: bool,
           local_grads) -> dict:
    """3 SGD steps; per step the loss, the gradients (after allreduce / reduce-scatter) and the
    engine's stats."""
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    eng = cs.Chameleon(budget, device="cpu", min_tensor_bytes=0) if use_engine else None
    res = {"losses": [], "grads": [], "stats": [], "host_in_use": []}
    try:
        for b in batches:
            opt.zero_grad(set_to_none=True)
            res["losses"].append(train_step(wrapped, b, eng))
            res["grads"].append(local_grads(inner))
            if eng is not None:
                res["stats"].append(eng.last_step.as_dict())
                res["host_in_use"].append(eng.host_bytes_in_use)
            opt.step()
    finally:
        if eng is not None:
            eng.close()
    return res


def _runs(make, base: Llama, batches, peaks, local_grads) -> dict:
    runs = {"none": _train(*make(base), batches, None, False, local_grads)}
    for label, frac in BUDGETS.items():
        budget = int(min(peaks) * frac)
        runs[label] = _train(*make(base), batches, budget, True, local_grads)
        runs[label]["budget"] = budget
    return runs


def _ddp(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = LlamaConfig(**TINY)
    torch.manual_seed(0)
    base = Llama(cfg)
    batches = [_batch(cfg, rank, s) for s in range(len(SEQ_LENS))]
    natural = _natural(base, batches)

    def make(base):
        inner = copy.deepcopy(base)
        return DDP(inner), inner

    return {"natural": natural,
            "runs": _runs(make, base, batches, [n["peak_resident_bytes"] for n in natural], grads)}


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
        return fully_shard
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import fully_shard
        return fully_shard
    except ImportError:
        return None


def _local_shards(model: torch.nn.Module) -> dict:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "to_local"):
            g = g.to_local()
        out[n] = None if g is None else g.detach().clone()
    return out


def _fsdp2(rank: int) -> dict:
    fully_shard = _fully_shard()
    if fully_shard is None:
        return {"skip": f"FSDP2 fully_shard is not available in torch {torch.__version__} "
                        "(neither torch.distributed.fsdp nor torch.distributed._composable.fsdp)"}
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    cfg = LlamaConfig(**TINY)
    torch.manual_seed(0)
    base = Llama(cfg)
    batches = [_batch(cfg, rank, s) for s in range(len(SEQ_LENS))]
    natural = _natural(base, batches)

    def make(base):
        model = copy.deepcopy(base)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model

    return {"natural": natural,
            "runs": _runs(make, base, batches, [n["peak_resident_bytes"] for n in natural],
                          _local_shards)}


def _worker(rank: int, port: int, out_dir: str, scenarios) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    results = {}
    try:
        for name in scenarios:
            t0 = time.perf_counter()
            try:
                results[name] = {"ddp": _ddp, "fsdp2": _fsdp2}[name](rank)
            except Exception:
                results[name] = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
            results[name]["seconds"] = time.perf_counter() - t0
            dist.barrier()
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- in the parent
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list:
    out = tmp_path_factory.mktemp("distributed")
    with pytest.MonkeyPatch.context() as mp_env:   # inherited by the spawned children only
        mp_env.setenv("OMP_NUM_THREADS", "1")
        mp_env.setenv("CHAMELEON_SWAP_TEST_COPY_DELAY", COPY_DELAY_S)
        ctx = mp.start_processes(_worker, args=(_free_port(), str(out), SCENARIOS), nprocs=WORLD,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + JOB_TIMEOUT_S
    try:
        # join() raises (with the child's traceback) when a rank fails, and returns False while
        # ranks are still running.
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"the distributed job did not finish within {JOB_TIMEOUT_S} s (hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(10)
    for rank, p in enumerate(ctx.processes):
        assert p.exitcode == 0, f"rank {rank} exited with code {p.exitcode}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _scenario(results, name: str) -> list:
    per_rank = [r[name] for r in results]
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        pytest.fail("\n".join(errors), pytrace=False)
    if "skip" in per_rank[0]:
        pytest.skip(per_rank[0]["skip"])
    return per_rank


def _check_run(res: dict, label: str, where: str) -> None:
    ref, got, budget = res["runs"]["none"], res["runs"][label], res["runs"][label]["budget"]
    for step in range(len(SEQ_LENS)):
        at = f"{where}, budget {label} ({budget} B), step {step}"
        try:
            assert_bitwise(ref["losses"][step], ref["grads"][step],
                           got["losses"][step], got["grads"][step])
        except AssertionError as e:
            raise AssertionError(f"{at}: {e}") from None
        st, nat = got["stats"][step], res["natural"][step]
        assert not st["failed"], f"{at}: {st}"
        assert st["budget_bytes"] == budget, f"{at}: {st}"
        assert st["peak_resident_bytes"] <= budget, f"{at}: over budget: {st}"
        assert st["offloaded_bytes"] > 0, f"{at}: the engine moved nothing: {st}"
        # Exactly the activations of the plain model for this batch: no parameter (sharded,
        # unsharded or replicated) was taken for an activation.
        assert st["saved_bytes"] == nat["saved_bytes"], f"{at}: {st} vs unwrapped {nat}"
        assert st["skipped_bytes"] > 0, f"{at}: no parameter was recognised as one: {st}"
        assert got["host_in_use"][step] == 0, f"{at}: host buffers still held after the step"


@pytest.mark.parametrize("label", list(BUDGETS))
def test_ddp_bitwise_under_budget(results, label):
    for rank, res in enumerate(_scenario(results, "ddp")):
        _check_run(res, label, f"DDP rank {rank}")


def test_ddp_reference_is_data_parallel(results):
    """The reference itself: rank-specific batches (losses differ) and allreduced gradients
    (identical on every rank), so the engine runs above are compared with real DDP."""
    r0, r1 = (res["runs"]["none"] for res in _scenario(results, "ddp"))
    for step in range(len(SEQ_LENS)):
        assert not torch.equal(r0["losses"][step], r1["losses"][step])
        for name, g in r0["grads"][step].items():
            assert g is not None and torch.equal(g, r1["grads"][step][name]), (step, name)


@pytest.mark.parametrize("label", list(BUDGETS))
def test_fsdp2_bitwise_under_budget(results, label):
    per_rank = _scenario(results, "fsdp2")
    for rank, res in enumerate(per_rank):
        _check_run(res, label, f"FSDP2 rank {rank}")
    # The gradients compared are really shards: each rank holds a different part.
    g0, g1 = (res["runs"]["none"]["grads"][0]["output.weight"] for res in per_rank)
    assert g0.shape[0] * WORLD == TINY["vocab_size"] and not torch.equal(g0, g1)
