"""The demo's comparison leg (bench/choice.py): keep, swap or recompute against gradient
checkpointing, on the same batches, with every loss bit-for-bit the plain step's."""
from __future__ import annotations

import json

import pytest
import torch

from chameleon_swap import cli
from chameleon_swap.bench import choice, records

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


@pytest.mark.filterwarnings("error::FutureWarning")   # (a deprecated checkpointing call)
def test_the_four_legs_run_side_by_side_and_say_who_won():
    c = choice.run_choice(torch.device("cpu"), 4, tiny=True)
    assert list(c["legs"]) == list(choice.LEGS)
    assert c["losses_identical"] is True and c["losses_exact"] is True
    # The CPU's plain step repeats bit for bit: no second reference run, nothing to be within.
    assert c["reference_max_diff"] is None and "reference_diff" not in c["steps"][0]
    assert all(r["losses_max_diff"] == 0 for r in c["legs"].values())
    assert c["legs"]["none"]["ratio_vs_none"] == pytest.approx(1.0)
    for leg in ("swap only", "chameleon model="):
        assert c["legs"][leg]["fits_budget"] and c["legs"][leg]["peak_saved_bytes"] <= c["budget_bytes"]
    assert c["legs"]["gradient checkpointing"]["peak_saved_bytes"] < c["natural_peak_bytes"]
    assert len(c["legs"]["chameleon model="]["block_modes"]) == 4
    assert c["emulated_link_bytes_per_s"] > 0                  # the CPU runs on an emulated link
    assert "gradient checkpointing" in c["verdict"] and "as fast as" in c["verdict"]
    # Both views: the whole run (first plans and learning included) and its last half.
    for leg in choice.LEGS:
        steady = c["steps"][len(c["steps"]) // 2:]
        assert c["legs"][leg]["steady_ratio_vs_none"] == pytest.approx(
            sum(r[leg]["seconds"] for r in steady) / sum(r["none"]["seconds"] for r in steady))
    assert "over the last 2" in c["verdict"]
    # The engines' planning at step ends is in their seconds, and shown as a share of them.
    for leg in ("swap only", "chameleon model="):
        timed = c["steps"][1:]
        assert c["legs"][leg]["planning_share"] == pytest.approx(
            sum(r[leg]["planning"] for r in timed) / sum(r[leg]["seconds"] for r in timed))
        assert all(0 <= r[leg]["planning"] < r[leg]["seconds"] for r in timed)
        # The engine's own figures beside the leg's wall time: the step without its end, and
        # what its plan predicted (for reading a run afterwards).
        assert all(r[leg]["step_s"] + r[leg]["planning"] <= r[leg]["seconds"] for r in timed)
    assert any(r["chameleon model="]["predicted"] for r in c["steps"][1:])
    # Mode plans made in the planner process: beside the seconds, a share of them too.
    for leg in ("swap only", "chameleon model="):
        assert c["legs"][leg]["background_planning_share"] == pytest.approx(
            sum(r[leg]["beside"] for r in timed) / sum(r[leg]["seconds"] for r in timed))
    assert all(r["swap only"]["beside"] == 0 for r in c["steps"])        # (no mode plans)
    assert "planning_share" not in c["legs"]["gradient checkpointing"]
    lines = choice.table(c)
    assert "last 2" in lines[1]
    assert any(x.startswith("  of which planning at step ends: swap only ") for x in lines)
    assert lines[-1] == c["verdict"] and any("block modes" in x for x in lines)


def test_the_demo_shows_the_comparison(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--size", "tiny", "--steps", "3", "--choice-steps", "3",
                     "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert set(s["choice"]["legs"]) == set(choice.LEGS)
    screen = capsys.readouterr().out
    assert "against gradient checkpointing" in screen and s["choice"]["verdict"] in screen
    try:
        import matplotlib  # noqa: F401
        assert (out / "choice.png").stat().st_size > 10000
    except ImportError:
        pass


def test_choice_steps_is_checked(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--size", "tiny", "--steps", "3", "--choice-steps", "2"])
    assert "choice_steps must be 0" in capsys.readouterr().err


def _steps(diffs: dict, reference: list) -> list:
    """Rows as run_choice makes them: plain losses 1.0, each leg 1.0 + its difference."""
    return [dict({leg: {"seconds": 0.1, "loss": 1.0 + diffs.get(leg, [0.0] * len(reference))[i],
                        "peak": 1, "block_modes": [1, 0, 0]} for leg in choice.LEGS},
                 step=i, length=8, reference_diff=ref) for i, ref in enumerate(reference)]


def test_where_the_plain_step_differs_from_itself_a_leg_within_that_is_exact():
    # On an H200 the demo's plain HF Llama step (bf16, SDPA) differed from a second run of itself
    # after a few steps: a leg can be no more exact than that, and says so by how much.
    peaks = {"none": {8: 4}, "gradient checkpointing": {8: 1}}
    size = choice.SIZES["tiny"]
    args = (peaks, 2, 4, None, False, size, torch.device("cpu"))
    within = choice.summarize(_steps({"swap only": [0, 1e-4, 2e-4]}, [0, 1e-4, 3e-4]), *args)
    assert within["reference_reproducible"] is False and within["reference_max_diff"] == 3e-4
    assert within["legs"]["swap only"]["losses_within_reference"] is True
    assert within["losses_exact"] is True
    line = next(x for x in choice.table(within) if x.startswith("  losses"))
    assert "not bitwise reproducible" in line and "swap only yes" in line
    beyond = choice.summarize(_steps({"chameleon model=": [0, 0, 7e-4]}, [0, 1e-4, 3e-4]), *args)
    assert beyond["legs"]["chameleon model="]["losses_within_reference"] is False
    assert beyond["losses_exact"] is False
    assert "chameleon model= NO" in next(x for x in choice.table(beyond) if "losses" in x)
    # Up to REFERENCE_SLACK times the reference's largest difference is within (one sample of
    # a random walk); a first step that differs where the plain step's own did not is not.
    assert choice.REFERENCE_SLACK == 2.0
    near = choice.summarize(_steps({"chameleon model=": [0, 0, 5e-4]}, [0, 1e-4, 3e-4]), *args)
    assert near["legs"]["chameleon model="]["losses_within_reference"] is True
    first = choice.summarize(_steps({"swap only": [1e-5, 0, 0]}, [0, 1e-4, 3e-4]), *args)
    assert first["legs"]["swap only"]["losses_within_reference"] is False
    loose = choice.summarize(_steps({"swap only": [1e-5, 0, 0]}, [1e-5, 1e-4, 3e-4]), *args)
    assert loose["legs"]["swap only"]["losses_within_reference"] is True
    # A NaN loss is never within, wherever it falls among the steps (max alone would drop it).
    nan = choice.summarize(_steps({"swap only": [0, 0, float("nan")]}, [0, 1e-4, 3e-4]), *args)
    assert nan["legs"]["swap only"]["losses_within_reference"] is False
    assert nan["losses_exact"] is False
    # A reproducible reference leaves the bitwise check alone: a difference is a failure.
    same = choice.summarize(_steps({"swap only": [0, 1e-6, 0]}, [0, 0, 0]), *args)
    assert same["reference_reproducible"] is True and same["losses_exact"] is False
    assert "  losses identical across the four: NO" in choice.table(same)


def test_the_legs_run_with_the_setup_frozen_out_of_full_collections(monkeypatch):
    # A full collection of the whole process (130-180 ms with transformers loaded on this
    # project's CPU) would land on whichever leg was running; the setup's objects are frozen
    # out of them while the legs run, and given back after, also when a leg fails.
    import gc

    import chameleon_swap as cs
    frozen = []
    real = cs.Chameleon.step

    def step(self, *args, **kwargs):
        if self.budget_bytes is not None:             # the legs' engines (not the probes)
            frozen.append(gc.get_freeze_count())
        return real(self, *args, **kwargs)
    monkeypatch.setattr(cs.Chameleon, "step", step)
    before = gc.get_freeze_count()
    choice.run_choice(torch.device("cpu"), 2, tiny=True)
    assert frozen and min(frozen) > 1000
    assert gc.get_freeze_count() == before

    def boom(self, *args, **kwargs):
        if self.budget_bytes is not None:
            raise RuntimeError("leg failed")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(cs.Chameleon, "step", boom)
    with pytest.raises(RuntimeError, match="leg failed"):
        choice.run_choice(torch.device("cpu"), 2, tiny=True)
    assert gc.get_freeze_count() == before
    # A caller that froze objects of its own keeps them frozen.
    monkeypatch.setattr(cs.Chameleon, "step", real)
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        choice.run_choice(torch.device("cpu"), 2, tiny=True)
        assert gc.get_freeze_count() > 0.9 * mine > 0     # (frozen objects may still die)
    finally:
        gc.unfreeze()


def test_the_h100_demo_legs_are_as_exact_as_its_plain_step():
    # The demo as it ran on the project's H100 (bf16, SDPA; its per-step losses, committed): the
    # plain step differed from itself by up to 5.3e-4, each leg from it by up to 4.8e-4 (gradient
    # checkpointing), 6.5e-4 (swap only) and 6.1e-4 (the engine), every first step bit for bit.
    # Read against one sample's maximum, swap only and the engine failed (the demo exited 1);
    # each is within the slack, and a leg whose drift grew past it would not be.
    import copy
    import json
    from pathlib import Path
    path = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h100-2026-11-26b"
            / "demo-summary-h100-97d2c5a.json")
    steps = json.loads(path.read_text())["choice"]["steps"]
    ref = max(r["reference_diff"] for r in steps)
    assert ref == pytest.approx(5.33e-4, rel=1e-2) and steps[0]["reference_diff"] == 0
    for leg in ("gradient checkpointing", "swap only", "chameleon model="):
        assert steps[0][leg]["loss"] == steps[0]["none"]["loss"]
        assert choice.within_reference(steps, leg, ref) is True
    assert max(abs(r["swap only"]["loss"] - r["none"]["loss"]) for r in steps) > ref
    grown = copy.deepcopy(steps)
    grown[-1]["chameleon model="]["loss"] += 3 * ref
    assert choice.within_reference(grown, "chameleon model=", ref) is False


def test_the_interval_of_a_median_is_the_sign_tests():
    # Order statistics k and n+1-k, k the largest with P(Binomial(n, 1/2) < k) <= 2.5%.
    assert records.median_interval([]) == (None, None)
    assert records.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (3.0, None)   # 2/32 > 2.5%
    assert records.median_interval([6, 1, 5, 2, 4, 3]) == (3.5, (1, 6))          # 2/64 <= 2.5%
    assert records.median_interval(list(range(23, 0, -1))) == (12, (7, 17))
    assert records.median_interval(list(range(1, 25))) == (12.5, (7, 18))
    assert records.median_interval(list(range(1, 24)), confidence=0.5)[1] == (10, 14)


def _timed(eng: list, gc: list) -> list:
    """Rows with each leg's seconds: the engine's and checkpointing's as given, the rest 0.1."""
    rows = []
    for i, (e, g) in enumerate(zip(eng, gc)):
        row = {leg: {"seconds": 0.1, "loss": 1.0, "peak": 1, "block_modes": [1, 0, 0]}
               for leg in choice.LEGS}
        row["chameleon model="]["seconds"], row["gradient checkpointing"]["seconds"] = e, g
        rows.append(dict(row, step=i, length=8))
    return rows


def test_the_verdict_compares_step_for_step_and_says_when_noise_hides_the_difference():
    peaks = {"none": {8: 4}, "gradient checkpointing": {8: 1}}
    args = (peaks, 2, 4, None, True, choice.SIZES["tiny"], torch.device("cpu"))
    # The machine's speed swings 3x between steps and the two legs swing together: summed
    # times say little, paired ratios are all 0.9: the engine is faster beyond the noise.
    gc = [0.1, 0.3, 0.1, 0.2, 0.3, 0.1, 0.25, 0.1, 0.3]
    faster = choice.summarize(_timed([0.9 * g for g in gc], gc), *args)
    p = faster["paired"]
    assert (p["leg"], p["against"], p["steps"]) == ("chameleon model=", "gradient checkpointing", 8)
    assert p["median_ratio"] == pytest.approx(0.9) and p["interval"] == pytest.approx([0.9, 0.9])
    assert "took 0.90x gradient checkpointing's time (median of 8 steps" in faster["verdict"]
    assert "beyond the step-to-step noise" in faster["verdict"]
    # Ratios that straddle 1 (as a loaded machine gives): the run cannot tell them apart.
    # (The first step sets up and is left out, as from the summed times.)
    ratios = [1.2, 0.8, 1.1, 0.9, 1.3, 0.85, 1.05, 0.95, 1.0]
    mixed = choice.summarize(_timed([r * g for r, g in zip(ratios, gc)], gc), *args)
    assert mixed["paired"]["median_ratio"] == pytest.approx(0.975)
    lo, hi = mixed["paired"]["interval"]
    assert lo < 1 < hi and "the run cannot tell them apart" in mixed["verdict"]
    assert mixed["verdict"] == choice.table(mixed)[-1]
    # Too few steps for an interval: said so, the median still given.
    short = choice.summarize(_timed([0.09, 0.18, 0.27], [0.1, 0.2, 0.3]), *args)
    assert short["paired"]["interval"] is None and "too few steps" in short["verdict"]


def test_the_verdict_names_the_leg_ahead_in_each_half():
    # Checkpointing ahead over all steps, the engine over the last half (its first steps plan):
    # the second clause names the engine. It read "it is ... as fast as gradient checkpointing"
    # after a first clause whose subject was checkpointing.
    peaks = {"none": {8: 4}, "gradient checkpointing": {8: 1}}
    args = (peaks, 2, 4, None, True, choice.SIZES["tiny"], torch.device("cpu"))
    gc = [0.1] * 9
    eng = [0.1, 0.2, 0.2, 0.2, 0.09, 0.09, 0.09, 0.09, 0.09]
    v = choice.summarize(_timed(eng, gc), *args)["verdict"]
    assert v.startswith("gradient checkpointing is 1.31x as fast as chameleon model= over all")
    assert "over the last 5, chameleon model= is 1.11x as fast as gradient checkpointing" in v
    # The same leg ahead in both: "it".
    v = choice.summarize(_timed([0.09] * 9, gc), *args)["verdict"]
    assert "over the last 5, it is 1.11x as fast as gradient checkpointing" in v


def test_the_h100_link_is_the_h100_s_share_of_what_the_forward_saves_per_second(monkeypatch):
    # A steady mocked clock: each forward takes 0.5 s but the first (1.0 s, warming up); the
    # least of three counts, and autograd records (the H100's 0.172 s forward is a training one).
    ticks = iter([0.0, 1.0, 10.0, 10.5, 20.0, 20.5])
    monkeypatch.setattr(choice.time, "perf_counter", lambda: next(ticks))
    grad = []
    link = choice.h100_link(lambda: grad.append(torch.is_grad_enabled()), 10**9)
    assert link == pytest.approx(choice.H100_LINK_SHARE * 2e9) and grad == [True] * 3
    for bad in ({"saved_bytes": 0}, {"saved_bytes": 1, "tries": 0}):
        with pytest.raises(ValueError, match="saved_bytes > 0 and tries >= 1"):
            choice.h100_link(lambda: None, **{"saved_bytes": 1, **bad})


def test_the_h100_link_follows_the_machine_s_compute_on_the_real_clock():
    # Its real-clock twin: a forward twice as slow gets a link about half as fast (a machine
    # whose compute is slower needs a slower link for the same ratio), whatever the clock's
    # noise adds on top of the 20 and 40 ms sleeps: the least of three, each at least its sleep.
    import time
    fast = choice.h100_link(lambda: time.sleep(0.02), 10**8)
    slow = choice.h100_link(lambda: time.sleep(0.04), 10**8)
    assert fast <= choice.H100_LINK_SHARE * 1e8 / 0.02
    assert slow <= choice.H100_LINK_SHARE * 1e8 / 0.04 < fast
