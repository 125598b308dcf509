"""bench/baselines.py: the ``hybrid`` baseline, the engine given the workload's model.

It is an engine baseline like the others (it takes a budget, its losses equal the plain step's bit
for bit, it holds its budget), and its records carry the block modes of every step.
"""
from __future__ import annotations

import pytest
import torch

import chameleon_swap as cs
from chameleon_swap.bench import baselines as B
from chameleon_swap.bench import commands
from chameleon_swap.bench.harness import SweepConfig, run_sweep, steps_per_workload
from chameleon_swap.bench.report import markdown
from chameleon_swap.workloads import get_workload

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py
CPU = torch.device("cpu")


def test_hybrid_is_an_engine_baseline_that_takes_a_budget():
    assert "hybrid" in B.BASELINES and "hybrid" in B.ENGINE_BASELINES
    assert "hybrid" in commands.BASELINE_NAMES
    cfg = SweepConfig(workloads=["llama-varlen"], baselines=["none", "hybrid"],
                      budgets=["30%", "60%"], steps=1, warmup=0, size="tiny")
    # one peer, two budgets of hybrid, both passes, plus the reference's repeat
    assert steps_per_workload(cfg) == (1 + 2) * 2 + 1


def test_hybrid_makes_its_engine_from_the_model_and_its_blocks():
    w = get_workload("llama-varlen", "tiny")
    b = B.make_baseline("hybrid", CPU, 4096)
    with pytest.raises(RuntimeError, match="prepare"):
        b.step()
    model = b.prepare(w.build(CPU, seed=1), w)
    first = b.engine
    assert isinstance(first, cs.Chameleon) and first.budget_bytes == 4096
    assert first.policy == "chameleon"
    # The workload's blocks are the engine's recompute units.
    blocks = [m for ml in w.block_lists(model) for m in ml]
    assert first._runner is not None and first._runner.blocks == blocks
    # A fresh model (the metered pass builds its own) gets a fresh engine; the old one closes.
    model = b.prepare(w.build(CPU, seed=1), w)
    assert b.engine is not first and first._closed and not b.engine._closed
    with b.step():
        w.run(model, w.batches(1, CPU)[0])
    assert len(b.stats()["block_modes"]) == 3 and sum(b.stats()["block_modes"]) == len(blocks)
    b.close()
    assert b.engine._closed


@pytest.fixture(scope="module")
def hybrid_sweep():
    cfg = SweepConfig(workloads=["llama-varlen", "video-dit"],
                      baselines=["none", "chameleon", "hybrid"], budgets=["25%", "50%"],
                      steps=3, warmup=1, size="tiny", seed=5)
    return cfg, run_sweep(cfg, {})


def test_hybrid_losses_are_bitwise_and_its_budget_holds(hybrid_sweep):
    cfg, recs = hybrid_sweep
    hybrid = [r for r in recs if r["baseline"] == "hybrid"]
    assert len(hybrid) == 4
    for r in hybrid:
        assert r["error"] is None and r["reference_reproducible"] is True
        assert r["losses_identical"] is True
        assert r["budget_applies"] and r["budget_held"] is True and r["fits"] is True
        assert r["activation_peak_bytes"] <= r["budget_bytes"]
        assert r["label"] == "hybrid" and sum(r["plan_sources"].values()) == cfg.warmup + cfg.steps


def test_hybrid_records_carry_the_block_modes_of_every_step(hybrid_sweep):
    _, recs = hybrid_sweep
    for r in recs:
        modes = [s.get("block_modes") for s in r["per_step"]]
        if r["baseline"] == "hybrid":
            n = len(get_workload(r["workload"], "tiny").block_lists(
                get_workload(r["workload"], "tiny").build(torch.device("meta")))[0])
            for m in modes:
                assert isinstance(m, list) and len(m) == 3 and sum(m) == n
            # The record counts the steps that ran each mix, and the table shows it.
            counts = r["block_modes"]
            assert sum(counts.values()) == sum(1 for m in modes if m)
            for mix, steps in counts.items():
                assert steps == sum(1 for m in modes if ",".join(map(str, m)) == mix)
        elif r["baseline"] == "chameleon":
            assert all(m == [] for m in modes)       # swap only: no blocks
            assert r["block_modes"] is None
        else:
            assert all(m is None for m in modes) and r["block_modes"] is None
    md = markdown(recs)
    row = next(line for line in md.splitlines() if "| hybrid |" in line)
    mix, steps = next(iter(next(r for r in recs if r["baseline"] == "hybrid")
                           ["block_modes"].items()))
    assert f"| {mix}: {steps}" in row
