"""The simulator's ``hybrid`` policy: the hybrid planner on analytic traces."""
from __future__ import annotations

import pytest

from chameleon_swap.sim import analytic, block_policies, hardware, policies
from chameleon_swap.sim.models import ModelConfig

H100 = hardware.load("h100-sxm")


def _trace(seq=8192, layers=6, hidden=2048):
    cfg = ModelConfig(name="t", layers=layers, hidden=hidden, heads=hidden // 128,
                      kv_heads=hidden // 128, ffn=4 * hidden, vocab=32000, seq=seq, dtype="bf16")
    return analytic.generate(cfg, H100)


def test_hybrid_blocks_cover_each_layer():
    step = _trace().steps[0]
    blocks = block_policies.hybrid_blocks(step)
    assert len(blocks) == 6
    for blk in blocks:
        ts = step.tensors[blk.first_span:blk.end_span]
        assert {t.block for t in ts} == {step.tensors[blk.first_span].block}
        assert blk.input_bytes == sum(t.nbytes for t in ts if t.kind == "block_input") > 0
        assert blk.forward_seconds > 0


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.75])
def test_hybrid_holds_the_budget_and_beats_both_parents(frac):
    tr = _trace()
    natural = tr.steps[0].activation_bytes
    budget = int(natural * frac)
    res = {p: policies.run(tr, p, budget) for p in ("full-recompute", "chameleon", "hybrid")}
    hyb = res["hybrid"]
    assert hyb.peak_bytes <= budget
    full = res["full-recompute"]
    if full.peak_bytes <= budget:
        assert hyb.step_seconds <= full.step_seconds * (1 + 1e-9)
    assert hyb.step_seconds <= res["chameleon"].step_seconds * (1 + 1e-9)


def test_hybrid_without_block_structure_is_a_clear_error():
    step = _trace().steps[0]
    step.segment_block = None
    with pytest.raises(ValueError, match="block"):
        block_policies.hybrid_blocks(step)
