"""The planner's answer at a (re)start (sim/restart.py): the layout, mode and per-rank budget
for a world size, from the pipeline simulator's modes; and what it refuses."""
from __future__ import annotations

import dataclasses

import pytest

from chameleon_swap.sim.hardware import load as load_hardware
from chameleon_swap.sim.models import ModelConfig
from chameleon_swap.sim.pipeline import MODES, simulate_pipeline
from chameleon_swap.sim.recovery import RecoveryError
from chameleon_swap.sim.restart import plan_restart

# A small Llama's shape (fp32, SGD with momentum): the model examples/elastic_train.py trains.
CFG = ModelConfig(layers=4, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256, seq=32,
                  dtype="fp32", state_bytes_per_param=12, name="small")
HW = load_hardware("h100-sxm")
MEMORY = 5_500_000


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_answer_is_the_fastest_fitting_mode_with_the_engines_budget(world):
    plan = plan_restart(CFG, HW, world, 12, MEMORY)
    assert (plan.layout.dp, plan.layout.pp, plan.layout.tp) == (world, 1, 1)
    assert plan.samples_per_rank == -(-12 // world)
    # What the simulator says of one rank running its samples in each mode, asked here.
    hw = dataclasses.replace(HW, device_memory_bytes=MEMORY, reserved_bytes=0)
    cfg = CFG.replace(micro_batch=plan.samples_per_rank)
    runs = {m: simulate_pipeline(cfg, hw, 1, 1, "1f1b", m) for m in MODES}
    fitting = [m for m in MODES if runs[m].fits]
    assert plan.mode in fitting
    assert all(runs[plan.mode].step_seconds <= runs[m].step_seconds for m in fitting)
    assert plan.budget_bytes == runs["engine"].ranks[0].budget_bytes
    assert plan.budget_bytes == MEMORY - plan.state_bytes - (
        runs["none"].ranks[0].total_bytes - plan.state_bytes
        - runs["none"].ranks[0].activation_peak_bytes)
    assert plan.peak_bytes <= MEMORY and plan.activation_bytes <= plan.budget_bytes
    assert plan.recompute == (plan.mode in ("recompute", "hybrid"))
    assert plan.modes == {m: {"fits": r.fits, "step_seconds": r.step_seconds}
                          for m, r in runs.items()}
    d = plan.as_dict()
    assert (d["world"], d["dp"], d["budget_bytes"], d["mode"]) == (world, world,
                                                                   plan.budget_bytes, plan.mode)


def test_fewer_ranks_more_samples_each_smaller_budget():
    plans = {w: plan_restart(CFG, HW, w, 12, MEMORY) for w in (3, 2, 1)}
    assert plans[3].mode == "none" and not plans[3].recompute
    assert plans[2].recompute and plans[1].recompute
    assert plans[3].budget_bytes > plans[2].budget_bytes > plans[1].budget_bytes
    # With the hardware's own memory (80 GiB) everything is kept.
    assert plan_restart(CFG, HW, 1, 12).mode == "none"


def test_refusals_are_clear():
    with pytest.raises(RecoveryError, match="no mode fits .* 1 rank"):
        plan_restart(CFG, HW, 1, 12, 3_000_000)
    with pytest.raises(ValueError, match="world"):
        plan_restart(CFG, HW, 13, 12)
    with pytest.raises(ValueError, match="world must be a positive int"):
        plan_restart(CFG, HW, 0, 12)
    with pytest.raises(ValueError, match="global_batch"):
        plan_restart(CFG, HW, 1, True)
    with pytest.raises(ValueError, match="device_memory_bytes"):
        plan_restart(CFG, HW, 1, 12, -1)
