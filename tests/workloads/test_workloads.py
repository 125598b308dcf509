import dataclasses
import math

import pytest
import torch

from chameleon_swap.workloads import Llama, LlamaConfig, MoE, MoEConfig

MODELS = [(Llama, LlamaConfig), (MoE, MoEConfig)]


def batch(cfg, B=2, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.vocab_size, (B, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("model_cls,cfg_cls", MODELS)
@pytest.mark.parametrize("T", [1, 5, 16, 64])
def test_forward_shapes(model_cls, cfg_cls, T):
    cfg = cfg_cls(max_seq_len=64)
    model = model_cls(cfg)
    x, y = batch(cfg, B=3, T=T)
    assert model(x).shape == (3, T, cfg.vocab_size)
    loss = model(x, y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    # Small init: the loss starts close to a uniform guess over the vocabulary.
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5


def test_sequence_longer_than_max_seq_len_is_rejected():
    model = Llama(LlamaConfig(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_structure():
    model = Llama()
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 2
    assert "inv_freq" not in model.state_dict()  # derived from the config, not checkpointed
    assert model.config.ffn_dim == 176 and model.config.ffn_dim % 16 == 0
    assert MoE().config.expert_ffn_dim == 176


def grads_after_step(model_cls, cfg, seed):
    torch.manual_seed(seed)
    model = model_cls(cfg)
    x, y = batch(cfg)
    loss = model(x, y)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("model_cls,cfg_cls", MODELS)
def test_same_seed_gives_bit_identical_loss_and_grads(model_cls, cfg_cls):
    cfg = cfg_cls()
    loss1, grads1 = grads_after_step(model_cls, cfg, seed=1234)
    loss2, grads2 = grads_after_step(model_cls, cfg, seed=1234)
    assert torch.equal(loss1, loss2)
    assert grads1.keys() == grads2.keys()
    for name in grads1:
        g1, g2 = grads1[name], grads2[name]
        assert (g1 is None) == (g2 is None), name
        assert g1 is None or torch.equal(g1, g2), name
    # And a different seed really gives a different model.
    loss3, _ = grads_after_step(model_cls, cfg, seed=99)
    assert not torch.equal(loss1, loss3)


@pytest.mark.parametrize("model_cls,cfg_cls", MODELS)
def test_init_weights_seed_ignores_global_rng(model_cls, cfg_cls):
    torch.manual_seed(0)
    a = model_cls(cfg_cls())
    torch.manual_seed(1)
    b = model_cls(cfg_cls())
    a.init_weights(seed=7)
    b.init_weights(seed=7)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na


def test_moe_counts_cover_every_token_slot():
    cfg = MoEConfig(n_layers=3, n_experts=4, top_k=2)
    model = MoE(cfg)
    x, _ = batch(cfg, B=2, T=10)
    model(x)
    counts = model.last_expert_counts
    assert len(counts) == cfg.n_layers * cfg.n_experts
    assert all(type(c) is int for c in counts)
    for layer in range(cfg.n_layers):
        assert sum(counts[layer * 4:(layer + 1) * 4]) == 2 * 10 * cfg.top_k


@pytest.mark.parametrize("n_experts,top_k", [(3, 1), (5, 2)])
def test_moe_skips_an_expert_that_gets_no_tokens(n_experts, top_k):
    cfg = MoEConfig(n_experts=n_experts, top_k=top_k)
    torch.manual_seed(0)
    model = MoE(cfg)
    # Router logits slope * (v . x) with slopes from 1 down to -1: whatever the sign of v . x, the
    # top_k experts are at one end, so the middle expert (slope 0) can never be chosen.
    skipped = n_experts // 2
    slopes = torch.linspace(1, -1, n_experts)
    v = torch.randn(cfg.dim)
    with torch.no_grad():
        for block in model.layers:
            block.mlp.router.weight.copy_(slopes[:, None] * v)
    calls = []
    hook = model.layers[0].mlp.experts[skipped].register_forward_pre_hook(
        lambda *_: calls.append(1))

    x, y = batch(cfg, B=4, T=16)
    model(x, y).backward()
    hook.remove()

    assert calls == []  # the expert was not even called
    counts = model.last_expert_counts
    for layer, block in enumerate(model.layers):
        layer_counts = counts[layer * n_experts:(layer + 1) * n_experts]
        assert layer_counts[skipped] == 0
        assert block.mlp.router.weight.grad is not None
        for e, expert in enumerate(block.mlp.experts):
            for p in expert.parameters():
                # An expert gets grads exactly when it got tokens.
                assert (p.grad is None) == (layer_counts[e] == 0), (layer, e)
        assert sum(c > 0 for c in layer_counts) >= top_k


def test_tied_embeddings_share_one_parameter():
    tied, untied = Llama(LlamaConfig(tie_embeddings=True)), Llama(LlamaConfig())
    assert tied.output.weight is tied.tok_emb.weight
    n = lambda m: sum(p.numel() for p in m.parameters())
    assert n(untied) - n(tied) == 256 * 64
    x, y = batch(tied.config)
    tied(x, y).backward()
    assert tied.tok_emb.weight.grad is not None


@pytest.mark.parametrize("cfg_cls,field,value", [
    (LlamaConfig, "vocab_size", 0),
    (LlamaConfig, "dim", -64),
    (LlamaConfig, "n_layers", True),
    (LlamaConfig, "n_layers", 2.0),
    (LlamaConfig, "n_heads", 3),  # does not divide dim=64
    (LlamaConfig, "n_kv_heads", 3),  # does not divide n_heads=4
    (LlamaConfig, "ffn_dim", 0),
    (LlamaConfig, "max_seq_len", 0),
    (LlamaConfig, "rope_theta", 0.0),
    (LlamaConfig, "norm_eps", float("nan")),
    (LlamaConfig, "tie_embeddings", "yes"),
    (MoEConfig, "n_experts", 0),
    (MoEConfig, "top_k", 5),  # more than n_experts=4
    (MoEConfig, "top_k", 0),
    (MoEConfig, "expert_ffn_dim", -1),
])
def test_config_errors_name_the_field(cfg_cls, field, value):
    with pytest.raises((TypeError, ValueError), match=field):
        cfg_cls(**{field: value})


def test_odd_head_size_is_rejected_for_rope():
    with pytest.raises(ValueError, match="n_heads"):
        LlamaConfig(dim=12, n_heads=4, n_kv_heads=2)  # head size 3


def test_replace_revalidates():
    with pytest.raises(ValueError, match="n_kv_heads"):
        dataclasses.replace(LlamaConfig(), n_kv_heads=3)


def test_wrong_config_type_is_rejected():
    with pytest.raises(TypeError, match="MoEConfig"):
        MoE(LlamaConfig())


@pytest.mark.parametrize("model_cls,cfg_cls", MODELS)
def test_causal(model_cls, cfg_cls):
    # Changing a later token must not change any earlier position's logits.
    model = model_cls(cfg_cls())
    x, _ = batch(model.config, B=1, T=12)
    x2 = x.clone()
    x2[0, 8] = (x2[0, 8] + 1) % model.config.vocab_size
    a, b = model(x), model(x2)
    assert torch.allclose(a[:, :8], b[:, :8], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_moe_layer_matches_a_dense_reference():
    torch.manual_seed(0)
    layer = MoE(MoEConfig(n_experts=4, top_k=2)).layers[0].mlp
    x = torch.randn(3, 7, 64)
    logits = layer.router(x)
    top, idx = logits.topk(2, dim=-1)
    gates = top.softmax(-1)
    everyone = torch.stack([e(x) for e in layer.experts], dim=-2)  # (3, 7, experts, dim)
    picked = everyone.gather(-2, idx[..., None].expand(-1, -1, -1, 64))  # (3, 7, top_k, dim)
    expected = (picked * gates[..., None]).sum(-2)
    # allclose, not assert_close: the latter's first call imports torch.distributed (~1 s).
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-6)
