"""``chameleon-swap recover``: the recovery planner (``sim/recovery.py``) on the command line.

For a model (``--model``, or the shape of a Hugging Face config with ``--hf``), a device
(``--hardware``) and a layout (``--dp``, ``--pp``, ``--tp``, ``--micro-batches``,
``--schedule``), after ``--fail`` ranks are lost: each strategy's throughput as a share of
failure-free, memory per rank with the mode that fits it, and the time to recover; the best
over ``--steps-to-repair`` steps. ``--json`` prints one object, ``--plot`` writes a figure.
"""
from __future__ import annotations

import argparse
import json

from ..config import format_bytes
from ..parallel.schedules import SCHEDULES
from . import report
from .cli_args import DEFAULT_MODEL, hardware_arg, hw_line
from .models import PRESETS, ModelConfig, resolve
from .recovery import (DEFAULT_NETWORK_BYTES_PER_S, DEFAULT_RESTART_SECONDS, Layout,
                       plan_recovery)

RECOVER_HELP = "plan the recovery from lost ranks: rerouting, reconfiguration, or ours"


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="NAME|FILE",
                   help=f"a preset ({', '.join(PRESETS)}) or a JSON file of ModelConfig fields "
                        f"(default {DEFAULT_MODEL})")
    p.add_argument("--hf", default=None, metavar="CONFIG.json|MODEL_TYPE",
                   help="the shape (layers, hidden, heads, ffn, vocab) of a Hugging Face causal "
                        "LM's config; activations by the formula (stages are cut by layer)")
    p.add_argument("--hardware", required=True, metavar="NAME|FILE",
                   help="a built-in profile or a JSON file")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--micro-batch", type=int, default=1,
                   help="sequences per micro-batch (default 1)")
    p.add_argument("--dtype", default="bf16", help="fp32, tf32, bf16, fp16 (default bf16)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per replica and step (default 4 x --pp)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule (default 1f1b)")
    p.add_argument("--fail", required=True, metavar="N|R1,R2,...",
                   help="how many ranks are lost (spread evenly over the world), or a "
                        "comma-separated list of the lost ranks")
    p.add_argument("--steps-to-repair", type=int, default=1000,
                   help="steps until the lost ranks are back (the planning horizon; "
                        "default 1000)")
    p.add_argument("--restart-seconds", type=float, default=DEFAULT_RESTART_SECONDS,
                   help=f"assumed restart cost: re-rendezvous, process restart, communicators "
                        f"(default {DEFAULT_RESTART_SECONDS:g})")
    p.add_argument("--network-gbps", type=float, default=DEFAULT_NETWORK_BYTES_PER_S / 1e9,
                   help=f"GB/s per rank for moving model states (default "
                        f"{DEFAULT_NETWORK_BYTES_PER_S / 1e9:g}: one 200 Gb/s port per GPU)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", default=None, metavar="PNG", help="also write a figure to this file")


def parse_fail(text: str):
    """``--fail``: ``N`` (a count) or ``R1,R2,...`` (ranks)."""
    parts = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        values = [int(t) for t in parts]
    except ValueError:
        raise ValueError(f"--fail must be a count N or a comma-separated list of ranks; "
                         f"got {text!r}") from None
    if not values:
        raise ValueError("--fail must be a count N or a comma-separated list of ranks")
    return values[0] if len(parts) == 1 and "," not in str(text) else values


def hf_shape(spec: str, **run) -> ModelConfig:
    """A ``ModelConfig`` of a transformers config's shape (Llama-like field names)."""
    from .hf_trace import hf_config
    c = hf_config(spec)
    try:
        return ModelConfig(layers=c.num_hidden_layers, hidden=c.hidden_size,
                           heads=c.num_attention_heads,
                           kv_heads=getattr(c, "num_key_value_heads", None),
                           ffn=getattr(c, "intermediate_size", None), vocab=c.vocab_size,
                           tied_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
                           name=getattr(c, "model_type", spec), **run)
    except AttributeError as exc:
        raise ValueError(f"--hf: {spec} has no decoder shape the planner reads ({exc})") from None


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        if args.model and args.hf:
            raise ValueError("give one of --model or --hf")
        settings = dict(seq=args.seq, micro_batch=args.micro_batch, dtype=args.dtype,
                        tp=args.tp)
        cfg = (hf_shape(args.hf, **settings) if args.hf else
               resolve(args.model or DEFAULT_MODEL, **settings))
        hw = hardware_arg(args)
        m = args.micro_batches if args.micro_batches is not None else 4 * args.pp
        layout = Layout(args.dp, args.pp, args.tp, m, args.schedule)
        if args.network_gbps <= 0:
            raise ValueError(f"--network-gbps must be positive; got {args.network_gbps}")
        if args.restart_seconds < 0:
            raise ValueError(f"--restart-seconds must be >= 0; got {args.restart_seconds}")
        rec = plan_recovery(cfg, hw, layout, parse_fail(args.fail), args.steps_to_repair,
                            args.restart_seconds, args.network_gbps * 1e9)
    except ValueError as exc:
        parser.error(str(exc))
    if args.plot:
        try:
            plot(rec, args.plot, f"{cfg.name}, {layout.world} ranks, {len(rec.failed)} lost")
        except ValueError as exc:
            parser.error(str(exc))
    if args.json:
        print(json.dumps(rec.as_dict()))
        return 0
    ff = rec.failure_free
    print(f"{cfg.describe()}\n{hw_line(hw)}\nlayout: dp {layout.dp} x pp {layout.pp} x tp "
          f"{layout.tp} = {layout.world} ranks, {layout.schedule}, {layout.micro_batches} "
          f"micro-batches per replica; failure-free: {ff.step_seconds:.3f} s per step "
          f"({ff.mode}), peak {format_bytes(ff.peak_bytes)} per rank\nlost ranks: "
          f"{_ranks(rec.failed)} ({rec.lost_groups} tensor-parallel group(s)); horizon "
          f"{rec.steps_to_repair} steps\n")
    rows = []
    for name, p in rec.plans.items():
        rows.append([name, p.feasible, p.step_seconds if p.feasible else None,
                     f"{p.share:.1%}" if p.feasible else None,
                     f"{p.horizon_share:.1%}" if p.feasible else None,
                     ",".join(p.modes) or None, report.gib(p.peak_bytes) if p.feasible else None,
                     report.gib(p.moved_bytes) if p.feasible else None,
                     p.recover_seconds if p.feasible else None,
                     "+".join(f"{x.stages}" for x in p.pipes[:6])
                     + ("..." if len(p.pipes) > 6 else "") or None,
                     p.choice or (p.reason or None)])
    print(report.table(["strategy", "ok", "step s", "share", "over horizon", "modes",
                        "peak/rank", "moved/rank", "recover s", "stages per pipeline",
                        "choice / why not"], rows), end="")
    best = rec.best
    ratios = []
    for base in ("rerouting", "reconfiguration"):
        b = rec.plans[base]
        ratios.append(f"{best.horizon_share / b.horizon_share:.3f}x {base}" if b.feasible
                      else f"{base} impossible")
    print(f"\nours: {best.choice}, {1 - best.horizon_share:.1%} below failure-free over the "
          f"horizon; {', '.join(ratios)}")
    return 0


def _ranks(ranks: list) -> str:
    return ",".join(map(str, ranks[:16])) + (f",... ({len(ranks)})" if len(ranks) > 16 else "")


def plot(rec, path: str, title: str) -> None:
    plt = report._pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(rec.plans)
    shares = [rec.plans[n].horizon_share for n in names]
    peaks = [rec.plans[n].peak_bytes / 2**30 for n in names]
    a1.bar(names, shares)
    a1.axhline(1.0, color="k", ls=":", lw=0.8)
    a1.set_ylabel("throughput over horizon / failure-free")
    a2.bar(names, peaks)
    a2.axhline(rec.failure_free.peak_bytes / 2**30, color="k", ls=":", lw=0.8)
    a2.set_ylabel("peak memory per rank, GiB")
    for a in (a1, a2):
        a.tick_params(axis="x", rotation=30, labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
