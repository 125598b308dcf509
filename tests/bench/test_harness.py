"""bench/harness.py and records.py: the exactness check runs the reference twice.

Where the plain step is bitwise reproducible (every CPU run here) the check stays bit for bit: a
loss one ulp away is a failure. Where it is not (injected here by a test-only workload whose loss
jitters from call to call, as nondeterministic kernels made the video DiT's plain step differ by
1.2e-7 on an H100), the records and the table say so, and say whether each baseline stays within
the reference's own difference.
"""
from __future__ import annotations

import math

import pytest
import torch

from chameleon_swap.bench import baselines as B
from chameleon_swap.bench.harness import SweepConfig, run_sweep, steps_per_workload
from chameleon_swap.bench.records import max_loss_diff
from chameleon_swap.bench.report import markdown
from chameleon_swap.workloads import get_workload
from chameleon_swap.workloads.base import Workload

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py

JITTER = 2.0 ** -10        # exactly representable steps, far above a loss's ulp
OFFSET = 2.0 ** -5


class _Perturbed(Workload):
    """llama-varlen (tiny), with its reported loss changed after the step:

    * ``jitter``: added on every other call to ``run`` (any baseline, the reference included), so
      two runs of the same step need not agree;
    * ``checkpointed``: ``"ulp"`` moves the loss of a model whose blocks are wrapped for
      recomputation one ulp up, a number adds that number.

    Only the number reported changes; the step itself (backward, gradients) is the workload's."""

    name = "perturbed"

    def __init__(self, jitter: float = 0.0, checkpointed=None) -> None:
        self.base = get_workload("llama-varlen", "tiny")
        self.jitter, self.checkpointed, self.calls = jitter, checkpointed, 0

    def build(self, device, dtype=torch.float32, seed=0):
        return self.base.build(device, dtype, seed)

    def batches(self, steps, device, seed=0):
        return self.base.batches(steps, device, seed)

    def block_lists(self, model):
        return self.base.block_lists(model)

    def run(self, model, batch):
        loss = self.base.run(model, batch)
        self.calls += 1
        if self.jitter and self.calls % 2:
            loss = loss + self.jitter
        if self.checkpointed is not None and any(isinstance(m, B.Checkpointed)
                                                 for m in model.modules()):
            loss = (torch.nextafter(loss, loss + 1) if self.checkpointed == "ulp"
                    else loss + self.checkpointed)
        return loss


def _sweep(workload: Workload, baselines, steps=4) -> dict:
    cfg = SweepConfig(workloads=["llama-varlen"], baselines=baselines, budgets=["50%"],
                      steps=steps, warmup=0, size="tiny")
    cfg.resolved = [workload]
    recs = run_sweep(cfg, {})
    return {r["baseline"]: r for r in recs}


def test_a_reproducible_reference_keeps_the_check_bit_for_bit():
    recs = _sweep(_Perturbed(checkpointed="ulp"), ["none", "full-recompute", "guard"])
    for r in recs.values():
        assert r["reference_reproducible"] is True and r["reference_max_diff"] == 0.0
        assert r["losses_within_reference"] is None
    assert recs["none"]["losses_identical"] is True
    assert recs["guard"]["losses_identical"] is True and recs["guard"]["losses_max_diff"] == 0.0
    # One ulp is a failure, however small.
    full = recs["full-recompute"]
    assert full["losses_identical"] is False and 0 < full["losses_max_diff"] < 1e-5
    md = markdown(list(recs.values()))
    assert "not bitwise reproducible" not in md
    row = next(line for line in md.splitlines() if "| full-recompute |" in line)
    assert row.endswith("| **no** |")


def test_a_reference_that_differs_from_itself_is_reported_with_its_max_diff():
    recs = _sweep(_Perturbed(jitter=JITTER, checkpointed=OFFSET),
                  ["none", "full-recompute", "guard"])
    for r in recs.values():
        assert r["reference_reproducible"] is False
        assert r["reference_max_diff"] == pytest.approx(JITTER, rel=1e-3)
    # guard only jitters as the reference does: within its difference, though not identical.
    guard = recs["guard"]
    assert guard["losses_within_reference"] is True
    assert guard["losses_max_diff"] <= guard["reference_max_diff"]
    # full-recompute is off by more than the reference ever is: reported as such.
    full = recs["full-recompute"]
    assert full["losses_identical"] is False and full["losses_within_reference"] is False
    assert full["losses_max_diff"] > OFFSET / 2
    md = markdown(list(recs.values()))
    assert f"reference not bitwise reproducible (max diff {JITTER:.3g})" in md
    rows = {b: next(line for line in md.splitlines() if f"| {b} |" in line)
            for b in ("guard", "full-recompute")}
    assert "within reference (max diff" in rows["guard"]
    assert "**no**: max diff" in rows["full-recompute"]
    assert "losses identical: no" not in md


def test_without_the_reference_there_is_no_check_and_no_repeat():
    w = _Perturbed()
    recs = _sweep(w, ["guard"], steps=2)
    assert recs["guard"]["losses_identical"] is None
    assert recs["guard"]["reference_reproducible"] is None
    # The probe's steps, then the two timed and two metered steps of guard: no repeat ran.
    probe = w.calls - 4
    assert 1 <= probe <= 2


def test_the_repeat_is_counted_in_the_progress_and_makes_no_record():
    cfg = SweepConfig(workloads=["llama-varlen"], baselines=["none", "guard"], budgets=["50%"],
                      steps=2, warmup=1, size="tiny")
    seen = []
    recs = run_sweep(cfg, {}, progress=seen.append)
    assert len(seen) == steps_per_workload(cfg) == 3 * (2 * 2 + 1)
    assert sum("none (repeat)" in s for s in seen) == 3
    assert sorted(r["label"] for r in recs) == ["guard", "none"]


def test_max_loss_diff():
    a = [torch.tensor(1.0), torch.tensor(2.0)]
    assert max_loss_diff(a, [torch.tensor(1.0), torch.tensor(2.5)]) == 0.5
    assert max_loss_diff(a, a) == 0.0
    assert max_loss_diff(a, a[:1]) is None and max_loss_diff([], []) is None
    # NaN wherever it appears (never "within" anything), whatever the order of the steps.
    nan = torch.tensor(float("nan"))
    assert math.isnan(max_loss_diff(a, [nan, torch.tensor(2.0)]))
    assert math.isnan(max_loss_diff(a, [torch.tensor(3.0), nan]))
