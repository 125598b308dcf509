"""Small deterministic CPU models for the engine tests, beyond the Llama/MoE workloads.

Each one's ``forward(x)`` returns a scalar loss and nothing else, so no intermediate is kept alive
by Python: every activation that survives the forward pass is held by autograd alone.

* ``ViewsModel``: views, transposes, one projection chunked/split into q/k/v, in-place activations,
  a submodule called twice in one forward and one Parameter shared by two layers (LESSONS 4, 11, 12).
* ``FunctionalModel``: not an ``nn.Module`` and with no submodules: plain leaf tensors with
  ``requires_grad`` as weights, so the engine's module hooks never fire (its guard must work from
  the unpack hook alone).
* ``random_model(spec)``: a random stack of blocks for hypothesis (``SPEC_BLOCKS``).
* ``tiny_llama``, ``tiny_moe``, ``lm_batches``: the workloads' Llama and MoE at test size, and
  seeded token batches for them.
* ``TModel``: a stack of pre-norm transformer blocks with dropout whose mask and rotary (cos, sin)
  tuple are passed as keyword arguments only, as Hugging Face layers get them.
"""
from __future__ import annotations

import math
from typing import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


TINY_LM = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def tiny_llama(**overrides):
    from chameleon_swap.workloads import Llama, LlamaConfig
    torch.manual_seed(0)
    return Llama(LlamaConfig(**{**TINY_LM, **overrides}))


def tiny_moe(**overrides):
    from chameleon_swap.workloads import MoE, MoEConfig
    torch.manual_seed(0)
    return MoE(MoEConfig(**{**TINY_LM, "n_experts": 4, "top_k": 2, **overrides}))


def tokens(vocab_size: int, B: int, T: int, seed: int) -> tuple:
    """(inputs, targets) of ``B`` random sequences of length ``T``."""
    t = torch.randint(vocab_size, (B, T + 1), generator=_gen(seed))
    return t[:, :-1], t[:, 1:]


def lm_batches(model, lengths, B: int = 2) -> list:
    """One seeded batch per length (seed = position), for ``tiny_llama`` / ``tiny_moe``."""
    return [tokens(model.config.vocab_size, B, T, seed=i) for i, T in enumerate(lengths)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _init_(module: nn.Module, seed: int) -> nn.Module:
    """Deterministic weights from a private generator (independent of the global RNG state)."""
    g = _gen(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():  # a tied weight is listed (and drawn) once
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(max(1, p.shape[-1])))
    return module


# --------------------------------------------------------------------------- ViewsModel
class ViewsModel(nn.Module):
    """Attention-like block written to stress storage dedup and view rebuild.

    * ``qkv`` is one projection, split into q, k, v by ``chunk`` (q, k) and ``split`` (v): three
      views of one storage, each saved by a different op with its own offset and stride;
    * ``k.transpose(-1, -2)`` and ``x.t()`` are saved by matmul: non-contiguous views sharing a
      storage with a tensor saved untransposed (LESSONS 4, 12);
    * ``nn.ReLU(inplace=True)`` and ``h.mul_()`` modify fresh intermediates in place (their
      versions move between creation and save: LESSONS 11);
    * ``mlp`` is called twice in one forward (two sets of saves from one module);
    * ``tied_a.weight`` and ``tied_b.weight`` are one Parameter.
    """

    def __init__(self, dim: int = 16, hidden: int = 32, seed: int = 0):
        super().__init__()
        self.dim = dim
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, dim))
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=True)
        self.mix = nn.Parameter(torch.empty(dim, dim))
        # Tied: one Parameter used by two layers.
        self.tied_a = nn.Linear(dim, dim, bias=False)
        self.tied_b = nn.Linear(dim, dim, bias=True)
        self.tied_b.weight = self.tied_a.weight
        _init_(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (B, T, dim)
        B, T, D = x.shape
        qk, v = self.qkv(x).split([2 * D, D], dim=-1)
        q, k = qk.chunk(2, dim=-1)
        att = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(D), dim=-1)   # (B, T, T)
        y = x + att @ v
        # A flattened view and its transpose, both saved by mm.
        flat = y.reshape(B * T, D)
        y = y + (self.mix @ flat.t()).t().reshape(B, T, D)
        y = y + self.mlp(y)                      # first call of the shared submodule
        h = F.linear(y, self.up.weight)          # fresh intermediate, not saved by linear
        h.mul_(0.5)                              # in place on it before anyone saves it
        h = torch.relu_(h)                       # saves its (modified) output
        y = y + self.down(h)
        y = self.tied_b(torch.tanh(self.tied_a(y))) + y   # one weight, two layers
        y = self.mlp(torch.tanh(y)) + y          # second call of the shared submodule
        return (y * y).mean()


# --------------------------------------------------------------------------- FunctionalModel
class FunctionalModel:
    """A model with no ``nn.Module`` anywhere: weights are plain leaf tensors that require grad.

    It offers the few methods the test helpers use (``named_parameters``, ``parameters``,
    ``zero_grad``, call, ``copy.deepcopy``), so ``compare()`` works on it unchanged.
    """

    def __init__(self, dim: int = 16, hidden: int = 24, seed: int = 0):
        g = _gen(seed)

        def w(*shape):
            return (torch.randn(*shape, generator=g) / math.sqrt(shape[-1])).requires_grad_()

        self._params = {"w_in": w(hidden, dim), "w_att": w(hidden, hidden),
                        "w_out": w(dim, hidden), "b_out": w(dim)}

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._params.items())

    def parameters(self) -> Iterator[torch.Tensor]:
        return iter(self._params.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params.values():
            p.grad = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (B, T, dim)
        p = self._params
        h = torch.tanh(torch.matmul(x, p["w_in"].t()))              # (B, T, hidden)
        s = torch.softmax(h @ h.transpose(-1, -2) / 4.0, dim=-1)     # (B, T, T), saves h and h^T
        h = s @ torch.matmul(h, p["w_att"])
        h = h * torch.sigmoid(h)
        out = torch.addmm(p["b_out"], h.reshape(-1, h.shape[-1]), p["w_out"].t())
        return out.pow(2).mean() + h.transpose(0, 1).tanh().sum() * 1e-3


# --------------------------------------------------------------------------- random_model
SPEC_BLOCKS = ("linear", "matmul_t", "gelu", "tanh", "relu", "relu_inplace", "layernorm",
               "residual", "chunk_cat", "softmax", "attention")


class _Block(nn.Module):
    def __init__(self, kind: str, dim: int):
        super().__init__()
        self.kind = kind
        if kind in ("linear", "residual", "relu_inplace"):
            self.lin = nn.Linear(dim, dim)
        elif kind == "matmul_t":
            self.w = nn.Parameter(torch.empty(dim, dim))
        elif kind == "layernorm":
            self.norm = nn.LayerNorm(dim)
        elif kind == "chunk_cat":
            self.scale = nn.Parameter(torch.empty(dim // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kind
        if k == "linear":
            return self.lin(x)
        if k == "matmul_t":         # matmul saves a transposed (non-contiguous) view of x
            return (self.w @ x.transpose(-1, -2)).transpose(-1, -2)
        if k == "gelu":
            return F.gelu(x)
        if k == "tanh":
            return torch.tanh(x)
        if k == "relu":
            return F.relu(x)
        if k == "relu_inplace":     # in place on a fresh intermediate (linear does not save it)
            return F.relu(self.lin(x), inplace=True)
        if k == "layernorm":
            return self.norm(x)
        if k == "residual":
            return x + self.lin(torch.tanh(x))
        if k == "chunk_cat":        # two views of one storage, saved by different ops
            a, b = x.chunk(2, dim=-1)
            return torch.cat([a * torch.sigmoid(b), b * self.scale], dim=-1)
        if k == "softmax":
            return torch.softmax(x, dim=-1)
        if k == "attention":        # x and x^T (one storage) both saved by matmul
            s = torch.softmax(x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1]), dim=-1)
            return s @ x
        raise ValueError(f"unknown block {k!r}")


class RandomModel(nn.Module):
    def __init__(self, blocks: Sequence[str], dim: int, seed: int = 0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"dim must be even (chunk_cat halves it); got {dim}")
        self.blocks = nn.ModuleList(_Block(k, dim) for k in blocks)
        self.head = nn.Linear(dim, 1)
        _init_(self, seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def random_model(spec: dict) -> RandomModel:
    """``spec``: ``{"blocks": [names from SPEC_BLOCKS], "dim": even int, "seed": int}``."""
    return RandomModel(spec["blocks"], spec["dim"], spec.get("seed", 0))


# --------------------------------------------------------------------------- TModel
class TBlock(nn.Module):
    """Pre-norm transformer block: dropout, SDPA with a mask and rotary (cos, sin) passed as
    keyword arguments only, an MLP with biases."""

    def __init__(self, dim: int, p: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(p)

    def forward(self, x, *, mask=None, rope=None, scale: float = 1.0):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        if rope is not None:
            cos, sin = rope
            q, k = q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.drop(self.proj(a)) * scale
        return x + self.fc2(self.drop(F.gelu(self.fc1(self.ln2(x)))))


class TModel(nn.Module):
    def __init__(self, dim: int = 16, n: int = 3, p: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.inp = nn.Linear(dim, dim)
            self.layers = nn.ModuleList(TBlock(dim, p) for _ in range(n))
            self.head = nn.Linear(dim, 1)

    def forward(self, x):
        T, D = x.shape[-2:]
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        pos = torch.arange(T, dtype=x.dtype)[:, None] / 7.0
        rope = (torch.cos(pos).expand(T, D), torch.sin(pos).expand(T, D))
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h, mask=mask, rope=rope, scale=0.5)
        return self.head(h).pow(2).mean()


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))
