"""The simulator's commands: ``simulate``, ``capacity``, ``compare`` and ``trace``.

Each is a (help, configure, run) triple for ``cli.COMMANDS``. Nothing here imports torch except
``trace --workload``, which records a real run.
"""
from __future__ import annotations

import argparse
import json

from ..config import format_bytes, parse_size
from . import hf_commands, pipeline_cli, report, sweeps
from .analytic import generate
from .cli_args import (DEFAULT_POLICIES, add_model_args, hardware_arg, hw_line, model_config,
                       policies_arg)
from .hf_commands import traced_model
from .models import ModelConfig, family, preset
from .policies import POLICIES, TP_RE, run, swap_only_bound
from ..runtime.trace import load as load_trace
from ..runtime.trace import save as save_trace



# ------------------------------------------------------------------------------ simulate
SIMULATE_HELP = "simulate every policy on a model (or a recorded trace) at a budget"


def configure_simulate(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="simulate a trace (file or trace_dir) instead of --model; its compute "
                        "stays as recorded, --hardware (optional) then gives the link and the "
                        "memory that 'fits' is judged against (without it, fits is null)")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="activation budget, e.g. 40GiB (default: device memory left after model "
                        "states, workspace and the runtime's reserve)")
    p.add_argument("--policies", default=None,
                   help=f"comma-separated (default: {','.join(DEFAULT_POLICIES)})")
    pipeline_cli.add_arguments(p)


def run_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if pipeline_cli.wanted(args):
        try:
            pipeline_cli.run(args, model_config(args), hardware_arg(args),
                             parse_size(args.budget, "--budget"))
        except ValueError as exc:
            parser.error(str(exc))
        return 0
    try:
        # tpN re-shards the formula's model: a recorded or traced step cannot be re-sharded, so
        # the default list leaves it out there (asked for by name, it is an error).
        fixed = bool(args.trace or args.hf)
        policies = policies_arg(args.policies, POLICIES if fixed else DEFAULT_POLICIES)
        budget = parse_size(args.budget, "--budget")
        if args.trace and (args.model or args.hf):
            raise ValueError("give one of --model, --hf or --trace")
        hw = hardware_arg(args, required=not args.trace)
        traced = traced_model(args, hw)
        if fixed:
            trace = traced.trace() if traced else load_trace(args.trace)
            cfg = None
            for p in policies:
                if TP_RE.match(p):
                    raise ValueError(f"--policies: {p} needs a model (--model): a recorded or "
                                     f"traced step cannot be re-sharded")
        else:
            cfg = model_config(args)
            trace = generate(cfg, hw)
        link = (hw.d2h, hw.h2d) if hw else trace.link
        if link is None:
            raise ValueError("the trace records no link bandwidth; give --hardware")
        if budget is None and hw is not None:
            budget = sweeps.default_budget(trace.steps[0], hw)
        results = {}
        cache: dict = {}
        for p in policies:
            if cfg is not None:
                results[p], _ = sweeps.evaluate(cfg, hw, p, budget, cache)
            else:
                results[p] = run(trace, p, budget, link=link,
                                 device_bytes=hw.usable_bytes if hw else None,
                                 host_bytes=hw.host_memory_bytes if hw else None,
                                 plan_cache=cache)
    except ValueError as exc:
        parser.error(str(exc))
    steps = trace.steps
    lb = sum(swap_only_bound(s, budget, *link) for s in steps) / len(steps)
    if args.json:
        print(json.dumps({"lower_bound_seconds": lb,
                          "policies": {k: r.as_dict() for k, r in results.items()}}))
    else:
        s0 = steps[0]
        head = [f"{cfg.describe()} (activations: formula estimate)" if cfg else
                traced.describe() if traced else
                f"trace: {args.trace} ({len(steps)} steps, {trace.source})"]
        if hw:
            head.append(hw_line(hw))
        else:
            head.append(f"link: {link[0] / 1e9:.2f}/{link[1] / 1e9:.2f} GB/s (D2H/H2D, recorded)")
        head.append(f"model states {format_bytes(s0.model_state_bytes)}, workspace "
                    f"{format_bytes(s0.workspace_bytes)}, natural activation peak "
                    f"{format_bytes(max(s.activation_bytes for s in steps))}, budget "
                    f"{format_bytes(budget)}")
        if traced and trace.meta.get("step_peak_bytes"):
            head.append(f"traced step peak above the weights (activations, gradients, logits "
                        f"and other transients): {format_bytes(trace.meta['step_peak_bytes'])}")
        compute = sum(s.compute_seconds for s in steps) / len(steps)
        head.append(f"compute {compute:.4f} s per step; lower bound for any swap schedule "
                    f"holding the budget {lb:.4f} s")
        rows = []
        for k, r in results.items():
            m = TP_RE.match(k)
            degree = int(m.group(1)) if m else (cfg.tp if cfg else 1)
            # A tpN step is another (per-device) step: the bound above is not its bound.
            rows.append([k, r.step_seconds, r.stall_seconds,
                         None if m or not lb else r.step_seconds / lb,
                         r.tokens_per_second / degree if r.tokens else None,
                         report.gib(r.peak_bytes), report.gib(r.moved_bytes),
                         report.gib(r.device_bytes), r.fits])
        print("\n".join(head) + "\n")
        print(report.table(["policy", "step s", "stall s", "x bound", "tok/s/device", "peak",
                            "moved", "device need", "fits"], rows), end="")
    if args.plot:
        try:
            report.plot_simulate(results, lb, hw.usable_bytes if hw else None,
                                 head_title(cfg or traced, hw, budget), args.plot)
        except ValueError as exc:
            parser.error(str(exc))
    return 0


def head_title(cfg, hw, budget) -> str:
    what = cfg.describe() if cfg else "recorded trace"
    return f"{what}\non {hw.name if hw else 'recorded link'}, budget {format_bytes(budget)}"


# ------------------------------------------------------------------------------ capacity
CAPACITY_HELP = "per policy: the largest model, sequence and micro-batch that fit a device"


def configure_capacity(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--policies", default=None,
                   help=f"comma-separated (default: {','.join(POLICIES)})")


def run_capacity(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        policies = policies_arg(args.policies, POLICIES)
        hw = hardware_arg(args)
        cfg = traced_model(args, hw)
        if cfg is None:
            cfg = model_config(args)
            generate(cfg, hw)          # fail fast on a dtype the hardware lacks
        else:
            cfg.trace()
    except ValueError as exc:
        parser.error(str(exc))
    axes = 3 if isinstance(cfg, ModelConfig) else 2
    with report.progress(axes * len(policies), "capacity", not args.json) as advance:
        if axes == 3:
            cap = sweeps.capacity(cfg, hw, policies, advance)
        else:
            from .hf_trace import capacity as traced_capacity
            cap = traced_capacity(cfg, policies, advance)
    if args.json:
        print(json.dumps({"hardware": hw.name, "model": cfg.name, "seq": cfg.seq,
                          "micro_batch": cfg.micro_batch, "device_memory_bytes":
                          hw.device_memory_bytes, "policies": cap}))
    else:
        print(capacity_text(cap, cfg, hw))
    if args.plot:
        try:
            report.plot_capacity(cap, f"capacity on {hw.name}: {cfg.describe()}", args.plot)
        except ValueError as exc:
            parser.error(str(exc))
    return 0


def capacity_text(cap: dict, cfg: ModelConfig, hw, markdown: bool = False) -> str:
    out = [] if markdown else [hw_line(hw), cfg.describe(), ""]
    specs = (("model", f"largest dense preset at seq {cfg.seq} x micro-batch {cfg.micro_batch}",
              lambda p: f"{p['model']} ({p['params'] / 1e9:.1f}B)"),
             ("seq", f"longest sequence for {cfg.name} at micro-batch {cfg.micro_batch}",
              lambda p: p["seq"]),
             ("micro_batch", f"largest micro-batch for {cfg.name} at seq {cfg.seq}",
              lambda p: p["micro_batch"]))
    for axis, title, show in specs:
        if any(axis not in row for row in cap.values()):
            continue                   # a traced model has no family of sizes
        rows = []
        for pol, row in cap.items():
            p = row[axis]
            rows.append([pol, show(p) if p else "does not fit",
                         p["tokens_per_second"] if p else None,
                         f"{p['demand_ratio']:.2f}x" if p else None,
                         report.gib(p["moved_bytes"]) if p else None])
        out.append(("**" + title + "**") if markdown else title + ":")
        out.append(report.table(["policy", "fits up to", "tokens/s", "demand / device memory",
                                 "moved per step"], rows, markdown))
    return "\n".join(out)


# ------------------------------------------------------------------------------ compare
COMPARE_HELP = ("chameleon and hybrid vs recomputation vs tensor-parallel degree at equal memory, "
                "by model (--hf: one traced model across hardware profiles)")


def configure_compare(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--models", default=None,
                   help=f"comma-separated presets (default: {','.join(family())})")
    p.add_argument("--degrees", default="1,2,4,8",
                   help="tensor-parallel degrees to try, smallest first (default 1,2,4,8)")
    p.add_argument("--approaches", default=None,
                   help=f"comma-separated, from {','.join(sweeps.APPROACHES)} (default: all)")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="with --hf: activation budget (default: what each device leaves after "
                        "model states, workspace and reserve); with --hf, --hardware takes a "
                        "comma-separated list (default: every built-in profile)")


def run_compare(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.hf:
        return hf_commands.run_compare(args, parser)
    try:
        if args.budget:
            raise ValueError("--budget: compare --models runs each approach at the budget its "
                             "device leaves at each degree; --budget is for --hf")
        hw = hardware_arg(args)
        models = ([m.strip() for m in args.models.split(",") if m.strip()] if args.models
                  else ([args.model] if args.model else family()))
        for m in models:
            preset(m)
        degrees = _degrees(args.degrees)
        approaches = sweeps.parse_approaches(args.approaches)
        settings = dict(seq=args.seq, micro_batch=args.micro_batch, dtype=args.dtype,
                        flash=args.flash, dp_shard=args.dp_shard)
        generate(preset(models[0], **settings), hw)
    except ValueError as exc:
        parser.error(str(exc))
    with report.progress(len(models) * len(approaches), "compare", not args.json) as advance:
        rows = sweeps.compare(models, hw, settings, degrees, advance, approaches)
    if args.json:
        print(json.dumps({"hardware": hw.name, "settings": settings, "models": rows}))
    else:
        print(hw_line(hw))
        print(f"seq {args.seq} x micro-batch {args.micro_batch}, {args.dtype}, flash "
              f"{'on' if args.flash else 'off'}; each approach at the smallest tensor-parallel "
              f"degree that fits\n")
        print(compare_text(rows), end="")
    if args.plot:
        try:
            report.plot_compare(rows, f"{hw.name}: tokens/s per device, seq {args.seq} x "
                                      f"mb {args.micro_batch}", args.plot)
        except ValueError as exc:
            parser.error(str(exc))
    return 0


def compare_text(rows: list[dict], markdown: bool = False) -> str:
    """One row per model: tokens/s per device of each approach that ran, then speedups."""
    def cell(x):
        return f"tp{x['tp']}: {x['tokens_per_second_per_device']:.0f}" if x else "does not fit"
    names = {"chameleon": "chameleon tok/s/dev", "hybrid": "hybrid",
             "full-recompute": "full recompute", "selective-recompute": "selective recompute",
             "none": "tensor parallel only"}
    cols = [a for a in names if rows and a in rows[0]]
    gains = [(k, h) for k, h in (("vs_full_recompute", "chameleon vs full"),
                                 ("vs_selective_recompute", "vs selective"),
                                 ("vs_tensor_parallel", "vs higher TP"),
                                 ("hybrid_vs_full_recompute", "hybrid vs full"))
             if any(r[k] is not None for r in rows)]
    table_rows = [[r["model"], f"{r['params'] / 1e9:.1f}B"] + [cell(r[a]) for a in cols]
                  + [report.pct(r[k]) for k, _ in gains] for r in rows]
    return report.table(["model", "params"] + [names[a] for a in cols] + [h for _, h in gains],
                        table_rows, markdown)


def _degrees(text: str) -> list[int]:
    try:
        ds = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--degrees must be comma-separated positive ints; got {text!r}") from None
    if not ds or ds[0] < 1:
        raise ValueError(f"--degrees must be comma-separated positive ints; got {text!r}")
    return ds


# ------------------------------------------------------------------------------ trace
TRACE_HELP = "write a trace: analytic (--model, --hardware) or recorded from a workload run"


def configure_trace(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--workload", default=None, metavar="NAME",
                   help="record a real run of a registered workload (e.g. llama-varlen, moe)")
    p.add_argument("--size", default="small", help="workload size (default small)")
    p.add_argument("--steps", type=int, default=4, help="recorded steps (default 4)")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="engine budget while recording (default: unlimited)")
    p.add_argument("--policy", default="guard", help="engine policy while recording")
    p.add_argument("--device", default="cpu", help="device of the recorded run (default cpu)")
    p.add_argument("--out", required=True, metavar="PATH",
                   help="trace file (analytic) or directory (recorded, one file per step)")


def run_trace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        if sum(map(bool, (args.workload, args.model, args.hf))) != 1:
            raise ValueError("give one of --model (with --hardware) for an analytic trace, --hf "
                             "(with --hardware) for one traced on fake tensors, or --workload "
                             "for a recorded one")
        if args.hf:
            hw = hardware_arg(args)
            traced = traced_model(args, hw)
            trace = traced.trace()
            path = save_trace(trace, args.out)
            msg = (f"wrote {path}: {traced.describe()}, {len(trace.steps[0].tensors)} saved "
                   f"tensors, {format_bytes(trace.steps[0].activation_bytes)} of activations")
        elif args.model:
            hw = hardware_arg(args)
            trace = generate(model_config(args), hw)
            path = save_trace(trace, args.out)
            msg = (f"wrote {path}: analytic trace of {trace.meta['model']['name']} on {hw.name}, "
                   f"{len(trace.steps[0].tensors)} saved tensors, "
                   f"{format_bytes(trace.steps[0].activation_bytes)} of activations")
        else:
            from .record import record
            budget = parse_size(args.budget, "--budget")
            if args.steps < 1:
                raise ValueError(f"--steps must be a positive int; got {args.steps}")
            with report.progress(args.steps, "recording", not args.json) as advance:
                trace = record(args.workload, args.out, steps=args.steps, size=args.size,
                               budget=budget, policy=args.policy, device=args.device,
                               advance=advance)
            msg = (f"wrote {len(trace.steps)} step traces to {args.out}: workload "
                   f"{args.workload} ({args.size}) on {args.device}")
    except ValueError as exc:
        parser.error(str(exc))
    if args.json:
        print(json.dumps({"path": str(args.out), "steps": len(trace.steps),
                          "source": trace.source}))
    else:
        print(msg)
    if args.plot:
        try:
            report.plot_trace(trace, msg.split(": ", 1)[-1][:120], args.plot)
        except ValueError as exc:
            parser.error(str(exc))
    return 0
