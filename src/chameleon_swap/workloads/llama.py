"""A small Llama-style decoder: RMSNorm, grouped-query attention with RoPE, SwiGLU MLP.

It is a workload for the swap engine, so it is written to be easy to wrap: every block lives in
``Llama.layers`` (one ``nn.ModuleList``), blocks take plain positional tensors, and nothing in the
forward pass syncs the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


def check_int(name: str, value, accepted: str = "a positive int") -> None:
    # bool is an int subclass: n_layers=True is surely a mistake, not one layer.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {accepted}; got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be {accepted}; got {value!r}")


def check_float(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a positive finite number; got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number; got {value!r}")


def swiglu_hidden(dim: int, multiple_of: int = 16) -> int:
    """SwiGLU's usual width: 8/3 * dim (the parameter count of a 4*dim GELU MLP), rounded up."""
    return multiple_of * math.ceil(int(8 * dim / 3) / multiple_of)


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: Optional[int] = None  # None -> swiglu_hidden(dim), resolved in __post_init__
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            check_int(name, getattr(self, name))
        if self.dim % self.n_heads:
            raise ValueError(f"n_heads must divide dim ({self.dim}); got n_heads={self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"dim / n_heads (the head size) must be even for RoPE; "
                             f"got dim={self.dim}, n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads must divide n_heads ({self.n_heads}); "
                             f"got n_kv_heads={self.n_kv_heads}")
        if self.ffn_dim is None:
            self.ffn_dim = swiglu_hidden(self.dim)
        check_int("ffn_dim", self.ffn_dim, "a positive int, or None for the SwiGLU default")
        check_float("rope_theta", self.rope_theta)
        check_float("norm_eps", self.norm_eps)
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"tie_embeddings must be True or False; got {self.tie_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: a mean of squares in bf16/fp16 loses too much precision.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_cos_sin(inv_freq: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles ``position * inv_freq``, each (seq_len, head_dim / 2)."""
    pos = torch.arange(seq_len, device=inv_freq.device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq.float())
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head of x (B, T, H, head_dim): channel i pairs with channel i + head_dim / 2."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: n_kv_heads key/value heads, each shared by a group of
    n_heads / n_kv_heads query heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.wq(x).view(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(B, T, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        # Expand the kv heads explicitly rather than with sdpa's enable_gqa: every sdpa backend on
        # every torch >= 2.5 accepts equal head counts. Query head h reads kv head h // group.
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down, back into the residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block; ``mlp`` is any (…, dim) -> (…, dim) module (dense or MoE)."""

    def __init__(self, cfg: LlamaConfig, mlp: nn.Module):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    config_class = LlamaConfig

    def __init__(self, config: Optional[LlamaConfig] = None):
        super().__init__()
        config = self.config_class() if config is None else config
        if not isinstance(config, self.config_class):
            raise TypeError(f"config must be a {self.config_class.__name__}; "
                            f"got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, self.make_mlp(config))
                                    for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_emb.weight
        # Not persistent: it is derived from the config, so checkpoints need not carry it.
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        self.init_weights()

    def _inv_freq(self, device=None) -> torch.Tensor:
        hd = self.config.head_dim
        exps = torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd
        return (1.0 / self.config.rope_theta ** exps).float()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the derived buffers (RoPE frequencies, always float32) where the model lives:
        needed after ``to_empty()`` (a model built on the meta device) or a cast to a low
        precision dtype."""
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def make_mlp(self, config: LlamaConfig) -> nn.Module:
        """The MLP of one block; subclasses (MoE) override this."""
        return SwiGLU(config.dim, config.ffn_dim)

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """(Re)initialise every parameter: ones for norm weights, N(0, 0.02) for the rest, with the
        projections that write into the residual stream (wo, w2) scaled by 1/sqrt(2 * n_layers) so
        the stream's variance does not grow with depth.

        Values are drawn on the CPU from a private generator seeded with ``seed`` (or from torch's
        global CPU generator when ``seed`` is None) and then copied to each parameter, so one seed
        gives the same weights on every device and dtype round-trip.
        """
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        std = 0.02
        resid_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():  # a tied weight is listed (and drawn) once
            if p.dim() == 1:  # the only vectors are RMSNorm weights
                p.fill_(1.0)
            else:
                s = resid_std if name.endswith(("wo.weight", "w2.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)

    def forward(self, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None,
                keep: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Logits (B, T, vocab), or the mean cross-entropy when ``targets`` is given.

        ``keep`` (layer drop): the indices of the blocks to run, increasing; the others are
        skipped entirely. None runs every block."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq_len); got shape {tuple(tokens.shape)}")
        T = tokens.size(1)
        if not 1 <= T <= self.config.max_seq_len:
            raise ValueError(f"seq_len must be between 1 and max_seq_len "
                             f"({self.config.max_seq_len}); got {T}")
        n = len(self.layers)
        if keep is None:
            keep = range(n)
        elif (not all(type(i) is int and 0 <= i < n for i in keep)
              or list(keep) != sorted(set(keep))):
            raise ValueError(f"keep must be increasing block indices from 0 to {n - 1}; "
                             f"got {keep!r}")
        cos, sin = rope_cos_sin(self.inv_freq, T)
        x = self.tok_emb(tokens)
        for i in keep:
            # Through the ModuleList by index, so a block wrapped in place (checkpointing) is used.
            x = self.layers[i](x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        # Loss in float32 whatever the model dtype (a no-op for float32 models).
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
