"""Arguments the simulator's commands share: the model (a preset, a config file or a Hugging Face
config), the hardware profile, the policies to run, and how a hardware profile is shown."""
from __future__ import annotations

import argparse
from typing import Optional

from ..config import format_bytes
from .hardware import builtin_names
from .hardware import load as load_hardware
from .models import PRESETS, ModelConfig, resolve
from .policies import POLICIES, check_policy

DEFAULT_POLICIES = (*POLICIES, "tp2")
DEFAULT_MODEL = "llama-7b"


def add_model_args(p: argparse.ArgumentParser, model_required: bool = False) -> None:
    p.add_argument("--model", required=model_required, default=None, metavar="NAME|FILE",
                   help=f"a preset ({', '.join(PRESETS)}) or a JSON file of ModelConfig fields "
                        f"(layers, hidden, heads, kv_heads, ffn, vocab, experts, top_k, ...)")
    p.add_argument("--hf", default=None, metavar="CONFIG.json|MODEL_TYPE",
                   help="a Hugging Face causal LM (a config.json or a transformers model_type), "
                        "its saved bytes traced from its code on fake tensors instead of the "
                        "formula of --model (cached under $CHAMELEON_SWAP_CACHE, else "
                        "$XDG_CACHE_HOME/chameleon-swap or ~/.cache/chameleon-swap)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"),
                   help="--hf model states: sgd keeps weights and gradients, adamw also two "
                        "moments (default adamw)")
    p.add_argument("--hardware", required=False, default=None, metavar="NAME|FILE",
                   help=f"a built-in profile ({', '.join(builtin_names())}) or a JSON file")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--dtype", default="bf16", help="fp32, tf32, bf16, fp16 (default bf16)")
    p.add_argument("--flash", action=argparse.BooleanOptionalAction, default=True,
                   help="FlashAttention: no s^2 tensors saved (default on)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    p.add_argument("--dp-shard", type=int, default=1,
                   help="ranks the optimizer states are sharded over, ZeRO-1 (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", default=None, metavar="PNG", help="also write a figure to this file")


def model_config(args, name: Optional[str] = None) -> ModelConfig:
    name = name or args.model or DEFAULT_MODEL
    return resolve(name, seq=args.seq, micro_batch=args.micro_batch, dtype=args.dtype,
                   flash=args.flash, tp=args.tp, dp_shard=args.dp_shard)


def hardware_arg(args, required: bool = True):
    if args.hardware is None:
        if required:
            raise ValueError(f"--hardware is required: a built-in profile "
                             f"({', '.join(builtin_names())}) or a JSON file")
        return None
    return load_hardware(args.hardware, "--hardware")


def policies_arg(text: Optional[str], default=DEFAULT_POLICIES) -> list[str]:
    if not text:
        return list(default)
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--policies must name at least one policy")
    return [check_policy(n, "--policies") for n in names]


def hw_line(hw) -> str:
    return (f"hardware: {hw.name} ({hw.title}): {format_bytes(hw.device_memory_bytes)} device "
            f"({format_bytes(hw.reserved_bytes)} reserved), host link {hw.d2h / 1e9:.1f}/"
            f"{hw.h2d / 1e9:.1f} GB/s (D2H/H2D achievable), host RAM "
            f"{format_bytes(hw.host_memory_bytes)}")
