"""The workload registry and configs (names, sizes, overrides, clear errors, the optional
transformers dependency), the gpu presets on the meta device, and the pieces of the video DiT:
Skiparse grouping, its padding mask, and the layer-drop argument of the Llama decoder."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from chameleon_swap.workloads import (WORKLOADS, Llama, LlamaConfig, VideoDiTConfig, get_workload,
                                      workload_names)
from chameleon_swap.workloads.dit import (SkiparseAttention, rope_3d, skiparse_group,
                                          skiparse_mask, skiparse_ungroup)


# --------------------------------------------------------------------------- registry
def test_names():
    assert set(WORKLOADS) == {"llama-varlen", "moe", "layerdrop", "video-dit", "mixed"}
    names = workload_names()
    assert names[:5] == list(WORKLOADS)
    assert all(n in WORKLOADS or n.startswith("hf:") for n in names)
    for name in WORKLOADS:
        w = get_workload(name, "tiny")
        assert w.name == name and w.description and w.config_dict()


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown workload 'gpt5'") as e:
        get_workload("gpt5")
    for name in list(WORKLOADS) + ["hf:<model_type>"]:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="hf:<model_type>"):
        get_workload("hf:")
    with pytest.raises(TypeError, match="name"):
        get_workload(3)


def test_bad_size_names_the_argument_and_the_sizes():
    with pytest.raises(ValueError, match=r"size must be one of tiny, small, gpu; got 'huge'"):
        get_workload("moe", "huge")


def test_unknown_override_lists_the_accepted_fields():
    with pytest.raises(ValueError, match="unknown override.*n_layer\\b.*accepted:.*n_layers"):
        get_workload("llama-varlen", "tiny", n_layer=3)


@pytest.mark.parametrize("name,override", [
    ("llama-varlen", {"lengths": "sometimes"}),
    ("llama-varlen", {"buckets": (0.5, 1.5)}),
    ("llama-varlen", {"buckets": ()}),
    ("llama-varlen", {"batch_size": 0}),
    ("llama-varlen", {"n_kv_heads": 3}),
    ("moe", {"top_k": 9}),
    ("layerdrop", {"drop_prob": 1.0}),
    ("mixed", {"accum_steps": 0}),
    ("mixed", {"eval_every": True}),
    ("video-dit", {"buckets": ((1, 7, 8),)}),   # H not a multiple of the patch
    ("video-dit", {"sparse_k": 0}),
    ("video-dit", {"n_heads": 8}),              # head size 4: too small for 3D RoPE
])
def test_bad_override_names_the_field(name, override):
    (field,) = override
    with pytest.raises((TypeError, ValueError), match=field):
        get_workload(name, "tiny", **override)


def test_overrides_apply_and_lists_become_tuples():
    w = get_workload("llama-varlen", "tiny", lengths="uniform", buckets=[0.5, 1.0], seq_len=40)
    assert w.config.buckets == (0.5, 1.0)
    lengths = {b.args[0].shape[1] for b in w.batches(40, "cpu")}
    assert min(lengths) >= 20 and max(lengths) <= 40 and len(lengths) > 4
    d = get_workload("video-dit", "tiny", buckets=[[1, 4, 4], [3, 4, 6]])
    assert d.config.buckets == ((1, 4, 4), (3, 4, 6))
    assert {b.tag for b in d.batches(8, "cpu")} == {"image 1x4x4", "video 3x4x6"}


def test_bucketed_lengths_come_from_the_buckets():
    w = get_workload("llama-varlen", "tiny", seq_len=64)
    lengths = {b.args[0].shape[1] for b in w.batches(40, "cpu")}
    assert lengths == {16, 32, 48, 64}
    fixed = get_workload("llama-varlen", "tiny", lengths="fixed")
    assert {b.tag for b in fixed.batches(5, "cpu")} == {f"T={fixed.config.seq_len}"}


def test_importing_workloads_does_not_import_transformers():
    code = ("import sys, chameleon_swap.workloads as w; w.workload_names(); "
            "assert 'transformers' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_hf_without_transformers_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    with pytest.raises(ImportError, match=r"transformers.*chameleon-swap\[bench\]"):
        get_workload("hf:llama", "tiny")


def test_hf_unknown_model_type_and_overrides():
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="'bert-ish' has no causal LM.*llama"):
        get_workload("hf:bert-ish", "tiny")
    with pytest.raises(ValueError, match="model_type"):
        get_workload("hf:llama", "tiny", model_type="gpt2")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        get_workload("hf:qwen2", "tiny", num_key_value_heads=3)
    w = get_workload("hf:gpt2", "tiny", num_hidden_layers=3)
    assert w.name == "hf:gpt2"
    model = w.build("cpu")
    assert len(w.block_lists(model)[0]) == 3 and model.config.n_layer == 3


# --------------------------------------------------------------------------- gpu presets
GPU_PARAMS = {"llama-varlen": (0.8e9, 1.5e9), "moe": (0.8e9, 1.5e9), "layerdrop": (0.8e9, 1.5e9),
              "mixed": (0.8e9, 1.5e9), "video-dit": (0.6e9, 1.5e9)}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_gpu_preset_builds_on_the_meta_device(name):
    w = get_workload(name, "gpu")
    model = w.build("meta", dtype=torch.bfloat16)
    params = list(model.parameters())
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params)
    low, high = GPU_PARAMS[name]
    assert low < sum(p.numel() for p in params) < high
    assert len(w.block_lists(model)[0]) >= 16


def test_hf_gpu_preset_builds_on_the_meta_device():
    pytest.importorskip("transformers")
    w = get_workload("hf:llama", "gpu")
    model = w.build("meta")
    assert all(p.is_meta for p in model.parameters())
    assert len(w.block_lists(model)[0]) == 16


def test_build_casts_weights_but_keeps_rope_frequencies_in_float32():
    w = get_workload("llama-varlen", "tiny")
    a, b = w.build("cpu", torch.float32, seed=2), w.build("cpu", torch.bfloat16, seed=2)
    assert b.inv_freq.dtype == torch.float32 and torch.equal(a.inv_freq, b.inv_freq)
    assert torch.equal(a.output.weight.bfloat16(), b.output.weight)
    loss = w.loss(b, w.batches(1, "cpu")[0])
    assert torch.isfinite(loss)


# --------------------------------------------------------------------------- layer drop
def test_llama_keep_runs_only_the_kept_blocks():
    model = Llama(LlamaConfig(n_layers=4))
    calls = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: calls.append(i))
    x = torch.randint(256, (2, 8))
    model(x, keep=(0, 3))
    assert calls == [0, 3]
    calls.clear()
    model(x)
    assert calls == [0, 1, 2, 3]
    for bad in [(3, 1), (0, 0), (4,), (-1,), (1.0,)]:
        with pytest.raises(ValueError, match="keep"):
            model(x, keep=bad)


# --------------------------------------------------------------------------- Skiparse
def positions(N):
    return torch.arange(N).view(1, N, 1, 1)


def test_single_skip_groups_tokens_k_apart():
    g = skiparse_group(positions(12), 3, "single").flatten(1).tolist()
    assert g == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


def test_group_skip_interleaves_chunks_of_k():
    g = skiparse_group(positions(18), 3, "group").flatten(1).tolist()
    # Chunks of 3 consecutive tokens; chunk j goes to group j % 3.
    assert g == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 12, 13, 14], [6, 7, 8, 15, 16, 17]]
    # 15 tokens are padded (zeros) to 18, a multiple of k * k: the last chunk is padding.
    g = skiparse_group(positions(15), 3, "group").flatten(1).tolist()
    assert g == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 12, 13, 14], [6, 7, 8, 0, 0, 0]]


@pytest.mark.parametrize("mode", ["single", "group"])
@pytest.mark.parametrize("N", [1, 5, 9, 16, 23])
def test_ungroup_inverts_group(mode, N):
    x = torch.randn(2, N, 3, 4)
    y = skiparse_ungroup(skiparse_group(x, 3, mode), 2, N, 3, mode)
    assert torch.equal(y, x.reshape(2, N, 12))


@pytest.mark.parametrize("mode", ["single", "group"])
def test_mask_hides_padding_and_never_a_whole_row(mode):
    B, N, k = 2, 5, 3
    mask = skiparse_mask(B, N, k, mode, "cpu")
    grouped = skiparse_group(positions(N) + 1, k, mode).reshape(k, -1)  # 0 marks padding
    for r in range(B * k):
        real = grouped[r % k] > 0
        expected = real if real.any() else torch.ones_like(real)
        assert torch.equal(mask[r, 0, 0], expected)
    assert skiparse_mask(B, 6, k, "group", "cpu") is not None   # 6 -> 9 (k * k)
    assert skiparse_mask(B, 6, k, "single", "cpu") is None      # 6 is a multiple of k


@pytest.mark.parametrize("mode", ["single", "group"])
def test_skiparse_attention_stays_inside_groups(mode):
    cfg = VideoDiTConfig(dim=24, n_heads=2, sparse_k=2)
    torch.manual_seed(0)
    attn = SkiparseAttention(cfg, mode)
    N = 11
    cos, sin = rope_3d((1, 1, N), cfg.head_dim, cfg.rope_theta, "cpu")
    x = torch.randn(1, N, cfg.dim)
    x2 = x.clone()
    x2[0, 4] += 1.0   # token 4: group 0 under single skip (4 % 2), group 0 under group skip (2 % 2)
    y, y2 = attn(x, cos, sin), attn(x2, cos, sin)
    group_of = [i % 2 if mode == "single" else (i // 2) % 2 for i in range(N)]
    for i in range(N):
        changed = not torch.equal(y[0, i], y2[0, i])
        assert changed == (group_of[i] == group_of[4]), i
    assert torch.isfinite(y).all()


def test_rope_3d_rotates_along_all_three_axes():
    cos, sin = rope_3d((2, 3, 4), 12, 10000.0, "cpu")   # 6 pairs: 2 for t, 2 for h, 2 for w
    assert cos.shape == (24, 6)
    grid = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(4),
                                      indexing="ij"), -1).reshape(24, 3)
    angles = torch.atan2(sin, cos)
    assert torch.allclose(angles[:, 0], grid[:, 0].float())   # first t pair: frequency 1
    assert torch.allclose(angles[:, 2], grid[:, 1].float())   # first h pair
    assert torch.allclose(angles[:, 4], grid[:, 2].float())   # first w pair


def test_video_dit_with_temporal_patches_pads_frames_and_predicts_every_one():
    w = get_workload("video-dit", "tiny", patch_t=2, buckets=((1, 4, 4), (3, 4, 6)))
    model = w.build("cpu", seed=0)
    for b in w.batches(6, "cpu", seed=0):
        xt, t, text, noise = b.args
        assert model(xt, t, text).shape == xt.shape      # padded frames are cropped away
        T, H, W = xt.shape[2:]
        assert b.tokens == xt.shape[0] * -(-T // 2) * (H // 2) * (W // 2)
        loss = w.loss(model, b)
        loss.backward()
        assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
