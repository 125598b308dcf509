"""Keep views (policy/keep_views.py): learnt on a step that kept every block, corrected by the
timed steps that ran in other mixes (the first step, which a view is measured on, runs slow)."""
from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

import chameleon_swap as cs
from chameleon_swap.planning.modes import Block
from chameleon_swap.planning.timeline import Profile, Span
from chameleon_swap.policy import keep_views
from chameleon_swap.policy.keep_views import KeepView

from _helpers import natural_peak, train_step
from _models import lm_batches, tiny_llama

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


def view(fwd=(1.0, 1.0, 1.0), bwd=(2.0, 2.0, 2.0), input_bytes=100) -> KeepView:
    # 2 saves: forward slots 0..2, backward slots 3..5 (as a profile counts them).
    prof = Profile(compute=tuple(fwd) + tuple(bwd), n_forward=2,
                   spans=(Span(40, 0, 4), Span(60, 1, 3)), d2h_bytes_per_s=1e9,
                   h2d_bytes_per_s=1e9)
    return KeepView(prof, [Block(0, 2, 1.5, input_bytes)], [0], input_bytes)


def step(fwd, bwd, recompute=0.0):
    """A timed step in another mix: its profile's compute and the blocks' first calls."""
    prof = SimpleNamespace(n_forward=len(fwd) - 1, compute=list(fwd) + list(bwd))
    calls = [SimpleNamespace(mode="full" if recompute else "keep", recompute_seconds=recompute)]
    return prof, calls


def corrected(v: KeepView, prof, calls, input_bytes):
    timed = keep_views.timed_compute(prof, calls)
    return timed and keep_views.corrected(v, timed, input_bytes)


def sums(v: KeepView):
    n = v.profile.n_forward
    return sum(v.profile.compute[:n + 1]), sum(v.profile.compute[n + 1:])


def test_a_view_within_ten_percent_of_the_step_stands():
    prof, calls = step([1.0, 1.05, 1.0], [2.0, 2.1, 2.0])
    assert corrected(view(), prof, calls, 100) is None


def test_another_size_s_view_within_ten_percent_is_returned_scaled_as_the_size_s_own():
    # A size planned from another size's view: the timed step confirms it, and it becomes the
    # size's own (scaled, its compute as it was), so the size's plans stop being stand-ins.
    prof, calls = step([2.0, 2.1, 2.0], [4.0, 4.2, 4.0])       # twice the view's, within 10%
    timed = keep_views.timed_compute(prof, calls)
    assert keep_views.corrected(view(), timed, 200) is None     # (its own: it stands)
    v = keep_views.corrected(view(), timed, 200, own=False)
    assert v.input_bytes == 200 and sums(v) == pytest.approx((6.0, 12.0))
    assert [sp.nbytes for sp in v.profile.spans] == [80, 120]


def test_forward_and_backward_are_corrected_apart_and_the_recompute_is_not_backward():
    # The step ran a recompute of 3 s inside a backward of 6 + 3 s: its backward is 6 s (the
    # view's), its forward 1.5 s where the view says 3 s.
    prof, calls = step([0.5, 0.5, 0.5], [3.0, 3.0, 3.0], recompute=3.0)
    v = corrected(view(), prof, calls, 100)
    assert sums(v) == pytest.approx((1.5, 6.0))
    assert v.blocks[0].forward_seconds == pytest.approx(0.75)   # forward times with forward
    assert [sp.nbytes for sp in v.profile.spans] == [40, 60]     # bytes untouched


def test_a_step_of_another_size_compares_with_the_view_scaled_to_it():
    # Twice the input bytes: the view scaled reads 6 s forward, 12 s backward; the step matches
    # its forward and runs its backward in 9 s.
    prof, calls = step([2.0, 2.0, 2.0], [3.0, 3.0, 3.0])
    v = corrected(view(), prof, calls, 200)
    assert v.input_bytes == 200 and sums(v) == pytest.approx((6.0, 9.0))
    assert [sp.nbytes for sp in v.profile.spans] == [80, 120]


def test_corrections_beyond_the_clamp_are_not_believed():
    prof, calls = step([10.0, 10.0, 10.0], [0.01, 0.01, 0.01])
    v = corrected(view(), prof, calls, 100)
    lo, hi = keep_views.CORRECTION_CLAMP
    assert sums(v) == pytest.approx((3.0 * hi, 6.0 * lo))
    # A step that cannot tell (no backward left once its recomputes are out) changes nothing.
    prof, calls = step([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], recompute=3.0)
    assert keep_views.timed_compute(prof, calls) is None


def test_the_first_timed_step_corrects_at_once_later_ones_by_their_median():
    timed = []
    assert keep_views.settled(timed, (3.0, 6.0)) == (3.0, 6.0)     # the slow first step's fix
    assert keep_views.settled(timed, (9.0, 1.0)) is None           # one more says nothing yet
    # Three: the median of each, forward and backward apart (an outlier cannot move it).
    assert keep_views.settled(timed, (3.3, 6.6)) == (3.3, 6.0)
    assert keep_views.settled(timed, (3.1, 90.0)) == (3.3, 6.6)
    assert len(timed) == keep_views.TIMED_KEPT                      # the last three are kept
    # The view a steady size settles on does not follow one noisy step.
    v = view()
    assert keep_views.corrected(v, keep_views.settled([(3.0, 6.0)] * 2, (6.0, 12.0)), 100) \
        is None


@pytest.mark.usefixtures("plans_land_by_the_next_step")
def test_a_slow_first_step_is_corrected_by_later_timed_steps_on_the_emulated_link():
    # The real clock: the first step (the keep view's) runs a backward slowed by 0.2 s (a
    # gradient hook sleeps once), as a cold first step does; the later steps recompute on a
    # link too slow to swap, and a timed one among them corrects the view the size plans from.
    model = tiny_llama(n_layers=3)
    batches = lm_batches(model, [24] * 6)
    budget = int(natural_peak(model, batches[0]) * 0.5)
    slow = [True]

    def first_step_slow(grad):
        if slow[0]:
            time.sleep(0.2)
        return grad
    model.layers[1].attn.wq.weight.register_hook(first_step_slow)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      emulate_link="10MB/s") as eng:
        train_step(model, batches[0], eng)
        slow[0] = False
        modes = eng._policy.modes
        key = modes.key
        first = sums(modes.views[key])[1]
        assert first > 0.2                         # the sleep is in the view's backward
        for b in batches[1:]:
            train_step(model, b, eng)
            assert eng.last_step.peak_resident_bytes <= budget
        assert any(s.block_modes[0] < 3 for s in eng.history)
        assert sums(modes.views[key])[1] < first - 0.1, (first, sums(modes.views[key]))


def test_thaw_corrects_every_cold_view_by_the_nearest_ones_factors_unclamped():
    # Views learnt on the engine's first step (cold) read 30x forward and 10x backward, as on
    # an H100 whose first step pinned host memory while it ran. A warm timed step at 200 bytes
    # (nearest: the 200-byte view) gives the factors; every cold view takes them, far beyond
    # CORRECTION_CLAMP, and is warm after; a warm view is left alone.
    from dataclasses import replace
    cold = {1: replace(view(fwd=(30.0,) * 3, bwd=(20.0,) * 3), cold=True),
            2: replace(view(fwd=(60.0,) * 3, bwd=(40.0,) * 3, input_bytes=200), cold=True),
            3: view(input_bytes=300)}
    assert keep_views.thaw(cold, (6.0, 12.0), 200)
    assert sums(cold[2]) == pytest.approx((6.0, 12.0))
    assert sums(cold[1]) == pytest.approx((3.0, 6.0))            # the same factors
    assert sums(cold[3]) == sums(view())                          # warm: untouched
    assert not any(v.cold for v in cold.values())
    assert cold[1].blocks[0].forward_seconds == pytest.approx(1.5 / 30)
    assert [sp.nbytes for sp in cold[1].profile.spans] == [40, 60]
    assert not keep_views.thaw(cold, (1.0, 1.0), 200)            # none cold: nothing to do
    assert keep_views.scaled(replace(view(), cold=True), 2.0, 200).cold   # scaling keeps it


def test_thaw_gives_the_blocks_their_own_factor_where_the_slots_read_gaps_outside_them():
    # On an H100 (HF Llama 4096x8, 50%) the first step's slots read its forward many times
    # over where its blocks, timed apart, did not; scaled by the slots' factor, the blocks read
    # a sixteenth of their forward or less, and every recompute measured against them 16x. Here
    # a cold view's first forward slot reads 60 s of a 3 s forward, its block 1.5 s as it runs.
    cold = {1: replace(view(fwd=(60.0, 1.0, 1.0)), cold=True)}
    assert keep_views.thaw(cold, (3.0, 6.0), 100, forwards={0: 1.5})
    assert sums(cold[1]) == pytest.approx((3.0, 6.0))               # the slots, as before
    assert cold[1].blocks[0].forward_seconds == pytest.approx(1.5)  # the block: its own
    # Without the step's own forwards, or with factors within SPLIT_TRUSTED of each other (on
    # the CPU a checkpointed forward runs about 0.7x a kept one), the slots' factor stands.
    cold = {1: replace(view(fwd=(60.0, 1.0, 1.0)), cold=True)}
    assert keep_views.thaw(cold, (3.0, 6.0), 100)
    assert cold[1].blocks[0].forward_seconds == pytest.approx(1.5 * 3 / 62)
    cold = {1: replace(view(), cold=True), 2: replace(view(input_bytes=200), cold=True)}
    assert keep_views.thaw(cold, (3.0, 6.0), 100, forwards={0: 1.05})
    assert [v.blocks[0].forward_seconds for v in cold.values()] == pytest.approx([1.5, 1.5])
    # A factor far off applies to every cold view alike, as the slots' does.
    cold = {1: replace(view(fwd=(60.0, 1.0, 1.0)), cold=True),
            2: replace(view(fwd=(60.0, 1.0, 1.0), input_bytes=200), cold=True)}
    assert keep_views.thaw(cold, (3.0, 6.0), 100, forwards={0: 0.75, 7: 9.0})   # (7: none)
    assert [v.blocks[0].forward_seconds for v in cold.values()] == pytest.approx([0.75, 0.75])


def test_a_ratio_reads_a_block_s_forward_at_no_less_than_half_the_step_s_own_timing():
    # A view whose block reads 10 ms, where the step timed its forward at 1 s and its recompute
    # at 0.9 s: against the view alone the recompute reads 90x (clamped to 16); against the
    # floor, 1.8x. A view that reads above the floor stands (the CPU's kept forward, with hooks).
    calls = [SimpleNamespace(block=0, mode="full", recompute_seconds=0.9)]
    tiny = KeepView(view().profile, [Block(0, 2, 0.01, 100)], [0], 100)
    assert keep_views.full_ratio(tiny, calls, 100) == keep_views.FULL_RATIO_CLAMP[1]
    assert keep_views.full_ratio(tiny, calls, 100, {0: 1.0}) == pytest.approx(1.8)
    assert keep_views.full_ratio(view(), calls, 100, {0: 1.0}) == pytest.approx(0.6)
    probe = SimpleNamespace(block=0, mode="selective", recompute_seconds=0.2, selective_bytes=50)
    assert keep_views.selective_ratios(tiny, probe, 100)[1] == pytest.approx(20)
    assert keep_views.selective_ratios(tiny, probe, 100, {0: 1.0})[1] == pytest.approx(0.4)


def test_spans_that_copy_a_parameter_keep_their_size_when_scaled():
    v = keep_views.scaled(view(), 1.0, 100)                 # (a view with no fixed spans)
    assert [sp.nbytes for sp in keep_views.scaled(v, 2.0, 200).profile.spans] == [80, 120]
    fixed = KeepView(v.profile, v.blocks, v.block_ids, 100, fixed=(True, False), keys=("a", "b"))
    s = keep_views.scaled(fixed, 2.0, 200)
    assert [sp.nbytes for sp in s.profile.spans] == [40, 120] and s.fixed == (True, False)
    assert s.keys == ("a", "b")             # its tensors' keys, for a mix's plan by keys
    assert keep_views.scaled(s, 1.0, 200, seconds=0.5).fixed == (True, False)   # (a correction)


def _trace_view(name: str, n_blocks: int = 8) -> KeepView:
    from pathlib import Path

    from chameleon_swap.runtime.trace import load
    tr = load(Path(__file__).resolve().parents[1] / "fixtures" / "gpu-traces" / name)
    prof = tr.steps[-1].profile(*tr.link)
    lo, per = 2, (prof.n_forward - 6) // n_blocks
    blocks = [Block(lo + b * per, lo + (b + 1) * per,
                    float(sum(prof.compute[lo + b * per:lo + (b + 1) * per])),
                    prof.spans[lo + b * per].nbytes) for b in range(n_blocks)]
    return KeepView(prof, blocks, list(range(n_blocks)), prof.spans[lo].nbytes)


def test_on_the_gpu_traces_a_view_scaled_with_its_fixed_spans_plans_as_the_size_s_own():
    # The engine's traces of HF Llama 4096x8 on an H100 at 8k and 16k tokens (bf16 autocast):
    # 74 of 243 saved tensors (3.3 GiB, the weights' casts) are the same size at both. Scaled
    # in proportion, 8k's view reads 37.2 GiB at 16k (it holds 33.9), and at a 75% budget its
    # mode plan recomputes a block that the 16k view's own plan keeps; with those spans fixed
    # (here marked from the two traces; the engine marks them by their parameters' shapes) it
    # reads the 16k step's bytes and plans its mix.
    from chameleon_swap.planning.modes import plan_hybrid
    from chameleon_swap.planning.timeline import unmoved_peak
    v8, v16 = _trace_view("h4096-unreached-8192"), _trace_view("h4096-unreached-16384")
    same = tuple(a.nbytes == b.nbytes for a, b in zip(v8.profile.spans, v16.profile.spans))
    assert sum(same) == 74
    total = lambda v: sum(sp.nbytes for sp in v.profile.spans)   # noqa: E731
    linear = keep_views.scaled(v8, 2.0, v8.input_bytes * 2)     # twice the tokens
    fixed = keep_views.scaled(KeepView(v8.profile, v8.blocks, v8.block_ids, v8.input_bytes,
                                       fixed=same), 2.0, v8.input_bytes * 2)
    assert total(linear) > 1.09 * total(v16)
    assert total(fixed) == pytest.approx(total(v16), rel=1e-6)
    budget = int(unmoved_peak(v16.profile) * 0.75)
    own = plan_hybrid(v16.profile, v16.blocks, budget).counts()
    assert own == (8, 0, 0)
    assert plan_hybrid(fixed.profile, fixed.blocks, budget).counts() == own
    assert plan_hybrid(linear.profile, linear.blocks, budget).counts() != own


def test_under_autocast_the_weights_casts_are_marked_fixed_and_scale_to_the_other_length():
    # A real model on the CPU under bf16 autocast, two lengths, each learnt on an engine's first
    # (timed, all kept) step: the spans marked fixed (by the parameters' shapes) are exactly those
    # of equal size at both lengths, and the shorter view scaled to the longer holds its bytes.
    import torch
    model = tiny_llama(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256)
    views = {}
    for T in (64, 128):
        batch = lm_batches(model, [T], B=2)[0]
        with cs.Chameleon(10**12, device="cpu", min_tensor_bytes=0, model=model) as eng:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                train_step(model, batch, eng)
            p, calls = eng._profiler.last_profile, eng._profiler.last_profile.blocks
            modes = eng._policy.modes
            seen: set = set()
            firsts = [c for c in calls if not (c.block in seen or seen.add(c.block))]
            views[T] = keep_views.learn(p, firsts, 1e9, 1e9, modes.eligible,
                                        firsts[0].input_bytes,
                                        param_shapes=modes.views.param_shapes)
    a, b = views[64], views[128]
    assert len(a.profile.spans) == len(b.profile.spans) and any(a.fixed)
    same = tuple(x.nbytes == y.nbytes for x, y in zip(a.profile.spans, b.profile.spans))
    assert a.fixed == same == b.fixed
    s = keep_views.scaled(a, b.input_bytes / a.input_bytes, b.input_bytes)
    # (within 1% a span: the token ids are one longer than the sequence, 1040 B -> 2064 B)
    assert all(x.nbytes == pytest.approx(y.nbytes, rel=0.01)
               for x, y in zip(s.profile.spans, b.profile.spans))
    linear = keep_views.scaled(replace(a, fixed=()), b.input_bytes / a.input_bytes, b.input_bytes)
    assert sum(sp.nbytes for sp in linear.profile.spans) > \
        1.05 * sum(sp.nbytes for sp in b.profile.spans)


def test_the_full_recompute_ratio_is_of_sums_not_a_mean_of_each_block_s():
    # A view whose forward is split unevenly among its blocks (the last one read small: its
    # waits taken out, or scaled so) against recomputes that ran evenly: the ratio of sums
    # says what recomputing those blocks costs; a mean of each block's ratio read 2.5 (clamped
    # to 2.0), as an H100 run's did while its recomputes summed to 1.1-1.2x the views'.
    blocks = [Block(0, 1, f, 100) for f in (0.010, 0.010, 0.010, 0.002)]
    v = KeepView(view().profile, blocks, [0, 1, 2, 3], 100)
    calls = [SimpleNamespace(mode="full", recompute_seconds=0.008, block=b) for b in range(4)]
    assert keep_views.full_ratio(v, calls, 100) == pytest.approx(0.032 / 0.032)
    assert keep_views.full_ratio(v, calls, 200) == pytest.approx(0.5)        # scaled to the size
    assert keep_views.full_ratio(v, calls[:1], 100) == pytest.approx(0.8)    # those blocks only
    slow = [SimpleNamespace(mode="full", recompute_seconds=1.0, block=0)]
    assert keep_views.full_ratio(v, slow, 100) == keep_views.FULL_RATIO_CLAMP[1]
    assert keep_views.full_ratio(replace(v, cold=True), calls, 100) is None
    kept = [SimpleNamespace(mode="keep", recompute_seconds=None, block=0)]
    assert keep_views.full_ratio(v, kept, 100) is None
