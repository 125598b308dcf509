"""Simulated vs measured step times (sim.gpu_steps): the fit, the errors, on a tiny config."""
from __future__ import annotations

import dataclasses

import pytest

from chameleon_swap.sim import gpu_steps, hardware

pytest.importorskip("transformers")
from chameleon_swap.sim.hf_trace import to_trace, trace_hf  # noqa: E402

TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, num_hidden_layers=2)
SEQ = 256


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAMELEON_SWAP_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def hw():
    # Compute-bound timing (memory bandwidth out of the way), so the step time depends on the
    # matmul fraction alone and the fit has a unique answer.
    return dataclasses.replace(hardware.load("h100-sxm"), memory_bandwidth_bytes_per_s=1e18)


def _sim(hw, **kw):
    rec = trace_hf("llama", seq=SEQ, **TINY)
    return gpu_steps.simulate_run(to_trace(rec, dataclasses.replace(hw, **kw), "sgd"))


def test_fit_recovers_the_fraction_the_measurement_came_from(hw):
    truth = _sim(hw, achievable_fraction=0.4)
    run = gpu_steps.Measured("tiny", "llama", SEQ, truth["none_seconds"], 1.0,
                             {0.25: 2.0}, overrides=TINY)
    tab = gpu_steps.step_table(hw, [run])
    assert tab["fitted_fraction"] == pytest.approx(0.4, rel=1e-3)
    assert tab["profile_fraction"] == hw.achievable_fraction
    (row,) = tab["rows"]
    assert row["error"]["none"] == pytest.approx(0, abs=1e-3)
    # At the profile's own fraction (0.69 > 0.4) the plain step is predicted too fast.
    assert row["error"]["profile_none"] < -0.3
    sim = row["simulated"]
    assert row["error"]["recompute"] == pytest.approx(sim["recompute_ratio"] / 1.0 - 1)
    assert row["error"]["chameleon"][0.25] == pytest.approx(sim["chameleon"][0.25] / 2.0 - 1)
    assert row["error"]["chameleon"][0.5] is None          # nothing measured there
    assert set(sim["hybrid"]) == set(gpu_steps.HYBRID_FRACTIONS)


def test_without_fit_the_profile_times_the_step(hw):
    run = gpu_steps.Measured("tiny", "llama", SEQ, 1.0, 1.2, overrides=TINY)
    tab = gpu_steps.step_table(hw, [run], fit=False)
    assert tab["fitted_fraction"] == hw.achievable_fraction
    (row,) = tab["rows"]
    assert row["error"]["none"] == pytest.approx(row["error"]["profile_none"])
    assert row["simulated"]["none_seconds"] == pytest.approx(_sim(hw)["none_seconds"])


def test_simulated_ratios_are_ordered(hw):
    sim = _sim(hw)
    assert sim["recompute_ratio"] > 1
    assert sim["chameleon"][0.25] >= sim["chameleon"][0.5] >= 1
    # Hybrid never predicts slower than swapping alone (swap only is one of its candidates).
    assert sim["hybrid"][0.25] <= sim["chameleon"][0.25] + 1e-9
    assert sim["hybrid"][0.25] >= sim["hybrid"][0.75] >= 1 - 1e-9


def test_within_flags_the_columns_out_of_tolerance():
    tab = {"rows": [{"error": {"none": 0.01, "recompute": 0.2,
                               "chameleon": {0.25: -0.05, 0.5: None}}}]}
    assert gpu_steps.within(tab, 0.15) == {"none": True, "recompute": False,
                                           "chameleon@25%": True, "chameleon@50%": True}


def test_measured_runs_name_their_configs():
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    for m in gpu_steps.H100_LLAMA:
        assert (root / m.spec).is_file(), m.spec
        assert m.peak_bytes and m.none_seconds > 0 and m.recompute_ratio > 1
