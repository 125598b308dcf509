"""A Hugging Face causal LM, traced on fake tensors, as a simulator trace (see ``traced``).

``--hf`` takes a ``config.json`` (any transformers config with a ``model_type``) or a bare
``model_type`` (its default config, e.g. ``llama``). ``--dtype bf16`` means what mixed precision
training runs: fp32 weights under ``torch.autocast`` to bf16; ``fp32`` runs without autocast.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from .hardware import Hardware
from .models import read_json
from ..runtime.trace import Step, Tensor, Trace
from .traced import OPTIMIZERS, TRACED_LAYERS, Recording, cached, scale_layers

DTYPES = ("bf16", "fp32")


def hf_config(spec: str, **overrides):
    """The transformers config of ``spec`` (a config.json or a model_type) with ``overrides``."""
    from ..workloads.hf import import_transformers
    import_transformers()
    from transformers import AutoConfig
    path = Path(spec)
    if spec.endswith(".json") or path.is_file():
        fields = read_json(spec, "--hf")
        if not isinstance(fields, dict) or "model_type" not in fields:
            raise ValueError(f"--hf: {spec} must be a transformers config with a model_type")
        spec = fields.pop("model_type")
    else:
        fields = {}
    fields.update(overrides)
    fields["use_cache"] = False
    try:
        return AutoConfig.for_model(spec, **fields)
    except ValueError:
        # (transformers' own message lists every model type it knows: hundreds of names)
        raise ValueError(f"--hf: {spec!r} is neither a config.json nor a transformers "
                         f"model_type (e.g. llama, mistral, qwen2, mixtral; a model name such "
                         f"as llama-7b goes to --model)") from None


def _record(cfg, seq: int, micro_batch: int, dtype: str, attn: str, use_cache: bool) -> Recording:
    import torch
    import transformers
    return cached([cfg.to_dict(), seq, micro_batch, dtype, attn, torch.__version__,
                   transformers.__version__],
                  lambda: _run(cfg, seq, micro_batch, dtype, attn), use_cache)


def _run(cfg, seq: int, micro_batch: int, dtype: str, attn: str) -> Recording:
    import unittest.mock
    import torch
    import transformers.masking_utils as masking
    from transformers import AutoModelForCausalLM
    from .fake_trace import trace_module

    def loss_fn(model):
        ids = torch.zeros(micro_batch, seq, dtype=torch.long)
        return model(input_ids=ids, labels=ids).loss

    # transformers reads position ids to detect packed sequences; fake ones cannot be read, and
    # it would then build a seq x seq mask a real unpacked batch never has.
    no_packing = unittest.mock.patch.object(masking, "find_packed_sequence_indices",
                                            lambda *a, **k: None)
    with no_packing, _experts_under_autocast():
        rec = trace_module(lambda: AutoModelForCausalLM.from_config(
            cfg, attn_implementation=attn, dtype=torch.float32),
                           loss_fn, autocast=torch.bfloat16 if dtype == "bf16" else None)
    rec.extra.update(seq=seq, micro_batch=micro_batch, dtype=dtype, attn=attn,
                     model_type=cfg.model_type)
    return rec


@contextlib.contextmanager
def _experts_under_autocast():
    """Mixture-of-experts layers (Mixtral, Qwen-MoE) multiply through a grouped matmul that no
    autocast list covers: with fp32 weights it runs in fp32, which its kernel refuses. Cast both
    operands to the autocast dtype, as autocast casts a linear layer's (the weight copy is then
    saved, as a linear's is)."""
    try:
        import transformers.integrations.moe as moe
    except ImportError:
        yield
        return
    grouped = getattr(moe, "_grouped_mm", None)
    if grouped is None:
        yield
        return
    import torch

    def cast(input, weight, offs):
        if torch.is_autocast_enabled("cpu"):
            low = torch.get_autocast_dtype("cpu")
            return grouped(input.to(low), weight.to(low), offs)
        return grouped(input, weight, offs)

    moe._grouped_mm = cast
    try:
        yield
    finally:
        moe._grouped_mm = grouped


def trace_hf(spec: str, *, seq: int, micro_batch: int = 1, dtype: str = "bf16",
             attn: str = "sdpa", scale: bool = True, use_cache: bool = True,
             **overrides) -> Recording:
    """One training step of the causal LM of ``spec`` at ``seq`` x ``micro_batch`` tokens."""
    for name, v in (("seq", seq), ("micro_batch", micro_batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int; got {v!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype for --hf must be one of {', '.join(DTYPES)}; got {dtype!r}")
    cfg = hf_config(spec, **overrides)
    if hasattr(cfg, "max_position_embeddings") and cfg.max_position_embeddings < seq:
        cfg.max_position_embeddings = seq
    layers = getattr(cfg, "num_hidden_layers", None)
    kinds = getattr(cfg, "layer_types", None)
    uniform = not kinds or len(set(kinds)) == 1
    if scale and uniform and isinstance(layers, int) and layers > TRACED_LAYERS:
        small = hf_config(spec, **{**overrides, "num_hidden_layers": TRACED_LAYERS})
        if kinds:
            small.layer_types = list(kinds[:TRACED_LAYERS])
        small.max_position_embeddings = cfg.max_position_embeddings
        rec = _record(small, seq, micro_batch, dtype, attn, use_cache)
        prefix = rec.extra.get("block_prefix")
        scaled = scale_layers(rec, prefix, layers) if prefix else None
        if scaled is not None:
            return scaled
    return _record(cfg, seq, micro_batch, dtype, attn, use_cache)


def to_trace(rec: Recording, hw: Hardware, optimizer: str = "adamw", name: str = "",
             dp_shard: int = 1) -> Trace:
    """The simulator's trace of ``rec`` timed on ``hw``: each op a roofline, ``max(flops /
    achievable FLOP/s, bytes / achievable memory bandwidth)``, in bf16 when it reads bf16 or fp16
    inputs, else fp32. Model states: weights and gradients, plus the optimizer's moments, those
    sharded over ``dp_shard`` data-parallel ranks (ZeRO-1)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}; got {optimizer!r}")
    if isinstance(dp_shard, bool) or not isinstance(dp_shard, int) or dp_shard < 1:
        raise ValueError(f"--dp-shard must be a positive int; got {dp_shard!r}")
    low, mem = hw.flops("bf16"), hw.memory_bytes_per_s
    # A profile without an fp32 figure (no datasheet gives one) times fp32 ops at its lowest
    # rate: under autocast they are norms, softmax and casts, which the flop counter counts as
    # zero FLOPs anyway (they are timed by their bytes).
    full = (hw.flops("fp32") if "fp32" in hw.peak_flops
            else min(hw.flops(d) for d in hw.peak_flops))
    def seconds(op) -> float:
        return max(op[0] / (low if op[2] else full), op[1] / mem)

    segments = [sum(seconds(op) for op in seg) for seg in rec.segment_ops]
    prefix, x = rec.extra.get("block_prefix"), rec.extra
    from .traced import _block_of
    blocks = [_block_of(m, prefix) if prefix else None for m in rec.segment_module]
    seq = x.get("seq", 0)
    tensors, kinds = [], [""] * rec.n_forward
    for t in rec.tensors:
        b = _block_of(t.module, prefix) if prefix else None
        kind = ""
        if b is not None and f"{prefix}.{b}" in t.input_of:
            kind = "block_input"
        elif b is not None and len(t.shape) == 4 and tuple(t.shape[-2:]) == (seq, seq):
            # (batch, heads, seq, seq): a score or probability matrix of eager attention
            kind = kinds[t.saved_at] = "attn_core"
        tensors.append(Tensor(t.nbytes, t.saved_at, t.first_used_at, True, b, kind))
    block_list = _selective_blocks(rec, tensors, blocks, segments, seconds)
    states = rec.param_bytes + rec.grad_bytes + OPTIMIZERS[optimizer] * rec.param_bytes // dp_shard
    tokens = x.get("seq", 0) * x.get("micro_batch", 0)
    step = Step(segments=segments, n_forward=rec.n_forward, tensors=tensors,
                model_state_bytes=states, workspace_bytes=rec.transient_bytes, tokens=tokens,
                tag=f"{name} seq={seq} mb={x.get('micro_batch')} traced",
                segment_block=blocks[:rec.n_forward], segment_kind=kinds, blocks=block_list)
    meta = {"model": name, "hardware": hw.name, "optimizer": optimizer, "dp_shard": dp_shard,
            "params": rec.param_bytes // 4,                # weights are built in fp32
            "traced_layers": x.get("traced_layers", x.get("layers")), "layers": x.get("layers"),
            "step_peak_bytes": rec.peak_bytes, "settings": {k: x.get(k) for k in (
                "seq", "micro_batch", "dtype", "attn", "model_type")}}
    return Trace(steps=[step], source="traced", meta=meta, d2h_bytes_per_s=hw.d2h,
                 h2d_bytes_per_s=hw.h2d)


def _selective_blocks(rec: Recording, tensors: list, blocks: list, segments: list,
                      seconds) -> Optional[list]:
    """Each block as selective checkpointing (recompute/selective.py) runs it: it keeps the block
    input and the outputs of matmuls and attention, and before the block's backward re-runs its
    other forward ops (norms, activations, elementwise). None when the recording's ops do not say
    what selective keeps (recorded before they did) or a block's tensors are not contiguous."""
    if not all(len(op) >= 4 for seg in rec.segment_ops[:rec.n_forward] for op in seg):
        return None
    ranges: dict = {}
    for j, t in enumerate(tensors):
        if t.block is not None:
            lo, hi = ranges.get(t.block, (j, j))
            ranges[t.block] = (min(lo, j), max(hi, j))
    out = []
    for blk, (lo, hi) in sorted(ranges.items(), key=lambda kv: kv[1]):
        if any(t.block != blk for t in tensors[lo:hi + 1]):
            return None
        segs = [i for i in range(rec.n_forward) if blocks[i] == blk]
        ops = [op for i in segs for op in rec.segment_ops[i]]
        out.append({"block": blk, "first": lo, "end": hi + 1,
                    "input_bytes": sum(t.nbytes for t in tensors[lo:hi + 1]
                                       if t.kind == "block_input"),
                    "forward_seconds": float(sum(segments[i] for i in segs)),
                    "selective_bytes": int(sum(op[3] for op in ops)),
                    "selective_seconds": float(sum(seconds(op) for op in ops if not op[3]))})
    return out or None


class TracedModel:
    """What the commands need to know of a ``--hf`` model: traces at any run settings (cached
    per setting) and a one-line description."""

    def __init__(self, spec: str, hw: Hardware, *, seq: int, micro_batch: int, dtype: str,
                 optimizer: str, attn: str = "sdpa", dp_shard: int = 1) -> None:
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}; "
                             f"got {optimizer!r}")
        self.spec, self.hw, self.dtype, self.optimizer, self.attn = spec, hw, dtype, optimizer, attn
        self.dp_shard = dp_shard
        self.seq, self.micro_batch = seq, micro_batch
        self.name = Path(spec).stem if spec.endswith(".json") else spec
        self._traces: dict = {}

    def trace(self, seq: Optional[int] = None, micro_batch: Optional[int] = None) -> Trace:
        key = (seq or self.seq, micro_batch or self.micro_batch)
        if key not in self._traces:
            rec = trace_hf(self.spec, seq=key[0], micro_batch=key[1], dtype=self.dtype,
                           attn=self.attn)
            self._traces[key] = to_trace(rec, self.hw, self.optimizer, self.name, self.dp_shard)
        return self._traces[key]

    def describe(self) -> str:
        m = self.trace().meta
        layers = (f"{m['layers']} layers" + (f" (traced {m['traced_layers']}, the middle one "
                  f"repeated)" if m["traced_layers"] != m["layers"] else ""))
        amp = "bf16 autocast, fp32 weights" if self.dtype == "bf16" else "fp32"
        return (f"{self.name} (traced on fake tensors): {m['params'] / 1e9:.2f}B params, {layers}; "
                f"seq {self.seq} x micro-batch {self.micro_batch}, {amp}, attention "
                f"{self.attn}, {self.optimizer}"
                + (f" (moments ZeRO-1 over {self.dp_shard})" if self.dp_shard > 1 else ""))

    def on(self, hw: Hardware) -> "TracedModel":
        """The same model and settings timed on another hardware profile."""
        return TracedModel(self.spec, hw, seq=self.seq, micro_batch=self.micro_batch,
                           dtype=self.dtype, optimizer=self.optimizer, attn=self.attn,
                           dp_shard=self.dp_shard)


def capacity(model: TracedModel, policies: list, advance=lambda: None) -> dict:
    """``sweeps.capacity`` for a traced model: the longest sequence and the largest
    micro-batch that fit, per policy (a traced model has no family of sizes to search)."""
    from .policies import run
    from .sweeps import MAX_MICRO_BATCH, MAX_SEQ, SEQ_STEP, _largest, default_budget, demand_bytes
    hw = model.hw

    def point(policy, **settings):
        trace = model.trace(**settings)
        step = trace.steps[0]
        r = run(trace, policy, default_budget(step, hw), device_bytes=hw.usable_bytes,
                host_bytes=hw.host_memory_bytes)
        if not r.fits:
            return None
        return {"step_seconds": r.step_seconds, "tokens_per_second": r.tokens_per_second,
                "peak_bytes": r.peak_bytes, "moved_bytes": r.moved_bytes,
                "demand_ratio": demand_bytes(step, hw) / hw.device_memory_bytes}

    out: dict = {}
    for p in policies:
        row: dict = {}
        value, got = _largest(lambda s: point(p, seq=s), SEQ_STEP, SEQ_STEP, MAX_SEQ)
        row["seq"] = None if value is None else {"seq": value, **got}
        advance()
        value, got = _largest(lambda b: point(p, micro_batch=b), 1, 1, MAX_MICRO_BATCH)
        row["micro_batch"] = None if value is None else {"micro_batch": value, **got}
        advance()
        out[p] = row
    return out


def compare(model: TracedModel, hws: list, approaches, budget: Optional[int] = None,
            advance=lambda: None) -> list[dict]:
    """``sweeps.compare`` for a traced model: a traced step cannot be re-sharded, so instead of
    tensor-parallel degrees this compares the approaches at one degree across hardware profiles
    (``hws``), at ``budget`` (default: what each device leaves once model states, workspace and
    its reserve are taken). Memory binds where ``none`` does not fit."""
    from .policies import run
    from .sweeps import default_budget, demand_bytes, speedups
    rows = []
    for hw in hws:
        trace = model.on(hw).trace()
        step = trace.steps[0]
        b = default_budget(step, hw) if budget is None else budget
        row: dict = {"hardware": hw.name, "budget_bytes": b,
                     "activation_bytes": step.activation_bytes,
                     "model_state_bytes": step.model_state_bytes,
                     "demand_ratio": demand_bytes(step, hw) / hw.device_memory_bytes}
        cache: dict = {}
        hopeless = step.model_state_bytes + step.workspace_bytes > hw.usable_bytes
        for a in approaches:
            if hopeless:              # model states alone overflow: no policy fits, skip planning
                row[a] = {"fits": False, "step_seconds": None, "stall_seconds": None,
                          "tokens_per_second_per_device": None, "peak_bytes": None,
                          "moved_bytes": None}
                advance()
                continue
            r = run(trace, a, b, device_bytes=hw.usable_bytes, host_bytes=hw.host_memory_bytes,
                    plan_cache=cache)
            row[a] = {"fits": r.fits, "step_seconds": r.step_seconds,
                      "stall_seconds": r.stall_seconds,
                      "tokens_per_second_per_device": r.tokens_per_second,
                      "peak_bytes": r.peak_bytes, "moved_bytes": r.moved_bytes}
            advance()
        fitting = {a: row[a] if row[a]["fits"] else None for a in approaches}
        row.update(speedups(fitting))
        row["memory_binds"] = not row["none"]["fits"] if "none" in row else None
        rows.append(row)
    return rows
