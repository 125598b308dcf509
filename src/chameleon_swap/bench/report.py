"""Turn sweep records into a markdown table and matplotlib figures.

Figures (one set per workload, written only when matplotlib is installed):

* ``memory-<workload>.png``: device memory over one step (the training step with the most tokens),
  per baseline, from the metered pass, with the memory each budget implies;
* ``throughput-<workload>.png``: tokens/s against the budget; baselines without a budget are
  horizontal lines, drawn solid where they fit the budget's memory and dotted where they do not;
* ``steps-<workload>.png``: a strip per engine run: which plan served each step, and where the
  operator sequence changed.

And the demo's comparison leg (``plot_choice``, ``choice.png``).
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Optional

from ..config import format_bytes

SOURCES = {"guard": "#d62728", "planned": "#2ca02c", "cache": "#1f77b4", "replanned": "#ff7f0e"}


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else format_bytes(n)


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}"


def _yes(v: Optional[bool]) -> str:
    return "-" if v is None else ("yes" if v else "**no**")


def markdown(records: list[dict]) -> str:
    """A table per workload; peers appear once per budget since fitting depends on it."""
    lines = []
    for w in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == w]
        first = rows[0]
        lines += [f"### {w}", "",
                  f"natural activation peak {_mib(first['natural_peak_bytes'])}; "
                  f"{first['steps']} timed steps after {first['warmup']} warm-up; "
                  f"peak = {first['peak_source'] or 'not measured'}.", "",
                  *reference_note(first),
                  "| budget | baseline | step ms (median) | IQR ms | x none | tokens/s | peak | "
                  "memory the budget implies | fits | activations held to budget | moved out | "
                  "stall ms | sync fetches | seq. changes (served by) | block modes (keep,sel,full:"
                  " steps) | OOM | losses identical |",
                  "|" + " --- |" * 17]
        for r in sorted(rows, key=lambda r: (r["budget_bytes"], _order(r["baseline"]))):
            served = r["changes_served_by"]
            changes = "-" if r["sequence_changes"] is None else (
                f"{r['sequence_changes']}" + (" (" + ", ".join(f"{k} {v}" for k, v in served.items())
                                              + ")" if served else ""))
            lines.append("| " + " | ".join([
                f"{r['budget']} ({_mib(r['budget_bytes'])})", r["label"],
                _ms(r["step_seconds_median"]), _ms(r["step_seconds_iqr"]),
                "-" if r["ratio_vs_none"] is None else f"{r['ratio_vs_none']:.2f}",
                "-" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:.0f}",
                _mib(r["peak_bytes"]), _mib(r["memory_cap_bytes"]), _yes(r["fits"]),
                _yes(r["budget_held"]) if r["budget_applies"] else "n/a",
                _mib(r["moved_bytes"]), _ms(r["stall_seconds"]),
                "-" if r["sync_fetches"] is None else str(r["sync_fetches"]), changes,
                _modes(r.get("block_modes")),
                "**OOM**" if r["oom"] else ("error" if r["error"] else "no"),
                exactness(r)]) + " |")
        lines.append("")
    return "\n".join(lines)


def _modes(counts: Optional[dict]) -> str:
    return "-" if not counts else ", ".join(f"{m}: {n}" for m, n in counts.items())


def reference_note(record: dict) -> list[str]:
    """The line that says the plain step differs from itself, when it does (else nothing)."""
    if record.get("reference_reproducible") is not False:
        return []
    return [f"reference not bitwise reproducible (max diff {record['reference_max_diff']:.3g}): "
            f"two runs of the plain step differ, so the last column says whether each "
            f"baseline's losses stay within that difference of the plain step's.", ""]


def exactness(record: dict) -> str:
    """The "losses identical" cell: yes/no bit for bit where the reference is reproducible;
    where it is not, whether the run stays within the reference's own difference."""
    if record.get("reference_reproducible") is not False or record["losses_identical"]:
        return _yes(record["losses_identical"])
    within, diff = record.get("losses_within_reference"), record.get("losses_max_diff")
    if within is None:
        return "-"
    shown = "nan" if diff is None else f"{diff:.3g}"
    return (f"within reference (max diff {shown})" if within
            else f"**no**: max diff {shown} > reference's")


def _order(name: str) -> int:
    from .baselines import BASELINES
    return BASELINES.index(name) if name in BASELINES else len(BASELINES)


# --------------------------------------------------------------------------- figures
def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def plot_workload(workload: str, records: list[dict], runs: list, info: dict,
                  out_dir: Path) -> list[Path]:
    """The three figures of one workload; returns the files written (none without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fn in (_memory_figure, _throughput_figure, _strip_figure):
        path = fn(plt, workload, records, runs, info, out_dir)
        if path is not None:
            written.append(path)
    return written


def _memory_figure(plt, workload, records, runs, info, out_dir) -> Optional[Path]:
    steps = info.get("curve_steps") or []
    if not steps:
        return None
    step = steps[0]
    curves = [(r, r.curves[step]) for r in runs if step in r.curves]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for run, curve in curves:
        xs = [t * 1e3 for t, _, _ in curve]
        label = run.label if run.budget is None else f"{run.label} @ {run.budget.label}"
        ax.step(xs, [b / 2**20 for _, b, _ in curve], where="post", label=label, linewidth=1.3)
        if run.baseline == "none":                  # its saved activations, as a shaded area
            ax.fill_between(xs, [s / 2**20 for _, _, s in curve], step="post", alpha=0.15,
                            color="grey", label="saved activations (none)")
    caps = {(r["budget"], r["memory_cap_bytes"]) for r in records if r["memory_cap_bytes"]}
    for label, cap in sorted(caps, key=lambda x: x[1]):
        ax.axhline(cap / 2**20, color="grey", linestyle="--", linewidth=0.8)
        ax.annotate(f"memory at budget {label}", (0, cap / 2**20), fontsize=7, color="grey",
                    xytext=(2, 2), textcoords="offset points")
    tag = info["schedule"][step]["tag"]
    ax.set_title(f"{workload}: device memory over one step ({tag}; metered, so slower)")
    ax.set_xlabel("time within the step (ms, under the meter)")
    ax.set_ylabel("MiB allocated by the step")
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, out_dir / f"memory-{_slug(workload)}.png")


def _throughput_figure(plt, workload, records, runs, info, out_dir) -> Optional[Path]:
    rows = [r for r in records if r["tokens_per_second"]]
    if not rows:
        return None
    natural = rows[0]["natural_peak_bytes"] or 1
    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs_all = sorted({r["budget_bytes"] / natural for r in records})
    for name in dict.fromkeys(r["baseline"] for r in rows):
        rs = sorted((r for r in rows if r["baseline"] == name), key=lambda r: r["budget_bytes"])
        if rs[0]["budget_applies"]:
            ax.plot([r["budget_bytes"] / natural * 100 for r in rs],
                    [r["tokens_per_second"] for r in rs], marker="o", label=rs[0]["label"])
        else:
            y = rs[0]["tokens_per_second"]
            line, = ax.plot([], [])
            for r in rs:
                x = r["budget_bytes"] / natural * 100
                ax.plot([x], [y], marker="s" if r["fits"] else "x", color=line.get_color(),
                        linestyle="none")
            ax.axhline(y, color=line.get_color(), linewidth=1,
                       linestyle="-" if all(r["fits"] for r in rs) else ":",
                       label=f"{rs[0]['label']} ({'fits' if all(r['fits'] for r in rs) else 'x: does not fit'})")
    ax.set_xlabel("budget (% of the natural activation peak)")
    ax.set_ylabel("tokens/s (median step)")
    ax.set_title(f"{workload}: throughput vs budget")
    if xs_all:
        ax.set_xlim(min(xs_all) * 100 - 5, max(xs_all) * 100 + 5)
    ax.legend(fontsize=7)
    return _save(plt, fig, out_dir / f"throughput-{_slug(workload)}.png")


def _strip_figure(plt, workload, records, runs, info, out_dir) -> Optional[Path]:
    rows = [r for r in records if r["budget_applies"] and r["per_step"]]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(rows) + 1.4))
    for y, r in enumerate(rows):
        for s in r["per_step"]:
            src = s.get("plan_source")
            if src is None:
                continue
            ax.barh(y, 1, left=s["step"], color=SOURCES.get(src, "#999999"), height=0.8,
                    edgecolor="white", linewidth=0.3)
            if s.get("sequence_changed"):
                ax.plot(s["step"] + 0.5, y, marker="v", color="black", markersize=4)
            if not s.get("train", True):
                ax.plot(s["step"] + 0.5, y + 0.3, marker=".", color="white", markersize=3)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['label']} @ {r['budget']}" for r in rows], fontsize=8)
    ax.set_xlabel("step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in SOURCES.values()]
    handles.append(plt.Line2D([], [], marker="v", color="black", linestyle="none"))
    ax.legend(handles, [*SOURCES, "sequence changed"], fontsize=7, ncol=4, loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.15))
    ax.set_title(f"{workload}: what served each step")
    return _save(plt, fig, out_dir / f"steps-{_slug(workload)}.png")


def plot_choice(choice: dict, path) -> Optional[object]:
    """The demo's comparison leg (``choice.run_choice``'s summary) as one figure: step time and
    saved peak per leg, and per step the engine's block modes with its step time over
    checkpointing's. Returns the path (None without matplotlib)."""
    plt = _pyplot()
    if plt is None:
        return None
    legs = list(choice["legs"])
    colors = ["#888888", "#c66", "#47a", "#2a6"]
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13, 3.6),
                                     gridspec_kw={"width_ratios": [1, 1, 1.4]})
    a1.bar([i - 0.2 for i in range(4)], [choice["legs"][k]["ratio_vs_none"] for k in legs],
           width=0.4, color=colors, label="all steps")
    a1.bar([i + 0.2 for i in range(4)],
           [choice["legs"][k].get("steady_ratio_vs_none", float("nan")) for k in legs],
           width=0.4, color=colors, alpha=0.45, hatch="//", label="last half")
    share = [choice["legs"][k].get("planning_share") for k in legs]
    if any(v is not None for v in share):     # the part of the engines' steps spent planning
        a1.bar([i - 0.2 for i in range(4)],
               [(v or 0.0) * choice["legs"][k]["ratio_vs_none"] for k, v in zip(legs, share)],
               width=0.4, color="none", edgecolor="k", hatch="..", label="of which planning")
    a1.axhline(1.0, color="k", lw=0.8)
    a1.set_ylabel("step time / none")
    a1.legend(fontsize=7)
    a2.bar(range(4), [choice["legs"][k]["peak_saved_bytes"] / 2**20 for k in legs], color=colors)
    a2.axhline(choice["budget_bytes"] / 2**20, color="#d62728", ls="--", label="budget")
    a2.set_ylabel("saved-activation peak (MiB)")
    a2.legend(fontsize=7)
    for ax in (a1, a2):
        ax.set_xticks(range(4))
        ax.set_xticklabels([k.replace(" ", "\n", 1) for k in legs], fontsize=7)
    modes = choice["legs"]["chameleon model="]["block_modes"]
    x = range(len(modes))
    bottom = [0] * len(modes)
    for j, (name, col) in enumerate((("keep", "#2a6"), ("selective", "#e9a"), ("full", "#c66"))):
        vals = [m[j] for m in modes]
        a3.bar(x, vals, bottom=bottom, color=col, label=name, alpha=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    a3.set_xlabel("step")
    a3.set_ylabel("blocks (chameleon model=)")
    a3.legend(fontsize=7, loc="lower left")
    pair = choice.get("paired")
    if pair:                    # the engine's step over checkpointing's on the same batch
        r = [row[pair["leg"]]["seconds"] / row[pair["against"]]["seconds"]
             for row in choice["steps"]]
        a4 = a3.twinx()
        a4.plot(x, r, "k.-", lw=0.8, label="chameleon / checkpointing, this step")
        a4.axhline(1.0, color="k", ls=":", lw=0.8)
        if pair["interval"]:
            a4.axhspan(*pair["interval"], color="k", alpha=0.12,
                       label=f"{pair['confidence']:.0%} interval of the median")
        a4.set_ylabel("step time ratio")
        a4.legend(fontsize=7, loc="upper right")
    fig.suptitle(textwrap.fill(choice["verdict"], 170), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-")
