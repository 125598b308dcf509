"""The Llama decoder with a top-k routed mixture of SwiGLU experts in place of each dense MLP.

An expert that no token chose is not called at all, so the sequence of operators (and of saved
activations) changes from step to step with the routing: a workload whose memory profile cannot
be learned once and replayed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .llama import Llama, LlamaConfig, SwiGLU, check_int


@dataclass
class MoEConfig(LlamaConfig):
    n_experts: int = 4
    top_k: int = 2
    expert_ffn_dim: Optional[int] = None  # None -> ffn_dim (itself defaulted from dim)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_experts", self.n_experts)
        check_int("top_k", self.top_k, f"an int from 1 to n_experts ({self.n_experts})")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k must be an int from 1 to n_experts ({self.n_experts}); "
                             f"got {self.top_k}")
        if self.expert_ffn_dim is None:
            self.expert_ffn_dim = self.ffn_dim
        check_int("expert_ffn_dim", self.expert_ffn_dim, "a positive int, or None for ffn_dim")


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.dim, cfg.expert_ffn_dim)
                                     for _ in range(cfg.n_experts))
        self.last_counts: list[int] = []  # tokens routed to each expert by the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))  # (N, dim)
        N, k = flat.size(0), self.top_k
        top_logits, top_idx = self.router(flat).topk(k, dim=-1)  # (N, k) each
        gates = F.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype).reshape(-1)

        # Row r = n * k + s of the (N * k) assignments is slot s of token n. A stable sort by expert
        # makes each expert's rows contiguous, in a fixed order.
        expert_of_row = top_idx.reshape(-1)
        order = torch.argsort(expert_of_row, stable=True)
        # The one host sync: slicing per expert and skipping empty experts need python ints.
        counts = torch.bincount(expert_of_row, minlength=self.n_experts).tolist()
        self.last_counts = counts

        outs = []
        for expert, rows, count in zip(self.experts, order.split(counts), counts):
            if count == 0:
                continue  # no call: no saved activations, no grads for this expert this step
            # A token picks an expert at most once, so rows // k has no repeats: the backward of
            # this gather never accumulates twice into one row.
            outs.append(expert(flat[rows // k]) * gates[rows].unsqueeze(-1))
        # Put each (token, slot) output back in its own row by gathering with the inverse
        # permutation (unique indices, so deterministic) and sum the k slots of each token;
        # no scatter-add with repeated indices anywhere.
        y = torch.cat(outs)[torch.argsort(order)]
        return y.view(N, k, -1).sum(dim=1).view_as(x)


class MoE(Llama):
    config_class = MoEConfig

    def __init__(self, config: Optional[MoEConfig] = None):
        super().__init__(config)

    def make_mlp(self, config: MoEConfig) -> nn.Module:
        return MoELayer(config)

    @property
    def last_expert_counts(self) -> list[int]:
        """Tokens routed to each expert by the last forward, layer-major: entry
        ``layer * n_experts + expert``. Each layer's counts sum to batch * seq_len * top_k.
        Found by module type, so it still works once blocks are wrapped (e.g. checkpointed)."""
        return [c for m in self.modules() if isinstance(m, MoELayer) for c in m.last_counts]
