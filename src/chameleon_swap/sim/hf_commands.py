"""What the commands do with ``--hf`` (a Hugging Face model traced on fake tensors).

``simulate`` and ``capacity`` take the traced model where they would take ``--model``'s formula;
``compare --hf`` cannot re-shard a traced step over tensor-parallel degrees, so it compares the
approaches at one degree across hardware profiles instead (``hf_trace.compare``).
"""
from __future__ import annotations

import argparse
import json
from typing import Optional

from ..config import format_bytes, parse_size
from . import report, sweeps
from .hardware import Hardware, builtin_names
from .hardware import load as load_hardware


def traced_model(args: argparse.Namespace, hw: Optional[Hardware]):
    """The ``--hf`` model, or None; ``--model`` and ``--hf`` exclude each other."""
    if not args.hf:
        return None
    if args.model:
        raise ValueError("give either --model (formula estimate) or --hf (traced), not both")
    from .hf_trace import TracedModel
    return TracedModel(args.hf, hw, seq=args.seq, micro_batch=args.micro_batch,
                       dtype=args.dtype, optimizer=args.optimizer, dp_shard=args.dp_shard)


def hardware_list(text: Optional[str]) -> list[Hardware]:
    """``--hardware`` of ``compare --hf``: comma-separated profiles (default: every built-in)."""
    names = [s.strip() for s in text.split(",") if s.strip()] if text else builtin_names()
    if not names:
        raise ValueError(f"--hardware must name at least one profile ({', '.join(builtin_names())}"
                         f" or JSON files)")
    return [load_hardware(n, "--hardware") for n in names]


def compare(args: argparse.Namespace, approaches=None,
            advance=lambda: None) -> tuple[object, list[dict]]:
    """``compare --hf``: (the traced model, one row per hardware profile)."""
    from .hf_trace import compare as traced_compare
    from .sweeps import APPROACHES
    if args.models:
        raise ValueError("--models names formula presets; with --hf give one traced model")
    if args.degrees != "1,2,4,8":
        raise ValueError("--degrees: a traced step cannot be re-sharded over tensor-parallel "
                         "degrees (compare --hf compares hardware profiles at degree 1)")
    if args.tp != 1:
        raise ValueError("--tp: a traced step cannot be re-sharded (use --model for tp)")
    hws = hardware_list(args.hardware)
    approaches = approaches or list(APPROACHES)
    budget = parse_size(args.budget, "--budget")
    model = traced_model(args, hws[0])
    model.trace()                         # trace (or read the cache) before the progress bar
    return model, traced_compare(model, hws, approaches, budget, advance)


def compare_text(rows: list[dict], markdown: bool = False) -> str:
    """One row per hardware profile: tokens/s of each approach that ran, then speedups."""
    def cell(x):
        return f"{x['tokens_per_second_per_device']:.0f}" if x["fits"] else "does not fit"
    names = {"chameleon": "chameleon tok/s", "hybrid": "hybrid", "full-recompute":
             "full recompute", "selective-recompute": "selective recompute", "none": "none"}
    cols = [a for a in names if rows and a in rows[0]]
    gains = [(k, h) for k, h in (("vs_full_recompute", "chameleon vs full"),
                                 ("hybrid_vs_full_recompute", "hybrid vs full"),
                                 ("hybrid_vs_selective_recompute", "hybrid vs selective"))
             if any(r[k] is not None for r in rows)]
    table_rows = [[r["hardware"], report.gib(r["budget_bytes"]), f"{r['demand_ratio']:.2f}x"]
                  + [cell(r[a]) for a in cols] + [report.pct(r[k]) for k, _ in gains]
                  for r in rows]
    return report.table(["hardware", "budget", "demand / device"] + [names[a] for a in cols]
                        + [h for _, h in gains], table_rows, markdown)


def compare_head(model, budget_text: Optional[str]) -> str:
    budget = (f"budget {format_bytes(parse_size(budget_text, '--budget'))}" if budget_text
              else "budget: what each device leaves after model states, workspace and reserve")
    return (f"{model.describe()}\n{budget}; tokens/s per device; speedups only where both "
            f"fit (a traced step cannot be re-sharded: tensor-parallel degree 1 throughout)\n")


def run_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``compare --hf``: parse, run, print (``commands.run_compare`` hands ``--hf`` here)."""
    try:
        if args.plot:
            raise ValueError("--plot: compare --hf draws no figure (simulate --hf --plot does)")
        approaches = sweeps.parse_approaches(args.approaches)
        n = len(hardware_list(args.hardware)) * len(approaches)
        with report.progress(n, "compare", not args.json) as advance:
            model, rows = compare(args, approaches, advance)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps({"model": model.name, "settings": dict(
            seq=args.seq, micro_batch=args.micro_batch, dtype=args.dtype,
            optimizer=args.optimizer, dp_shard=args.dp_shard), "hardware": rows}))
    else:
        print(compare_head(model, args.budget))
        print(compare_text(rows), end="")
    return 0
