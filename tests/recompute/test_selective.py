"""Which ops' outputs selective checkpointing keeps, and the contexts reporting them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from _models import randn
from chameleon_swap.recompute import selective
from chameleon_swap.recompute.selective import saves_output, selective_contexts

aten = torch.ops.aten


def test_matmuls_and_attention_are_kept_the_rest_recomputed():
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert saves_output(op), op
    for op in (aten.gelu.default, aten.native_layer_norm.default, aten.add.Tensor,
               aten.native_dropout.default, aten._softmax.default, aten.view.default):
        assert not saves_output(op), op
    assert not saves_output(lambda x: x)       # not an aten op at all


@pytest.mark.parametrize("op_output", [True, False])
def test_the_contexts_report_each_kept_output_and_keep_gradients(monkeypatch, op_output):
    if op_output and not selective._OP_OUTPUT:
        pytest.skip("this torch does not pass op_output to the policy")
    monkeypatch.setattr(selective, "_OP_OUTPUT", op_output)
    w = randn(6, 4, seed=1).requires_grad_()
    x = randn(3, 5, 4, seed=2)

    def fn(x):
        h = torch.tanh(x @ w.t()).unsqueeze(1)                      # (3, 1 head, 5, 6)
        return F.scaled_dot_product_attention(h, h, h).sum()

    seen = []
    loss = checkpoint(fn, x, use_reentrant=False,
                      context_fn=lambda: selective_contexts(seen.append))
    loss.backward()
    g = w.grad.clone()
    w.grad = None
    ref = fn(x)
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(g, w.grad)
    shapes = [tuple(o.shape) if isinstance(o, torch.Tensor) else tuple(t.shape for t in o)
              for o in seen]
    assert shapes[0] == (15, 6)                  # x @ w.t(): one mm over the flattened rows
    # The fused attention kernel: its output and its logsumexp (all it returns), nothing else.
    assert len(shapes) == 2 and shapes[1][0] == (3, 1, 5, 6) and len(shapes[1]) == 2


def test_a_write_into_a_kept_output_is_seen_and_what_selective_would_do_with_it():
    # Selective checkpointing keeps a matmul's output; an op that then writes into it in place
    # makes the recompute raise in the middle of backward. MutationWatch, on a kept run, sees it.
    lin = torch.nn.Linear(4, 4)
    x = randn(2, 3, 4, seed=0).requires_grad_()

    def inplace(x):
        return F.relu(lin(x), inplace=True)

    def fresh(x):
        return F.relu(lin(x))
    with selective.MutationWatch() as w:
        out = inplace(x)
    assert w.unsafe
    with selective.MutationWatch() as w:
        out = fresh(x)
    assert not w.unsafe and not selective.aliases(w.outputs, out)
    with selective.MutationWatch() as w:
        out = lin(x)                                  # its output is the kept op's own
    assert not w.unsafe and selective.aliases(w.outputs, out)
    # What the watch guards against: PyTorch's own check, in backward.
    loss = checkpoint(lambda x: inplace(x).sum(), x, use_reentrant=False,
                      context_fn=lambda: selective_contexts(lambda out: None))
    with pytest.raises(RuntimeError, match="selective activation checkpoint has been mutated"):
        loss.backward()
    loss = checkpoint(lambda x: fresh(x).sum(), x, use_reentrant=False,
                      context_fn=lambda: selective_contexts(lambda out: None))
    loss.backward()


def test_a_kept_output_freed_is_not_mistaken_for_a_later_tensor_at_its_address():
    # A storage known by its address alone: a freed kept output's address came back for a later
    # intermediate, whose in-place write then read as a write into the kept output (a block of
    # a 6-block test model was read unsafe one run in three). Fifty tries: reuse is the rule.
    lin = torch.nn.Linear(4, 4)
    x = randn(2, 3, 4, seed=0)
    for _ in range(50):
        with selective.MutationWatch() as w:
            y = lin(x)
            del y                                  # the kept output dies
            z = torch.tanh(x)                      # a fresh intermediate (an address now free)
            z.mul_(2)
        assert not w.unsafe
