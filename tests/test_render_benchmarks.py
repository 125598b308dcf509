"""benchmarks/render_benchmarks.py: BENCHMARKS.md's tables are the result files', not typed by hand.

The committed document must be what the committed files render; a changed file changes the
document (and ``--check`` then fails); a document missing a block is an error naming it.
"""
from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def render(monkeypatch):
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    sys.modules.pop("render_benchmarks", None)
    return importlib.import_module("render_benchmarks")


def test_the_committed_document_is_what_the_committed_results_render(render):
    assert render.main(["--check"]) == 0
    text = (ROOT / "BENCHMARKS.md").read_text()
    for name in render.BLOCKS:
        assert f"<!-- render: {name} -->" in text


def _copied_results(render, tmp_path) -> Path:
    results = tmp_path / "results"
    shutil.copytree(ROOT / "benchmarks" / "results" / "h100", results / "h100")
    for label in render.EMULATED:
        name = f"hybrid-emulated-{label}-cpu.json"
        shutil.copy(ROOT / "benchmarks" / "results" / name, results / name)
    return results


def test_a_changed_emulated_run_changes_its_row_and_its_verdict(render, tmp_path):
    results = _copied_results(render, tmp_path)
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text((ROOT / "BENCHMARKS.md").read_text())
    label = next(iter(render.EMULATED))
    path = results / f"hybrid-emulated-{label}-cpu.json"
    d = json.loads(path.read_text())
    d["results"]["25%"]["hybrid@25%"]["paired_vs"]["full-recompute"] = 0.9
    d["results"]["50%"]["hybrid@50%"]["paired_vs"]["selective-recompute"] = 1.2
    path.write_text(json.dumps(d))
    assert render.main(["--check", "--results", str(results), "--doc", str(doc)]) == 1
    assert render.main(["--results", str(results), "--doc", str(doc)]) == 0
    block = doc.read_text().split("<!-- render: cpu-emulated -->")[1]
    row = next(line for line in block.splitlines() if f"{label}-cpu.md" in line)
    assert "| **0.900 (" in row and "| 1.200 (" in row     # met at 25%; missed at 50%


def test_a_changed_result_changes_the_table_and_fails_the_check(render, tmp_path, capsys):
    results = _copied_results(render, tmp_path)
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text((ROOT / "BENCHMARKS.md").read_text())
    path = results / "h100" / "hybrid-h100-4096x8.json"
    d = json.loads(path.read_text())
    before = d["results"]["25%"]["hybrid@25%"]["ratio_vs_none"]
    d["results"]["25%"]["hybrid@25%"]["ratio_vs_none"] = 1.05
    d["results"]["25%"]["hybrid@25%"]["block_modes"] = [0, 2, 6]
    path.write_text(json.dumps(d))
    assert render.main(["--check", "--results", str(results), "--doc", str(doc)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert render.main(["--results", str(results), "--doc", str(doc)]) == 0
    text = doc.read_text()
    # Within the rendered block: the hand-written sections may quote the same figure.
    block = text.split("<!-- render: h100-llama -->")[1].split("<!-- /render: h100-llama -->")[0]
    assert f"**{before:.2f}x (" not in block and "**1.05x (" in block and "(0, 2, 6)" in block
    # The comparison follows the numbers: 1.05x now beats full recomputation's 1.27x.
    assert "4096x8 @25%: hybrid 1.05x, faster than full recomputation 1.27x." in text
    assert render.main(["--check", "--results", str(results), "--doc", str(doc)]) == 0


def test_a_missing_block_or_file_is_named(render, tmp_path):
    with pytest.raises(ValueError, match="no block 'h100-env'"):
        render.render("# nothing here\n")
    with pytest.raises(FileNotFoundError, match="hybrid-h100-4096x8.json is missing"):
        render.render((ROOT / "BENCHMARKS.md").read_text(), tmp_path)


def test_the_pooled_verdict_is_what_the_interval_decides(render):
    assert render.verdict(0.90, 0.95, 0.95) == "**met**"
    assert render.verdict(0.951, 0.99, 0.95) == "missed"
    assert render.verdict(0.93, 0.97, 0.95) == "not decided"
    values = [0.9, 1.1, 1.0, 0.95, 1.05, 0.97]
    low, high = render._interval(values)
    assert min(values) <= low <= render.statistics.median(values) <= high <= max(values)
    assert render._interval(values) == (low, high)          # the document renders the same
    assert render._interval([1.0] * 5) == (1.0, 1.0)


def test_pooled_runs_follow_their_files_and_pool_one_config(render, tmp_path):
    results = _copied_results(render, tmp_path)
    pooled = [label for label in render.EMULATED
              if render._pool_key(render._emulated(results, label))
              == render._pool_key(render._emulated(results, list(render.EMULATED)[-1]))]
    for label in pooled:                     # every pooled run meets 25% and misses 50%
        path = results / f"hybrid-emulated-{label}-cpu.json"
        d = json.loads(path.read_text())
        d["results"]["25%"]["hybrid@25%"]["paired_vs"]["full-recompute"] = 0.9
        d["results"]["50%"]["hybrid@50%"]["paired_vs"]["selective-recompute"] = 1.1
        path.write_text(json.dumps(d))
    block = render.pooled_block(results)
    n = len(pooled)
    rows = [line for line in block.splitlines() if line.startswith(f"| all {n} (")]
    assert len(rows) == 4, block
    assert f"| 0.900 | 0.900-0.900 | {n} of {n} | **met** |" in rows[0]
    assert f"| 1.100 | 1.100-1.100 | 0 of {n} | missed |" in rows[1]
    # A run on another link is not pooled with the rest.
    path = results / f"hybrid-emulated-{pooled[0]}-cpu.json"
    d = json.loads(path.read_text())
    d["config"]["emulated_link"] = "999MB/s"
    path.write_text(json.dumps(d))
    assert f"| all {n - 1} (" in render.pooled_block(results)


def test_each_link_is_pooled_apart_the_latest_run_s_first(render, tmp_path):
    # The runs on the H100's ratio (measured on each run's machine) make a pool of their own,
    # rendered first as the latest run's; the 130 MB/s runs stay pooled on their fixed link.
    # Two of those moved to the ratio (measured at 100 and 900 MB/s) move to its pool.
    results = _copied_results(render, tmp_path)
    runs = {label: render._emulated(results, label) for label in render.EMULATED}
    ratio = [label for label, d in runs.items() if d["config"]["emulated_link"] == "h100"]
    fixed = [label for label, d in runs.items() if d["config"]["emulated_link"] == "130MB/s"
             and d["config"]["layers"] == 8]
    assert ratio and list(runs)[-1] in ratio and len(fixed) >= render.POOL_MIN + 2

    def pools() -> list:
        return render.pooled_block(results).split("Pooled: ")[1:]
    assert f"| all {len(ratio)} (" in pools()[0] and f"| all {len(fixed)} (" in pools()[1]
    assert "on 130MB/s." in pools()[1]
    for label, bw in zip(fixed[-2:], (100e6, 900e6)):
        path = results / f"hybrid-emulated-{label}-cpu.json"
        d = json.loads(path.read_text())
        d["config"].update(emulated_link="h100", emulated_link_bytes_per_s=bw)
        path.write_text(json.dumps(d))
    first, second = pools()[:2]
    assert "an H100's ratio of bytes to compute, measured on each run's machine (100-900 MB/s)" \
        in first and f"| all {len(ratio) + 2} (" in first
    assert f"| all {len(fixed) - 2} (" in second
    assert "h100 ratio, 900 MB/s" in render.emulated_block(results)


def test_the_pool_says_where_a_target_s_recomputation_exceeds_the_budget(render, tmp_path):
    # hybrid.py records what each recomputation keeps after its forward per length and whether
    # the budget holds it; where a target's comparator does not fit (selective at 50%), the
    # pooled section says so under its table, from the latest run; a run that fits says nothing.
    results = _copied_results(render, tmp_path)
    latest = list(render.EMULATED)[-1]
    path = results / f"hybrid-emulated-{latest}-cpu.json"
    d = json.loads(path.read_text())
    sel = d["results"]["50%"]["selective-recompute"]
    sel["kept_bytes_per_length"] = {"256": 2**20, "512": 60 * 2**20}
    sel["fits_per_length"] = {"256": True, "512": False}
    d["results"]["50%"]["hybrid@50%"]["budget_bytes"] = 40 * 2**20
    path.write_text(json.dumps(d))
    first = render.pooled_block(results).split("Pooled: ")[1]
    assert ("keeps more after its forward than the budget: at 50%, selective recomputation at "
            "512 tokens (60.0 MiB against 40.0)") in first
    sel["fits_per_length"] = {"256": True, "512": True}
    path.write_text(json.dumps(d))
    assert "keeps more after its forward" not in render.pooled_block(results)
