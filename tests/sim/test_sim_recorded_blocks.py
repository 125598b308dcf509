"""Recorded traces carry the block structure replay needs (issue 18, item 6): a trace recorded
with ``model=`` runs hybrid, full and selective recomputation in the simulator; the engine's old
GPU traces, which lack it, are refused with a message naming the field and how to record one."""
import json
from pathlib import Path

import pytest
import torch

import chameleon_swap as cs
from chameleon_swap.cli import main
from chameleon_swap.runtime.trace import Step, Tensor, load, loads, dumps
from chameleon_swap.sim import policies

from _models import tiny_llama, tokens

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu-traces"
BLOCK_POLICIES = ("hybrid", "full-recompute", "selective-recompute")


def _record(tmp_path, budget=None):
    model = tiny_llama(n_layers=3)
    x, y = tokens(model.config.vocab_size, 2, 32, seed=0)
    d = tmp_path / "tr"
    with cs.Chameleon(budget=budget, model=model, trace_dir=d, min_tensor_bytes=0,
                      device="cpu") as eng:
        for _ in range(2):
            model.zero_grad()
            with eng.step():
                torch.nn.functional.cross_entropy(
                    model(x).flatten(0, 1), y.flatten()).backward()
    return d


def test_recorded_trace_has_blocks_and_runs_block_policies(tmp_path, capsys):
    d = _record(tmp_path)
    tr = load(d)
    step = tr.steps[-1]
    assert step.has_blocks and step.blocks
    assert len({b["block"] for b in step.blocks}) == 3          # each layer's call recorded
    for k, b in enumerate(step.blocks):
        assert 0 <= b["first"] < b["end"] <= step.n_forward and b["input_bytes"] > 0
        assert b["forward_seconds"] >= 0
        assert step.segment_block[b["first"]:b["end"]] == [k] * (b["end"] - b["first"])
        assert all(t.block == k for t in step.tensors[b["first"]:b["end"]])
    # Round trip: the new fields survive save and load.
    again = loads(dumps(tr)).steps[-1]
    assert again.blocks == step.blocks and again.segment_block == step.segment_block
    none = policies.run(tr, "none", None)
    for policy in BLOCK_POLICIES:
        r = policies.run(tr, policy, None)
        assert r.peak_bytes > 0 and r.step_seconds > 0
        if policy != "hybrid":
            # Recomputation drops the blocks' saved tensors and repeats their forward.
            assert r.peak_bytes < none.peak_bytes
            assert r.step_seconds > none.step_seconds
    budget = policies.run(tr, "full-recompute", None).peak_bytes
    assert policies.run(tr, "hybrid", budget).peak_bytes <= none.peak_bytes
    assert main(["simulate", "--trace", str(d), "--budget", str(budget), "--json",
                 "--policies", ",".join(("none",) + BLOCK_POLICIES)]) in (0, None)
    out = json.loads(capsys.readouterr().out)
    for policy in BLOCK_POLICIES:
        assert out["policies"][policy]["peak_bytes"] > 0


def _step_with(blocks, waits=()):
    return Step(segments=[0.1, 0.2, 0.3, 0.1, 0.2, 0.3], n_forward=3,
                tensors=[Tensor(10, 0, 5), Tensor(20, 1, 4), Tensor(30, 2, 3)],
                segment_block=[0, 0, None], blocks=blocks, segment_waits=list(waits))


def test_recorded_selective_uses_measured_bytes_and_seconds():
    blk = {"block": 0, "first": 0, "end": 2, "input_bytes": 5, "forward_seconds": 0.3,
           "selective_bytes": None, "selective_seconds": None}
    full_like = _step_with([blk])
    sel = _step_with([{**blk, "selective_bytes": 7, "selective_seconds": 0.1}])
    from chameleon_swap.sim.block_policies import recompute_step
    t_full, p_full = recompute_step(full_like, "full-recompute")
    # Unmeasured selective counts as full; measured, it keeps its bytes and pays its seconds.
    assert recompute_step(full_like, "selective-recompute") == (t_full, p_full)
    t_sel, p_sel = recompute_step(sel, "selective-recompute")
    assert t_full == pytest.approx(1.2 + 0.3) and t_sel == pytest.approx(1.2 + 0.1)
    assert p_sel == p_full + 7


def test_segment_waits_and_moves_round_trip_and_are_checked():
    s = _step_with(None, waits=[0.0, 0.1, 0.0, 0.0, 0.2, 0.0])
    s.segment_moves = [0.0, 0.01, 0.0, 0.0, 0.0, 0.02]
    back = loads(dumps(_trace(s))).steps[0]
    assert back.segment_waits == s.segment_waits and back.segment_moves == s.segment_moves
    with pytest.raises(ValueError, match="segment_waits"):
        _step_with(None, waits=[0.1])
    s.segment_moves = [0.0, -1.0, 0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="segment_moves"):
        s.validate("step")
    with pytest.raises(ValueError, match=r"blocks\[0\]"):
        _step_with([{"block": 0, "first": 2, "end": 1, "input_bytes": 0}])


def _trace(step):
    from chameleon_swap.runtime.trace import Trace
    return Trace(steps=[step], source="profiler")


@pytest.mark.parametrize("name", ["h4096-b10GiB-model-16384", "h4096-unreached-16384"])
def test_gpu_traces_load_and_old_ones_are_refused_clearly(name, capsys):
    d = FIXTURES / name
    tr = load(d)                                    # the H100 traces load as they are
    assert tr.source == "profiler" and tr.steps[0].n_forward > 0
    assert main(["simulate", "--trace", str(d), "--policies", "none,chameleon",
                 "--budget", "10GiB", "--json"]) in (0, None)
    capsys.readouterr()
    assert not tr.steps[0].has_blocks               # recorded before blocks were written
    for policy in BLOCK_POLICIES:
        with pytest.raises(ValueError, match=r"segment_block.*model=.*trace_dir="):
            policies.run(tr, policy, 10 * 2**30)
