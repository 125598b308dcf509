"""The pipeline simulator (sim/pipeline.py, sim/pipeline_cli.py): stages cut from the analytic
trace add up to the model, the memory modes order as they must, the engine holds its budget and
pays only what the link cannot hide, the hybrid mode holds it too and is never predicted slower
than the engine or than recomputation that fits, and the command line prints and refuses
clearly."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings, strategies as st

from chameleon_swap.cli import main
from chameleon_swap.sim.analytic import generate
from chameleon_swap.sim.hardware import load
from chameleon_swap.sim.models import preset
from chameleon_swap.sim.pipeline import (MODES, largest_model, simulate_pipeline, stage_costs)

HW = load("h100-sxm")
CFG = preset("llama-7b", seq=2048)


def test_stages_add_up_to_the_model():
    step = generate(CFG, HW).steps[0]
    costs = stage_costs(CFG, HW, 4)
    assert sum(c.act for c in costs) == step.activation_bytes
    assert sum(c.fwd + c.bwd for c in costs) == pytest.approx(step.compute_seconds)
    assert sum(c.state for c in costs) == pytest.approx(CFG.model_state_bytes(), rel=1e-6)
    assert all(c.kept < c.act for c in costs)
    with pytest.raises(ValueError, match="at least as many layers"):
        stage_costs(CFG.replace(layers=3), HW, 4)


def test_modes_order_memory_and_time():
    r = {m: simulate_pipeline(CFG, HW, 4, 8, "1f1b", m, budget=2 * 2**30) for m in MODES}
    none, rec, eng = r["none"], r["recompute"], r["engine"]
    # 1F1B: the first rank holds the most.
    peaks = [x.activation_peak_bytes for x in none.ranks]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]
    assert all(a.activation_peak_bytes < b.activation_peak_bytes
               for a, b in zip(rec.ranks, none.ranks))
    assert rec.step_seconds > none.step_seconds
    for x, n in zip(eng.ranks, none.ranks):
        assert x.activation_peak_bytes == min(n.activation_peak_bytes, 2 * 2**30)
        assert (x.offloaded_bytes > 0) == (n.activation_peak_bytes > 2 * 2**30)
        assert x.fetched_bytes == x.offloaded_bytes          # everything out comes back
    assert eng.step_seconds >= none.step_seconds


def _link(bytes_per_s: float):
    # The measured link, where a profile has one, is what the simulator uses: set both.
    return dataclasses.replace(HW, h2d_bytes_per_s=bytes_per_s, d2h_bytes_per_s=bytes_per_s,
                               measured_h2d_bytes_per_s=None, measured_d2h_bytes_per_s=None)


def test_a_slow_link_shows_as_stall():
    slow = _link(1e8)
    fast = simulate_pipeline(CFG, HW, 4, 8, "1f1b", "engine", budget=2**30)
    res = simulate_pipeline(CFG, slow, 4, 8, "1f1b", "engine", budget=2**30)
    assert res.ranks[0].stall_seconds > 0
    assert res.step_seconds > fast.step_seconds


def _check_hybrid(hw, schedule: str, budget: int) -> dict:
    """Hybrid holds ``budget`` on every rank, is never predicted slower than the engine, nor than
    full recomputation where that fits the budget; returns the results by mode."""
    r = {m: simulate_pipeline(CFG, hw, 4, 8, schedule, m, budget) for m in MODES}
    hyb, eng, rec = r["hybrid"], r["engine"], r["recompute"]
    assert all(x.activation_peak_bytes <= budget for x in hyb.ranks)
    assert hyb.fits == eng.fits
    assert hyb.step_seconds <= eng.step_seconds * (1 + 1e-12)
    if all(x.activation_peak_bytes <= budget for x in rec.ranks):
        assert hyb.step_seconds <= rec.step_seconds * (1 + 1e-12)
    return r


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "chronos"])
@pytest.mark.parametrize("link", [1e12, 5e10, 1e10, 1e8])
@pytest.mark.parametrize("budget_gib", [1, 2, 4])
def test_hybrid_holds_the_budget_and_is_never_slower(schedule, link, budget_gib):
    _check_hybrid(_link(link), schedule, budget_gib * 2**30)


@settings(max_examples=25, deadline=None)
@given(schedule=st.sampled_from(["1f1b", "chronos"]), share=st.floats(0.02, 1.2),
       link=st.sampled_from([3e9, 2e10, 6e10]))
def test_hybrid_over_budgets(schedule, share, link):
    natural = simulate_pipeline(CFG, HW, 4, 8, schedule, "none").ranks[0].activation_peak_bytes
    block = max(c.block_act for c in stage_costs(CFG, HW, 8 if schedule == "chronos" else 4))
    _check_hybrid(_link(link), schedule, max(block, int(share * natural)))


@pytest.mark.parametrize("schedule", ["1f1b", "chronos"])
def test_hybrid_is_the_engine_on_a_fast_link(schedule):
    r = _check_hybrid(_link(1e13), schedule, 2**30)
    hyb, eng = r["hybrid"], r["engine"]
    assert hyb.step_seconds == eng.step_seconds
    assert all(h.offloaded_bytes == e.offloaded_bytes > 0 and h.recomputed_fraction == 0
               for h, e in zip(hyb.ranks, eng.ranks))


@pytest.mark.parametrize("schedule", ["1f1b", "chronos"])
def test_hybrid_recomputes_on_a_slow_link(schedule):
    r = _check_hybrid(_link(1e6), schedule, 2 * 2**30)
    hyb = r["hybrid"]
    assert all(x.offloaded_bytes == 0 and x.recomputed_fraction > 0 for x in hyb.ranks)
    assert r["engine"].step_seconds > 10 * hyb.step_seconds


def test_hybrid_splits_between_swap_and_recompute():
    """Where the link hides part of what must go, hybrid swaps that part and recomputes the
    rest: faster than either alone."""
    r = _check_hybrid(_link(2e10), "1f1b", 2**30)
    hyb = r["hybrid"]
    assert hyb.step_seconds < min(r["engine"].step_seconds, r["recompute"].step_seconds)
    assert all(0 < x.recomputed_fraction < 1 and x.offloaded_bytes > 0 for x in hyb.ranks)
    assert all(x.stall_seconds < e.stall_seconds for x, e in zip(hyb.ranks, r["engine"].ranks))


def test_chronos_balances_ranks():
    one = simulate_pipeline(CFG, HW, 4, 16, "1f1b", "none")
    v = simulate_pipeline(CFG, HW, 4, 16, "chronos", "none")
    spread = lambda r: (max(x.activation_peak_bytes for x in r.ranks)
                        / min(x.activation_peak_bytes for x in r.ranks))
    assert spread(v) < spread(one)
    assert [x.stages for x in v.ranks] == [[0, 7], [1, 6], [2, 5], [3, 4]]


def test_largest_model_grows_with_memory_saving_modes():
    cfg = preset("llama-13b", seq=4096)
    sizes = {m: largest_model(cfg, HW, 4, 8, "1f1b", m, max_layers=200) for m in MODES}
    assert sizes["none"] is not None
    assert sizes["recompute"].layers > sizes["none"].layers
    assert sizes["engine"].layers > sizes["none"].layers
    assert all(r.fits for r in sizes.values())
    with pytest.raises(ValueError, match="mode must be one of"):
        simulate_pipeline(cfg, HW, 2, 2, "1f1b", "offload")


def test_cli_pipeline(capsys):
    assert main(["simulate", "--model", "llama-7b", "--hardware", "h100-sxm", "--pp", "2",
                 "--micro-batches", "4", "--schedule", "chronos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == set(MODES)
    assert [r["stages"] for r in out["none"]["ranks"]] == [[0, 3], [1, 2]]
    assert main(["simulate", "--model", "llama-7b", "--hardware", "h100-sxm", "--pp", "2"]) == 0
    text = capsys.readouterr().out
    assert "pipeline: 1f1b, pp=2, 8 micro-batches" in text and "recompute" in text
    assert "hybrid" in text and "recomputed" in text


def test_cli_pipeline_refuses_a_trace(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(tmp_path), "--hardware", "h100-sxm", "--pp", "2"])
    assert "cannot be cut into stages" in capsys.readouterr().err
