"""A video diffusion transformer, trained the way Open-Sora Plan trains (arXiv 2412.00131).

Open-Sora Plan v1.3 trains one denoiser on images and videos together. What matters for memory is
reproduced here; the VAE and the T5 text encoder are replaced by random tensors of their shapes:

* every batch comes from one latent bucket T x H x W; T = 1 is an image, T > 1 a video, so token
  counts, padding and attention shapes change from step to step;
* 3D patchify: non-overlapping (patch_t, patch, patch) patches, flattened and projected to tokens
  (the linear layer is a stride = kernel Conv3d); positions enter through a 3D rotary embedding;
* timestep embedding (sinusoid -> MLP) modulates every block adaLN-single style (PixArt-alpha):
  one shared projection gives shift/scale/gate vectors, to which each block adds its own table;
* cross-attention from the video tokens to a fixed number of text tokens;
* Skiparse self-attention: the tokens are regrouped with sparsity k and attention is full inside
  each group. Even layers use "single skip" (tokens i, i+k, i+2k, ... form a group), odd layers
  "group skip" (chunks of k consecutive tokens, every k-th chunk in one group), so over two
  layers every token can reach every other. The token count is padded up to what the grouping
  needs; padded keys are masked out;
* loss: MSE between the predicted and the true noise on latents noised with a linear beta
  schedule (DDPM epsilon prediction).

The code is written for this project from the paper's description. The weights are not
adaLN-zero initialised: every parameter gets a gradient from the first step, which the bitwise
tests of the engine need to mean something.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import Batch
from .common import (PresetWorkload, as_tuple, build_on, check_int, data_generator, draw_int)
from .llama import apply_rope, check_float

TIME_FREQ_DIM = 256  # width of the sinusoidal timestep features, as in DiT


@dataclass
class VideoDiTConfig:
    in_channels: int = 4         # latent channels of the (absent) VAE
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_dim: Optional[int] = None  # None: 4 * dim
    patch: int = 2               # spatial patch size
    patch_t: int = 1             # temporal patch size (Open-Sora Plan v1.3 uses 1)
    sparse_k: int = 2            # Skiparse sparsity; 1 is full attention
    text_len: int = 8            # text tokens per sample (T5 features' stand-ins)
    text_dim: int = 32
    batch_size: int = 2
    # Latent buckets (T, H, W), drawn uniformly per step; T = 1 are images.
    buckets: tuple = ((1, 8, 8), (1, 6, 10), (3, 8, 8), (5, 6, 6))
    num_timesteps: int = 1000
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("in_channels", "dim", "n_layers", "n_heads", "patch", "patch_t", "sparse_k",
                     "text_len", "text_dim", "batch_size", "num_timesteps"):
            check_int(name, getattr(self, name))
        if self.ffn_dim is None:
            self.ffn_dim = 4 * self.dim
        check_int("ffn_dim", self.ffn_dim)
        check_float("rope_theta", self.rope_theta)
        check_float("norm_eps", self.norm_eps)
        hd = self.dim // self.n_heads
        if self.dim % self.n_heads or hd % 2 or hd < 6:
            raise ValueError(f"n_heads must divide dim ({self.dim}) into heads of an even size of "
                             f"at least 6 (3D RoPE rotates pairs along 3 axes); "
                             f"got n_heads={self.n_heads}")
        accepted = "a non-empty tuple of (T, H, W) latent sizes, H and W multiples of patch"
        self.buckets = as_tuple("buckets", self.buckets, accepted)
        for b in self.buckets:
            ok = (isinstance(b, tuple) and len(b) == 3
                  and all(type(n) is int and n > 0 for n in b)
                  and b[1] % self.patch == 0 and b[2] % self.patch == 0)
            if not ok:
                raise ValueError(f"buckets must be {accepted} ({self.patch}); got {b!r}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# ------------------------------------------------------------------ positions and time
def rope_3d(grid: tuple[int, int, int], head_dim: int, theta: float,
            device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (N, head_dim / 2) for tokens on a (T, H, W) grid in row-major order: of the
    head_dim / 2 rotated pairs, a third each turn with the h and w positions, the rest with t."""
    pairs = head_dim // 2
    sizes = (pairs - 2 * (pairs // 3), pairs // 3, pairs // 3)
    parts = []
    for axis, (n, size) in enumerate(zip(grid, sizes)):
        inv = 1.0 / theta ** (torch.arange(size, device=device, dtype=torch.float32) / size)
        angles = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv)
        shape = [1, 1, 1, size]
        shape[axis] = n
        parts.append(angles.view(shape).expand(*grid, size))
    angles = torch.cat(parts, dim=-1).reshape(-1, pairs)
    return angles.cos(), angles.sin()


def timestep_features(t: torch.Tensor, dim: int = TIME_FREQ_DIM) -> torch.Tensor:
    """Sinusoidal features (B, dim) of integer timesteps t (B,)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device,
                                                         dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat((args.cos(), args.sin()), dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


# ------------------------------------------------------------------ Skiparse
def skiparse_group(x: torch.Tensor, k: int, mode: str) -> torch.Tensor:
    """(B, N, H, hd) -> (B * k, H, M, hd): the k groups of each sample, zero-padded first to
    M * k tokens (a multiple of k for "single", of k * k for "group").

    single: token i is in group i % k.   group: token i is in chunk i // k, chunk j in group j % k.
    """
    B, N, H, hd = x.shape
    n_pad = -N % (k if mode == "single" else k * k)
    if n_pad:
        x = F.pad(x, (0, 0, 0, 0, 0, n_pad))
    M = (N + n_pad) // k
    if mode == "single":
        x = x.reshape(B, M, k, H, hd).permute(0, 2, 3, 1, 4)           # (B, r, H, M, hd)
    else:  # token (a * k + r) * k + c -> group r, position a * k + c
        x = x.reshape(B, M // k, k, k, H, hd).permute(0, 2, 4, 1, 3, 5)  # (B, r, H, a, c, hd)
    return x.reshape(B * k, H, M, hd)


def skiparse_ungroup(y: torch.Tensor, B: int, N: int, k: int, mode: str) -> torch.Tensor:
    """The inverse of ``skiparse_group`` with heads merged: (B * k, H, M, hd) -> (B, N, H * hd)."""
    _, H, M, hd = y.shape
    if mode == "single":
        y = y.view(B, k, H, M, hd).permute(0, 3, 1, 2, 4)
    else:
        y = y.view(B, k, H, M // k, k, hd).permute(0, 3, 1, 4, 2, 5)
    return y.reshape(B, M * k, H * hd)[:, :N]


def skiparse_mask(B: int, N: int, k: int, mode: str, device) -> Optional[torch.Tensor]:
    """Which keys each group may attend to (B * k, 1, 1, M), or None when nothing was padded.
    Built from shapes alone, on the device: no host sync. A group made only of padding attends to
    its own padding (all-masked rows would give NaN); its outputs are cropped away."""
    n_pad = -N % (k if mode == "single" else k * k)
    if n_pad == 0:
        return None
    real = torch.arange(N + n_pad, device=device).view(1, -1, 1, 1) < N
    real = skiparse_group(real, k, mode).transpose(-1, -2)         # (k, 1, 1, M)
    real = real | ~real.any(dim=-1, keepdim=True)
    return real.repeat(B, 1, 1, 1)


class SkiparseAttention(nn.Module):
    def __init__(self, cfg: VideoDiTConfig, mode: str):
        super().__init__()
        self.n_heads, self.k, self.mode = cfg.n_heads, cfg.sparse_k, mode
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.n_heads, D // self.n_heads).unbind(2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # before regrouping: true positions
        if self.k == 1:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return self.proj(y.transpose(1, 2).reshape(B, N, D))
        q, k, v = (skiparse_group(t, self.k, self.mode) for t in (q, k, v))
        mask = skiparse_mask(B, N, self.k, self.mode, x.device)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(skiparse_ungroup(y, B, N, self.k, self.mode))


class CrossAttention(nn.Module):
    def __init__(self, cfg: VideoDiTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.kv = nn.Linear(cfg.dim, 2 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        H, hd = self.n_heads, D // self.n_heads
        q = self.q(x).view(B, N, H, hd).transpose(1, 2)
        k, v = self.kv(text).view(B, text.size(1), 2, H, hd).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, N, D))


class DiTBlock(nn.Module):
    """Modulated Skiparse self-attention, cross-attention to the text, modulated MLP."""

    def __init__(self, cfg: VideoDiTConfig, mode: str):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, elementwise_affine=False)
        self.attn = SkiparseAttention(cfg, mode)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.cross = CrossAttention(cfg)
        self.norm3 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.ffn_dim, cfg.dim))
        # adaLN-single: this block's offsets to the shared shift/scale/gate vectors.
        self.table = nn.Parameter(torch.empty(6, cfg.dim))

    def forward(self, x: torch.Tensor, t6: torch.Tensor, text: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.table + t6).chunk(6, dim=1)
        x = x + gate1 * self.attn(modulate(self.norm1(x), shift1, scale1), cos, sin)
        x = x + self.cross(self.norm2(x), text)
        return x + gate2 * self.mlp(modulate(self.norm3(x), shift2, scale2))


class VideoDiT(nn.Module):
    def __init__(self, cfg: VideoDiTConfig):
        super().__init__()
        self.config = cfg
        patch_dim = cfg.in_channels * cfg.patch_t * cfg.patch ** 2
        self.patch_embed = nn.Linear(patch_dim, cfg.dim)
        self.t_embed = nn.Sequential(nn.Linear(TIME_FREQ_DIM, cfg.dim), nn.SiLU(),
                                     nn.Linear(cfg.dim, cfg.dim))
        self.t_mod = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))
        self.text_proj = nn.Sequential(nn.Linear(cfg.text_dim, cfg.dim), nn.GELU(approximate="tanh"),
                                       nn.Linear(cfg.dim, cfg.dim))
        self.blocks = nn.ModuleList(DiTBlock(cfg, "single" if i % 2 == 0 else "group")
                                    for i in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps, elementwise_affine=False)
        self.final_table = nn.Parameter(torch.empty(2, cfg.dim))
        self.final = nn.Linear(cfg.dim, patch_dim)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """N(0, 0.02) for matrices and modulation tables, ones for norm weights, zeros for biases;
        drawn on the CPU from a generator seeded with ``seed``, whatever the device and dtype."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.fill_(1.0 if name.endswith("weight") else 0.0)

    def patchify(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(B, C, T, H, W) -> tokens (B, N, C * pt * p * p) and their grid; T is zero-padded up to
        a multiple of patch_t (an image becomes patch_t frames)."""
        cfg = self.config
        pt, p = cfg.patch_t, cfg.patch
        if x.size(2) % pt:
            x = F.pad(x, (0, 0, 0, 0, 0, -x.size(2) % pt))
        B, C, T, H, W = x.shape
        grid = (T // pt, H // p, W // p)
        x = x.view(B, C, grid[0], pt, grid[1], p, grid[2], p).permute(0, 2, 4, 6, 1, 3, 5, 7)
        return x.reshape(B, math.prod(grid), C * pt * p * p), grid

    def unpatchify(self, x: torch.Tensor, grid: tuple[int, int, int], T: int) -> torch.Tensor:
        cfg = self.config
        pt, p, C = cfg.patch_t, cfg.patch, cfg.in_channels
        B = x.size(0)
        x = x.view(B, *grid, C, pt, p, p).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(B, C, grid[0] * pt, grid[1] * p, grid[2] * p)[:, :, :T]

    def forward(self, latents: torch.Tensor, t: torch.Tensor, text: torch.Tensor,
                noise: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The predicted noise (B, C, T, H, W), or its MSE to ``noise`` when given."""
        cfg, dtype = self.config, self.patch_embed.weight.dtype
        B, T = latents.size(0), latents.size(2)
        tokens, grid = self.patchify(latents.to(dtype))
        x = self.patch_embed(tokens)
        cos, sin = rope_3d(grid, cfg.head_dim, cfg.rope_theta, x.device)
        temb = self.t_embed(timestep_features(t).to(dtype))                  # (B, dim)
        t6 = self.t_mod(temb).view(B, 6, cfg.dim)
        ctx = self.text_proj(text.to(dtype))
        for i in range(len(self.blocks)):
            x = self.blocks[i](x, t6, ctx, cos, sin)  # by index: wrapped blocks are used
        shift, scale = (self.final_table + temb[:, None]).chunk(2, dim=1)
        x = self.final(modulate(self.final_norm(x), shift, scale))
        pred = self.unpatchify(x, grid, T)
        if noise is None:
            return pred
        return F.mse_loss(pred.float(), noise.float())


# ------------------------------------------------------------------ the workload
def linear_alphas_cumprod(num_timesteps: int) -> torch.Tensor:
    """DDPM's linear beta schedule (1e-4 to 0.02), as the cumulative product of 1 - beta."""
    betas = torch.linspace(1e-4, 0.02, num_timesteps, dtype=torch.float64)
    return torch.cumprod(1 - betas, dim=0)


class VideoDiTWorkload(PresetWorkload):
    name = "video-dit"
    description = ("Open-Sora-Plan-style video diffusion transformer: image and video latent "
                   "buckets, 3D patches, adaLN timestep modulation, text cross-attention and "
                   "Skiparse sparse attention; token counts change every step")
    config_class = VideoDiTConfig
    presets = {
        # tiny: 15 to 48 tokens; two of the buckets need Skiparse padding.
        "tiny": dict(dim=32, n_layers=2, n_heads=4, sparse_k=2, text_len=8, text_dim=32,
                     batch_size=2, buckets=((1, 8, 8), (1, 6, 10), (3, 8, 8), (5, 6, 6))),
        # small: 225 to 576 tokens, Open-Sora Plan's k = 4.
        "small": dict(dim=192, n_layers=4, n_heads=6, sparse_k=4, text_len=16, text_dim=64,
                      batch_size=2, buckets=((1, 32, 32), (1, 30, 30), (5, 16, 16),
                                             (9, 16, 16), (9, 12, 20))),
        # gpu: 480p latents of an 8x-spatial, 4x-temporal causal VAE with 8 channels (33 frames ->
        # 9 latent frames), up to 10,800 tokens: ~40 GB of fp32 activations (156 KiB per token
        # and layer, measured on CPU), 0.9B parameters; 512 text tokens of T5-XXL width.
        "gpu": dict(in_channels=8, dim=1536, n_layers=24, n_heads=24, sparse_k=4, text_len=512,
                    text_dim=4096, batch_size=1,
                    buckets=((1, 60, 80), (1, 80, 60), (5, 60, 80), (9, 48, 64), (9, 60, 80))),
    }

    def build(self, device, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
        return build_on(device, dtype, lambda: VideoDiT(self.config), lambda m: m.init_weights(seed))

    def batches(self, steps: int, device, seed: int = 0) -> list[Batch]:
        check_int("steps", steps, minimum=0)
        cfg, gen = self.config, data_generator(seed)
        alphas = linear_alphas_cumprod(cfg.num_timesteps)
        out = []
        for _ in range(steps):
            T, H, W = cfg.buckets[draw_int(gen, 0, len(cfg.buckets))]
            B = cfg.batch_size
            x0 = torch.randn(B, cfg.in_channels, T, H, W, generator=gen)   # the VAE latents
            noise = torch.randn(x0.shape, generator=gen)
            t = torch.randint(cfg.num_timesteps, (B,), generator=gen)
            a = alphas[t].view(B, 1, 1, 1, 1)
            xt = (a.sqrt() * x0 + (1 - a).sqrt() * noise).float()
            text = torch.randn(B, cfg.text_len, cfg.text_dim, generator=gen)  # the T5 features
            n = math.ceil(T / cfg.patch_t) * (H // cfg.patch) * (W // cfg.patch)
            kind = "image" if T == 1 else "video"
            out.append(Batch(tuple(v.to(device) for v in (xt, t, text, noise)),
                             tokens=B * n, tag=f"{kind} {T}x{H}x{W}"))
        return out

    def block_lists(self, model: nn.Module) -> list[nn.ModuleList]:
        return [model.blocks]
