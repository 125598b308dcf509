"""Tables (plain text, markdown) and matplotlib figures for the simulator's commands."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

from ..bench.env import progress as _progress
from ..config import format_bytes


def table(header: list[str], rows: list[list], markdown: bool = False) -> str:
    cells = [[_cell(v) for v in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells]) + "\n"
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*r) for r in cells]
    return "\n".join(out) + "\n"


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def gib(n: Optional[int]) -> str:
    return "-" if n is None else format_bytes(n)


def pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


@contextmanager
def progress(total: int, description: str, enabled: bool = True) -> Iterator:
    """``bench.env.progress`` (a rich bar on a terminal, plain lines otherwise), or nothing when
    not ``enabled`` (``--json`` keeps stdout and stderr quiet)."""
    if not enabled:
        yield lambda: None
        return
    with _progress(total, description) as advance:
        yield advance


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib (pip install matplotlib, or "
                         "pip install 'chameleon-swap[bench]')") from exc
    return plt


def plot_simulate(results: dict, lower_bound: float, device_bytes: Optional[int],
                  title: str, path: str) -> None:
    plt = _pyplot()
    names = list(results)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    comp = [r.step_seconds - r.stall_seconds for r in results.values()]
    stall = [r.stall_seconds for r in results.values()]
    a.bar(names, comp, label="compute")
    a.bar(names, stall, bottom=comp, label="stall")
    a.axhline(lower_bound, color="k", ls="--", lw=1, label="swap lower bound")
    a.set_ylabel("step seconds")
    a.legend(fontsize=8)
    need = [r.device_bytes / 2**30 for r in results.values()]
    colors = ["tab:green" if r.fits else "tab:red" for r in results.values()]
    b.bar(names, need, color=colors)
    if device_bytes:
        b.axhline(device_bytes / 2**30, color="k", ls="--", lw=1, label="device memory")
        b.legend(fontsize=8)
    b.set_ylabel("device GiB needed (green: fits)")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_capacity(cap: dict, title: str, path: str) -> None:
    plt = _pyplot()
    names = list(cap)
    # A traced model (--hf) has no family of sizes: no "model" axis.
    specs = [(axis, label) for axis, label in (("model", "largest model (B params)"),
                                               ("seq", "longest sequence"),
                                               ("micro_batch", "largest micro-batch"))
             if all(axis in row for row in cap.values())]
    fig, axes = plt.subplots(1, len(specs), figsize=(4.7 * len(specs), 4.2))
    for ax, (axis, label) in zip(axes, specs):
        vals, ratios = [], []
        for n in names:
            p = cap[n][axis]
            if p is None:
                vals.append(0)
                ratios.append(None)
            else:
                vals.append(p["params"] / 1e9 if axis == "model" else p[axis])
                ratios.append(p["demand_ratio"])
        bars = ax.bar(names, vals)
        for bar, r in zip(bars, ratios):
            if r is not None:
                ax.annotate(f"{r:.1f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.set_title(label + " (demand / device memory)", fontsize=9)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        if axis != "model":
            ax.set_yscale("log", base=2)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compare(rows: list[dict], title: str, path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    models = [r["model"] for r in rows]
    from .sweeps import APPROACHES
    APPROACHES = [a for a in APPROACHES if rows and a in rows[0]]   # those that ran
    width = 0.8 / len(APPROACHES)
    for k, a in enumerate(APPROACHES):
        ys = [(r[a]["tokens_per_second_per_device"] if r[a] else 0) for r in rows]
        xs = [i + (k - (len(APPROACHES) - 1) / 2) * width for i in range(len(rows))]
        bars = ax.bar(xs, ys, width, label=a if a != "none" else "tensor parallel only")
        for bar, r in zip(bars, rows):
            if r[a]:
                ax.annotate(f"tp{r[a]['tp']}", (bar.get_x() + bar.get_width() / 2,
                                                bar.get_height()),
                            ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(rows)), models, rotation=30, fontsize=8)
    ax.set_ylabel("tokens / s per device")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_trace(trace, title: str, path: str) -> None:
    """Saved activations on the device over one step with nothing moved: each tensor from the
    forward slot that saves it to the backward slot that first needs it (the trace does not say
    when backward last uses it), one line per step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for k, step in enumerate(trace.steps):
        delta = [0] * (step.n_slots + 1)
        for t in step.tensors:
            delta[t.saved_at] += t.nbytes
            delta[min(t.first_used_at, step.n_slots - 1) + 1] -= t.nbytes
        level, ys = 0, []
        for d in delta[:-1]:
            level += d
            ys.append(level / 2**30)
        ax.plot(range(step.n_slots), ys, lw=1, label=step.tag or f"step {k}")
        ax.axvline(step.n_forward - 0.5, color="k", ls=":", lw=0.8)
    ax.set_xlabel("slot (forward, then backward)")
    ax.set_ylabel("saved activations, GiB")
    if len(trace.steps) <= 8:
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
