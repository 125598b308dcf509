"""Block modes at run time (policy/modes.py) through the engine: ``Chameleon(model=...)`` keeps,
swaps or recomputes, bit for bit, under the budget, on CPU."""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import chameleon_swap as cs

from _helpers import (assert_bitwise, compare, grads, natural_peak, shared_cpu_noise,
                      steady_planning, train_beside, train_step)
from _models import SPEC_BLOCKS, lm_batches, randn, random_model, tiny_llama, tiny_moe

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py

SLOW, FAST = "10MB/s", "1TB/s"


def llama():
    return tiny_llama(n_layers=3)


def moe():
    return tiny_moe(n_layers=3)


class Cheap(nn.Module):
    """A block whose saved bytes take far longer to copy over a 1 GB/s link than its
    elementwise compute takes: the link cannot hide them."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x * self.scale
        for _ in range(4):
            h = h * torch.sigmoid(h)
        return x + h


class CheapNet(nn.Module):
    def __init__(self, dim: int = 64, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Cheap(dim) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


# --------------------------------------------------------------------------- the decision
@pytest.fixture
def steady_clock(monkeypatch):
    """Every timestamp the profiler and the runner take is 50 us after the previous one, so the
    plan's compute times do not depend on how busy this machine is: the decision below then
    depends only on the bytes and the link, which is what it tests."""
    # The steps' wall time is off too (checks, mixes' times, fallbacks, view corrections, the
    # planning ration): this decision's twin on the emulated link is
    # test_the_decision_on_the_real_clock.
    steady_planning(monkeypatch)
    # A move's host time would read as ticks of this clock (three per move, 150 us: about what
    # one costs on this CPU, many times a GPU's); the decision here is about the link alone.
    from chameleon_swap.policy import checks
    monkeypatch.setattr(checks.PlanChecks, "move_seconds", lambda self: 0.0)


@pytest.mark.parametrize("link,recomputes", [("1GB/s", True), ("1TB/s", False)])
def test_a_slow_link_recomputes_a_fast_one_swaps(link, recomputes, steady_clock):
    # Each block saves ~9 MB in ~0.5 ms of (steady) compute: 18 GB/s, which 1 GB/s cannot hide
    # and 1 TB/s can.
    torch.manual_seed(0)
    model = CheapNet()
    batches = [(randn(4, 2048, 64, seed=i),) for i in range(4)]
    # (plans made on the step's thread: on the steady clock the decision, not when it lands)
    history, _, budget = compare(model, batches, 0.4, model_kwarg=True, link_bandwidth=link,
                                 min_tensor_bytes=2**16, plan_in_background=False)
    last = history[-1]
    assert all(s.peak_resident_bytes <= budget for s in history)
    if recomputes:
        assert last.block_modes[0] < 4 and last.recomputed_bytes > 0, last
        assert last.recompute_seconds > 0
    else:
        assert last.block_modes == (4, 0, 0) and last.offloaded_bytes > 0, last
        assert last.recomputed_bytes == 0 and last.recompute_seconds == 0



@pytest.mark.usefixtures("plans_land_by_the_next_step")
def test_a_link_that_slows_tenfold_mid_run_keeps_its_size_recomputing_on_the_real_clock():
    # A 4-block Llama at 25% of its peak recomputes every block on a 200 MB/s emulated link;
    # from its ninth step the link runs at 20 MB/s. Before, the size kept every block for good
    # once its plan was made again for the slower link (1.76 s a step, as predicted, where all
    # full had run 0.19 s): the model put all full over the budget, a recomputed block's
    # working set entering backward while the copies out of the blocks' inputs were still on
    # their way, and ranked a mix that fits first. The guard waits for those copies; so does
    # the model now, and a mix that ran fits as it ran (planning/modes.py's twins).
    model = tiny_llama(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    batches = lm_batches(model, [128] * 16, B=4)
    budget = int(natural_peak(model, batches[0]) * 0.25)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      emulate_link="200MB/s") as eng:
        for i, b in enumerate(batches):
            if i == 8:
                eng._copy._d2h.bytes_per_s = eng._copy._h2d.bytes_per_s = 20e6
            train_step(model, b, eng)
            assert eng.last_step.peak_resident_bytes <= budget
        hist = list(eng.history)
    assert any(s.block_modes[2] == 4 for s in hist[1:8])     # all full on the fast link
    late = [s.block_modes for s in hist[8:]]
    assert all(m[0] < 4 for m in late), late

def test_on_the_real_clock_the_budget_keeps_the_last_block_the_families_recomputed(monkeypatch):
    # A 6-block transformer at 25% of its peak on a 50 MB/s emulated link (copies too dear to
    # pay, even with the compute slowed by a loaded machine): the budget holds the last block's
    # saves unmoved (backward frees them before the first recompute), which the mode search's
    # families, keeping the first blocks in a row, never tried: they recompute every block. The
    # climb (planning/modes.py) keeps it, predicted faster on the view learnt on this clock, and
    # the engine runs it (the hand-built view's twin: test_modes.py's last blocks kept).
    import chameleon_swap.planning.modes as mode_search
    from _models import TModel
    monkeypatch.setattr(mode_search, "CLIMB_PASSES", 2)       # (off by default: see climb)
    model = TModel(dim=128, n=6, seed=0)
    x = randn(2, 64, 128, seed=1)
    budget = int(natural_peak(model, (x,)) * 0.25)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      emulate_link="50MB/s", plan_in_background=False) as eng:
        for _ in range(6):
            model.zero_grad(set_to_none=True)
            with eng.step():
                model(x).backward()
            assert eng.last_step.peak_resident_bytes <= budget
        modes = eng._policy.modes
        (key, plan), = modes.plans.items()
        args = modes._job(key).args[:3]
        climbed = mode_search.plan_hybrid(*args)
        monkeypatch.setattr(mode_search, "CLIMB_PASSES", 0)
        families = mode_search.plan_hybrid(*args)
        ran = eng.last_step.block_modes
    assert climbed.modes[-1] == "keep" and families.modes[-1] == "full", (climbed.modes,
                                                                         families.modes)
    assert climbed.predicted.total_seconds < families.predicted.total_seconds
    assert plan.hybrid.modes[-1] == "keep" and ran[0] >= 1, (plan.hybrid.modes, ran)


def _upsized_run(engine_kwargs: dict, link_at_long=None) -> list:
    """CheapNet at 40% of its longest step's peak: two steps of one size, then one twice as
    long, larger than every size planned (``link_at_long``: the link the mode policy reads from
    then on, bytes/s each way)."""
    torch.manual_seed(0)
    batches = [(randn(4, n, 64, seed=i),) for i, n in enumerate((1024, 1024, 2048))]
    done = []

    def between(eng):
        done.append(True)
        if len(done) == 2 and link_at_long is not None:
            eng._policy.modes.bandwidth_fn = lambda: (link_at_long, link_at_long)
    # Plans made on the step's thread (``plan_in_background=False``): which plan the long step
    # runs is the test (with a planner process it depends on when the short size's lands).
    history, _, _ = compare(CheapNet(), batches, lambda peaks: int(max(peaks) * 0.4),
                            model_kwarg=True, min_tensor_bytes=2**16, between=between,
                            plan_in_background=False, **engine_kwargs)
    return history


@pytest.mark.parametrize("slow", [True, False])
def test_a_size_larger_than_every_plan_runs_full_where_the_link_cannot_hide_the_excess(
        slow, steady_clock):
    # On a fast link the short size's plan keeps every block and moves the rest: its peak is
    # the budget, twice that at twice the length. Where the link can copy that excess out in
    # the forward, the long step runs the plan (the guard copies the excess out) and keeps its
    # first visit's keep view; where it cannot (here the link is made 10 MB/s for the long
    # step: on an H100 such copies stalled the step 2.5x), it runs every block full, which
    # fits (the guard forces nothing), and predicts nothing (no plan was made for such a mix).
    history = _upsized_run({"link_bandwidth": FAST}, 1e7 if slow else None)
    assert history[1].block_modes == (4, 0, 0) and history[1].offloaded_bytes > 0
    long = history[2]
    if slow:
        assert long.block_modes == (0, 0, 4) and long.forced_offloads == 0, long
        assert long.predicted_step_seconds is None
    else:
        assert long.block_modes == (4, 0, 0) and long.offloaded_bytes > 0, long
        assert long.predicted_step_seconds is not None


def test_a_larger_size_on_the_real_clock_runs_full_or_a_plan_whose_excess_the_link_hides():
    # The twin on the real clock and the emulated link, made 10 MB/s for the long step: which
    # mix the short size runs depends on the clock (here its first plans run a quiet stand-in,
    # (2, 0, 2) in four runs of four). Where it kept half its blocks or more, that plan's peak
    # at twice the length is over the budget by megabytes, far more than 10 MB/s copies in a
    # forward of milliseconds: the long step keeps no block (the selective probe may run one
    # of them selective) and predicts nothing; the old rule ran the short size's plan there.
    # Either way the guard forces no copy out.
    history = _upsized_run({"emulate_link": FAST}, 1e7)
    long = history[2]
    assert long.forced_offloads == 0, long
    if history[1].block_modes[0] >= 2:
        assert long.block_modes[0] == 0 and long.predicted_step_seconds is None, history
    if long.block_modes == (0, 0, 4):
        assert long.predicted_step_seconds is None


def test_upsized_by_hand():
    from types import SimpleNamespace

    from chameleon_swap.planning.timeline import Profile, Span
    from chameleon_swap.policy.mix_runs import ModePlan, upsized
    spans = [Span(60, 0, 2), Span(40, 1, 2)]                  # 100 bytes held, nothing moved
    view = Profile([0.25, 0.25, 1.0], 2, spans, 1.0, 1.0)     # a forward of 0.5 s
    hybrid = SimpleNamespace(predicted=SimpleNamespace(peak_bytes=100), profile=view)
    plan = ModePlan({0: "keep"}, {}, 1000, 150, True, hybrid, key=5)
    # At twice the size: peak 200, forward 1 s; over a budget of 150 by 50 bytes.
    assert upsized(plan, False, 2000, 150, 49.0)     # 50 bytes take 1.02 s: not hidden
    assert not upsized(plan, False, 2000, 150, 51.0)  # 0.98 s: hidden in the forward
    assert not upsized(plan, False, 2000, 200, 1.0)  # fits exactly
    assert not upsized(plan, True, 2000, 150, 1.0)   # the size has its own plan
    assert not upsized(None, False, 2000, 150, 1.0)  # nothing planned yet
    assert not upsized(plan, False, 500, 60, 1.0)    # a larger size's plan, scaled down: 50
    # A plan that copies: it holds 100 bytes with nothing moved and peaks at 80 after its copies
    # (20 bytes out). At twice the size its copies are 40 and the excess over 150 is 50, not the
    # 10 its predicted peak says: 51 bytes/s hide 50 bytes in the 1 s forward, 49 do not.
    moving = SimpleNamespace(predicted=SimpleNamespace(peak_bytes=80), profile=view)
    plan = ModePlan({0: "keep"}, {}, 1000, 80, True, moving, key=5)
    assert upsized(plan, False, 2000, 150, 49.0) and not upsized(plan, False, 2000, 150, 51.0)
    assert upsized(plan, False, 2000, 150, 11.0)     # (hides the 10 bytes the old count saw)
    # No plan yet (the first size's is being made in the planner process): the nearest keep
    # view decides, by the same arithmetic on what it holds (100 bytes, a forward of 0.5 s).
    kv = SimpleNamespace(profile=view, input_bytes=1000)
    assert upsized(None, False, 2000, 150, 49.0, kv)
    assert not upsized(None, False, 2000, 150, 51.0, kv)
    assert not upsized(None, False, 2000, 150, 1.0)          # no view either: the first step


def test_a_larger_size_with_no_plan_yet_on_the_emulated_link_runs_full_where_copies_stall():
    # The real clock: CheapNet's first step (1024 rows, kept: a keep view) and then one twice
    # as long before any plan is there (dropped between the steps, as when the first size's is
    # still in the planner process). On a 10 MB/s link the excess over the budget cannot leave
    # in the forward: every block runs full and the guard forces nothing; on a fast one the
    # step keeps its blocks and the guard copies the excess.
    for link, full in (("10MB/s", True), (FAST, False)):
        torch.manual_seed(0)
        batches = [(randn(4, n, 64, seed=i),) for i, n in enumerate((1024, 2048))]

        def between(eng):
            eng._policy.modes.plans.clear()
        history, _, budget = compare(CheapNet(), batches, lambda p: int(max(p) * 0.4),
                                     model_kwarg=True, min_tensor_bytes=2**16,
                                     between=between, plan_in_background=False,
                                     emulate_link=link)
        long = history[1]
        if full:
            assert long.block_modes == (0, 0, 4) and long.forced_offloads == 0, long
        else:
            assert long.block_modes == (4, 0, 0) and long.offloaded_bytes > 0, long


def test_nothing_recomputed_or_moved_when_the_step_fits():
    model = llama()
    history, _, _ = compare(model, lm_batches(model, [16, 16, 24]), 2.0, model_kwarg=True,
                            link_bandwidth=SLOW)
    for s in history:
        assert s.block_modes == (3, 0, 0) and s.offloaded_bytes == 0 and s.recomputed_bytes == 0


# --------------------------------------------------------------------------- bitwise matrix
@pytest.mark.parametrize("link", [SLOW, FAST])
@pytest.mark.parametrize("fraction", [0.5, 0.2, 0.05, 0.0])
@pytest.mark.parametrize("make", [llama, moe], ids=["llama", "moe"])
def test_bitwise_under_budget_with_recompute(make, fraction, link, steady_clock):
    model = make()
    batches = lm_batches(model, [24, 24, 12, 24, 32, 24])
    history, _, budget = compare(model, batches, fraction, model_kwarg=True, link_bandwidth=link)
    assert all(s.peak_resident_bytes <= budget for s in history)
    # (The budget is a share of the shortest length's peak: at the longer ones a block's
    # recompute working set alone passes it, so those run swap only; the next test recomputes.)


@pytest.mark.parametrize("clock", ["steady", "real"])
def test_llama_at_half_its_peak_on_a_slow_link_recomputes(clock, request):
    # Recomputing must pay where it can: one length, half its peak, a link too slow to swap.
    # (Before: this was asserted on the mixed lengths above, where it held only through the
    # selective probe, whose working set was then counted as 0 bytes.) On the steady clock the
    # planner is told the link; on the real one the copies run at that speed (emulated link).
    link = ({"link_bandwidth": SLOW} if clock == "steady" else {"emulate_link": SLOW})
    if clock == "steady":
        request.getfixturevalue("steady_clock")
    model = llama()
    history, _, budget = compare(model, lm_batches(model, [24] * 5), 0.5, model_kwarg=True,
                                 plan_in_background=False, **link)   # (planned for step 2 on)
    assert all(s.peak_resident_bytes <= budget for s in history)
    assert any(s.block_modes[2] + s.block_modes[1] and s.recomputed_bytes for s in history), \
        history[-1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.fixed_dictionaries({
           "blocks": st.lists(st.sampled_from(SPEC_BLOCKS), min_size=2, max_size=5),
           "dim": st.sampled_from([4, 8]), "seed": st.integers(0, 2**16)}),
       lengths=st.lists(st.integers(2, 9), min_size=2, max_size=4),
       fraction=st.floats(0.0, 1.0), link=st.sampled_from([SLOW, FAST]))
# Found by this test: the selective probe ran the relu_inplace block selective, and PyTorch's
# selective checkpointing raised in backward (relu_ wrote into the linear's kept output).
@example(spec={"blocks": ["linear", "attention", "relu_inplace", "linear"], "dim": 4, "seed": 0},
         lengths=[8, 5, 5], fraction=0.7730622574491768, link=SLOW)
def test_random_models_bitwise_and_budget_with_recompute(spec, lengths, fraction, link):
    model = random_model(spec)
    ref = copy.deepcopy(model)
    dim = spec["dim"]
    inputs = [(randn(2, T, dim, seed=i),) for i, T in enumerate(lengths)]
    budget = int(min(natural_peak(model, b) for b in inputs) * fraction)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      blocks=list(model.blocks), link_bandwidth=link) as eng:
        train_beside(model, ref, inputs, eng, budget)


def test_hugging_face_llama_blocks_found_and_bitwise(steady_clock):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    batches = []
    for i, T in enumerate([16, 24, 16]):
        ids = torch.randint(64, (2, T), generator=torch.Generator().manual_seed(i))
        batches.append(ids)
    loss_fn = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    # Plans made on the step's thread: three steps of a tiny model can end before a planner
    # process's first plan lands (2 of 2 failed with the process starved by a nicer priority).
    history, _, budget = compare(model, batches, 0.5, loss_fn=loss_fn, model_kwarg=True,
                                 link_bandwidth=SLOW, plan_in_background=False)
    assert all(sum(s.block_modes) == 3 for s in history)      # LlamaDecoderLayer x 3
    assert any(s.block_modes[0] < 3 for s in history)


def test_gradient_accumulation_and_autocast_in_one_step():
    model = llama()
    ref = copy.deepcopy(model)
    batches = lm_batches(model, [20, 20])
    budget = int(natural_peak(model, batches[0]) * 0.3)

    def step(m, eng=None):
        ctx = eng.step() if eng is not None else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)
        with ctx:
            for b in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = m(*b)
                loss.backward()
        return loss.detach()

    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      link_bandwidth=SLOW) as eng:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            assert_bitwise(step(ref), grads(ref), step(model, eng), grads(model))
            assert eng.last_step.peak_resident_bytes <= budget


# --------------------------------------------------------------------------- a mix's first steps
def _mix_rows(frac: float, steps: int, **engine_kwargs) -> list:
    """A 4-layer Llama at ``frac`` of its peak; per step: whether the plan applied by keys was
    a mode plan's swap set (``by_mix``), the bytes moved on a plan by keys' word, that plan's
    modes against the step's mode plan's, and whether the step's own swap plan was then made
    (cached, or being made in the planner process)."""
    model = tiny_llama(n_layers=4, dim=64, max_seq_len=128)
    rows = []

    def between(eng):
        pol = eng._policy
        a, sig = pol._applied, pol._prev_sig
        plan = pol.modes.plan
        rows.append({"by_mix": bool(a is not None and a.by_mix), "moved": pol._fuzzy_moved,
                     "modes": a.modes if a is not None else None,
                     "step_modes": dict(plan.modes) if plan is not None else None,
                     "own_plan": pol.cache.get(sig) is not None or sig in pol.swap_jobs.pending,
                     "cached_mix": any(e.by_mix for e in pol.cache.entries())})
    compare(model, lm_batches(model, [128] * steps), frac, model_kwarg=True, between=between,
            **engine_kwargs)
    return rows


def _check_mix_rows(rows: list) -> None:
    assert not any(r["cached_mix"] for r in rows)     # a mix's plan is never cached
    for r in rows:
        if r["by_mix"]:
            assert r["modes"] == r["step_modes"]      # the step's own mode plan's swap set
            assert r["own_plan"]                      # and the step's own plan follows


def test_a_mixs_first_step_moves_by_its_mode_plans_swap_set(steady_clock):
    # With the first step (every block kept, the guard's) the size gets its mode plan: a mix
    # that keeps one block and swaps part of it. No step ran in those modes, so no swap plan
    # was made in them: the step runs its mode plan's swap set, by the keep view's keys, and
    # moves on its word (before, the guard alone moved, late: the emulated-link benchmark's
    # Llama at 25% stalled 87-150 ms on such steps).
    rows = _mix_rows(0.4, 4, link_bandwidth="200MB/s", plan_in_background=False)
    assert rows[1]["by_mix"] and rows[1]["moved"] > 0, rows
    _check_mix_rows(rows)


def test_a_mixs_first_steps_on_the_emulated_link_follow_its_mode_plan():
    # The real clock's twin: which mixes a size runs, and when, depends on the machine (this
    # CPU ran two of them, steps 7 to 10 on a mix's swap set); what must hold is the same.
    for frac in (0.4, 0.6):
        _check_mix_rows(_mix_rows(frac, 10, emulate_link="200MB/s"))


# --------------------------------------------------------------------------- plans per size
def test_each_size_gets_its_own_plan_and_recurrences_come_from_the_cache():
    model = llama()
    batches = lm_batches(model, [24, 24, 40, 40, 24, 40])
    # Each step's plans land before the next (the planner process answers when it can: on a
    # loaded 2-core machine the size-40 plan once came after its revisit, which then ran on the
    # nearest size's plan and read "planned", as it should; tests/policy/test_background.py
    # covers plans landing late).
    history, _, _ = compare(model, batches, 0.3, model_kwarg=True, link_bandwidth=SLOW,
                            between=lambda eng: eng._policy.modes.collect(wait=True))
    assert [s.plan_source for s in history] == ["guard", "cache", "planned", "cache", "cache",
                                                "cache"]


def test_plans_are_made_per_size():
    model = llama()
    batches = lm_batches(model, [24, 40, 24, 40])
    budget = int(natural_peak(model, batches[0]) * 0.3)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      link_bandwidth=SLOW) as eng:
        for b in batches:
            train_step(model, b, eng)
        modes = eng._policy.modes
        modes.collect(wait=True)               # (the planner process's last plans landed)
        assert len(modes.plans) == 2
        assert all(p.budget == budget for p in modes.plans.values())


# --------------------------------------------------------------------------- arguments
def test_model_and_blocks_arguments_are_checked():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        cs.Chameleon(1000, device="cpu", model="llama")
    with pytest.raises(ValueError, match="pass model= too"):
        cs.Chameleon(1000, device="cpu", blocks="layers")
    with pytest.raises(ValueError, match="blocks"):
        cs.Chameleon(1000, device="cpu", model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="link_bandwidth"):
        cs.Chameleon(1000, device="cpu", link_bandwidth="fast")


@pytest.mark.parametrize("policy", ["guard", "static"])
def test_swap_only_policies_ignore_recompute(policy):
    model = llama()
    blocks_before = [b.__dict__.get("forward") for b in model.layers]
    history, _, _ = compare(model, lm_batches(model, [16, 24]), 0.3, model_kwarg=True,
                            policy=policy)
    assert all(s.block_modes == () and s.recomputed_bytes == 0 for s in history)
    assert [b.__dict__.get("forward") for b in model.layers] == blocks_before


def test_close_restores_the_model():
    model = llama()
    with cs.Chameleon(1000, device="cpu", model=model) as eng:
        assert all("forward" in b.__dict__ for b in model.layers)
    assert all("forward" not in b.__dict__ for b in model.layers)
    assert eng.last_step is None


# --------------------------------------------------------------------------- mixes that ran
class SlowRecompute(Cheap):
    """A ``Cheap`` block whose forward sleeps when it runs inside backward (a recompute): the
    keep view, measured in forward, cannot see what recomputing it costs."""

    def forward(self, x):
        if torch._C._current_graph_task_id() != -1:
            time.sleep(0.04)
        return super().forward(x)


def _slow_recompute_run(steps: int = 16) -> list:
    """The engine's history over ``steps`` steps of a 4-block ``SlowRecompute`` net at 40% of
    its peak on a 1 GB/s emulated link (bitwise and the budget checked by ``compare``)."""
    torch.manual_seed(0)
    model = CheapNet()
    for i, blk in enumerate(model.blocks):
        model.blocks[i] = SlowRecompute(64)
        model.blocks[i].load_state_dict(blk.state_dict())
    batches = [(randn(4, 2048, 64, seed=0),)] * steps
    history, _, _ = compare(model, batches, 0.4, model_kwarg=True, emulate_link="1GB/s",
                            min_tensor_bytes=2**16, plan_in_background=False)
    return history


def test_mixes_are_ranked_by_what_they_ran_at_on_the_emulated_link():
    # On a link too slow to hide the copies the model recomputes (as in the test above), but
    # here each recompute sleeps 40 ms, several times the stall swapping a block costs: the steps
    # run far slower than predicted, and the sizes's mixes that ran are ranked by their step
    # times. The engine leaves recomputing for what runs faster. (The real clock: the sleep is
    # real and so are the emulated link's copies.)
    history = _slow_recompute_run()
    assert any(s.block_modes[2] > 0 for s in history[:4]), [s.block_modes for s in history]
    last = [s.block_modes[2] for s in history[-3:]]
    most = max(s.block_modes[2] for s in history)
    assert max(last) < most, [s.block_modes for s in history]


def test_the_full_ratio_is_the_median_of_the_last_steps(monkeypatch):
    # Its real-clock side: the two tests above (each recompute sleeps 40 ms, about 11x its
    # kept forward: the bound of 4 held it at a third, and the mixes that ran then read every
    # other mix, keeping every block included, at twice its prediction).
    from chameleon_swap.policy import block_modes, keep_views
    modes = block_modes.BlockModes(lambda: (1e13, 1e13))
    ratios = iter([1.0, 1.0, 9.0, 1.1, None, 12.0, 12.0, 12.0])
    monkeypatch.setattr(keep_views, "full_ratio", lambda *a: next(ratios))
    got = []
    for _ in range(8):
        modes._learn_full([])
        got.append(modes.full_seconds_ratio)
    # A spike (9) moves it not at all; a step that measured none leaves it; a recompute slow on
    # every step (12) moves it within three steps.
    assert got == pytest.approx([1.0, 1.0, 1.0, 1.05, 1.05, 1.1, 9.0, 12.0])
    assert keep_views.FULL_RATIO_CLAMP[1] >= 12


def test_a_size_whose_steps_pin_every_visit_is_still_checked(monkeypatch):
    # Every step reads as slowed by pinning (the host arena allocating through it: mocked here,
    # the rest is the real clock and the emulated link). Only the first of such a row is left
    # out; before, none was checked or learnt from, and a size could run its first plan for
    # good (here: all four blocks recomputed, each recompute sleeping 40 ms, where keeping them
    # runs faster). As the test above, it leaves recomputing.
    from chameleon_swap.policy import checks
    monkeypatch.setattr(checks, "pinned", lambda profile: bool(profile.step_seconds))
    history = _slow_recompute_run()
    assert any(s.block_modes[2] > 0 for s in history[:4]), [s.block_modes for s in history]
    assert any(s.plan_source == "replanned" for s in history), [s.plan_source for s in history]
    last = [s.block_modes[2] for s in history[-3:]]
    assert max(last) < max(s.block_modes[2] for s in history), [s.block_modes for s in history]


# --------------------------------------------------------------------------- the fallback
def _scripted_modes():
    """A BlockModes with one size (key 5) planned on a fast link: every block kept, its copies
    hidden, so the plan carries a fallback that moves nothing; and a step function that runs it
    at a given time."""
    from types import SimpleNamespace

    from chameleon_swap.planning.modes import plan_hybrid
    from chameleon_swap.planning.timeline import Profile, Span, unmoved_peak
    from chameleon_swap.planning.modes import Block
    from chameleon_swap.policy.block_modes import BlockModes, ModePlan
    n = 8
    prof = Profile([1e-3] * n + [1e-3] + [2e-3] * n, n,
                   [Span(2**20, i, n + 1 + (n - 1 - i)) for i in range(n)], 1e13, 1e13)
    blocks = [Block(2 * b, 2 * b + 2, 2e-3, 2**18) for b in range(4)]
    budget = unmoved_peak(prof) // 2
    hp = plan_hybrid(prof, blocks, budget)
    assert hp.predicted.moved_bytes > 0 and hp.fallback is not None
    modes = BlockModes(lambda: (1e13, 1e13))
    modes.plans[5] = ModePlan(dict(enumerate(hp.modes)), dict(enumerate(hp.working_set)),
                              1000, budget, True, hp, key=5)
    pred = hp.predicted.total_seconds

    def step(seconds: float) -> tuple:
        modes.begin_step(budget)
        modes.key, modes.input_bytes, modes.plan = 5, 1000, modes.plans[5]
        ran = modes.plan
        calls = [SimpleNamespace(block=b, mode=m) for b, m in ran.modes.items()]
        modes._learn_run(SimpleNamespace(step_seconds=seconds), calls)
        return tuple(ran.modes.values())
    return modes, step, pred, hp


def test_a_mix_slower_than_predicted_tries_its_fallback_and_the_faster_stays():
    modes, step, pred, hp = _scripted_modes()
    assert step(3 * pred) == hp.modes           # its first step stands in: no verdict yet
    assert step(2 * pred) == hp.modes           # its second runs 2x its prediction: a miss,
    assert step(2 * pred) == hp.modes           # and its third (two steps for the fallback's)
    tried = modes.plans[5]
    assert tuple(tried.modes.values()) == hp.fallback.modes and tried.replanned
    assert tried.hybrid is hp.fallback
    assert step(5 * pred) == hp.fallback.modes  # the fallback's first step: no verdict yet
    assert step(1.5 * pred) == hp.fallback.modes  # faster than the 2x the copying mix ran at:
    assert modes.plans[5] is tried and 5 not in modes.stale   # the faster of two decides
    assert not modes.trials.running(5, tried)
    for _ in range(3):                          # ... and it stays: no second trial, no replan
        assert step(1.5 * pred) == hp.fallback.modes
    assert modes.plans[5] is tried


def _fallback_predicted(modes, hp, ratio: float):
    """The scripted plan (``_scripted_modes``) with its fallback predicted at ``ratio`` x its
    own prediction (its own mix scripted: ``hp``, else the scripted plan's)."""
    swap = hp.fallback.swap
    fb = replace(hp.fallback, swap=replace(swap, predicted=replace(
        swap.predicted, total_seconds=ratio * hp.predicted.total_seconds)))
    return _runs(modes, replace(hp, fallback=fb))


def _scripted_after_stand_in(link: float, fallback: float):
    """The scripted plan (``_scripted_modes``) on a link of ``link`` bytes/s each way, its
    fallback predicted at ``fallback`` x its own prediction, after its first step (which stands
    in): ``(modes, step, pred, hp)`` as ``_scripted_modes`` gives them."""
    modes, step, pred, hp = _scripted_modes()
    modes.bandwidth_fn = lambda: (link, link)
    hp = _fallback_predicted(modes, hp, fallback)
    step(3 * pred)
    return modes, step, pred, hp


def _runs(modes, hp, **changes):
    """The scripted plan (``_scripted_modes``) made to run hybrid plan ``hp`` (its mix with it;
    ``changes``: other fields of the ``ModePlan``); returns ``hp``."""
    plan = modes.plans[5]
    modes.plans[5] = replace(plan, modes=dict(zip(plan.modes, hp.modes)), hybrid=hp, **changes)
    return hp


@pytest.mark.parametrize("fallback", [0.95, 1.05, 1.32])
@pytest.mark.parametrize("link", [1e13, 1e8])
def test_a_mix_that_copies_is_checked_against_its_fallback_though_it_ran_as_predicted(
        link, fallback):
    # Its copies at the link's bandwidth: a few microseconds of a step of milliseconds (1e13),
    # or more than the 10% a prediction may miss by (1e8). It ran as predicted: its fallback is
    # tried where predicted no slower than it ran (0.95x: tried); predicted 5% slower, or 32%
    # (the scripted plan's own), it could stay only on a model wrong about a mix that moves
    # nothing by more than MISS (``mix_runs.may_win``; 1.05 was tried before).
    modes, step, pred, hp = _scripted_modes()
    hp = _fallback_predicted(modes, hp, fallback)
    modes.bandwidth_fn = lambda: (link, link)
    copies = hp.predicted.moved_bytes / link
    assert hp.predicted.moved_bytes > 0
    step(3 * pred)
    assert step(pred) == hp.modes               # as predicted (twice: as many steps as its
    assert step(pred) == hp.modes               # fallback's trial runs)
    tried = tuple(modes.plans[5].modes.values()) == hp.fallback.modes
    assert tried == (copies > 0.1 * hp.predicted.total_seconds and fallback <= 1.0), copies


def test_whether_a_fallback_may_win_or_is_outrun_is_read_at_the_steps_size():
    # mix_runs.may_win and outran, directly: the fallback's prediction scaled as the plan's is
    # (``pred``: the plan's own prediction at this step's size). Where either prediction is not
    # known, the fallback may win and is not outrun (the trial's own checks decide).
    from chameleon_swap.policy.mix_runs import may_win, outran
    modes, step, pred, hp = _scripted_modes()
    hp = _fallback_predicted(modes, hp, 1.05)
    own = hp.predicted.total_seconds
    assert not may_win(hp, own, own) and may_win(hp, own, 1.06 * own)
    assert not may_win(hp, 2 * own, 2 * own) and may_win(hp, 2 * own, 2.11 * own)  # scaled
    assert outran(hp, own, 0.95 * own) and not outran(hp, own, 0.96 * own)   # 1.05 > 0.95 x 1.1
    assert may_win(hp, float("inf"), own) and not outran(hp, float("inf"), own)
    bare = replace(hp, fallback=None)
    assert may_win(bare, own, own) and not outran(bare, own, own)


@pytest.mark.parametrize("fallback", [1.25, 1.5])
def test_a_mix_that_ran_slow_is_tried_against_its_fallback_where_the_fallback_could_win(
        fallback):
    # Slower than its own prediction by 20%: its model is wrong about it. Its fallback, which
    # moves nothing, runs next where predicted within the 10% a switch asks for of what the mix
    # ran (1.25x its prediction, under 1.2 x 1.1); not where predicted clearly slower than that
    # (1.5x): it would win only on a model wrong about it too, and its trial costs steps.
    # (The real clock's twin: test_mixes_are_ranked_by_what_they_ran_at_on_the_emulated_link.)
    modes, step, pred, hp = _scripted_modes()
    modes.bandwidth_fn = lambda: (1e13, 1e13)   # (its copies: nothing to the step)
    hp = _fallback_predicted(modes, hp, fallback)
    step(3 * pred)
    step(1.2 * pred)
    step(1.2 * pred)
    assert (modes.plans[5].hybrid is hp.fallback) == (fallback < 1.2 * 1.1)
    assert bool(modes.trials.by_key) == (fallback < 1.2 * 1.1)


@pytest.mark.parametrize("fallback", [0.95, 1.05, 1.32])
def test_a_mix_with_a_selective_block_is_checked_against_its_fallback_though_it_ran_as_predicted(
        fallback):
    # Selective's figures come from one probe of one block: a mix that leans on them is run
    # beside the fallback once, as a mix that copies is, where its fallback is predicted no
    # slower than it ran. (The trigger is what is tested: the plan is the scripted one with its
    # last block's mode set selective.)
    modes, step, pred, hp = _scripted_modes()
    modes.bandwidth_fn = lambda: (1e13, 1e13)   # its copies: nothing to the step
    sel = _fallback_predicted(modes, replace(hp, modes=hp.modes[:-1] + ("selective",)), fallback)
    step(3 * pred)
    step(pred)                                  # as predicted
    step(pred)
    assert (modes.plans[5].hybrid is sel.fallback) == (fallback <= 1.0)


def test_a_mix_that_moves_nothing_is_tried_against_its_fallback_only_where_it_ran_slow():
    modes, step, pred, hp = _scripted_modes()
    quiet = hp.fallback                         # a plan that moves nothing, given a fallback
    # (what the fallback is does not matter here: the trigger is what is tested)
    _runs(modes, replace(quiet, fallback=hp), working_set={})
    pred = quiet.predicted.total_seconds
    step(3 * pred)
    step(1.05 * pred)                           # within 10% of its prediction: it stays
    assert modes.plans[5].hybrid is not hp and not modes.trials.by_key
    step(1.5 * pred)                            # one slow step of two is noise (the faster) ...
    assert modes.plans[5].hybrid is not hp and not modes.trials.by_key
    step(1.5 * pred)                            # ... two of three are not: the fallback runs next
    assert modes.plans[5].hybrid is hp


def test_a_quiet_mix_that_does_no_more_work_than_its_fallback_is_not_tried_against_it():
    # One block kept and the rest full, nothing copied, against its fallback all full: keeping
    # a block it would recompute cannot make a step slower, so its slow steps are noise and no
    # trial runs (on the CPU demo such a trial sent sizes to all full on one noisy step).
    modes, step, pred, hp = _scripted_modes()
    all_full = replace(hp.fallback, fallback=None)
    assert set(all_full.modes) == {"full"} and not all_full.predicted.moved_bytes
    # (the same prediction: what decides is that it keeps a block all full recomputes)
    quiet = replace(all_full, modes=("keep",) + all_full.modes[1:])
    _runs(modes, replace(quiet, fallback=all_full), working_set={})
    p = quiet.predicted.total_seconds
    for t in (3 * p, 1.5 * p, 1.5 * p, 1.5 * p):
        step(t)
    assert modes.plans[5].hybrid.modes == quiet.modes and not modes.trials.by_key


def test_one_slow_step_of_the_fallback_does_not_send_the_size_back():
    # Noise only slows a step: the CPU demo's 160-token size went back to a mix at 130 ms after
    # all full's second step read 190 ms, where checkpointing ran 100-145 ms.
    modes, step, pred, hp = _scripted_modes()
    step(3 * pred)
    step(2 * pred)                              # a miss, twice: the fallback runs next
    step(2 * pred)
    tried = modes.plans[5]
    step(2.5 * pred)                            # slower than the plan ran (2x): one step ...
    assert step(1.2 * pred) == hp.fallback.modes
    assert modes.plans[5] is tried              # ... the faster of two decides: it stays
    assert not modes.trials.running(5, tried)
    for _ in range(3):
        assert step(1.2 * pred) == hp.fallback.modes


@pytest.mark.parametrize("ran", [2.5, 1.9])   # slower; faster but within the 10% of noise
def test_a_fallback_not_clearly_faster_gives_the_size_its_plan_back_once(ran):
    # Decided on the faster of the fallback's two steps (it moves next to nothing: its first
    # runs no stand-in swap plan).
    modes, step, pred, hp = _scripted_modes()
    original = modes.plans[5]
    step(3 * pred)
    step(2 * pred)                              # a miss, twice: the fallback runs next
    step(2 * pred)
    assert step(ran * pred) == hp.fallback.modes
    assert modes.plans[5] is not original       # one step decides nothing (noise) ...
    assert step(1.1 * ran * pred) == hp.fallback.modes
    assert modes.plans[5] is original           # back to the plan that missed, which its
    assert 5 in modes.stale                     # size plans again on what both ran at ...
    for _ in range(3):                          # ... and it stays (once per size)
        assert step(2 * pred) == hp.modes
    assert modes.plans[5] is original


def test_a_fallback_is_judged_against_as_many_steps_of_the_plan_as_it_runs():
    # Noise only slows a step, so the faster of two steps reads faster than one step does.
    # Judged against one step of the plan (its first stood in), a fallback exactly as fast as
    # the plan stayed in 27% of trials under a shared CPU's noise as simulated (a step 1 + |N(0,
    # 0.12)| of its time, one in five 10-50% slower), and one 5% slower in 17%; against the
    # faster of the plan's last two steps, 9% and 4%. (On the emulated-link benchmark at 25%
    # sizes went from two to six kept blocks to more recomputed on such trials late in a run.)
    modes, step, pred, hp = _scripted_modes()
    original = modes.plans[5]
    step(3 * pred)                              # stands in
    step(2 * pred)                              # a miss, but one step of its own: no trial yet
    assert modes.plans[5] is original and not modes.trials.by_key
    step(1.6 * pred)                            # its second: tried, against the faster (1.6x)
    assert modes.plans[5].hybrid is hp.fallback
    step(1.5 * pred)
    step(1.55 * pred)                           # not 10% faster than 1.6x (under 2x): back
    assert modes.plans[5] is original


def test_a_fallback_as_fast_as_its_plan_seldom_wins_its_trial_on_noise():
    # The rule above under scripted noise, through the policy's own code: a plan that copies
    # (its copies over a tenth of its step on the link: tried whatever it ran) and a fallback
    # predicted and running exactly as fast, every step its time x (1 + |N(0, 0.12)|), one in
    # five 10-50% slower instead (a shared CPU's noise only slows a step). The fallback stays in
    # 10 of 200 trials (a size's plan decided by noise); judged against one step of the plan,
    # as before, it stayed in 56.
    noise = shared_cpu_noise()
    stayed = 0
    for _ in range(200):
        modes, step, pred, hp = _scripted_after_stand_in(1e8, 1.0)
        for _ in range(8):
            if modes.plans[5].hybrid is hp.fallback:
                break
            step(pred * noise())
        assert modes.plans[5].hybrid is hp.fallback     # tried
        tried = modes.plans[5]
        for _ in range(2):
            step(pred * noise())
        stayed += modes.plans[5] is tried
    assert stayed <= 0.15 * 200, stayed


def test_a_plan_on_its_prediction_seldom_misses_on_noise():
    # A quiet plan (its copies hidden: tried only where it runs over its prediction) whose
    # prediction is its median step under the scripted shared-CPU noise, as a model learnt from
    # such steps predicts, its fallback predicted 5% slower: 400 sizes, ten steps each. It is read
    # by the faster of its last two steps, as its trial and the ranking read it: 123 tried their
    # fallback on noise alone; read by the low median of up to three, 182 did. And a plan is
    # planned again on a miss of those two steps only where no trial starts: none here; 59 were
    # on one slow second step.
    noise = shared_cpu_noise(1)
    median = statistics.median(shared_cpu_noise(7)() for _ in range(20000))
    tried = replanned = 0
    for _ in range(400):
        modes, step, pred, hp = _scripted_after_stand_in(1e13, 1.05)
        for _ in range(10):
            step(pred * noise() / median)
            if modes.plans[5].hybrid is hp.fallback:
                tried += 1
                break
            replanned += 5 in modes.stale
            modes.stale.discard(5)
    assert tried <= 0.35 * 400, tried
    assert replanned == 0, replanned


def test_on_the_emulated_link_a_fallback_is_tried_once_the_plan_ran_two_steps(monkeypatch):
    # The real clock, the two rules above: as the tests below, a planner told the link is far
    # faster than the emulated one keeps and swaps, runs slow and tries its fallback. When the
    # trial starts, the plan has two step times of its own at the size beside its stand-in, the
    # fallback is judged against the faster of them, and that one ran over the plan's
    # prediction by more than MISS (its copies hidden on the link it was told of: it is tried
    # for its time alone).
    from chameleon_swap.policy import checks, mix_runs
    model = _told_a_fast_link(monkeypatch)
    batches = [(randn(4, 2048, 64, seed=0),)] * 9
    started, at_start = [], []
    start = mix_runs.Trials.start

    def recorded(self, key, plan, ran):
        out = start(self, key, plan, ran)
        if out is not None:
            started.append((key, plan, ran))
        return out
    monkeypatch.setattr(mix_runs.Trials, "start", recorded)

    def between(eng):
        m = eng._policy.modes
        m._probe, m._probed = None, True
        if started and not at_start:
            key, plan, ran = started[0]
            mix = tuple(sorted(plan.modes.items()))
            at_start.append((list(m.runs.runs[key][mix]), ran))
    history, _, budget = compare(model, batches, 0.4, model_kwarg=True, emulate_link="200MB/s",
                                 min_tensor_bytes=2**16, between=between)
    runs = [(s.block_modes, s.plan_source, round(s.step_seconds, 3)) for s in history]
    assert at_start, runs                       # a trial ran ...
    (times, ran), = at_start
    assert len(times) >= mix_runs.TRIAL_STEPS, (times, runs)    # ... on two steps of the plan
    assert ran == min(times[-mix_runs.TRIAL_STEPS:]), (times, ran)
    plan = started[0][1]
    assert "selective" in plan.hybrid.modes or \
        ran > plan.hybrid.predicted.total_seconds * (1 + checks.MISS), (ran, runs)
    assert all(s.peak_resident_bytes <= budget for s in history)


@pytest.mark.parametrize("ran", [2.5, 1.5])   # the plan goes back; the fallback stays
def test_a_size_is_not_planned_again_while_its_fallback_is_on_trial(monkeypatch, ran):
    # A plan made mid-trial takes the fallback as the mix the size runs (the incumbent another
    # must beat by 10%), and replacing the plan ended the trial without its verdict: the
    # emulated-link benchmark's 8-block Llama ran one block kept at 431-641 ms for the rest of
    # its run where three kept had run 394-396. Put off until the verdict, planned then.
    modes, step, pred, hp = _scripted_modes()
    made = []
    monkeypatch.setattr(modes, "_make", lambda key, **kw: made.append(key))
    step(3 * pred)
    step(2 * pred)                              # a miss, twice: the fallback runs next
    step(2 * pred)
    tried = modes.plans[5]
    assert modes.trials.running(5, tried)
    modes.replan(5, 1.3)                        # a correction asks for a plan: put off
    assert made == [] and modes.plans[5] is tried and 5 in modes.stale
    step(ran * pred)
    modes.replan(5, 1.3)
    assert made == [] and modes.plans[5] is tried
    step(ran * pred)                            # the verdict
    assert not modes.trials.running(5, modes.plans[5])
    assert (modes.plans[5] is tried) == (ran < 2 * (1 - 0.1))
    modes.replan(5, 1.0)                        # decided: planned again at once
    assert made == [5] and 5 not in modes.stale


def test_on_the_emulated_link_a_mix_that_copies_as_predicted_skips_a_trial_its_model_rules_out():
    # The real clock, the rule above: blocks whose recompute sleeps 40 ms (``SlowRecompute``),
    # a 1 GB/s emulated link. Once the first plans' fallbacks have run, the size keeps every
    # block and copies about 48 MB (more than a tenth of its step on the link: a mix the model
    # is least sure of), and runs at or under its prediction (about 100 ms); its fallback, every
    # block full, is predicted (and runs) at about 220 ms. Before the rule, the fallback ran its
    # three steps of trial all the same, at 215-222 ms.
    history = _slow_recompute_run(12)
    runs = [(s.block_modes, round(s.step_seconds * 1e3), s.predicted_step_seconds and
             round(s.predicted_step_seconds * 1e3), s.offloaded_bytes) for s in history]
    kept = [i for i, s in enumerate(history) if s.block_modes == (4, 0, 0) and i > 0]
    assert kept and history[kept[0]].offloaded_bytes > 0, runs
    first = kept[0]
    assert all(s.block_modes == (4, 0, 0) for s in history[first:]), runs


def test_on_the_emulated_link_a_mix_that_copies_as_predicted_is_not_tried_against_a_slower_fallback(
        monkeypatch):
    # The real clock, ``mix_runs.may_win``: the run above, every plan's fallback predicted 5%
    # slower than the plan (as the scripted test does), within the 10% a switch asks for. A
    # trial starts only where the faster of the plan's two steps ran over its prediction by
    # more than MISS, or no faster than its fallback's; before the rule, a plan that copies and
    # ran as predicted was tried all the same (it failed here in two runs of three).
    from chameleon_swap.policy import block_modes, checks, mix_runs
    learn, start = block_modes.BlockModes._learn_run, mix_runs.Trials.start
    preds, started = [], []

    def slower_fallback(self, profile, calls):
        p = self.plan
        fb = p and p.hybrid.fallback
        if fb is not None and fb.predicted is not None and self.plans.get(self.key) is p \
                and not self.trials.running(self.key, p):
            fb = replace(fb, swap=replace(fb.swap, predicted=replace(
                fb.swap.predicted, total_seconds=1.05 * p.hybrid.predicted.total_seconds)))
            self.plan = self.plans[self.key] = replace(p, hybrid=replace(p.hybrid, fallback=fb))
        preds.append((self.predicted_seconds(), profile.step_seconds,
                      self.plan is not None and self.plan.hybrid.predicted.moved_bytes > 0))
        return learn(self, profile, calls)

    def recorded(self, key, plan, ran):
        out = start(self, key, plan, ran)
        if out is not None:                             # a trial starts (not: asked for one
            started.append((ran, preds[-1][0]))         # where there is no fallback left)
        return out
    monkeypatch.setattr(block_modes.BlockModes, "_learn_run", slower_fallback)
    monkeypatch.setattr(mix_runs.Trials, "start", recorded)
    history = _slow_recompute_run(12)
    runs = [(s.block_modes, round(s.step_seconds * 1e3), s.predicted_step_seconds and
             round(s.predicted_step_seconds * 1e3)) for s in history]
    spared = [(pr, ran) for pr, ran, moves in preds if moves and pr and ran and ran < 1.05 * pr]
    assert len(spared) >= 2, (preds, runs)              # the rule was asked ...
    assert all(ran > pr * (1 + checks.MISS) or ran >= 1.05 * pr for ran, pr in started), \
        (started, runs)                                 # ... and kept


def _told_a_fast_link(monkeypatch) -> nn.Module:
    """A CheapNet whose engine's planner is told the link is 1 TB/s each way (the emulated one
    is far slower), with the loop's other learners off (the checks' replans, keep views
    corrected by timed steps, the host time of a move, the first plans' fallbacks)."""
    from chameleon_swap.policy import block_modes, checks, keep_views
    monkeypatch.setattr(block_modes, "FIRST_PLANS_FALL_BACK", False)
    monkeypatch.setattr(cs.Chameleon, "_bandwidth", lambda self: (1e12, 1e12))
    monkeypatch.setattr(checks, "MISSES_TO_REPLAN", 10**9)
    monkeypatch.setattr(keep_views, "corrected", lambda *a, **k: None)
    monkeypatch.setattr(checks.PlanChecks, "move_seconds", lambda self: 0.0)   # copies: free
    torch.manual_seed(0)
    return CheapNet()


def test_a_fallback_on_trial_on_the_emulated_link_reaches_its_verdict_though_asked_to_replan(
        monkeypatch):
    # The real clock, the rule above: as the test below, a planner told the link is far faster
    # than the emulated one keeps and swaps, runs slow and tries its fallback; here every step of
    # the trial also marks the size to be planned again (as a correction of its keep view does).
    # The fallback runs its steps all the same, to the verdict.
    from chameleon_swap.policy import mix_runs
    model = _told_a_fast_link(monkeypatch)
    batches = [(randn(4, 2048, 64, seed=0),)] * 9
    verdicts, on_trial = [], []
    back = mix_runs.Trials.back

    def recorded(self, key, n, seen):
        out = back(self, key, n, seen)
        if n == mix_runs.TRIAL_STEPS:
            verdicts.append(key)
        return out
    monkeypatch.setattr(mix_runs.Trials, "back", recorded)

    def between(eng):
        m = eng._policy.modes
        m._probe, m._probed = None, True
        running = [k for k, p in m.plans.items() if m.trials.running(k, p)]
        on_trial.append(bool(running))
        m.stale.update(running)                 # asked to plan again, every step of the trial
    history, _, budget = compare(model, batches, 0.4, model_kwarg=True, emulate_link="200MB/s",
                                 min_tensor_bytes=2**16, between=between)
    runs = [(s.block_modes, s.plan_source, s.offloaded_bytes) for s in history]
    assert any(on_trial), runs                  # a trial ran ...
    first = on_trial.index(True)
    assert on_trial[first:first + mix_runs.TRIAL_STEPS] == [True] * mix_runs.TRIAL_STEPS, runs
    assert verdicts, runs                       # ... its steps, to its verdict
    assert all(s.peak_resident_bytes <= budget for s in history)


def test_a_mix_that_copies_and_runs_slow_on_the_emulated_link_gives_way_to_its_fallback(
        monkeypatch):
    # The real clock: the planner is told the link is 5000x faster than the emulated one the
    # copies really take (its model of the link is wrong, as on an H100 whose profile counted
    # stalls as compute), so it keeps every block and swaps. The steps wait for the copies far
    # beyond the prediction; the plan's fallback, which moves nothing, runs next and stays.
    # The loop's other learners, which would leave the mix first by ways of their own, are off
    # (the checks, keep views corrected by timed steps, the selective probe, the host time of a
    # move, the first plans' fallbacks: tested apart); the step times the decision reads are the
    # wall clock's.
    from chameleon_swap.policy import checks
    model = _told_a_fast_link(monkeypatch)
    batches = [(randn(4, 2048, 64, seed=0),)] * 8
    trials = []

    def between(eng):
        m = eng._policy.modes
        m._probe, m._probed = None, True
        trials.append(dict(m.trials.by_key))
    history, _, budget = compare(model, batches, 0.4, model_kwarg=True, emulate_link="200MB/s",
                                 min_tensor_bytes=2**16, between=between)
    runs = [(s.block_modes, s.plan_source, s.offloaded_bytes) for s in history]
    at = next((i for i, t in enumerate(trials) if t), None)   # the step it was tried after
    assert at is not None, runs
    (missed, ran, tried), = trials[at].values()
    assert missed.hybrid.predicted.moved_bytes > 0 and history[at].offloaded_bytes > 0, runs
    assert history[at].step_seconds > (1 + checks.MISS) * history[at].predicted_step_seconds
    assert history[at + 1].plan_source == "replanned", runs
    assert not tried.hybrid.predicted.moved_bytes
    for s in history[at + 1:]:                  # the fallback ran, and stayed: no copies
        assert s.block_modes[0] < 4 and s.offloaded_bytes == 0, runs


# --------------------------------------------------------------------------- planning time
def test_planning_again_waits_while_planning_took_more_than_its_share_of_the_steps(
        monkeypatch):
    from chameleon_swap.policy import block_modes
    made = []
    modes = block_modes.BlockModes(lambda: (1e9, 1e9))
    monkeypatch.setattr(modes, "_plan_key", made.append)
    modes.planning_seconds, modes.trained_seconds = 1.0, 1.0      # 100% of the steps' time
    modes.replan(7, 1.0)
    assert made == [] and 7 in modes.stale                        # put off, not dropped
    modes.trained_seconds = 1.0 / block_modes.PLANNING_SHARE      # now within its share
    modes.replan(7, 1.0)
    assert made == [7] and 7 not in modes.stale
    assert modes.planning_seconds >= 1.0                          # the plan's time counts


def test_planning_time_stays_within_its_share_after_the_first_plans_on_the_emulated_link():
    # The real clock: every plan a run makes after each size's first is paid from the share,
    # except those made at once when the first step's views are corrected (``_thaw``, once).
    model = tiny_llama(dim=64, n_layers=3)
    batches = lm_batches(model, [24, 32, 24, 32] * 4)
    budget = int(natural_peak(model, batches[1]) * 0.3)
    plans = []                                   # (first, free, seconds) of every plan made
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      emulate_link="20MB/s", plan_in_background=False) as eng:  # (timed here)
        modes = eng._policy.modes
        make = modes._make

        def timed(key, free=False, after=None):
            first = key not in modes.plans
            t0 = time.perf_counter()
            make(key, free=free, after=after)
            plans.append((first, free, time.perf_counter() - t0))
        modes._make = timed
        for b in batches:
            train_step(model, b, eng)
            assert eng.last_step.peak_resident_bytes <= budget
        from chameleon_swap.policy.block_modes import PLANNING_SHARE
        again = sum(s for first, free, s in plans if not first and not free)
        firsts = [s for first, _, s in plans if first]
        # One plan may start while within the share and end past it.
        assert again <= PLANNING_SHARE * modes.trained_seconds - sum(firsts) + max(
            s for *_, s in plans), plans
        assert sum(free for _, free, _ in plans) <= len(modes.plans)        # one thaw
        assert modes.unrationed == pytest.approx(sum(s for _, free, s in plans if free), rel=0.05)


def test_replans_that_keep_choosing_the_same_mix_wait_longer_each_time(monkeypatch):
    # On the CPU demo (8 blocks) each replan took 40-80 ms on 50-70 ms steps, and most chose
    # the mix the size had. After such a replan the size waits 2 of its visits, then 4, 8...;
    # a replan that changes the mix ends the wait. Counted in visits: no clock involved.
    from types import SimpleNamespace
    from chameleon_swap.policy import block_modes
    modes = block_modes.BlockModes(lambda: (1e9, 1e9))
    chosen = {"modes": {0: "full"}}
    made = []

    def plan_key(key):
        made.append(modes.visits.get(key, 0))
        modes.plans[key] = SimpleNamespace(modes=dict(chosen["modes"]), replanned=False)
    monkeypatch.setattr(modes, "_plan_key", plan_key)
    modes.trained_seconds = 1e9                                   # the share never binds
    modes._make(7)                                                # the size's first plan
    for visit in range(1, 16):
        modes.visits[7] = visit
        modes.replan(7, 1.0)                                      # asked at every visit
    # The first plan, then replans at visits 1, 3 (2 later), 7 (4 later), 15 (8 later).
    assert made == [0, 1, 3, 7, 15], made
    chosen["modes"] = {0: "keep"}                                 # a replan that changes it
    for visit in range(16, 40):
        modes.visits[7] = visit
        modes.replan(7, 1.0)
        if len(made) == 7:
            break
    assert made[5:] == [31, 32], made    # waited 16 visits, changed the mix: no wait after it


def test_a_replan_put_off_takes_no_second_correction_against_the_same_plan(monkeypatch):
    # Misses measured against one plan correct its model once: while the replan waits for its
    # share of time, later misses of the same plan would correct it again, compounding.
    from chameleon_swap.policy import block_modes
    modes = block_modes.BlockModes(lambda: (1e9, 1e9))
    monkeypatch.setattr(modes, "_plan_key", lambda key: None)
    modes.planning_seconds, modes.trained_seconds = 1.0, 1.0
    modes.begin_step(1000)
    modes.replan(7, 0.8, missed_bytes=100)
    modes.replan(7, 0.8, missed_bytes=100)
    assert modes.compute_scale[7] == 0.8 and modes.margin[7] == 100
    modes.trained_seconds = 100.0                                # within its share now
    modes.replan(7, 1.0)
    assert 7 not in modes.stale and 7 not in modes.put_off
    modes.planning_seconds = 1e9                                 # a new plan, new misses
    modes.replan(7, 0.5)
    assert modes.compute_scale[7] == 0.4


# --------------------------------------------------------------------------- the first plans
def _scripted_view(hp):
    """The keep view of ``_scripted_modes``'s size: its plan's profile (every block kept) and
    its four blocks, at 1000 input bytes."""
    from chameleon_swap.planning.modes import Block
    from chameleon_swap.policy.keep_views import KeepView
    return KeepView(hp.profile, [Block(2 * b, 2 * b + 2, 2e-3, 2**18) for b in range(4)],
                    [0, 1, 2, 3], 1000)


def _quiet(plan, searched, budget) -> bool:
    """``plan`` is the quiet mix (``planning/quiet.py``: kept and full blocks, nothing moved,
    fitting ``budget``), at least as fast as the fallback the full search (``searched``)
    carried."""
    p = plan.predicted
    return (set(plan.modes) <= {"keep", "full"} and not p.moved_bytes and p.peak_bytes <= budget
            and p.total_seconds <= searched.fallback.predicted.total_seconds * (1 + 1e-9))


def test_plans_from_the_first_steps_times_run_their_fallback_until_a_later_step_is_timed():
    # On an H200 the demo's first plain step ran 2.6x its later time; planned from such a
    # step, copies looked hidden, and the engine kept every block and moved the rest for ten
    # steps at 3-9x checkpointing's time. Until compute is timed again the plan's mix that
    # moves nothing runs (no selective probe either); then every size is planned again.
    from chameleon_swap.planning.modes import plan_hybrid
    from chameleon_swap.policy import block_modes
    modes, _, _, hp = _scripted_modes()
    assert block_modes.FIRST_PLANS_FALL_BACK and not modes.warm
    assert set(hp.modes) == {"keep"}            # so its profile is the keep view's
    view = _scripted_view(hp)
    modes.views[5], modes.budget, modes.input_bytes = view, modes.plans[5].budget, 1000
    del modes.plans[5]
    modes._make(5)
    first = modes.plans[5].hybrid
    assert _quiet(first, hp, modes.budget) and modes._probe is None
    modes._warmed(True)
    assert modes.warm and 5 in modes.stale
    modes._make(5)
    again = plan_hybrid(modes.plans[5].hybrid.profile, view.blocks, modes.budget)
    assert modes.plans[5].hybrid.modes == hp.modes == again.modes
    assert modes.plans[5].hybrid.predicted.moved_bytes > 0


def test_a_size_planned_from_another_sizes_view_runs_its_fallback_until_it_has_its_own():
    # A size's first plan comes from the nearest size's keep view, scaled: its copies are a guess
    # (the CPU demo, 25%: a length first planned so kept three blocks and moved 3.9 MB, predicted
    # 60-67 ms, and ran 84-102 ms where checkpointing ran 58-63). Warm or not, the plan's mix that
    # moves nothing runs until the size has a view of its own; then the search's mix does.
    modes, _, _, hp = _scripted_modes()
    view = _scripted_view(hp)
    budget = modes.plans.pop(5).budget
    modes.views[4], modes.budget, modes.input_bytes, modes.warm = view, budget, 1000, True
    modes._make(5)                               # key 5: no view of its own, key 4's scaled
    first = modes.plans[5]
    assert not first.measured and first.stand_in and _quiet(first.hybrid, hp, budget)
    modes.views[5] = view                       # its own, as a timed step gives it
    modes._make(5)
    assert modes.plans[5].measured and not modes.plans[5].stand_in
    assert modes.plans[5].hybrid.modes == hp.modes and modes.plans[5].hybrid.predicted.moved_bytes


def test_selective_is_planned_and_probed_only_where_the_runner_saw_it_can_run():
    # Selective figures known and cheap: a warm plan recomputes selectively. Blocks whose kept
    # run showed that selective checkpointing would fail them (the runner's selective_safe, a
    # list it changes in place) get no selective figures, so no plan runs them selective and
    # the probe that measures selective never picks them.
    modes, _, _, hp = _scripted_modes()
    view = _scripted_view(hp)
    budget = modes.plans.pop(5).budget
    modes.views[5], modes.budget, modes.input_bytes, modes.warm = view, budget, 1000, True
    modes.sel_bytes_ratio, modes.sel_seconds_ratio = 0.05, 0.05
    modes.bandwidth_fn = lambda: (1e6, 1e6)       # a slow link: copies cannot hide
    modes.selective_safe = [True] * 4
    modes._make(5)
    assert "selective" in modes.plans[5].hybrid.modes
    modes.selective_safe[:] = [False, True, False, True]
    modes._make(5)
    ran = modes.plans[5].hybrid.modes
    assert ran[0] != "selective" and ran[2] != "selective", ran
    modes.selective_safe[:] = [False] * 4
    modes._make(5)
    assert "selective" not in modes.plans[5].hybrid.modes
    modes.sel_bytes_ratio = modes.sel_seconds_ratio = None        # not measured yet: a probe
    modes._make(5)
    assert "full" in modes.plans[5].hybrid.modes and modes._probe is None and not modes._probed
    modes.selective_safe[:] = [True] * 4
    modes._make(5)
    assert modes._probe is not None and modes.plans[5].modes[modes._probe] == "full"


def test_the_selective_probe_runs_only_where_the_plan_recomputes_the_block_fully():
    # The probe is chosen by one size's plan and runs on the next step the block appears in:
    # it replaces a full recompute there, never a kept block (a size the budget holds whole lost
    # a step to it: the emulated-link benchmark's 8-block Llama at 75%, 256 tokens).
    modes, _, _, hp = _scripted_modes()
    plan = modes.plans[5]
    b = max(plan.modes)
    modes.budget = 10**12
    for planned, want in (("keep", "keep"), ("full", "selective")):
        modes.begin_step(modes.budget)
        modes.plan = replace(plan, modes={**plan.modes, b: planned},
                             working_set={**plan.working_set, b: 2000})
        modes.key, modes.input_bytes, modes.upsized = 5, 1000, False
        modes._probe, modes._probed, modes.probing = b, False, None
        assert modes.mode(b, 1000) == want
        assert (modes.probing == b) == (want == "selective") and modes._probe == b


def test_the_selective_probe_on_the_emulated_link_leaves_a_size_that_fits_whole_alone():
    # The real clock: a long size recomputes (its plan chooses the probe), a short one fits its
    # budget whole. No step of the short size after its first (which may run the long size's
    # plan, the nearest) runs a block selective or full, and every step holds its budget
    # (compare). Before, the probe ran where it was due next: one run of this test ran a short
    # step (3, 1, 0).
    model = tiny_llama(dim=64, n_layers=4)
    lengths = [64, 16] * 6
    batches = lm_batches(model, lengths)
    history, peaks, budget = compare(model, batches, lambda p: int(max(p) * 0.45),
                                     model_kwarg=True, emulate_link="200MB/s")
    assert max(p for p, T in zip(peaks, lengths) if T == 16) <= budget
    rows = [(T, s.block_modes) for T, s in zip(lengths, history)]
    assert all(m[1] == m[2] == 0 for T, m in rows[2:] if T == 16), rows
    assert any(m[2] > 0 for T, m in rows if T == 64), rows


def test_a_first_plans_stand_in_is_not_kept_as_the_mix_the_size_runs():
    # A size keeps the mix it runs unless another is predicted 10% faster; the fallback that
    # stood in for a first plan was never chosen, so the plan made once warm is the search's
    # own even where it is only slightly faster (recomputes cheap here: within 10%).
    from chameleon_swap.planning.modes import Block, SWITCH_GAIN, plan_hybrid
    from chameleon_swap.planning.quiet import plan_quiet
    from chameleon_swap.policy.keep_views import KeepView
    modes, step, _, hp = _scripted_modes()
    cheap = [Block(2 * b, 2 * b + 2, 1e-4, 2**18) for b in range(4)]
    budget = modes.plans.pop(5).budget
    best = plan_hybrid(hp.profile, cheap, budget)
    stand_in = plan_quiet(hp.profile, cheap, budget)
    assert best.predicted.moved_bytes and stand_in is not None
    assert best.predicted.total_seconds > (1 - SWITCH_GAIN) * stand_in.predicted.total_seconds
    assert plan_hybrid(hp.profile, cheap, budget, incumbent=stand_in.modes).modes == \
        stand_in.modes                          # as an incumbent, it would have stayed
    modes.views[5] = KeepView(hp.profile, cheap, [0, 1, 2, 3], 1000)
    modes.budget, modes.input_bytes = budget, 1000
    modes._make(5)
    assert modes.plans[5].stand_in and modes.plans[5].hybrid.modes == stand_in.modes
    for _ in range(3):                          # its steps (the first, slow ones) rank nothing
        assert step(0.5) == stand_in.modes
    assert modes.measured(5, [0, 1, 2, 3]) == {}
    modes._warmed(True)
    modes._make(5)
    assert not modes.plans[5].stand_in and modes.plans[5].hybrid.modes == best.modes


def test_the_first_plans_fall_back_and_are_made_again_on_the_emulated_link(monkeypatch):
    # The real clock: the steps after the first run the first plan's fallback (nothing moved)
    # until one of them is timed in detail (the second runs on a swap plan made from estimates,
    # which asks for a timed step next), and the size is planned again (for the step after,
    # or later where planning has spent its share of the steps' time: a loaded machine). The
    # planner is told the link is fast (a bandwidth measured earlier in the process could
    # otherwise make its first choice all full, which needs no stand-in), so its first plan
    # keeps and copies.
    monkeypatch.setattr(cs.Chameleon, "_bandwidth", lambda self: (1e12, 1e12))
    torch.manual_seed(0)
    model = CheapNet()
    batches = [(randn(4, 2048, 64, seed=i),) for i in range(6)]
    warm, stand_in, ranked = [], [], []

    def between(eng):
        m = eng._policy.modes
        warm.append(m.warm)
        stand_in.append(m.plan is not None and m.plan.stand_in)   # the plan the step ran
        ranked.append(sum(m.runs.steps.values()))                 # steps kept against a mix
    history, _, budget = compare(model, batches, 0.4, model_kwarg=True, emulate_link="1GB/s",
                                 min_tensor_bytes=2**16, between=between,
                                 plan_in_background=False)      # (step by step, as planned)
    runs = [(s.plan_source, s.block_modes, s.offloaded_bytes) for s in history]
    assert all(s.peak_resident_bytes <= budget for s in history)
    assert history[0].plan_source == "guard" and history[0].offloaded_bytes > 0, runs
    w = warm.index(True)                        # the step after which compute was timed again
    assert 1 <= w <= 2, (warm, runs)
    for s in history[1:w + 1]:
        assert s.offloaded_bytes == 0 and s.block_modes[2] > 0, runs
    assert "replanned" in [s.plan_source for s in history[w + 1:]], runs
    # The stand-in's steps (the engine's first, slow ones) are kept against no mix; the steps
    # after it, on a plan the search chose, are.
    assert all(stand_in[1:w + 1]) and ranked[w] == 0, (stand_in, ranked, runs)
    assert ranked[-1] == sum(not x for x in stand_in[w + 1:]) > 0, (stand_in, ranked, runs)


@pytest.mark.usefixtures("plans_land_by_the_next_step")
def test_a_first_step_timed_far_too_slow_steers_no_plan_after_the_next_timed_one(monkeypatch):
    # The real clock, on the emulated link. On an H100 the engine's first step pinned host
    # memory while it ran and its device-timed slots read 11-16 s for a 0.3 s step; plans made
    # from that view predicted 5-50 s for steps that ran in 0.3-0.6 s, and the corrections,
    # clamped, took five visits of a size to catch up. Here the first timed profile's compute
    # is multiplied by 30 as it is taken. The step after it is timed as well (the views are
    # cold), which corrects every cold view at once (``keep_views.thaw``) and plans every size
    # again: from every size's second visit on, predictions hold (without the thaw, steps 4
    # and 5 ran at 0.04x and 0.22x theirs; a size's first visit may run on another size's
    # plan, and a full suite once read the third step at 2.2x). Loose bounds on single steps:
    # this machine's noise alone has doubled a step.
    from chameleon_swap.runtime import profiler as P
    finish, first = P.Profiler.finish, []

    def slow_first(self, *args, **kwargs):
        p = finish(self, *args, **kwargs)
        if p.detailed and not first:
            first.append(p)
            p.compute = [c * 30 for c in p.compute]
        return p
    monkeypatch.setattr(P.Profiler, "finish", slow_first)
    model = tiny_llama(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    batches = lm_batches(model, [128, 256, 192] * 3, B=4)
    timed, cold = [], []

    def between(eng):
        timed.append(eng._profiler.last_profile.detailed)
        cold.append(any(v.cold for v in eng._policy.modes.views.values()))
    history, _, budget = compare(model, batches, lambda peaks: int(max(peaks) * 0.25),
                                 model_kwarg=True, emulate_link="200MB/s", between=between)
    assert first and timed[:2] == [True, True] and cold[0] and not cold[1], (timed, cold)
    off = [s.step_seconds / s.predicted_step_seconds for s in history[3:]]
    assert all(1 / 3 < r < 3 for r in off), [round(r, 2) for r in off]
    assert 2 / 3 < statistics.median(off) < 1.5, [round(r, 2) for r in off]


def test_a_first_step_whose_slots_read_gaps_its_blocks_did_not_skews_no_ratio(monkeypatch):
    # The real clock, on the emulated link (the scripted side: test_keep_views' thaw and ratio
    # tests; a steady clock counts marks, and a block run full takes fewer). On an H100 (HF
    # Llama 4096x8, 50%) the planner held every full recompute at 16x its forward (the clamp)
    # and selective's at 12.6x, where the steps' recomputes ran at about their forward's time;
    # 12k and 16k kept every block for good (1.38x the plain step, selective 1.12x). Their view
    # was the first step's, cold, thawed by its slots' factor: where the first step's slow time
    # falls in slots outside its blocks (timed apart), that factor shrinks the blocks alike.
    # Here the first keep view's first fifth of forward slots reads 100x as it is learnt, its
    # blocks as they ran: the views' blocks keep their times, and the ratios those of the
    # recomputes against them (before the fix: blocks at a twentieth of their first view's,
    # full's ratio 15-16 and selective's 12.6-114, the H100's figures).
    from chameleon_swap.policy import keep_views
    learn, first = keep_views.learn, []

    def gaps_first(profile, *args, **kwargs):
        if not first:
            first.append(profile)
            cut = max(1, profile.n_forward // 5)
            profile.compute = [c * 100 if s < cut else c for s, c in enumerate(profile.compute)]
        return learn(profile, *args, **kwargs)
    monkeypatch.setattr(keep_views, "learn", gaps_first)
    model = tiny_llama(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    blocks, ratios = [], []

    def between(eng):
        m = eng._policy.modes
        ratios.append((m.full_seconds_ratio, m.sel_seconds_ratio))
        v = m.views.get(m.key) or m._view_near(m.input_bytes)
        blocks.append(v and not v.cold and sum(b.forward_seconds for b in v.blocks)
                      / v.input_bytes)          # (per byte of its size: sizes compare)
    compare(model, lm_batches(model, [128, 256, 192] * 3, B=4), 0.5, model_kwarg=True,
            between=between, emulate_link="130MB/s")
    warm = [b for b in blocks if b]
    assert first and warm and max(warm) < 4 * min(warm), blocks   # none shrank 20x
    full, sel = ratios[-1]
    assert full is not None and 0.25 < full < 4, ratios
    assert sel is None or sel < 4, ratios


def _second_step_slowed(monkeypatch, at: tuple = (2,)) -> list:
    """Each engine's second step (its steps ``at``, counted from 1) read 20 times slow (its
    profile's compute, as it is taken); returns a list that holds True from then until the
    caller pops it (to tell what slowed the step). Per profiler (natural_peak's engines have
    their own), held weakly: keyed by id(), a profiler collected after natural_peak could hand
    its count to the next one at its address (a full suite once read the engine's first step as
    the second)."""
    import weakref

    from chameleon_swap.runtime import profiler as P
    finish, flag = P.Profiler.finish, []
    calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def slow_second(self, *args, **kwargs):
        p = finish(self, *args, **kwargs)
        n = calls[self] = calls.get(self, 0) + 1
        if n in at:
            p.compute = [c * 20 for c in p.compute]
            flag.append(True)
        return p
    monkeypatch.setattr(P.Profiler, "finish", slow_second)
    return flag


def _only_the_second_step_is_left_out(read, lengths=(128, 256, 192), slowed=(1,)) -> None:
    """Nine steps of three sizes (``lengths``, three times) at 25% on the emulated link:
    ``read(engine)`` (``checks.pinned`` or ``contended`` of its last profile, or whether the
    policy left the step out) says the second step (the steps ``slowed``, counted from 0:
    ``_second_step_slowed``) was slowed and no other was, and from the step after the last
    slowed one on, the predictions hold."""
    model = tiny_llama(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    batches = lm_batches(model, list(lengths) * 3, B=4)
    seen = []

    def between(eng):
        seen.append(read(eng))
    history, _, budget = compare(model, batches, lambda peaks: int(max(peaks) * 0.25),
                                 model_kwarg=True, emulate_link="200MB/s", between=between)
    assert [i for i, s in enumerate(seen) if s] == list(slowed), seen
    off = [s.step_seconds / s.predicted_step_seconds for s in history[max(slowed) + 2:]]
    assert all(1 / 3 < r < 3 for r in off), [round(r, 2) for r in off]
    assert 2 / 3 < statistics.median(off) < 1.5, [round(r, 2) for r in off]


def test_a_step_slowed_by_pinning_steers_no_plan(monkeypatch):
    # The real clock, on the emulated link. On an H100 the first visit of a longer sequence
    # grew the host arena, pinning for 2-16 s of a 0.5 s step (pinning holds up the step's
    # kernel launches even from the arena's background thread); learnt from, its times made
    # that size's plans predict 2.5-90 s for steps of 0.5-0.6 s. Here the second step (the
    # first of the longest size) is made to read so: its timed compute multiplied by 20 as it
    # is taken, and the arena reporting that it allocated through half of it. Read as pinned
    # (``checks.pinned``), it teaches nothing and is checked against nothing; the next steps
    # are, and from the fourth step on predictions hold (bounds as in the test above).
    from chameleon_swap.copy.host_pool import HostPool
    from chameleon_swap.policy import checks
    allocating, flag = HostPool.allocating_seconds, _second_step_slowed(monkeypatch)

    def pinning(self, since, until):
        return 0.5 * (until - since) if flag and flag.pop() else allocating(self, since, until)
    monkeypatch.setattr(HostPool, "allocating_seconds", pinning)
    _only_the_second_step_is_left_out(lambda eng: checks.pinned(eng._profiler.last_profile))



def test_a_step_slowed_by_the_planner_on_its_cores_steers_no_plan(monkeypatch):
    # The real clock, on the emulated link. On this project's 2-core CPU a size's second visit,
    # run while the first plans were made in the planner process, took 0.66-0.71 s where its
    # later steps took 0.30-0.42 s; learnt from at once, it moved the emulated-link benchmark's
    # 256 tokens at 25% off its fastest mix. Here the second step is made to read 20 times slow
    # and the planner to have shared its cores (``step_end.planner_busy_seconds``): read as slowed
    # (``checks.contended``), it teaches nothing and is checked against nothing.
    from chameleon_swap.policy import checks
    _slowed_beside_the_planner(monkeypatch)
    _only_the_second_step_is_left_out(lambda eng: checks.contended(eng._profiler.last_profile))


def test_steps_of_one_size_slowed_by_the_planner_in_a_row_steer_no_plan(monkeypatch):
    # The real clock, on the emulated link. The planner process works beside a size's first
    # visits in a row: in the emulated-link benchmark (HF Llama 256x8 at 25%) a size's second
    # and third visits ran 0.60-0.64 s with it busy for 0.24-0.42 s of them, where later steps
    # ran 0.33-0.42 s. Left out only as the first of a row (as pinning is), the others taught
    # their mix's time and view, and two misses in a row corrected the size's compute. Here one
    # size's second to fourth steps read 20 times slow beside the planner: each is left out
    # (before: the second only), and the predictions hold after them.
    _slowed_beside_the_planner(monkeypatch, at=(2, 3, 4))
    _only_the_second_step_is_left_out(lambda eng: eng._policy.pinned_step, lengths=(128,) * 3,
                                      slowed=(1, 2, 3))


def _slowed_beside_the_planner(monkeypatch, at: tuple = (2,)) -> None:
    """Each engine's steps ``at`` (``_second_step_slowed``) read 20 times slow, with the planner
    process busy beside them on cores it shares with the step
    (``step_end.planner_busy_seconds``), and no other step so."""
    from chameleon_swap.runtime import step_end
    flag = _second_step_slowed(monkeypatch, at)
    monkeypatch.setattr(step_end, "planner_busy_seconds",
                        lambda eng, since: 1e9 if flag and flag.pop() else 0.0)


@pytest.mark.usefixtures("plans_land_by_the_next_step")
def test_every_size_plans_from_a_view_of_its_own_once_a_timed_step_confirmed_it():
    # The real clock, on the emulated link. A size first planned from another size's view
    # (scaled) runs stand-in plans that move nothing until it has a view of its own. A timed
    # step that finds the scaled view within 10% used to leave it scaled, and the size ran
    # stand-ins for good (without the rule here, three runs in four ended with a size so; the
    # emulated-link benchmark's 384 tokens at 50% ran a stand-in on all of its 12 visits).
    model = tiny_llama(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=256)
    batches = lm_batches(model, [128, 256, 192] * 5, B=4)
    own = []

    def between(eng):
        m = eng._policy.modes
        own.append({k: (k in m.views, m.plans[k].stand_in) for k in m.plans})
    compare(model, batches, lambda peaks: int(max(peaks) * 0.5), model_kwarg=True,
            emulate_link="200MB/s", between=between)
    assert len(own[-1]) == 3 and all(o and not s for o, s in own[-1].values()), own[-1]


def test_a_plan_is_out_of_date_only_when_the_view_it_was_made_from_changes():
    # Each size's plan records the stamp of the keep view it was made from: its own, else the
    # nearest. Another size's view changing leaves it current (the checks go on counting its
    # misses); its own changing, or a nearer view appearing, puts it out of date (planned
    # again at its size's next step end). With one version for every view, 60% of the CPU
    # hybrid benchmark's steps went unchecked, half of them 10% or more off their prediction.
    from chameleon_swap.policy import block_modes
    from chameleon_swap.policy.keep_views import KeepView
    modes = block_modes.BlockModes(lambda: (1e9, 1e9))

    def view(nbytes):
        return KeepView(None, [], [], nbytes)
    modes.views[100] = view(1000)
    modes.views[300] = view(3000)
    modes.input_bytes = 1000
    own = modes.view_stamp(100)
    modes.input_bytes = 2400                         # size 240: no view, plans from 300's
    near = modes.view_stamp(240)
    assert own[0] == 100 and near[0] == 300
    modes.views[300] = view(3000)                    # 300's view corrected
    assert modes.view_stamp(240) != near             # out of date: made from 300's before
    modes.input_bytes = 1000
    assert modes.view_stamp(100) == own              # 100's plan still current
    modes.input_bytes = 2400
    now = modes.view_stamp(240)
    modes.views[250] = view(2500)                    # a nearer view appears
    assert modes.view_stamp(240)[0] == 250 and modes.view_stamp(240) != now
    assert block_modes.keep_views.Views().near(5) is None


@pytest.mark.usefixtures("plans_land_by_the_next_step")
def test_sizes_keep_being_checked_while_other_sizes_views_change_on_the_emulated_link():
    # Three lengths in turn on the real clock: every step that ran a mode plan made from the
    # view as it still is gets checked (its misses counted), however often the other sizes'
    # views are learnt or corrected between its visits.
    from chameleon_swap.policy import checks as checks_mod
    model = tiny_llama(dim=64, n_layers=3)
    batches = lm_batches(model, [24, 40, 32] * 6)
    budget = int(natural_peak(model, batches[1]) * 0.4)
    seen = {"checked": 0}
    orig = checks_mod.PlanChecks.observe

    def observe(self, key, *a, **kw):
        seen["checked"] += key[0] == "modes"      # (a mode plan's prediction, not a swap plan's)
        return orig(self, key, *a, **kw)
    with cs.Chameleon(budget, device="cpu", min_tensor_bytes=0, model=model,
                      emulate_link="20MB/s") as eng:
        checks_mod.PlanChecks.observe = observe
        try:
            for b in batches:
                train_step(model, b, eng)
        finally:
            checks_mod.PlanChecks.observe = orig
        n = len(batches)
    assert seen["checked"] >= 3, (seen, n)       # (before: none of the 18)
