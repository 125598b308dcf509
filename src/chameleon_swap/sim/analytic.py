"""Analytic traces of decoder-only transformers: per-op FLOPs, bytes and saved tensors.

What each op saves for backward follows the itemization of Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", Sec. 4.1: for their GPT layer (16-bit
activations, 1-byte dropout masks, no FlashAttention) the tensors below add up to exactly
``s*b*h*(34 + 5*a*s/h)`` bytes per layer, and to that over ``t`` with tensor and sequence
parallelism of degree ``t`` (their Eq. 6). The llama layout itemizes the same way: RMSNorm and
linear inputs, rotated q and k, v, the softmax output (or, with FlashAttention, Dao et al. 2022,
the output and the softmax log-sum-exp instead of any s^2 tensor), SwiGLU's gate, its SiLU,
up projection and product; no dropout. Cross-entropy keeps fp32 logits (Korthikanti's 4sbv).

FLOPs: 2mnk per matmul forward, twice that backward; per layer this gives Narayanan et al. 2021
("Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") 24bsh^2 +
4bs^2h forward for their GPT layer, i.e. their ``72 B s l h^2 (1 + s/6h + V/12lh)`` per step
without recomputation and ``96 ... (1 + s/6h + V/16lh)`` with full recomputation. FlashAttention's
backward is 2.5 times its forward (Dao 2023, FlashAttention-2, Sec. 4), and causal masking lets
it skip half the score matrix; the non-flash path computes the full matrix.

Time of an op: a roofline, ``max(flops / achievable FLOP/s, bytes / achievable HBM bandwidth)``.
Tensor parallelism (Megatron with sequence parallelism): matmuls, bytes and activations over
``t``; per layer and pass, two all-gathers and two reduce-scatters of ``s*b*h`` elements, each
moving ``(t-1)/t`` of it per device over the interconnect, on the critical path (not overlapped).
"""
from __future__ import annotations

import math
from typing import Optional

from .hardware import Hardware
from .models import ModelConfig
from ..runtime.trace import Step, Tensor, Trace


class _Builder:
    """Ops in forward order, each with its forward and backward time; saved tensors by the op
    that saves them and the op whose backward first needs them."""

    def __init__(self, cfg: ModelConfig, hw: Hardware) -> None:
        self.cfg, self.hw = cfg, hw
        self.F = hw.flops(cfg.dtype)
        self.M = hw.memory_bytes_per_s
        self.ops: list[dict] = []
        self.saved: list[tuple] = []        # (nbytes, save_op, use_op, block, kind)
        self.block: Optional[int] = None
        self.flops = {"forward": 0.0, "backward": 0.0}

    def op(self, name: str, *, flops: float = 0.0, nbytes: float = 0.0, bwd_flops=None,
           bwd_bytes=None, kind: str = "", comm: float = 0.0) -> int:
        t = self.cfg.tp
        f, b = flops / t, nbytes / t
        bf = 2 * f if bwd_flops is None else bwd_flops / t
        bb = 2 * b if bwd_bytes is None else bwd_bytes / t
        fwd = max(f / self.F, b / self.M) + comm
        bwd = max(bf / self.F, bb / self.M) + comm
        self.flops["forward"] += f
        self.flops["backward"] += bf
        self.ops.append(dict(name=name, fwd=fwd, bwd=bwd, block=self.block, kind=kind))
        return len(self.ops) - 1

    def matmul(self, name: str, m: int, k: int, n: int, **kw) -> int:
        e = self.cfg.elem
        return self.op(name, flops=2.0 * m * k * n, nbytes=e * (m * k + k * n + m * n), **kw)

    def save(self, nbytes: float, at: int, used_by: Optional[int] = None, kind: str = "") -> None:
        # Sequence parallelism splits every activation over the tensor-parallel ranks.
        b = math.ceil(nbytes / self.cfg.tp)
        if b > 0:
            self.saved.append((b, at, at if used_by is None else used_by, self.block, kind))

    def collective(self) -> float:
        """Seconds of one all-gather or reduce-scatter of the s*b*h activation per device."""
        t = self.cfg.tp
        if t == 1:
            return 0.0
        c = self.cfg
        return (t - 1) / t * c.tokens * c.hidden * c.elem / self.hw.interconnect


def generate(cfg: ModelConfig, hw: Hardware) -> Trace:
    """A one-step trace of ``cfg`` (one micro-batch, forward and backward) timed on ``hw``."""
    B = _Builder(cfg, hw)
    s, b, h, a = cfg.seq, cfg.micro_batch, cfg.hidden, cfg.heads
    e, sb, hkv, V = cfg.elem, cfg.tokens, cfg.kv_hidden, cfg.vocab
    gpt = cfg.arch == "gpt"
    drop = cfg.dropout > 0

    i = B.op("embedding", nbytes=e * sb * h * 2)
    B.save(8 * sb, i)                                    # token ids (int64)
    if gpt and drop:
        i = B.op("embedding.dropout", nbytes=e * sb * h * 2)
        B.save(sb * h, i)                                # 1-byte mask
    for layer in range(cfg.layers):
        B.block = layer
        _layer(B, cfg, s, b, h, a, e, sb, hkv, gpt, drop)
    B.block = None
    i = B.op("final_norm", nbytes=e * sb * h * 2)
    B.save(e * sb * h, i)
    i = B.matmul("lm_head", sb, h, V)
    B.save(e * sb * h, i)
    i = B.op("loss", nbytes=(e + 4 + 4) * sb * V)
    B.save(4 * sb * V, i)                                # fp32 logits (Korthikanti's 4sbv)

    n = len(B.ops)
    segments = [o["fwd"] for o in B.ops] + [o["bwd"] for o in reversed(B.ops)]
    tensors = [Tensor(nb, at, n + (n - 1 - use), True, blk, kind)
               for nb, at, use, blk, kind in B.saved]
    tensors.sort(key=lambda t: t.saved_at)               # save order (stable within an op)
    biggest = max((t.nbytes for t in tensors), default=0)
    step = Step(segments=segments, n_forward=n, tensors=tensors,
                model_state_bytes=cfg.model_state_bytes(),
                # A transient estimate: the output and the input gradient of the largest op.
                workspace_bytes=2 * biggest, tokens=cfg.tokens,
                tag=f"{cfg.name} seq={cfg.seq} mb={cfg.micro_batch} tp={cfg.tp}",
                segment_block=[o["block"] for o in B.ops],
                segment_kind=[o["kind"] for o in B.ops])
    meta = {"model": _config_dict(cfg), "hardware": hw.name, "params": cfg.params(),
            "flops": dict(B.flops), "ops": [o["name"] for o in B.ops]}
    return Trace(steps=[step], source="analytic", meta=meta,
                 d2h_bytes_per_s=hw.d2h, h2d_bytes_per_s=hw.h2d)


def _layer(B: _Builder, cfg: ModelConfig, s, b, h, a, e, sb, hkv, gpt, drop) -> None:
    comm = B.collective()
    # Attention. The block input x is what a full-recompute checkpoint keeps.
    i = B.op("attn_norm", nbytes=e * sb * h * 2, comm=comm)       # all-gather (SP) before it
    B.save(e * sb * h, i, kind="block_input")
    i = B.matmul("qkv", sb, h, h + 2 * hkv)
    B.save(e * sb * h, i)                                         # norm output
    if not gpt:
        B.op("rope", nbytes=e * sb * (h + hkv) * 2)
    if cfg.flash:
        causal = 0.5
        fl = 4.0 * b * s * s * h * causal
        i = B.op("flash_attn", flops=fl, bwd_flops=2.5 * fl,
                 nbytes=e * sb * (2 * h + 2 * hkv))
        B.save(e * sb * h, i)                                     # q
        B.save(e * sb * hkv, i)                                   # k
        B.save(e * sb * hkv, i)                                   # v
        B.save(4 * b * a * s, i)                                  # softmax log-sum-exp (fp32)
        o = i                                                     # O: saved by the attention,
        j = B.matmul("attn_out", sb, h, h, comm=comm)             # first needed by the projection
        B.save(e * sb * h, o, used_by=j)
    else:
        sq = b * a * s * s
        i = B.op("scores", flops=2.0 * b * s * s * h, nbytes=e * (sb * (h + hkv) + sq),
                 kind="attn_core")
        B.save(e * sb * h, i)                                     # q
        B.save(e * sb * hkv, i)                                   # k
        p = B.op("softmax", nbytes=e * sq * 2, kind="attn_core")
        if drop:
            B.save(e * sq, p, kind="attn_core")                   # softmax output
            d = B.op("attn_dropout", nbytes=e * sq * 2, kind="attn_core")
            B.save(sq, d, kind="attn_core")                       # 1-byte mask
            pv = B.op("pv", flops=2.0 * b * s * s * h, nbytes=e * (sq + sb * (hkv + h)))
            B.save(e * sq, pv, kind="attn_core")                  # dropout output
        else:
            pv = B.op("pv", flops=2.0 * b * s * s * h, nbytes=e * (sq + sb * (hkv + h)))
            B.save(e * sq, p, used_by=pv, kind="attn_core")       # softmax output, PV needs it first
        B.save(e * sb * hkv, pv)                                  # v
        j = B.matmul("attn_out", sb, h, h, comm=comm)             # reduce-scatter (SP) after it
        B.save(e * sb * h, j)                                     # its input
    if drop:
        i = B.op("attn_out.dropout", nbytes=e * sb * h * 2)
        B.save(sb * h, i)
    B.op("residual", nbytes=e * sb * h * 3)
    # MLP (or experts).
    i = B.op("mlp_norm", nbytes=e * sb * h * 2, comm=comm)
    B.save(e * sb * h, i)
    if cfg.experts:
        _experts(B, cfg, e, sb, h, comm)
    elif gpt:
        f = cfg.ffn
        i = B.matmul("fc1", sb, h, f)
        B.save(e * sb * h, i)
        i = B.op("gelu", nbytes=e * sb * f * 2)
        B.save(e * sb * f, i)
        i = B.matmul("fc2", sb, f, h, comm=comm)
        B.save(e * sb * f, i)
    else:
        f = cfg.ffn
        i = B.matmul("w1_w3", sb, h, 2 * f)
        B.save(e * sb * h, i)
        i = B.op("silu", nbytes=e * sb * f * 2)
        B.save(e * sb * f, i)                                     # gate pre-activation
        i = B.op("gate_mul", nbytes=e * sb * f * 3)
        B.save(e * sb * f, i)                                     # SiLU output
        B.save(e * sb * f, i)                                     # up projection
        i = B.matmul("w2", sb, f, h, comm=comm)
        B.save(e * sb * f, i)                                     # product
    if drop:
        i = B.op("mlp.dropout", nbytes=e * sb * h * 2)
        B.save(sb * h, i)
    B.op("residual", nbytes=e * sb * h * 3)


def _experts(B: _Builder, cfg: ModelConfig, e, sb, h, comm) -> None:
    E, k, f = cfg.experts, cfg.top_k, cfg.expert_ffn
    i = B.matmul("router", sb, h, E)
    B.save(e * sb * h, i)                                         # norm output (router input)
    i = B.op("topk", nbytes=4 * sb * E * 2)
    B.save(4 * sb * k + 8 * sb * k, i)                            # gates (fp32) and indices
    # Balanced routing: every expert gets sb*k/E tokens (an assumption; real routers are not).
    t = math.ceil(sb * k / E)
    for x in range(E):
        i = B.matmul(f"expert{x}.w1_w3", t, h, 2 * f)
        B.save(e * t * h, i)                                      # gathered input
        i = B.op(f"expert{x}.silu", nbytes=e * t * f * 2)
        B.save(e * t * f, i)
        i = B.op(f"expert{x}.gate_mul", nbytes=e * t * f * 3)
        B.save(2 * e * t * f, i)
        i = B.matmul(f"expert{x}.w2", t, f, h)
        B.save(e * t * f, i)
        i = B.op(f"expert{x}.scale", nbytes=e * t * h * 3)
        B.save(e * t * h + e * t, i)                              # expert output and its gate
    B.op("combine", nbytes=e * sb * k * h * 2, comm=comm)


def _config_dict(cfg: ModelConfig) -> dict:
    import dataclasses
    return dataclasses.asdict(cfg)


def layer_activation_bytes(trace: Trace, layer: int = 0) -> int:
    """Bytes saved by one layer (block) of an analytic trace: for the GPT layout, Korthikanti's
    ``s*b*h*(34 + 5*a*s/h) / t``."""
    return sum(t.nbytes for t in trace.steps[0].tensors if t.block == layer)
