"""The demo's comparison leg (bench/choice.py): keep, swap or recompute against gradient
checkpointing, on the same batches, with every loss bit-for-bit the plain step's."""
from __future__ import annotations

import json

import pytest
import torch

from chameleon_swap import cli
from chameleon_swap.bench import choice

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")   # see conftest.py


def test_the_four_legs_run_side_by_side_and_say_who_won():
    c = choice.run_choice(torch.device("cpu"), 4, tiny=True)
    assert list(c["legs"]) == list(choice.LEGS)
    assert c["losses_identical"] is True
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
    lines = choice.table(c)
    assert "last 2" in lines[1]
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
