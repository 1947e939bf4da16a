"""SoftTopK: the LapSum mask as an nn.Module (a differentiable exact-budget gate)."""
from __future__ import annotations

import torch
from torch import nn

from .functional import Budget, _as_int, soft_topk


class SoftTopK(nn.Module):
    """p = soft_topk(x, k, temperature) along `dim`, with sum(p) == k exactly.

    `k` and `temperature` are plain attributes (change them between steps for a
    schedule) or tensors (per-row values, learnable if they require grad). With
    `hard=True` the forward is the exact hard top-k mask and the backward the soft one
    (straight-through), e.g. to make later layers really run on k items.
    """

    def __init__(self, k: Budget, temperature: Budget = 1.0, *, dim: int = -1, hard: bool = False,
                 largest: bool = True, method: str = "auto") -> None:
        super().__init__()
        self.k = k
        self.temperature = temperature
        self.dim = _as_int(dim, "dim", "SoftTopK")
        self.hard = hard
        self.largest = largest
        self.method = method

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return soft_topk(x, self.k, self.temperature, dim=self.dim, largest=self.largest,
                         hard=self.hard, method=self.method)

    def extra_repr(self) -> str:
        k = self.k if not isinstance(self.k, torch.Tensor) else f"tensor{tuple(self.k.shape)}"
        t = self.temperature if not isinstance(self.temperature, torch.Tensor) else "tensor"
        return f"k={k}, temperature={t}, dim={self.dim}, hard={self.hard}, largest={self.largest}"
