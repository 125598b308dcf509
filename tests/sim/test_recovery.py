"""The recovery planner (sim/recovery.py) and ``chameleon-swap recover``: properties of the
strategies and what the planner refuses."""
from __future__ import annotations

import json

import pytest

from chameleon_swap import cli
from chameleon_swap.sim.hardware import load as load_hardware
from chameleon_swap.sim.models import preset
from chameleon_swap.sim.recovery import Layout, RecoveryError, failed_ranks, plan_recovery

HW = load_hardware("a100-80gb")


def _plan(model="llama-13b", dp=4, pp=8, tp=1, fail=1, seq=4096, steps=1000):
    return plan_recovery(preset(model, seq=seq), HW, Layout(dp, pp, tp, 4 * pp), fail, steps)


def test_ours_is_the_best_feasible_and_no_better_than_failure_free():
    rec = _plan()
    ours = rec.best
    assert ours.choice in ("rerouting", "reconfiguration")
    for name, p in rec.plans.items():
        if p.feasible:
            assert ours.horizon_share >= p.horizon_share - 1e-12, name
            assert 0 < p.horizon_share <= p.share
    # Losing ranks never speeds the step up: the failure-free layout is the reference.
    assert ours.share <= 1.0 + 1e-9


def test_engine_modes_never_worse_than_the_baselines():
    rec = _plan(fail=[8, 9, 10, 11], seq=8192)
    for base in ("rerouting", "reconfiguration"):
        b, o = rec.plans[base], rec.plans["ours-" + base]
        if b.feasible:
            assert o.feasible and o.step_seconds <= b.step_seconds + 1e-12
    # A replica reduced to half its stages: its stages' activations no longer fit without
    # recomputation, the engine's budget makes the shorter pipeline fast again.
    assert rec.plans["reconfiguration"].modes == ["recompute"]
    assert "engine" in rec.plans["ours-reconfiguration"].modes or \
        "hybrid" in rec.plans["ours-reconfiguration"].modes
    assert rec.best.step_seconds < rec.plans["reconfiguration"].step_seconds


def test_memory_per_rank_fits_the_device_for_every_feasible_plan():
    rec = _plan(fail=3)
    for p in rec.plans.values():
        if p.feasible:
            assert 0 < p.peak_bytes <= HW.usable_bytes


def test_rerouting_moves_no_state_reconfiguration_does():
    rec = _plan()
    assert rec.plans["rerouting"].moved_bytes == 0
    assert rec.plans["reconfiguration"].moved_bytes > 0
    assert rec.plans["reconfiguration"].recover_seconds > rec.plans["rerouting"].recover_seconds


def test_short_horizon_favours_the_cheaper_recovery():
    # Over one step the restart and state moves dominate; over many, the step time does.
    short, long = _plan(steps=1), _plan(steps=100000)
    assert short.best.horizon_share < long.best.horizon_share


def test_rerouting_impossible_when_every_replica_loses_the_same_stage():
    rec = _plan(dp=2, pp=8, fail=[0, 8])
    assert not rec.plans["rerouting"].feasible
    assert "stage" in rec.plans["rerouting"].reason
    assert rec.best.choice == "reconfiguration"


def test_a_failed_rank_takes_its_tensor_parallel_group():
    rec = _plan(model="llama-70b", dp=4, pp=8, tp=4, fail=[0, 1])
    assert rec.lost_groups == 1


def test_fail_count_spreads_and_list_is_checked():
    lay = Layout(4, 8, 1, 32)
    assert failed_ranks(lay, 4) == [0, 8, 16, 24]
    with pytest.raises(ValueError, match="--fail"):
        failed_ranks(lay, 33)
    with pytest.raises(ValueError, match="--fail"):
        failed_ranks(lay, [40])


def test_refuses_too_few_survivors():
    with pytest.raises(RecoveryError, match="too few survivors"):
        _plan(dp=1, pp=8, fail=list(range(8)))


def test_refuses_a_model_no_layout_fits():
    # One replica of 4 stages of a 13B model fits only as 4 stages; losing two leaves 2
    # stages of 20 layers each, whose model states alone pass 80 GiB.
    with pytest.raises(RecoveryError, match="no layout"):
        _plan(dp=1, pp=4, fail=[0, 1])


def test_refuses_a_failure_free_layout_that_does_not_fit():
    with pytest.raises(RecoveryError, match="failure-free layout"):
        _plan(dp=1, pp=2, fail=1)


def test_layout_arguments_checked():
    with pytest.raises(ValueError, match="--dp"):
        Layout(0, 1, 1, 1)
    with pytest.raises(ValueError, match="--steps-to-repair"):
        _plan(steps=0)


@pytest.mark.parametrize("world,model,dp,pp,tp", [(32, "llama-13b", 4, 8, 1),
                                                  (256, "llama-70b", 8, 8, 4),
                                                  (1024, "llama-70b", 32, 8, 4)])
def test_scales(world, model, dp, pp, tp):
    rec = _plan(model=model, dp=dp, pp=pp, tp=tp, fail=max(1, world // 256))
    assert rec.layout.world == world
    assert rec.best.feasible and rec.best.ranks_used <= world - len(rec.failed)


# ------------------------------------------------------------------------------ the command
ARGS = ["recover", "--model", "llama-13b", "--hardware", "a100-80gb", "--dp", "4", "--pp", "8"]


def test_cli_json(capsys):
    assert cli.main([*ARGS, "--fail", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["world"] == 32 and out["failed_ranks"] == [0]
    assert set(out["plans"]) == {"rerouting", "reconfiguration", "ours-rerouting",
                                 "ours-reconfiguration", "ours"}
    assert out["plans"]["ours"]["choice"] in ("rerouting", "reconfiguration")


def test_cli_table_and_plot(capsys, tmp_path):
    png = tmp_path / "r.png"
    assert cli.main([*ARGS, "--fail", "8,9", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "lost ranks: 8,9" in out and "ours:" in out
    assert png.stat().st_size > 0


@pytest.mark.parametrize("extra,msg", [(["--fail", "x"], "--fail"),
                                       (["--fail", "1", "--steps-to-repair", "0"],
                                        "--steps-to-repair"),
                                       (["--fail", "1", "--network-gbps", "0"], "--network-gbps"),
                                       (["--fail", "0,1,2,3,4,5,6,7", "--dp", "1"],
                                        "too few survivors")])
def test_cli_errors(capsys, extra, msg):
    argv = [*ARGS, *extra]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_cli_hf_shape(capsys):
    assert cli.main(["recover", "--hf", "llama", "--hardware", "a100-80gb", "--dp", "2", "--pp",
                     "4", "--fail", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plans"]["ours"]["feasible"]
    with pytest.raises(SystemExit):
        cli.main(["recover", "--hf", "llama", "--model", "llama-7b", "--hardware", "a100-80gb",
                  "--fail", "1"])
    assert "one of --model or --hf" in capsys.readouterr().err


def test_benchmark_simulated_rows(monkeypatch):
    import importlib
    import sys
    from pathlib import Path
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch.setattr(sys, "path", [str(bench), *sys.path])
    sys.modules.pop("recovery", None)
    rows = importlib.import_module("recovery").simulated("a100-80gb", 1000)
    assert {r["setting"] for r in rows} == {"32 GPUs", "256 GPUs", "1024 GPUs"}
    for r in rows:
        assert 0 < r["ours_share"] <= 1 + 1e-9
        for k in ("ours_vs_rerouting", "ours_vs_reconfiguration"):
            assert r[k] is None or r[k] >= 1 - 1e-12
