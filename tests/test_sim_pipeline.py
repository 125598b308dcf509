"""The pipeline simulator (sim/pipeline.py, sim/pipeline_cli.py): stages cut from the analytic
trace add up to the model, the memory modes order as they must, the engine holds its budget and
pays only what the link cannot hide, and the command line prints and refuses clearly."""
from __future__ import annotations

import json

import pytest

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


def test_a_slow_link_shows_as_stall():
    import dataclasses
    # The measured link, where a profile has one, is what the simulator uses: slow both.
    slow = dataclasses.replace(HW, h2d_bytes_per_s=1e8, d2h_bytes_per_s=1e8,
                               measured_h2d_bytes_per_s=None, measured_d2h_bytes_per_s=None)
    fast = simulate_pipeline(CFG, HW, 4, 8, "1f1b", "engine", budget=2**30)
    res = simulate_pipeline(CFG, slow, 4, 8, "1f1b", "engine", budget=2**30)
    assert res.ranks[0].stall_seconds > 0
    assert res.step_seconds > fast.step_seconds


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


def test_cli_pipeline_refuses_a_trace(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(tmp_path), "--hardware", "h100-sxm", "--pp", "2"])
    assert "cannot be cut into stages" in capsys.readouterr().err
