"""An Open-Sora-Plan-like video diffusion transformer (``workloads.dit``), traced on fake tensors.

Shape (``OPEN_SORA_PLAN``): the Open-Sora Plan v1.3 denoiser as its report describes it (arXiv
2412.00131): 32 layers of width 2304 (24 heads of 96), Skiparse attention with k = 4, 512 T5-XXL
text tokens (width 4096), latents of an 8-channel VAE that compresses 8x in space and 4x in time;
93 frames at 352 x 640 are 24 x 44 x 80 latents, 21,120 tokens with 2 x 2 patches. The step is
one sample under bf16 autocast with fp32 weights, as ``hf_trace`` traces the language models.
"""
from __future__ import annotations

from dataclasses import asdict

from .traced import Recording, cached

OPEN_SORA_PLAN = dict(in_channels=8, dim=2304, n_layers=32, n_heads=24, sparse_k=4,
                      text_len=512, text_dim=4096, batch_size=1, buckets=((24, 44, 80),))


def trace_dit(use_cache: bool = True, **fields) -> Recording:
    """One training step of ``VideoDiT(VideoDiTConfig(**fields))`` on its first bucket."""
    import torch
    from ..workloads.dit import VideoDiT, VideoDiTConfig
    from .fake_trace import trace_module
    cfg = VideoDiTConfig(**fields)
    T, H, W = cfg.buckets[0]
    B = cfg.batch_size

    def loss_fn(model):
        x = torch.zeros(B, cfg.in_channels, T, H, W)
        t = torch.zeros(B, dtype=torch.long)
        text = torch.zeros(B, cfg.text_len, cfg.text_dim)
        return model(x, t, text, noise=torch.zeros_like(x))

    def make() -> Recording:
        rec = trace_module(lambda: VideoDiT(cfg), loss_fn, autocast=torch.bfloat16)
        tokens = -(-T // cfg.patch_t) * (H // cfg.patch) * (W // cfg.patch)
        rec.extra.update(seq=tokens, micro_batch=B, dtype="bf16", attn="sdpa",
                         model_type="video-dit")
        return rec
    return cached(["dit", asdict(cfg), torch.__version__], make, use_cache)
