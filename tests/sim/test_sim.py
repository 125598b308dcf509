"""The simulator: trace format, hardware profiles, the analytic generator against the published
formulas, and every policy's invariants on the timeline model."""
from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest

from chameleon_swap import sim
from chameleon_swap.sim import analytic, hardware, policies, sweeps
from chameleon_swap.sim.models import ModelConfig, family, preset
from chameleon_swap.runtime.trace import Step, Tensor, Trace, dumps, load, loads, save

H100 = hardware.load("h100-sxm")


def tiny(**kw) -> ModelConfig:
    base = dict(layers=2, hidden=64, heads=4, vocab=100, seq=32, micro_batch=2, name="tiny")
    base.update(kw)
    return ModelConfig(**base)


# ------------------------------------------------------------------------------ module rules
def test_sim_imports_no_torch_and_no_executor_internals():
    src = Path(sim.__file__).parent
    for f in src.glob("*.py"):
        tree = ast.parse(f.read_text())
        if f.name == "fake_trace.py":
            continue               # the tracer runs a model: only hf_trace imports it, lazily
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        mods = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods.add(node.module)
        assert not any("executor" in m or m.startswith("..copy") or "policy" == m.split(".")[-1]
                       for m in mods), (f.name, mods)
        # torch only inside functions (record, calibrate), never at module level.
        for n in top:
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            assert not any(x.split(".")[0] == "torch" for x in names), f.name


# ------------------------------------------------------------------------------ trace format
def test_trace_round_trip_file_and_string(tmp_path):
    tr = analytic.generate(tiny(), H100)
    again = loads(dumps(tr))
    assert again.to_dict() == tr.to_dict()
    path = save(tr, tmp_path / "t.json")
    assert load(path).to_dict() == tr.to_dict()
    assert json.loads(path.read_text())["version"] == sim.VERSION


def test_trace_directory_reads_steps_in_order(tmp_path):
    for i, n in enumerate((3, 1, 2)):
        step = Step(segments=[0.1] * (2 * n + 1), n_forward=n,
                    tensors=[Tensor(10 * (k + 1), k, 2 * n - k) for k in range(n)])
        save(Trace([step], source="profiler", d2h_bytes_per_s=1e9, h2d_bytes_per_s=2e9),
             tmp_path / f"step-{i:06d}.json")
    tr = load(tmp_path)
    assert [s.n_forward for s in tr.steps] == [3, 1, 2]
    assert tr.link == (1e9, 2e9) and tr.source == "profiler"


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=99), "version 99 is not supported"),
    (lambda d: d.update(format="other"), "not a chameleon-swap trace"),
    (lambda d: d["steps"][0]["tensors"][0].update(saved_at=10**6), "tensors[0].saved_at"),
    (lambda d: d["steps"][0]["tensors"][0].update(first_used_at=0), "tensors[0].first_used_at"),
    (lambda d: d["steps"][0]["tensors"][1].update(bytes=-1), "tensors[1].bytes"),
    (lambda d: d["steps"][0]["tensors"][1].pop("bytes"), "tensors[1] must be an object with"),
    (lambda d: d["steps"][0].update(segments=[]), "segments must be a non-empty list"),
    (lambda d: d["steps"][0]["segments"].__setitem__(0, -1.0), "segments[0]"),
    (lambda d: d["steps"][0].update(n_forward="3"), "n_forward must be an int"),
    (lambda d: d["steps"][0].update(segment_block=[0]), "segment_block must be null or a list"),
    (lambda d: d.update(steps=[]), "steps must be a non-empty list"),
    (lambda d: d.update(source="guess"), "source must be one of"),
])
def test_trace_validation_names_the_field(mutate, message):
    d = analytic.generate(tiny(), H100).to_dict()
    mutate(d)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Trace.from_dict(d)


def test_trace_not_json(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        load(p)
    with pytest.raises(ValueError, match="no such file"):
        load(tmp_path / "missing.json")


# ------------------------------------------------------------------------------ hardware
def test_builtin_profiles_load_with_sources():
    names = hardware.builtin_names()
    assert {"h100-sxm", "h100-pcie", "h200", "a100-80gb", "ascend-910b"} <= set(names)
    for n in names:
        hw = hardware.load(n)
        assert hw.sources and hw.usable_bytes > 0 and hw.d2h < hw.d2h_bytes_per_s
    # Dense figures, not the 2:4-sparsity ones the datasheets print first.
    assert H100.peak_flops["bf16"] == pytest.approx(989.4e12)
    assert hardware.load("a100-80gb").peak_flops["bf16"] == pytest.approx(312e12)


def test_measured_link_replaces_the_nominal_rate():
    # h100-sxm carries the pinned rates measured on an H100 (with their source).
    assert (H100.h2d, H100.d2h) == (53.6e9, 54.7e9)
    d = json.loads((Path(hardware.__file__).parent / "hardware" / "h100-sxm.json").read_text())
    assert "H100 80GB HBM3" in d["host_link"]["measured"]["source"]
    del d["host_link"]["measured"]
    plain = hardware.Hardware.from_dict(d)
    assert plain.h2d == pytest.approx(64e9 * 0.8)
    d["host_link"]["measured"] = {"h2d_bytes_per_s": 1e9}
    with pytest.raises(ValueError, match="host_link.measured must be an object"):
        hardware.Hardware.from_dict(d)


def test_user_profile_from_file_and_errors(tmp_path):
    d = json.loads((Path(hardware.__file__).parent / "hardware" / "h200.json").read_text())
    d["name"] = "mine"
    d["device_memory_bytes"] = 2**30
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(d))
    assert hardware.load(str(p)).device_memory_bytes == 2**30
    with pytest.raises(ValueError, match="h100-sxm"):
        hardware.load("h101")                       # unknown names list the valid ones
    d["schema"] = 7
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="schema must be 1"):
        hardware.load(str(p))
    with pytest.raises(ValueError, match="no peak FLOP/s for dtype 'fp32'"):
        hardware.load("ascend-910b").flops("fp32")


# ------------------------------------------------------------------------------ analytic
def test_gpt_layer_matches_korthikanti_activation_formula():
    # Korthikanti et al. 2022, Sec. 4.1: s*b*h*(34 + 5*a*s/h) bytes per layer with 16-bit
    # activations, 1-byte dropout masks, no FlashAttention. s=32, b=2, h=64, a=4:
    # 32*2*64*(34 + 5*4*32/64) = 4096 * 44 = 180224.
    cfg = tiny(arch="gpt", dtype="fp16", flash=False)
    tr = analytic.generate(cfg, H100)
    assert analytic.layer_activation_bytes(tr, 0) == 180224
    assert analytic.layer_activation_bytes(tr, 1) == 180224
    # With tensor and sequence parallelism of degree t, divided by t (their Eq. 6).
    tr2 = analytic.generate(cfg.replace(tp=2), H100)
    assert analytic.layer_activation_bytes(tr2, 0) == 180224 // 2


def test_gpt_flops_match_narayanan():
    # Narayanan et al. 2021: 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) per step without
    # recomputation. B=2, s=32, l=2, h=64, V=100: 72*2*32*2*4096*(1 + 1/12 + 100/1536).
    cfg = tiny(arch="gpt", dtype="fp16", flash=False)
    f = analytic.generate(cfg, H100).meta["flops"]
    expected = 72 * 2 * 32 * 2 * 64**2 * (1 + 32 / (6 * 64) + 100 / (12 * 2 * 64))
    assert f["forward"] + f["backward"] == pytest.approx(expected, rel=1e-12)
    assert expected == 43_352_064                    # 37,748,736 * 1.1484375


def test_flash_drops_the_quadratic_tensors():
    cfg = tiny(arch="gpt", dtype="fp16", flash=False)
    off = analytic.generate(cfg, H100).steps[0]
    on = analytic.generate(cfg.replace(flash=True), H100).steps[0]
    quad = sum(t.nbytes for t in off.tensors if t.kind == "attn_core")
    assert quad == 2 * (5 * 4 * 32 * 32 * 2)        # 5*a*s^2*b per layer, two layers
    assert not [t for t in on.tensors if t.kind == "attn_core"]
    # O and the fp32 log-sum-exp replace them: (o: 2sbh) + (lse: 4*a*s*b) - (proj input: 2sbh)
    # - (attention dropout mask: counted in the s^2 group) per layer.
    assert on.activation_bytes == off.activation_bytes - quad + 2 * (4 * 4 * 32 * 2)


def test_llama_7b_parameter_count_and_state_bytes():
    cfg = preset("llama-7b")
    assert cfg.params() == 6_738_415_616             # Llama 2 7B
    assert cfg.model_state_bytes() == 16 * cfg.params()
    assert cfg.replace(tp=2).model_state_bytes() == 8 * cfg.params()
    # ZeRO-1 over 4 ranks: 2 + 2 + 12/4 bytes per parameter.
    assert cfg.replace(dp_shard=4).model_state_bytes() == 7 * cfg.params()
    assert family()[0] == "llama3.2-1b" and family()[-1] == "gpt3-175b"


def test_model_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="model must be one of .*llama-7b"):
        preset("llama-8b")
    with pytest.raises(ValueError, match="heads must divide hidden"):
        tiny(heads=5)
    with pytest.raises(ValueError, match="top_k must be an int from 1 to experts"):
        tiny(experts=2, top_k=3)
    with pytest.raises(ValueError, match="dtype must be one of"):
        tiny(dtype="int4")
    with pytest.raises(ValueError, match="tp must divide heads"):
        tiny(tp=3)


def test_moe_trace_has_expert_tensors_and_compute():
    cfg = tiny(experts=4, top_k=2)
    tr = analytic.generate(cfg, H100)
    names = tr.meta["ops"]
    assert sum(n.startswith("expert") and n.endswith("w2") for n in names) == 2 * 4
    dense = analytic.generate(tiny(), H100).steps[0]
    assert tr.steps[0].activation_bytes > dense.activation_bytes   # top-2: twice the MLP tokens


# ------------------------------------------------------------------------------ policies
def scenario(flash=True, **kw):
    return analytic.generate(tiny(flash=flash, **kw), H100)


@pytest.mark.parametrize("flash", [True, False])
def test_budgeted_policies_hold_the_budget_and_respect_the_lower_bound(flash):
    tr = scenario(flash)
    step = tr.steps[0]
    budget = int(0.3 * step.activation_bytes)
    lb = policies.swap_only_bound(step, budget, H100.d2h, H100.h2d)
    assert lb >= step.compute_seconds
    for p in ("guard", "static", "chameleon", "sync-swap"):
        r = policies.run(tr, p, budget)
        assert r.steps[0].counted_peak_bytes <= budget or p == "sync-swap"
        assert r.step_seconds >= lb * (1 - 1e-9), p
        assert r.step_seconds >= step.compute_seconds
    none = policies.run(tr, "none", budget)
    assert none.step_seconds == pytest.approx(step.compute_seconds)
    assert none.peak_bytes == step.activation_bytes and none.moved_bytes == 0


def test_lower_bound_on_random_traces():
    rng = random.Random(7)
    for _ in range(25):
        n = rng.randint(1, 12)
        n_slots = 2 * n + 1
        tensors = [Tensor(rng.randint(1, 10**6), k, rng.randint(n, n_slots)) for k in range(n)]
        step = Step(segments=[rng.uniform(0, 1e-3) for _ in range(n_slots)], n_forward=n,
                    tensors=tensors)
        tr = Trace([step], d2h_bytes_per_s=rng.uniform(1e8, 1e10),
                   h2d_bytes_per_s=rng.uniform(1e8, 1e10))
        budget = rng.randint(max(t.nbytes for t in tensors), step.activation_bytes + 1)
        lb = policies.swap_only_bound(step, budget, *tr.link)
        for p in ("guard", "chameleon"):
            r = policies.run(tr, p, budget)
            assert r.steps[0].counted_peak_bytes <= budget
            assert r.step_seconds >= lb * (1 - 1e-9)


def test_full_recompute_adds_a_forward_and_keeps_block_inputs():
    tr = scenario()
    step = tr.steps[0]
    r = policies.run(tr, "full-recompute", None)
    block_fwd = sum(s for s, b in zip(step.segments, step.segment_block) if b is not None)
    assert r.step_seconds == pytest.approx(step.compute_seconds + block_fwd)
    kept = sum(t.nbytes for t in step.tensors if t.block is None or t.kind == "block_input")
    assert kept <= r.peak_bytes < step.activation_bytes
    layer = analytic.layer_activation_bytes(tr, 0)
    assert r.peak_bytes <= kept + layer              # at most one layer rebuilt at a time


def test_selective_recompute_drops_attention_core_only():
    off = scenario(flash=False)
    step = off.steps[0]
    r = policies.run(off, "selective-recompute", None)
    quad = sum(t.nbytes for t in step.tensors if t.kind == "attn_core")
    core = sum(s for s, k in zip(step.segments, step.segment_kind) if k == "attn_core")
    assert r.step_seconds == pytest.approx(step.compute_seconds + core)
    assert r.peak_bytes < step.activation_bytes and quad > 0
    on = scenario(flash=True)                        # nothing left to drop
    assert policies.run(on, "selective-recompute", None).peak_bytes == on.steps[0].activation_bytes


def test_recompute_needs_blocks():
    step = Step(segments=[1.0, 1.0, 1.0], n_forward=1, tensors=[Tensor(5, 0, 1)])
    tr = Trace([step], source="profiler", d2h_bytes_per_s=1.0, h2d_bytes_per_s=1.0)
    with pytest.raises(ValueError, match="block .*structure"):
        policies.run(tr, "full-recompute", None)


def test_sync_swap_waits_for_every_copy():
    tr = scenario()
    step = tr.steps[0]
    r = policies.run(tr, "sync-swap", None)
    total = step.activation_bytes
    assert r.stall_seconds == pytest.approx(total / H100.d2h + total / H100.h2d, rel=1e-6)
    assert r.peak_bytes == max(t.nbytes for t in step.tensors)
    assert r.moved_bytes == total


def test_tensor_parallel_divides_memory_and_fits_follows_device_memory():
    cfg = tiny(layers=2, hidden=256, heads=8, seq=512, micro_batch=4, name="t")
    one = analytic.generate(cfg, H100).steps[0]
    two = analytic.generate(cfg.replace(tp=2), H100).steps[0]
    assert two.activation_bytes == pytest.approx(one.activation_bytes / 2, rel=1e-3)
    assert two.model_state_bytes == pytest.approx(one.model_state_bytes / 2, rel=1e-6)
    for p in ("none", "tp2", "chameleon", "full-recompute"):
        r, step = sweeps.evaluate(cfg, H100, p)
        assert r.fits == (r.device_bytes <= H100.usable_bytes
                          and r.host_bytes <= H100.host_memory_bytes)
        assert r.device_bytes == step.model_state_bytes + r.peak_bytes + step.workspace_bytes
    small = hardware.Hardware(**{**H100.__dict__, "name": "small",
                                 "device_memory_bytes": one.model_state_bytes + 2**20,
                                 "reserved_bytes": 0})
    assert sweeps.evaluate(cfg, small, "none")[0].fits is False


def test_chameleon_fits_where_none_does_not():
    cfg = preset("llama3.2-1b", seq=32768)
    none, _ = sweeps.evaluate(cfg, H100, "none")
    ch, _ = sweeps.evaluate(cfg, H100, "chameleon")
    assert none.fits is False and ch.fits is True
    assert ch.peak_bytes <= sweeps.default_budget(_, H100) + max(t.nbytes for t in _.tensors)


def test_static_applies_its_frozen_plan_by_position_and_cold_start_runs_the_guard():
    a = scenario().steps[0]
    b = analytic.generate(tiny(seq=16), H100).steps[0]
    tr = Trace([a, b, a, b], d2h_bytes_per_s=H100.d2h, h2d_bytes_per_s=H100.h2d)
    budget = int(0.3 * b.activation_bytes)
    warm = policies.run(tr, "static", budget)
    cold = policies.run(tr, "static", budget, cold=True)
    guard = policies.run(tr, "guard", budget)
    assert cold.steps[0].step_seconds == pytest.approx(guard.steps[0].step_seconds)
    assert warm.steps[2].step_seconds == pytest.approx(cold.steps[2].step_seconds)
    for r in (warm, cold):
        assert all(s.counted_peak_bytes <= budget for s in r.steps)


def test_unknown_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="choose from none, full-recompute"):
        policies.check_policy("recompute")
    assert policies.check_policy("tp8") == "tp8"
    with pytest.raises(ValueError, match="generated with tp=4"):
        policies.run(scenario(), "tp4", None)
