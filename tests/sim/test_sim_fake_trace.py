"""The fake-tensor tracer: saved bytes as the engine counts them, dedup, layer scaling, --hf."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import chameleon_swap as cs
from chameleon_swap import cli
from chameleon_swap.sim.fake_trace import record_step, trace_module

from _models import ViewsModel, randn

transformers = pytest.importorskip("transformers")
from chameleon_swap.sim import hf_trace  # noqa: E402  (needs transformers)

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHAMELEON_SWAP_CACHE", str(tmp_path / "cache"))


def _views_loss(model):
    return model(randn(2, 4, model.dim, seed=1)).square().sum()


def test_real_mode_saved_bytes_equal_the_engines():
    model = ViewsModel()
    rec = record_step(model, _views_loss)
    with cs.Chameleon(budget=None) as eng:
        with eng.step():
            _views_loss(model).backward()
    assert rec.activation_bytes == eng.last_step.saved_bytes > 0
    # The fake trace of the same model saves the same bytes without running a kernel.
    fake = trace_module(ViewsModel, _views_loss)
    assert fake.activation_bytes == rec.activation_bytes
    assert [t.nbytes for t in fake.tensors] == [t.nbytes for t in rec.tensors]


class _ViewsAndParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8, 8))

    def forward(self, x):
        h = torch.relu(x @ self.w) @ self.w.t()   # saves x, relu's output, a view of w
        a, b = h.exp().chunk(2, dim=1)        # exp saves its output; a and b are views of it
        return (a * b).sum() + (a.t() @ b).sum()


def test_views_count_once_and_parameters_are_skipped():
    rec = trace_module(_ViewsAndParams, lambda m: m(torch.ones(4, 8)))
    by_module = sorted(t.nbytes for t in rec.tensors)
    # x, relu's output (saved by relu and the matmul) and exp's output (4x8 fp32 each) once
    # each, though views of exp's (a, b, a.t()) are saved again; w and w.t() are skipped.
    assert by_module == [128, 128, 128]
    assert rec.skipped_bytes > 0 and rec.skipped_bytes % (8 * 8 * 4) == 0
    assert rec.grad_bytes == rec.param_bytes == 256
    assert all(0 <= t.saved_at < rec.n_forward <= t.first_used_at <= len(rec.segment_ops)
               for t in rec.tensors)
    assert rec.peak_bytes >= rec.activation_bytes + rec.grad_bytes


def test_hf_llama_traces_with_layers_and_block_inputs():
    rec = hf_trace.trace_hf("llama", seq=32, num_hidden_layers=2, use_cache=False, **TINY)
    assert rec.extra["block_prefix"] == "model.layers" and rec.extra["layers"] == 2
    assert {t.dtype for t in rec.tensors} >= {"bfloat16", "float32"}     # autocast on
    from chameleon_swap.sim.hardware import load
    step = hf_trace.to_trace(rec, load("h100-sxm"), "sgd", "tiny").steps[0]
    assert [t.block for t in step.tensors if t.kind == "block_input"] == [0, 1]
    assert step.model_state_bytes == 2 * rec.param_bytes
    # No seq x seq mask or scores with SDPA: nothing for selective recomputation to drop.
    assert not any(t.kind == "attn_core" for t in step.tensors)


def test_layer_scaling_equals_the_full_trace():
    full = hf_trace.trace_hf("llama", seq=32, num_hidden_layers=6, scale=False,
                             use_cache=False, **TINY)
    scaled = hf_trace.trace_hf("llama", seq=32, num_hidden_layers=6, use_cache=False, **TINY)
    assert scaled.extra["traced_layers"] == 4 and full.extra["layers"] == 6
    for field in ("segment_ops", "segment_module", "n_forward", "tensors", "param_bytes",
                  "grad_bytes", "transient_bytes"):
        assert getattr(scaled, field) == getattr(full, field), field


def test_layer_scaling_refuses_what_it_cannot_repeat():
    import copy

    from chameleon_swap.sim.traced import scale_layers
    rec = hf_trace.trace_hf("llama", seq=16, num_hidden_layers=4, scale=False, use_cache=False,
                            **TINY)
    prefix = rec.extra["block_prefix"]
    assert scale_layers(rec, prefix, 7).extra["layers"] == 7
    assert scale_layers(rec, prefix, 3) is None                   # fewer layers than traced
    mid_start = min(t.saved_at for t in rec.tensors if t.module.startswith(f"{prefix}.1."))
    use_mid = min(t.first_used_at for t in rec.tensors if t.module.startswith(f"{prefix}.1."))
    broken = []
    r = copy.deepcopy(rec)                                         # the middle blocks differ
    next(t for t in r.tensors if t.module.startswith(f"{prefix}.2.")).nbytes += 1
    broken.append(r)
    r = copy.deepcopy(rec)                                         # block 0's tensor used by 1
    next(t for t in r.tensors if t.module.startswith(f"{prefix}.0.")).first_used_at = use_mid
    broken.append(r)
    r = copy.deepcopy(rec)                                         # block 1 split in two runs
    r.segment_module[mid_start + 1] = ""
    broken.append(r)
    for r in broken:
        assert scale_layers(r, prefix, 7) is None


def test_cache_hit_on_second_call(monkeypatch):
    first = hf_trace.trace_hf("llama", seq=16, num_hidden_layers=2, **TINY)
    monkeypatch.setattr(hf_trace, "_run", lambda *a: pytest.fail("traced again"))
    again = hf_trace.trace_hf("llama", seq=16, num_hidden_layers=2, **TINY)
    assert again.tensors == first.tensors and again.segment_ops == first.segment_ops


def test_cli_simulate_hf_config_file(capsys, tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(dict(model_type="llama", num_hidden_layers=2, **TINY)))
    assert cli.main(["simulate", "--hf", str(cfg), "--hardware", "h100-sxm", "--seq", "64",
                     "--optimizer", "sgd", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "tp2" not in out["policies"] and out["policies"]["none"]["fits"] is True
    assert cli.main(["simulate", "--hf", str(cfg), "--hardware", "h100-sxm", "--seq", "64"]) == 0
    text = capsys.readouterr().out
    assert "traced on fake tensors" in text and "traced step peak" in text
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--hf", str(cfg), "--hardware", "h100-sxm", "--policies", "tp2"])
    with pytest.raises(SystemExit):
        cli.main(["simulate", "--hf", str(tmp_path / "missing.json"), "--hardware", "h100-sxm"])


def test_cli_model_path_is_labelled_an_estimate(capsys):
    assert cli.main(["simulate", "--model", "llama3.2-1b", "--hardware", "h100-sxm",
                     "--policies", "none"]) == 0
    assert "formula estimate" in capsys.readouterr().out


def test_cli_capacity_hf(capsys, tmp_path, monkeypatch):
    from chameleon_swap.sim import sweeps
    monkeypatch.setattr(sweeps, "MAX_SEQ", 1024)        # a tiny model fits any length: stop early
    monkeypatch.setattr(sweeps, "MAX_MICRO_BATCH", 2)
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(dict(model_type="llama", num_hidden_layers=2, **TINY)))
    assert cli.main(["capacity", "--hf", str(cfg), "--hardware", "h100-sxm", "--policies",
                     "none", "--json"]) == 0
    cap = json.loads(capsys.readouterr().out)["policies"]["none"]
    assert set(cap) == {"seq", "micro_batch"} and cap["seq"]["seq"] == 1024


def test_cli_compare_hf_across_profiles(capsys, tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(dict(model_type="llama", num_hidden_layers=2, **TINY)))
    argv = ["compare", "--hf", str(cfg), "--seq", "64", "--optimizer", "sgd",
            "--hardware", "h100-sxm,h200"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["hardware"] for r in out["hardware"]] == ["h100-sxm", "h200"]
    from chameleon_swap.sim.sweeps import APPROACHES
    for r in out["hardware"]:
        assert set(APPROACHES) <= set(r)
        assert r["none"]["fits"] and r["memory_binds"] is False   # a tiny model fits anywhere
        assert r["vs_full_recompute"] is not None and r["hybrid_vs_full_recompute"] is not None
    # A budget below the natural peak: the swapping approaches move bytes, and they fit.
    assert cli.main([*argv, "--budget", "1KiB", "--approaches", "none,chameleon,hybrid",
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["hardware"]
    assert "full-recompute" not in rows[0] and rows[0]["chameleon"]["moved_bytes"] > 0
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "traced on fake tensors" in text and "hybrid vs full" in text and "h200" in text
    for bad in (["--models", "llama-7b"], ["--degrees", "1,2"], ["--tp", "2"],
                ["--approaches", "tp2"]):
        with pytest.raises(SystemExit):
            cli.main([*argv, *bad])


def test_hybrid_is_in_every_default_list():
    from chameleon_swap.sim import commands, sweeps
    from chameleon_swap.sim.policies import POLICIES
    assert "hybrid" in POLICIES                            # capacity's default
    assert "hybrid" in commands.DEFAULT_POLICIES           # simulate's default
    assert "hybrid" in sweeps.APPROACHES and "hybrid" in sweeps.parse_approaches(None)


def test_dit_traces_with_blocks_and_simulates_every_approach():
    from chameleon_swap.sim.dit_trace import OPEN_SORA_PLAN, trace_dit
    from chameleon_swap.sim.hardware import load
    from chameleon_swap.sim.policies import run
    small = dict(OPEN_SORA_PLAN, n_layers=2, dim=64, n_heads=4, text_len=8, text_dim=32,
                 buckets=((2, 8, 8),))
    rec = trace_dit(**small)
    assert rec.extra["block_prefix"] == "blocks" and rec.extra["layers"] == 2
    assert rec.extra["seq"] == 2 * 4 * 4                  # tokens: T x (H / 2) x (W / 2)
    trace = hf_trace.to_trace(rec, load("h100-sxm"), "sgd", "dit")
    step = trace.steps[0]
    assert [t.block for t in step.tensors if t.kind == "block_input"] == [0, 1]
    budget = step.activation_bytes // 4
    for p in ("none", "full-recompute", "chameleon", "hybrid"):
        r = run(trace, p, budget)
        assert r.step_seconds >= step.compute_seconds * (1 - 1e-9)
        if p in ("chameleon", "hybrid"):
            assert r.peak_bytes <= budget


def test_an_unknown_hf_model_type_is_named_with_examples_not_transformers_whole_list():
    from chameleon_swap.sim.hf_trace import hf_config
    with pytest.raises(ValueError) as info:
        hf_config("llama-7b")
    msg = str(info.value)
    assert msg.startswith("--hf: 'llama-7b' is neither") and "--model" in msg
    assert len(msg) < 300, msg                  # not the hundreds of names transformers lists
