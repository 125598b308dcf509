"""A ``Llama`` cut into pipeline stages: the first stage embeds, the last normalises and projects
to the vocabulary, each runs a contiguous run of blocks. The stages share the model's modules
(no copy), so a stage of a model and the model itself compute the same thing, op for op."""
from __future__ import annotations

import torch
import torch.nn as nn

from .llama import Llama, rope_cos_sin


class LlamaStage(nn.Module):
    """Blocks ``first..last-1`` of ``model``, plus the embedding on stage 0 and the norm and
    output head on the last stage. Input: token ids (stage 0) or hidden states; output: hidden
    states, or logits on the last stage."""

    def __init__(self, model: Llama, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.tok_emb = model.tok_emb if is_first else None
        self.layers = nn.ModuleList(model.layers[first:last])
        self.norm = model.norm if is_last else None
        self.output = model.output if is_last else None
        self.register_buffer("inv_freq", model.inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        cos, sin = rope_cos_sin(self.inv_freq, x.size(1))
        for layer in self.layers:
            x = layer(x, cos, sin)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def split_llama(model: Llama, n_stages: int) -> list[LlamaStage]:
    """``model`` as ``n_stages`` stages of as equal a number of blocks as divides (the first
    stages take one more when it does not divide)."""
    n = len(model.layers)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or not 1 <= n_stages <= n:
        raise ValueError(f"n_stages must be an int from 1 to the number of blocks ({n}); "
                         f"got {n_stages!r}")
    base, extra = divmod(n, n_stages)
    bounds, start = [], 0
    for s in range(n_stages):
        end = start + base + (1 if s < extra else 0)
        bounds.append((start, end))
        start = end
    return [LlamaStage(model, a, b, s == 0, s == n_stages - 1) for s, (a, b) in enumerate(bounds)]


def llama_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss ``Llama.forward(tokens, targets)`` computes, from the last stage's logits."""
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                       targets.reshape(-1))
