"""policy/memory.py: activation budgets derived from ``device_memory_limit``, on synthetic numbers.

The scenario is a 16-layer decoder with a 32k vocabulary whose step length changes: its weights
(3.8 GiB) are allocated when a step begins; each token saves 1.9 MB of activations plus its fp32
log-probabilities, and the rest of the step (the transient) is the weight gradients plus three
fp32 logits-sized tensors per token (logits, log-probabilities' gradient, logits' gradient), so it
grows linearly with tokens. The device is capped at 25.2 GiB: a 16k-token step needs more than
that with every activation kept, and fits easily with full recomputation.

A step is driven the way the engine drives it: ``begin_step`` with what is allocated,
``on_progress`` before each module (embedding, 16 layers, the head) with the bytes saved so far,
then the transient peak (after forward, with the budget then in force), then ``end_step``.
"""
from __future__ import annotations

import pytest

from chameleon_swap.policy.memory import DeviceMemoryBudget

GiB = 2**30
VOCAB = 32000
LAYERS = 16
STATE = int(3.8 * GiB)                     # weights, allocated when each step begins
CAP = int(25.2 * GiB)
WEIGHT_GRADS = STATE                       # gradients are None between steps (set_to_none)
LOGITS_PER_TOKEN = VOCAB * 4               # fp32
LAYER_PER_TOKEN = 1_900_000 // LAYERS      # saved activations per token and layer
CHECKPOINT_PER_TOKEN = LAYERS * 2048 * 4   # what full recomputation keeps: each layer's input
SCHEDULE = [16384, 8192, 12288, 16384, 4096, 12288]


def transient(tokens: int) -> int:
    return WEIGHT_GRADS + 3 * LOGITS_PER_TOKEN * tokens


def saved(tokens: int) -> int:
    return LAYERS * LAYER_PER_TOKEN * tokens + LOGITS_PER_TOKEN * tokens


def recompute_fits(tokens: int) -> bool:
    return STATE + CHECKPOINT_PER_TOKEN * tokens + transient(tokens) <= CAP


def run_step(mem: DeviceMemoryBudget, tokens: int, *, extra_transient: int = 0,
             progress: bool = True) -> dict:
    """One synthetic step; returns its budgets and report. The transient peak comes after
    forward, with whatever budget is in force then, and the engine holds resident activations
    to that budget (the guard copies out the rest)."""
    start_budget = budget = mem.begin_step(STATE)
    done = 0
    for _ in range(1 + LAYERS + 1):            # embedding, the layers, the head
        if progress:
            lowered = mem.on_progress(done)
            if lowered is not None:
                assert lowered < budget            # only ever lowered within a step
                budget = lowered
        if 0 < _ <= LAYERS:
            done += LAYER_PER_TOKEN * tokens
    done += LOGITS_PER_TOKEN * tokens
    assert done == saved(tokens)
    resident = min(done, budget)
    need = transient(tokens) + extra_transient
    report = mem.end_step(saved_bytes=done, peak_allocated=STATE + resident + need,
                          allocated_at_start=STATE, peak_resident=resident)
    return dict(start=start_budget, final=budget, report=report, transient=need)


def test_the_scenario_binds_and_recomputation_fits():
    for tokens in SCHEDULE:
        assert recompute_fits(tokens), tokens
    assert STATE + saved(16384) + transient(16384) > CAP      # keeping everything does not fit


@pytest.mark.parametrize("schedule", [SCHEDULE, SCHEDULE[::-1], [4096, 8192, 16384, 12288],
                                      [4096] * 3 + [16384]])
def test_rising_and_falling_lengths_stay_under_the_cap(schedule):
    mem = DeviceMemoryBudget(CAP)
    headroom = CAP - STATE
    for i, tokens in enumerate(schedule):
        r = run_step(mem, tokens)
        # The budget in force at the transient peak plus that transient fits under the cap.
        assert r["final"] + r["transient"] <= headroom, (i, tokens, r)
        assert not r["report"].tightened, (i, tokens, r)      # every prediction held
        assert r["report"].min_budget_bytes == r["final"]
        assert r["report"].transient_bytes == r["transient"]
        if 0 < i and tokens <= max(schedule[:i]):
            # ... and within the lengths seen, the budget is not thrown away: at least half of
            # what an oracle would give. (Past them the transient is scaled up in proportion to
            # the size, safe whatever share of it is fixed, so much less may be left.)
            assert r["final"] >= 0.5 * (headroom - r["transient"]), (i, tokens, r)


def test_a_step_larger_than_any_seen_lowers_its_budget_in_forward():
    mem = DeviceMemoryBudget(CAP)
    for tokens in (4096, 8192):
        run_step(mem, tokens)
    r = run_step(mem, 16384)
    # The budget it started with (assuming the previous step's size) would not have held ...
    assert r["start"] + transient(16384) > CAP - STATE, r
    # ... the one it was lowered to as forward revealed its size does.
    assert r["final"] < r["start"]
    assert r["final"] + transient(16384) <= CAP - STATE, r
    assert r["report"].predicted_transient_bytes >= transient(16384)


def test_without_progress_a_larger_step_is_known_only_from_its_start():
    """The mid-step lowering is what holds the cap above: the same steps with no progress calls
    keep the budget they started with, which is too large for the longer step."""
    mem = DeviceMemoryBudget(CAP)
    for tokens in (4096, 8192):
        run_step(mem, tokens, progress=False)
    r = run_step(mem, 16384, progress=False)
    assert r["final"] == r["start"]
    assert r["final"] + transient(16384) > CAP - STATE
    assert r["report"].tightened                  # measured above the prediction: a miss


def test_a_miss_tightens_the_following_steps_and_says_so():
    mem = DeviceMemoryBudget(CAP)
    for _ in range(3):
        run_step(mem, 8192)
    before = mem.predict_transient(saved(8192))
    safety = mem.safety
    extra = GiB                                   # a workspace the earlier steps did not need
    r = run_step(mem, 8192, extra_transient=extra)
    assert r["report"].tightened
    assert r["report"].predicted_transient_bytes == before
    assert r["report"].transient_bytes == transient(8192) + extra > before
    assert mem.safety > safety
    after = mem.predict_transient(saved(8192))
    assert after >= (transient(8192) + extra) * mem.safety - 1
    nxt = run_step(mem, 8192)                     # the next step of that size leaves more room
    assert nxt["final"] < r["final"]
    assert not nxt["report"].tightened


def test_out_of_memory_is_a_miss_and_a_plain_failure_teaches_nothing():
    mem = DeviceMemoryBudget(CAP)
    run_step(mem, 8192)
    start = mem.begin_step(STATE)
    mem.on_progress(saved(8192) // 2)
    r = mem.end_step(saved_bytes=saved(8192) // 2, peak_allocated=STATE + GiB,
                     allocated_at_start=STATE, peak_resident=GiB, failed=True)
    assert not r.tightened
    assert mem.begin_step(STATE) == start             # nothing learnt from a user's exception
    safety = mem.safety
    r = mem.end_step(saved_bytes=saved(8192) // 2, peak_allocated=STATE + GiB,
                     allocated_at_start=STATE, peak_resident=GiB, failed=True, out_of_memory=True)
    assert r.tightened and mem.safety > safety
    assert mem.begin_step(STATE) < start


def test_fragmentation_is_kept_free():
    plain, fragmented = DeviceMemoryBudget(CAP), DeviceMemoryBudget(CAP)
    for mem, gap in ((plain, 0), (fragmented, 300 * 2**20)):
        mem.begin_step(STATE)
        mem.end_step(saved_bytes=saved(8192), peak_allocated=STATE + GiB + transient(8192),
                     allocated_at_start=STATE, peak_resident=GiB, fragmentation_bytes=gap)
    assert plain.begin_step(STATE) - fragmented.begin_step(STATE) == 300 * 2**20


def test_first_step_keeps_half_of_what_is_free_and_the_user_budget_caps():
    assert DeviceMemoryBudget(10 * GiB).begin_step(2 * GiB) == 4 * GiB
    assert DeviceMemoryBudget(10 * GiB).begin_step(2 * GiB, user_budget=GiB) == GiB
    assert DeviceMemoryBudget(10 * GiB).begin_step(12 * GiB) == 0    # over the limit already
    assert DeviceMemoryBudget(10 * GiB).predict_transient(GiB) is None


def test_a_step_that_saves_nothing_does_not_reset_the_assumed_size():
    mem = DeviceMemoryBudget(CAP)
    run_step(mem, 16384)
    run_step(mem, 16384)
    before = mem.begin_step(STATE)
    mem.end_step(saved_bytes=0, peak_allocated=STATE + GiB, allocated_at_start=STATE,
                 peak_resident=0)                 # an eval step under no_grad
    assert mem.begin_step(STATE) == before


def test_prediction_interpolates_and_extrapolates_upwards():
    mem = DeviceMemoryBudget(CAP, margin=0.0)
    for size, t in ((100, 1000), (300, 2000)):
        mem.begin_step(0)
        mem.end_step(saved_bytes=size, peak_allocated=t, allocated_at_start=0, peak_resident=0)
    assert mem.predict_transient(50) == 1000          # smaller than any seen
    assert mem.predict_transient(200) == 1500         # the chord
    assert mem.predict_transient(600) == 4000         # scaled from the largest
    mem.begin_step(0)
    r = mem.end_step(saved_bytes=200, peak_allocated=2500, allocated_at_start=0, peak_resident=0)
    assert r.tightened and mem.safety == 1.25         # 2500 where 1500 was predicted: a miss
    # The chord from 200 to 300 falls to 2250 at 250; never below a smaller step's transient.
    assert mem.predict_transient(250) == 2500 * 1.25


@pytest.mark.parametrize("kwargs,name", [(dict(limit_bytes=-1), "limit_bytes"),
                                         (dict(limit_bytes=1.5), "limit_bytes"),
                                         (dict(limit_bytes=1, margin=-0.1), "margin"),
                                         (dict(limit_bytes=1, miss_growth=1.0), "miss_growth")])
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DeviceMemoryBudget(**kwargs)
