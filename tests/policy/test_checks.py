"""Every plan is checked (policy/checks.py): predictions, misses, corrections and replanning.

The unit tests run on numbers given by hand (a steady clock by construction); their twins run
the engine on the real clock with the emulated link (``emulate_link=``), which gives a 2-core CPU
a GPU's ratio of bytes to compute, so that copies really stall and recomputing really pays."""
from __future__ import annotations

import warnings

import pytest
import torch

import chameleon_swap as cs
from chameleon_swap.policy import checks
from chameleon_swap.policy.checks import PlanChecks, compute_factor, fit_factor

from _helpers import assert_bitwise, compare, grads, natural_peak, train_step
from _models import lm_batches, tiny_llama, tokens

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


# --------------------------------------------------------------------------- by hand
def test_two_misses_in_a_row_of_one_key_call_for_a_replan():
    c = PlanChecks()
    assert not c.observe("a", 1.0, 1.5)             # first miss
    assert not c.observe("b", 1.0, 1.5)             # another key counts apart
    assert c.observe("a", 1.0, 1.5)                 # second miss of "a": replan
    assert not any(c.observe("a", 1.0, 9.0) for _ in range(checks.COOLDOWN))   # cooling down
    assert not c.observe("a", 1.0, 1.5)             # counting starts again
    assert not c.observe("a", 1.0, 1.05)            # within 10%: a hit resets ...
    assert not c.observe("a", 1.0, 1.5)             # ... so this is a first miss again
    assert not c.observe("a", 1.0, 1.0)             # a hit
    assert c.observe("a", 1.0, 0.5) is False and c.observe("a", 1.0, 0.5)   # faster misses too
    assert not c.observe("a", None, 9.0)            # no prediction, nothing to check


def test_the_cost_of_a_move_is_timed_as_a_running_mean_and_capped():
    from types import SimpleNamespace as NS
    c = PlanChecks()
    assert c.move_seconds() == 0.0
    c.learn_moves(NS(move_seconds_each=None))                 # nothing moved, or CUDA: no news
    assert c.move_measured is None
    c.learn_moves(NS(move_seconds_each=4e-4))                 # the first step that moved
    assert c.move_seconds() == pytest.approx(4e-4)
    c.learn_moves(NS(move_seconds_each=2e-4))
    assert c.move_seconds() == pytest.approx(3e-4)            # half the newest, half the mean
    for _ in range(20):
        c.learn_moves(NS(move_seconds_each=1.0))              # a stalled machine's reading
    assert c.move_seconds() == checks.MAX_MOVE_SECONDS        # not believed beyond this


def test_a_step_that_timed_few_moves_weighs_in_proportion():
    # A 4-block Llama running all full: steps that moved one small tensor each swung the mean
    # by a third and more, and each swing over 30% planned the size again (50-90 ms a time).
    from types import SimpleNamespace as NS
    c = PlanChecks()
    full = checks.MOVES_FULL_WEIGHT
    c.learn_moves(NS(move_seconds_each=4e-4, moved=200))       # the first: taken as it is
    c.learn_moves(NS(move_seconds_each=1e-4, moved=1))         # one tensor, timed low
    assert c.move_seconds() == pytest.approx(4e-4 - 0.5 / full * 3e-4)
    assert abs(c.move_seconds() / 4e-4 - 1) < 0.05
    before = c.move_seconds()
    c.learn_moves(NS(move_seconds_each=1e-4, moved=full))      # enough moves: half and half
    assert c.move_seconds() == pytest.approx(0.5 * before + 0.5 * 1e-4)


def test_jitter_of_a_few_milliseconds_is_no_miss():
    c = PlanChecks()
    assert not any(c.observe("a", 0.010, 0.014) for _ in range(5))   # 40%, but 4 ms


def test_a_what_if_link_is_never_checked():
    c = PlanChecks()
    c.enabled = False
    assert not any(c.observe("a", 1.0, 9.0) for _ in range(5))


def test_the_link_is_taken_from_timed_copies_per_direction():
    c = PlanChecks()
    link = c.correct_link((1e9, 1e9), {"d2h": (10**8, 1.0), "h2d": (4 * 10**8, 1.0)})
    assert link == (1e8, 4e8) and c.link == link


def test_untimed_copies_fit_the_link_to_the_measured_stall():
    # Stall of a model where 1 GB crosses a link of 1 GB/s x factor while 0.5 s of compute hides
    # it: max(0, 1/f - 0.5). A measured stall of 1.5 s means the link runs at half speed.
    stall_at = lambda f: max(0.0, 1.0 / f - 0.5)              # noqa: E731
    assert fit_factor(stall_at, 1.5) == pytest.approx(0.5, rel=1e-3)
    c = PlanChecks()
    assert c.correct_link((1e9, 2e9), {}, stall_at, 1.5) == pytest.approx((5e8, 1e9), rel=1e-3)
    c2 = PlanChecks()
    assert c2.correct_link((1e9, 2e9), {}, stall_at, 0.1) == (1e9, 2e9)   # less stall: kept


def test_compute_is_corrected_by_measured_over_predicted_and_clamped():
    assert compute_factor(1.2, 0.2, 0.6, 0.1) == pytest.approx(2.0)
    assert compute_factor(100.0, 0.0, 1.0, 0.0) == checks.COMPUTE_CLAMP[1]
    assert compute_factor(1.0, 2.0, 1.0, 0.0) == 1.0                      # nothing left to scale


# --------------------------------------------------------------------------- the real clock
def test_a_step_that_pinned_through_a_tenth_of_it_is_read_as_pinned():
    from types import SimpleNamespace as NS
    assert checks.pinned(NS(step_seconds=0.5, extra={"host_alloc_seconds": 0.06}))
    assert not checks.pinned(NS(step_seconds=0.5, extra={"host_alloc_seconds": 0.04}))
    assert not checks.pinned(NS(step_seconds=0.5, extra={}))       # (a profile made by hand)
    assert not checks.pinned(NS(step_seconds=0.0, extra={"host_alloc_seconds": 1.0}))


def _fake_policy(views_version: int):
    from types import SimpleNamespace as NS

    def replan(*a, **kw):
        raise AssertionError("no correction was due")
    modes = NS(key=5, plans={}, replan=replan, view_stamp=lambda key: (key, views_version))
    return NS(checks=PlanChecks(), modes=modes, pinned_step=False)


def test_a_miss_of_a_plan_from_views_changed_since_corrects_nothing_and_counting_restarts():
    # An H100 (HF Llama 4096x8): a size planned from the slow first step's views missed twice;
    # the views were corrected in between and the size planned again from them, right; the
    # second miss then scaled that plan's compute by 0.25 (measured over the old prediction),
    # and it predicted 0.11 s for steps of 0.44 s. A plan carries its views' version.
    from types import SimpleNamespace as NS
    profile = NS(step_seconds=0.44, extra={}, waits=[], blocks=[])
    pol = _fake_policy(views_version=3)
    pol.modes.input_bytes = 100
    pol.ex = NS(stats=NS(offloaded_tensors=0))
    pred = NS(total_seconds=2.8, stall_seconds=0.0)
    plan = NS(views_version=(5, 2), input_bytes=100, hybrid=NS(predicted=pred))
    pol.modes.plans[5] = plan
    pol.checks.misses[("modes", 5)] = 1             # one miss already
    checks.check_step(pol, profile, None, plan, predicted=2.8)
    assert ("modes", 5) not in pol.checks.misses    # no replan, nothing counted
    plan.views_version = (5, 3)                     # made from the view as it is: counted
    checks.check_step(pol, profile, None, plan, predicted=2.8)
    assert pol.checks.misses[("modes", 5)] == 1
    # A step slowed by pinning is not a miss either (the first of a row: ``exempt``).
    slowed = NS(step_seconds=0.44, extra={"host_alloc_seconds": 0.3}, signature="s", blocks=[])
    pol.pinned_step = pol.checks.exempt(slowed, 5)
    checks.check_step(pol, slowed, None, plan, predicted=2.8)
    assert pol.checks.misses[("modes", 5)] == 1


def test_only_the_first_of_a_row_of_steps_that_pinned_is_exempt():
    # The real-clock twin: test_a_size_whose_steps_pin_every_visit_is_still_checked
    # (tests/policy/test_block_modes.py).
    from types import SimpleNamespace as NS
    slow = NS(step_seconds=0.5, extra={"host_alloc_seconds": 0.3}, signature="a")
    fine = NS(step_seconds=0.5, extra={}, signature="a")
    c = PlanChecks()
    assert c.exempt(slow, 5)                 # a first visit that pinned: its own
    assert not c.exempt(slow, 5)             # ... pinning again: what the plan costs
    assert not c.exempt(slow, 5)
    assert c.exempt(slow, 6)                 # another size counts apart
    assert not c.exempt(fine, 5) and c.exempt(slow, 5)   # a clean step ends the row
    assert c.exempt(slow) and not c.exempt(slow)         # without model=: by signature
    assert c.exempt(NS(step_seconds=0.5, extra={"host_alloc_seconds": 0.3}, signature="b"))
    for key in (5, 6, None):                 # kept only while a key pins: no key left after
        c.exempt(fine, key)
    c.exempt(NS(step_seconds=0.5, extra={}, signature="b"))
    assert not c.pinning


def test_a_key_s_first_steps_beside_the_planner_are_exempt_in_a_row_or_not():
    # The real-clock twin: test_steps_of_one_size_slowed_by_the_planner_in_a_row_steer_no_plan
    # (tests/policy/test_block_modes.py).
    from types import SimpleNamespace as NS

    from chameleon_swap.policy import checks
    busy = NS(step_seconds=0.5, extra={"planner_seconds": 0.3}, signature="a")
    fine = NS(step_seconds=0.5, extra={"planner_seconds": 0.04}, signature="a")
    c = PlanChecks()
    assert c.exempt(busy, 5) and c.exempt(busy, 5)     # a row: each left out
    assert not c.exempt(fine, 5) and c.exempt(busy, 5)  # not in a row: left out too
    assert not c.exempt(busy, 5)                       # past the allowance: what it costs
    assert c.exempt(busy, 6) and c.exempt(busy)        # another size, a signature: apart
    assert checks.PLANNER_EXEMPT_STEPS == 3
    # Pinning keeps its row rule beside it: a pinning step past the allowance is exempt as
    # the first of its row.
    both = NS(step_seconds=0.5, extra={"planner_seconds": 0.3, "host_alloc_seconds": 0.3})
    assert c.exempt(both, 5) and not c.exempt(both, 5)
    # Counted for a bounded number of keys (without model= a run whose sequences stay new has
    # a key a step): the oldest is forgotten.
    for k in range(checks.PLANNER_EXEMPT_KEYS + 10):
        assert c.exempt(NS(step_seconds=0.5, extra={"planner_seconds": 0.3}, signature=k))
    assert len(c.contended_steps) == checks.PLANNER_EXEMPT_KEYS


def test_a_step_s_timed_recomputes_are_left_out_of_its_compute_correction():
    # The real-clock twin: test_mixes_are_ranked_by_what_they_ran_at_on_the_emulated_link
    # (tests/policy/test_block_modes.py), whose recomputes sleep.
    from types import SimpleNamespace as NS
    pol = _fake_policy(views_version=0)
    pol.modes.input_bytes = 100
    pol.ex = NS(stats=NS(offloaded_tensors=0))
    plan = NS(input_bytes=100, hybrid=NS(predicted=NS(total_seconds=0.112, stall_seconds=0.0),
                                         recompute_seconds=0.012))
    slow = [NS(mode="full", recompute_seconds=0.041) for _ in range(4)] + [NS(mode="keep")]
    step = NS(step_seconds=0.220, blocks=slow)
    # The recomputes ran 164 ms where 12 were predicted; the rest ran 56 ms against 100.
    assert checks._step_factor(pol, plan, step, 0.0) == pytest.approx(0.056 / 0.100)
    # Recomputes not timed (a lightweight step): the whole step, as before.
    untimed = NS(step_seconds=0.220, blocks=[NS(mode="full", recompute_seconds=None)] * 4)
    assert checks._step_factor(pol, plan, untimed, 0.0) == pytest.approx(0.220 / 0.112)


def test_a_correction_is_what_the_misses_agree_on_not_one_step():
    c = PlanChecks()
    assert not c.observe("a", 1.0, 1.3, factor=1.3)
    assert c.observe("a", 1.0, 2.0, factor=2.0)     # a spike: the second miss
    assert c.agreed("a") == 1.3                      # what both steps say, not the spike's 2
    assert c.agreed("a") == 1.0                      # (taken: nothing left to agree on)
    c = PlanChecks()
    assert not c.observe("b", 1.0, 0.6, factor=0.6)
    assert c.observe("b", 1.0, 0.8, factor=0.8)
    assert c.agreed("b") == 0.8
    c = PlanChecks()
    assert not c.observe("c", 1.0, 1.5, factor=1.5)
    assert c.observe("c", 1.0, 0.7, factor=0.7)      # they disagree: no compute correction
    assert c.agreed("c") == 1.0
    c = PlanChecks()
    assert not c.observe("d", 1.0, 1.5, factor=1.5)
    assert not c.observe("d", 1.0, 1.02, factor=1.02)    # a hit: the miss before is forgotten
    assert c.observe("d", 1.0, 1.4, factor=1.4) is False and c.agreed("d") == 1.4


def _run(model, batches, budget, **kw):
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model, **kw) as eng:
        for b in batches:
            train_step(model, b, eng)
        return list(eng.history)


def test_every_plan_carries_its_prediction_and_a_miss_replans_on_the_emulated_link():
    model = tiny_llama(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    batches = lm_batches(model, [128] * 8, B=4)
    budget = int(natural_peak(model, batches[0]) * 0.25)
    hist = _run(model, batches, budget, emulate_link="50MB/s")
    assert hist[0].predicted_step_seconds is None                  # no plan yet: the guard
    assert all(s.predicted_step_seconds > 0 for s in hist[1:])
    assert all(s.peak_resident_bytes <= budget for s in hist)
    assert any(s.block_modes[0] < 4 for s in hist[1:])              # the slow link recomputes
    # The first plan comes from a step that stalled for most of its time (the guard, swapping
    # everything at 50 MB/s); with its waits kept apart, the prediction lands where the steps
    # run. Tolerance: a shared 2-core machine (the emulated-link benchmark reports the figure).
    ratios = sorted(s.step_seconds / s.predicted_step_seconds for s in hist[-3:])
    assert 0.7 <= ratios[1] <= 1.4, [(s.step_seconds, s.predicted_step_seconds) for s in hist]


@pytest.mark.usefixtures("plans_land_by_the_next_step")
def test_a_model_that_misses_is_corrected_and_the_step_says_replanned(monkeypatch):
    # Planned for a link 20x faster than the copies run: every plan under-predicts its stall
    # until the engine measures the link and plans again. (Plans from the first step's times
    # run their fallback, which copies nothing: here that often ran all full from the second
    # step on, never copied, and had nothing to miss. Off: this is about the misses. And the
    # planner process's plans land by the next step: in one fresh-clone suite of 2026-11-27 on
    # the loaded 2-core machine the 7 steps had a replan but left the link uncorrected (not
    # seen again in 16 runs alone or beside a busy core; likely the plans that move came late).)
    from chameleon_swap.policy import block_modes
    monkeypatch.setattr(block_modes, "FIRST_PLANS_FALL_BACK", False)
    model = tiny_llama(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    batches = lm_batches(model, [128] * 7, B=4)
    budget = int(natural_peak(model, batches[0]) * 0.5)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      emulate_link="40MB/s") as eng:
        eng._policy.checks.link = (8e8, 8e8)        # a wrong model to start from
        for b in batches:
            train_step(model, b, eng)
        hist = list(eng.history)
        assert "replanned" in [s.plan_source for s in hist]
        d2h, h2d = eng._policy.link()
        assert 2e7 < d2h < 6e7 and 2e7 < h2d < 6e7          # timed: about 40 MB/s


def _swap_plans_read_a_third(after_settling=lambda eng: None):
    """A 4-block Llama at 25% of its peak on a 50 MB/s link: 8 steps to settle, then the swap
    plans standing for its size made to read a third of their step (``after_settling(eng)``
    first), and 16 steps more. Their ratios of measured to predicted step, and their stats."""
    model = tiny_llama(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    # (8 steps first: the mix and its swap plans settle; 16 after, since a check follows a
    # correction's cooldown. With 5 and 11 this test failed 4 runs in 10 at 79e1127 on a busy
    # machine: a miss that came late, or a step that the plan divided below did not use.)
    batches = lm_batches(model, [128] * 24, B=4)
    budget = int(natural_peak(model, batches[0]) * 0.25)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      emulate_link="50MB/s") as eng:
        for b in batches[:8]:
            train_step(model, b, eng)
        after_settling(eng)
        for entry in eng._policy.cache.entries():
            entry.predicted_step_seconds /= 3
        for b in batches[8:]:
            train_step(model, b, eng)
            assert eng.last_step.peak_resident_bytes <= budget
        hist = list(eng.history)[8:]
    return [s.step_seconds / s.predicted_step_seconds for s in hist], hist


@pytest.mark.usefixtures("plans_land_by_the_next_step")
def test_a_swap_plan_that_misses_under_a_mode_plan_is_made_again_on_the_emulated_link():
    # With model=, the prediction a step reports is the swap plan's made from a step in its
    # modes; a miss re-plans the modes, and (before) left that swap plan as it was: it went on
    # missing and the modes were planned again every second step. Here the swap plans standing
    # for the size are made to read a third of their step; the misses must make them again.
    off, hist = _swap_plans_read_a_third()
    assert max(off[:3]) > 2, off                             # the wrong plan stood, and missed
    assert "replanned" in [s.plan_source for s in hist]
    # Made again from a step, it holds (the median of the last three: this machine's noise
    # alone once ran one of them 2.6x its neighbours).
    assert sorted(off[-3:])[1] < 2, off


def test_a_swap_plan_that_misses_while_its_modes_are_being_planned_again_is_made_again(
        monkeypatch):
    # As above, but no plan of the planner process lands after the first 8 steps (as when a
    # loaded machine starves it: CI once ran 16 steps at 3.1-3.7x the prediction while the mode
    # plan, made again from a changed keep view, was on its way). The swap plan that stands for
    # the step is checked on its own meanwhile, made again from a step, and says so.
    from chameleon_swap.policy import background

    def starve(eng):
        monkeypatch.setattr(background.Worker, "ready", lambda self, ticket: False)
        modes = eng._policy.modes                   # (its view changed: the modes wait a plan)
        src = modes.view_stamp(modes.key)[0]
        modes.views[src] = modes.views[src]
    off, _ = _swap_plans_read_a_third(starve)
    assert max(off[:3]) > 2, off
    # (Which step reads "replanned" depends on the mix the first 8 steps settled on, which this
    # machine's timing decides: the prediction coming right is what the check must bring.)
    assert sorted(off[-3:])[1] < 2, off


@pytest.mark.usefixtures("plans_land_by_the_next_step")
def test_the_10mb_link_case_recomputes():
    # An HF Llama (hidden 128, 8 layers, batch 2 x 128) at 50% of its peak, planned for a
    # 10 MB/s link: the plan's own prediction is seconds of stall on a 0.05 s step, so blocks
    # recompute (before: all 8 kept on every step). Its default use_cache=True is turned off
    # for training steps, as transformers does under gradient checkpointing.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(512, (2, 128), generator=torch.Generator().manual_seed(0))
    loss_fn = lambda m, b: m(input_ids=b, labels=b).loss          # noqa: E731
    history, _, budget = compare(model, [ids] * 4, 0.5, loss_fn=loss_fn, model_kwarg=True,
                                 link_bandwidth="10MB/s")
    assert model.config.use_cache is True                           # the user's model untouched
    assert all(s.peak_resident_bytes <= budget for s in history)
    assert all(s.block_modes[0] < 8 for s in history[1:]), [s.block_modes for s in history]
    assert all(s.recomputed_bytes > 0 for s in history[1:])


def test_a_size_that_comes_back_reads_its_plan_from_the_cache():
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    lengths = [96, 160, 96, 160, 96, 128, 160, 96]
    batches = lm_batches(model, lengths, B=4)
    budget = int(min(natural_peak(model, b) for b in batches) * 0.3)
    # Plans made on the step's thread: with a planner process a second visit may come before
    # its size's plan lands, and run the nearest size's ("planned"; the twin below).
    hist = _run(model, batches, budget, emulate_link="200MB/s", plan_in_background=False)
    seen = set()
    for T, s in zip(lengths, hist):
        if T in seen:
            assert s.plan_source in ("cache", "replanned"), (T, s.plan_source)
        seen.add(T)
    assert [s.plan_source for s in hist].count("cache") >= 3


@pytest.mark.usefixtures("plans_land_by_the_next_step")
def test_no_mix_that_fits_warns_once_naming_the_budget():
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    batches = lm_batches(model, [96] * 4, B=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = _run(model, batches, 4096, emulate_link="1GB/s")
    msgs = [str(w.message) for w in caught if "no mix" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert "4.00 KiB" in msgs[0] and "peaks at" in msgs[0]
    assert all(s.peak_resident_bytes <= 4096 for s in hist)   # the guard still holds it


def test_emulated_link_keeps_gradients_bitwise():
    model = tiny_llama(dim=64, n_layers=3, max_seq_len=256)
    batches = lm_batches(model, [64, 96, 64], B=2)
    history, _, budget = compare(model, batches, 0.3, model_kwarg=True, emulate_link="100MB/s")
    assert all(s.peak_resident_bytes <= budget for s in history)


def test_use_cache_is_put_back_and_gradients_stay_bitwise():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                   max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = tokens(128, 2, 64, 0)[0]
    loss_fn = lambda m, b: m(input_ids=b, labels=b).loss          # noqa: E731
    ref = loss_fn(model, ids)
    ref.backward()
    ref_grads = grads(model)
    model.zero_grad()
    with cs.Chameleon(10**9, device="cpu", model=model) as eng:
        with eng.step():
            assert model.config.use_cache is False               # off inside the step ...
            loss = loss_fn(model, ids)
            loss.backward()
    assert model.config.use_cache is True                        # ... and back after it
    assert_bitwise(ref.detach(), ref_grads, loss.detach(), grads(model))
