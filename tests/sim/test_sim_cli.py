"""The simulator's commands (output shape, errors), traces recorded by the engine, calibration."""
from __future__ import annotations

import json

import pytest
import torch

import chameleon_swap as cs
from chameleon_swap import cli
from chameleon_swap.sim import load, policies
from chameleon_swap.sim.calibrate import calibrate

SIM = ["--hardware", "h100-sxm"]


def run_json(capsys, argv):
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_json_is_exactly_the_documented_object(capsys):
    out = run_json(capsys, ["simulate", "--model", "llama-7b", *SIM, "--budget", "40GiB",
                            "--seq", "4096", "--micro-batch", "1", "--json"])
    assert set(out) == {"lower_bound_seconds", "policies"}
    assert set(out["policies"]) == set(policies.POLICIES) | {"tp2"}
    for name, r in out["policies"].items():
        assert set(r) == {"step_seconds", "stall_seconds", "peak_bytes", "moved_bytes", "fits"}
        assert isinstance(r["fits"], bool)
        if name in ("guard", "static", "chameleon"):
            assert r["step_seconds"] >= out["lower_bound_seconds"] * (1 - 1e-9)
    # Llama 2 7B's model states alone (16 bytes x 6.7B) exceed 80 GB: only tp2 fits.
    assert [k for k, r in out["policies"].items() if r["fits"]] == ["tp2"]


def test_simulate_table_and_plot(capsys, tmp_path):
    png = tmp_path / "sim.png"
    assert cli.main(["simulate", "--model", "llama3.2-1b", *SIM, "--policies",
                     "none,chameleon,full-recompute", "--seq", "8192", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "lower bound" in out and "chameleon" in out and "full-recompute" in out
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--model", "llama-8b", *SIM], "model must be one of .*llama-7b"),
    (["simulate", "--model", "llama-7b", "--hardware", "h300"], "--hardware must be .*h100-sxm"),
    (["simulate", "--model", "llama-7b"], "--hardware is required"),
    (["simulate", "--model", "llama-7b", *SIM, "--policies", "magic"],
     "unknown policy 'magic'; choose from none"),
    (["simulate", "--model", "llama-7b", *SIM, "--budget", "lots"], "--budget must be"),
    (["simulate", "--model", "llama-7b", "--hardware", "ascend-910b", "--dtype", "fp32"],
     "no peak FLOP/s for dtype 'fp32'"),
    (["capacity", "--model", "llama-7b"], "--hardware is required"),
    (["compare", *SIM, "--models", "llama-7b,nope"], "model must be one of"),
    (["compare", *SIM, "--degrees", "two"], "--degrees must be"),
    (["trace", "--out", "x.json"], "one of --model"),
])
def test_errors_name_the_argument_and_the_accepted_values(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    import re
    assert re.search(message, capsys.readouterr().err)


def test_capacity_json_shape(capsys):
    out = run_json(capsys, ["capacity", *SIM, "--model", "llama3.2-1b", "--policies",
                            "none,chameleon", "--json"])
    assert set(out["policies"]) == {"none", "chameleon"}
    for row in out["policies"].values():
        assert set(row) == {"model", "seq", "micro_batch"}
    none, ch = out["policies"]["none"], out["policies"]["chameleon"]
    assert ch["seq"]["seq"] > none["seq"]["seq"]
    assert none["seq"]["demand_ratio"] <= 1.0 < ch["seq"]["demand_ratio"]
    assert ch["micro_batch"]["tokens_per_second"] > 0


def test_compare_json_shape(capsys):
    out = run_json(capsys, ["compare", *SIM, "--models", "llama3.2-1b", "--seq", "16384",
                            "--json"])
    (row,) = out["models"]
    for a in ("chameleon", "hybrid", "full-recompute", "selective-recompute", "none"):
        assert row[a] is None or {"tp", "tokens_per_second_per_device"} <= set(row[a])
    assert row["vs_full_recompute"] is not None and row["vs_full_recompute"] > 0
    assert row["hybrid_vs_full_recompute"] is not None


def test_compare_approaches_subset_and_text(capsys):
    argv = ["compare", *SIM, "--models", "llama3.2-1b", "--approaches", "chameleon,none"]
    out = run_json(capsys, [*argv, "--json"])
    (row,) = out["models"]
    assert "hybrid" not in row and row["hybrid_vs_full_recompute"] is None
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "vs higher TP" in text and "hybrid" not in text
    with pytest.raises(SystemExit):
        cli.main([*argv, "--budget", "1GiB"])             # --budget is for --hf


def test_trace_analytic_then_simulate_it(capsys, tmp_path):
    path = tmp_path / "t.json"
    assert cli.main(["trace", "--model", "llama3.2-1b", *SIM, "--seq", "1024",
                     "--out", str(path)]) == 0
    capsys.readouterr()
    tr = load(path)
    assert tr.source == "analytic" and tr.steps[0].tokens == 1024
    out = run_json(capsys, ["simulate", "--trace", str(path), *SIM, "--policies",
                            "none,full-recompute,chameleon", "--json"])
    assert set(out["policies"]) == {"none", "full-recompute", "chameleon"}
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--trace", str(path), *SIM, "--policies", "tp2"])


def test_trace_recorded_from_a_workload_then_simulated(capsys, tmp_path):
    out_dir = tmp_path / "rec"
    assert cli.main(["trace", "--workload", "llama-varlen", "--size", "tiny", "--steps", "2",
                     "--out", str(out_dir), "--json"]) == 0
    capsys.readouterr()
    tr = load(out_dir)
    assert tr.source == "profiler" and len(tr.steps) == 2 and tr.link is not None
    budget = tr.steps[0].activation_bytes // 3
    out = run_json(capsys, ["simulate", "--trace", str(out_dir), "--budget", str(budget),
                            "--policies", "none,guard,chameleon", "--json"])
    assert out["policies"]["chameleon"]["fits"] is None      # no device memory without --hardware
    assert out["policies"]["none"]["peak_bytes"] == max(s.activation_bytes for s in tr.steps)


# ------------------------------------------------------------------------------ engine trace_dir
def test_trace_dir_writes_a_loadable_trace_per_step(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                  for _ in range(3)])
    x = torch.randn(256, 64)
    with cs.Chameleon(budget=2**20, trace_dir=tmp_path / "tr", min_tensor_bytes=0,
                      policy="guard") as eng:
        for _ in range(3):
            model.zero_grad()
            with eng.step():
                model(x).pow(2).mean().backward()
        stats = list(eng.history)
    tr = load(tmp_path / "tr")
    assert [p.name for p in sorted((tmp_path / "tr").iterdir())] == [
        "step-000000.json", "step-000001.json", "step-000002.json"]
    assert len(tr.steps) == 3 and tr.source == "profiler" and tr.link
    for step, st in zip(tr.steps, stats):
        assert step.activation_bytes == st.saved_bytes
        assert step.measured["step_seconds"] == st.step_seconds
        assert step.measured["peak_resident_bytes"] == st.peak_resident_bytes
        assert st.profile_mode == "detailed"          # every traced step is timed
        # Slots: one per save, the gap to backward, one per first use (profiler.py).
        used = sum(t.first_used_at < step.n_slots for t in step.tensors)
        assert step.n_slots == step.n_forward + 1 + used and step.compute_seconds > 0
    # The trace simulates: no budget means no stall, the compute is the measured one.
    r = policies.run(tr, "none", None)
    assert r.stall_seconds == 0 and r.peak_bytes == max(s.activation_bytes for s in tr.steps)


def test_trace_dir_argument_errors(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="trace_dir must be a directory"):
        cs.Chameleon(trace_dir=f)
    with pytest.raises(TypeError, match="trace_dir must be a directory path"):
        cs.Chameleon(trace_dir=3)
    with cs.Chameleon() as eng:                        # default: nothing written, nothing timed
        with eng.step():
            torch.randn(4, 4, requires_grad=True).exp().sum().backward()
        assert eng.last_step.profile_mode in ("lightweight", "detailed")
    assert not list(tmp_path.glob("*.json"))


# ------------------------------------------------------------------------------ calibration
def test_calibration_code_path_on_a_tiny_run():
    res = calibrate("llama-varlen", size="tiny", steps=2, repeats=1, fractions=(0.5,),
                    policies=("guard", "chameleon"))
    assert set(res["summary"]["by_config"]) == {"none", "guard@0.5", "chameleon@0.5"}
    for row in res["rows"]:
        assert row["predicted_step_s"] > 0 and row["measured_step_s"] > 0
        assert row["peak_error"] is not None and row["step_error"] is not None
    # Peaks are the engine's own accounting, which the timeline models: none is exact.
    assert all(r["peak_error"] == 0 for r in res["rows"] if r["policy"] == "none")


def test_model_from_a_json_file(capsys, tmp_path):
    f = tmp_path / "mymoe.json"
    f.write_text(json.dumps({"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2,
                             "vocab": 1000, "experts": 4, "top_k": 2}))
    out = run_json(capsys, ["simulate", "--model", str(f), *SIM, "--seq", "512",
                            "--policies", "none,chameleon", "--json"])
    assert out["policies"]["none"]["fits"] is True
    f.write_text(json.dumps({"layerz": 2}))
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--model", str(f), *SIM])
    assert "unknown: ['layerz']" in capsys.readouterr().err


def test_simulate_trace_with_the_default_policies_leaves_tp_out(capsys, tmp_path):
    path = tmp_path / "t.json"
    assert cli.main(["trace", "--model", "llama3.2-1b", *SIM, "--out", str(path)]) == 0
    capsys.readouterr()
    out = run_json(capsys, ["simulate", "--trace", str(path), *SIM, "--json"])
    assert set(out["policies"]) == set(policies.POLICIES)


def test_trace_plot_writes_the_figure(capsys, tmp_path):
    png = tmp_path / "trace.png"
    assert cli.main(["trace", "--model", "llama3.2-1b", *SIM, "--out", str(tmp_path / "t.json"),
                     "--plot", str(png)]) == 0
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 1000
