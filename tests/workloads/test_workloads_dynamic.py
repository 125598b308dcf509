"""Every benchmark workload at its tiny preset: deterministic builds and schedules, finite losses
and gradients, a schedule that really changes, bitwise-equal activation checkpointing of its
blocks, and bitwise-equal training under the engine at 30% of the natural activation peak."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

import chameleon_swap as cs
from chameleon_swap.workloads import get_workload

from _helpers import assert_bitwise, compare, train_step

BUILTIN = ["llama-varlen", "moe", "layerdrop", "video-dit", "mixed"]
HF = ["hf:llama", "hf:gpt2", "hf:qwen2"]
ALL = BUILTIN + HF


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


_cache: dict = {}


def workload(name):
    if name.startswith("hf:"):
        pytest.importorskip("transformers")
    if name not in _cache:
        _cache[name] = get_workload(name, "tiny")
    return _cache[name]


def train_batches(w, n=8, seed=0):
    return [b for b in w.batches(n, "cpu", seed) if b.train]


def tensors_of(batch):
    return [v for v in (*batch.args, *batch.kwargs.values()) if isinstance(v, torch.Tensor)]


def param_grads(model):
    """Gradients by parameter order, which wrapping blocks in place keeps (names change)."""
    return {i: None if p.grad is None else p.grad.clone() for i, p in enumerate(model.parameters())}


def keep_matmuls_and_attention():
    """Selective checkpointing's usual policy: save matmul and attention outputs, recompute the
    rest."""
    aten = torch.ops.aten
    keep = {getattr(aten, n).default for n in ("mm", "addmm", "bmm", "baddbmm",
                                                "_scaled_dot_product_flash_attention_for_cpu")
            if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class Checkpointed(torch.nn.Module):
    """What the recompute baselines put in place of each block."""

    def __init__(self, block, selective=False):
        super().__init__()
        self.block = block
        self.selective = selective

    def forward(self, *args, **kwargs):
        if self.selective:
            return checkpoint(self.block, *args, use_reentrant=False,
                              context_fn=keep_matmuls_and_attention, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


# --------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("name", ALL)
def test_build_is_deterministic_and_leaves_the_global_rng_alone(name):
    w = workload(name)
    rng = torch.get_rng_state()
    a, b, c = w.build("cpu", seed=3), w.build("cpu", seed=3), w.build("cpu", seed=4)
    assert torch.equal(rng, torch.get_rng_state())
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("name", ALL)
def test_batches_are_deterministic(name):
    w = workload(name)
    rng = torch.get_rng_state()
    a, b, c = w.batches(8, "cpu", seed=5), w.batches(8, "cpu", seed=5), w.batches(8, "cpu", seed=6)
    assert torch.equal(rng, torch.get_rng_state())
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        assert (x.tag, x.train, x.tokens, x.optimizer_step) == (y.tag, y.train, y.tokens, y.optimizer_step)
        assert x.kwargs.keys() == y.kwargs.keys()
        tx, ty = tensors_of(x), tensors_of(y)
        assert len(tx) == len(ty) and all(torch.equal(p, q) for p, q in zip(tx, ty))

    def same(x, z):
        tx, tz = tensors_of(x), tensors_of(z)
        return all(p.shape == q.shape and torch.equal(p, q) for p, q in zip(tx, tz))
    assert not all(same(x, z) for x, z in zip(a, c))  # another seed, another schedule


# --------------------------------------------------------------------------- losses and grads
@pytest.mark.parametrize("name", ALL)
def test_loss_and_grads_are_finite(name):
    w = workload(name)
    model = w.build("cpu", seed=0)
    for batch in train_batches(w, 3):
        model.zero_grad(set_to_none=True)
        loss = w.loss(model, batch)
        assert loss.dim() == 0 and torch.isfinite(loss)
        loss.backward()
        named = dict(model.named_parameters())
        used = {n for n, p in named.items() if p.grad is not None}
        for n in used:
            assert torch.isfinite(named[n].grad).all(), n
        if name == "layerdrop":
            # Exactly the kept blocks (and everything outside the blocks) get gradients.
            keep = batch.kwargs["keep"]
            expected = {n for n in named
                        if not n.startswith("layers.") or int(n.split(".")[1]) in keep}
            assert used == expected
        elif name == "moe":
            # Everything but the experts; of those, the ones that got tokens.
            assert {n for n in named if ".experts." not in n} <= used
            assert any(".experts." in n for n in used)
        else:
            assert used == set(named), set(named) - used


# --------------------------------------------------------------------------- dynamic schedules
def shape_key(batch):
    return (tuple(tuple(t.shape) for t in tensors_of(batch)), repr(batch.kwargs.get("keep")),
            batch.train)


@pytest.mark.parametrize("name", ALL)
def test_schedule_is_dynamic(name):
    w = workload(name)
    batches = w.batches(8, "cpu", seed=0)
    assert len({b.tag for b in batches}) >= 2
    assert len({shape_key(b) for b in batches}) >= 2
    assert all(b.tokens > 0 for b in batches)


def test_moe_routing_changes_between_steps():
    w = workload("moe")
    model = w.build("cpu", seed=0)
    counts = []
    with torch.no_grad():
        for b in w.batches(8, "cpu", seed=0):
            w.loss(model, b)
            counts.append(tuple(model.last_expert_counts))
    assert len(set(counts)) >= 2
    # Routing, not only the token count, changes: the share of the busiest expert moves.
    shares = {round(max(c) / sum(c), 6) for c in counts}
    assert len(shares) >= 2


def test_video_dit_mixes_images_and_videos_and_counts_patches():
    w = workload("video-dit")
    cfg = w.config
    batches = w.batches(16, "cpu", seed=0)
    kinds = {b.tag.split()[0] for b in batches}
    assert kinds == {"image", "video"}
    for b in batches:
        xt, t, text, noise = b.args
        B, C, T, H, W = xt.shape
        assert b.tag.endswith(f"{T}x{H}x{W}") and (T == 1) == b.tag.startswith("image")
        assert b.tokens == B * T * (H // cfg.patch) * (W // cfg.patch)
        assert noise.shape == xt.shape and t.shape == (B,) and t.dtype == torch.long
        assert text.shape == (B, cfg.text_len, cfg.text_dim)


def test_layerdrop_keeps_a_nonempty_increasing_subset():
    w = workload("layerdrop")
    keeps = [b.kwargs["keep"] for b in w.batches(32, "cpu", seed=0)]
    n = w.config.n_layers
    for keep in keeps:
        assert keep and list(keep) == sorted(set(keep)) and all(0 <= i < n for i in keep)
    assert len(set(keeps)) >= 3
    assert any(len(k) < n for k in keeps) and any(len(k) > 1 for k in keeps)


def test_mixed_accumulates_and_evaluates_on_schedule():
    w = get_workload("mixed", "tiny", accum_steps=3, eval_every=2)
    batches = w.batches(17, "cpu", seed=0)
    pattern = "".join("e" if not b.train else ("S" if b.optimizer_step else "t") for b in batches)
    # Groups of 3 micro-batches (step on the last), an eval after every 2nd group, and the last
    # batch of a cut-off schedule still steps.
    assert pattern == "ttSttSettSttSettS"
    evals = [b for b in batches if not b.train]
    assert all(b.args[0].shape[1] == w.config.seq_len and b.tag.startswith("eval") for b in evals)


def test_mixed_scales_micro_batch_losses_but_not_eval_losses():
    w = get_workload("mixed", "tiny", accum_steps=4)
    model = w.build("cpu", seed=0)
    b = w.batches(1, "cpu", seed=0)[0]
    with torch.no_grad():
        full = model(*b.args)
        assert torch.equal(w.loss(model, b), full / 4)
        b.train = False
        assert torch.equal(w.loss(model, b), full)


# --------------------------------------------------------------------------- recompute baseline
@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
@pytest.mark.parametrize("name", ALL)
def test_checkpointed_blocks_are_bitwise_equal(name, selective):
    w = workload(name)
    ref, wrapped = w.build("cpu", seed=1), w.build("cpu", seed=1)
    lists = w.block_lists(wrapped)
    assert lists and all(isinstance(l, torch.nn.ModuleList) and len(l) > 0 for l in lists)
    n_params = sum(1 for _ in wrapped.parameters())
    for blocks in lists:
        for i in range(len(blocks)):
            blocks[i] = Checkpointed(blocks[i], selective)
    assert sum(1 for _ in wrapped.parameters()) == n_params
    calls = []
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1))
             for l in lists for m in l]
    for batch in train_batches(w, 8)[:2]:
        for m in (ref, wrapped):
            m.zero_grad(set_to_none=True)
        loss_ref, loss = w.loss(ref, batch), w.loss(wrapped, batch)
        loss_ref.backward()
        loss.backward()
        assert_bitwise(loss_ref.detach(), param_grads(ref), loss.detach(), param_grads(wrapped))
    for h in hooks:
        h.remove()
    assert calls, "the model never called its blocks through the ModuleList"


# --------------------------------------------------------------------------- under the engine
@pytest.mark.parametrize("name", ALL)
def test_engine_at_30_percent_is_bitwise_and_holds_the_budget(name):
    w = workload(name)
    model = w.build("cpu", seed=0)
    batches = train_batches(w, 8)[:4]
    history, peaks, budget = compare(model, batches, 0.3, loss_fn=w.loss, policy="chameleon")
    assert budget > 0 and len(history) == len(batches)
    assert all(st.peak_resident_bytes <= budget for st in history)
    assert sum(st.offloaded_bytes for st in history) > 0  # the budget really made it swap


def test_mixed_schedule_with_eval_steps_under_the_engine():
    """The harness's loop: train steps with backward, eval steps under no_grad, all inside
    eng.step(); losses bitwise equal to the run without the engine."""
    w = workload("mixed")
    ref, test = w.build("cpu", seed=0), w.build("cpu", seed=0)
    batches = w.batches(10, "cpu", seed=0)
    assert sum(not b.train for b in batches) == 2
    with cs.Chameleon(20_000, device="cpu", policy="chameleon", min_tensor_bytes=0) as eng:
        for b in batches:
            if b.train:
                l_ref = train_step(ref, b, None, w.loss)
                l = train_step(test, b, eng, w.loss)
            else:
                with torch.no_grad():
                    l_ref = w.loss(ref, b)
                    with eng.step():
                        l = w.loss(test, b)
                assert eng.last_step.saved_bytes == 0
            assert torch.equal(l_ref, l), b.tag
            assert eng.last_step.peak_resident_bytes <= 20_000
            if b.optimizer_step and b.train:
                for p, q in zip(ref.parameters(), test.parameters()):
                    assert (p.grad is None) == (q.grad is None)
                    assert p.grad is None or torch.equal(p.grad, q.grad)
                ref.zero_grad(set_to_none=True)
                test.zero_grad(set_to_none=True)
        assert eng.host_bytes_in_use == 0
