"""``chameleon-swap bench``: the sweep, written to a directory.

``DIR/results.json`` (a list of records, one per workload x baseline x budget, each with the
device, torch version, commit and config), ``DIR/results.md`` (the tables) and the figures of
``report.py``. Progress is shown while it runs; the tables are printed at the end.
"""
from __future__ import annotations

import json
from pathlib import Path

from .env import environment, progress
from .harness import SweepConfig, run_sweep, steps_per_workload
from .report import markdown, plot_workload


def run_bench(cfg: SweepConfig, out_dir: Path, *, quiet: bool = False) -> list[dict]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(cfg.torch_device)
    figures: list[Path] = []

    def done(name: str, recs: list[dict], info: dict) -> None:
        figures.extend(plot_workload(name, recs, info["runs"], info, out_dir))

    total = steps_per_workload(cfg) * len(cfg.resolved)
    with progress(total, "bench") as advance:
        records = run_sweep(cfg, env, progress=advance, on_workload=done)
    (out_dir / "results.json").write_text(json.dumps(records, indent=1) + "\n")
    head = (f"# chameleon-swap bench\n\n{env['device_name']} ({env['device']}), torch "
            f"{env['torch']}, {records[0]['cpu_threads'] if records else '?'} compute thread(s), "
            f"commit {env['commit']}, {env['date']}.\n\n")
    (out_dir / "results.md").write_text(head + markdown(records))
    if not quiet:
        print(markdown(records))
        print(f"wrote {out_dir / 'results.json'}, {out_dir / 'results.md'}"
              + (f" and {len(figures)} figures" if figures else ""))
    return records
