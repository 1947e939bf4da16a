"""Mixture-of-experts MLPs for a timm ViT block (`block.mlp = MoE(...)`), three routers:

  ec_soft : expert choice, each expert takes exactly C of the batch's tokens through
            `fastlapsum.soft_topk(scores^T, C, t, hard=True)`: the forward is the exact hard
            top-C mask, the backward the soft mask's gradient, so the router learns through
            the selection itself (every token's score gets a gradient) and through the gate.
  ec_hard : expert choice with `torch.topk` per expert: the same tokens, the router learns
            only through the softmax gate of the tokens that were picked.
  tc      : token choice (Switch, top-1) with capacity C per expert: a token goes to its
            best expert unless that expert is full (batch order decides), then it is
            dropped (the block's residual carries it). Switch's load-balancing loss.

C = capacity_factor * tokens / experts in all three, so they do the same expert work.
Each forward records per-expert loads, the tokens no expert processed, and (tc) the drops
(as device tensors: no host sync in training); in evaluation mode it also asserts the
budget: every expert exactly C tokens (ec_*), at most C (tc). The token-choice dispatch is
vectorised (cumsum queue positions, one scatter into the [E, C] slots), no Python loop.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import fastlapsum

ROUTERS = ("ec_soft", "ec_hard", "tc")


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int = 4, router: str = "ec_soft",
                 capacity_factor: float = 1.0, temperature: float = 0.5, aux_weight: float = 0.01):
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
        self.kind, self.experts, self.capacity_factor = router, experts, capacity_factor
        self.temperature, self.aux_weight = temperature, aux_weight
        self.router = nn.Linear(dim, experts)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.b1 = nn.Parameter(torch.zeros(experts, 1, hidden))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))
        self.b2 = nn.Parameter(torch.zeros(experts, 1, dim))
        self.aux_loss = torch.zeros(())
        self.stats: dict = {}
        self.logits: torch.Tensor | None = None  # [N, E] router logits (retain_grad in probes)

    def capacity(self, n_tokens: int) -> int:
        return max(1, min(n_tokens, int(self.capacity_factor * n_tokens / self.experts)))

    def _experts(self, flat, idx, w):
        """Expert e runs on flat[idx[e]] ([E, C]); outputs weighted by w [E, C], summed back."""
        h = F.gelu(flat[idx] @ self.w1 + self.b1) @ self.w2 + self.b2     # [E, C, d]
        out = torch.zeros_like(flat)
        return out.index_add_(0, idx.reshape(-1), (w.unsqueeze(-1) * h).reshape(-1, flat.shape[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        flat = x.reshape(b * n, d)
        N, E = b * n, self.experts
        c = self.capacity(N)
        logits = self.router(flat)                                       # [N, E]
        self.logits = logits
        gate = logits.softmax(-1)
        check = not self.training  # the budget asserts sync with the device: evaluation only
        if self.kind in ("ec_soft", "ec_hard"):
            scores = logits.t()                                          # experts choose tokens
            _, idx = fastlapsum.topk(scores.detach(), c, dim=-1)        # [E, C]
            w = gate.t().gather(1, idx)
            if self.kind == "ec_soft":
                sel = fastlapsum.soft_topk(scores, c, self.temperature, dim=-1, hard=True)
                picked = sel.gather(1, idx)         # 1.0 forward, soft mask gradient backward
                counts = sel.detach().sum(-1)
                if check:
                    assert bool((picked.detach() == 1).all()), "topk indices disagree with the hard mask"
                w = w * picked
            else:
                counts = torch.full((E,), float(c), device=x.device)
            if check:
                assert bool((counts == c).all()), f"expert capacity violated: {counts.tolist()} != {c}"
            out = self._experts(flat, idx, w)
            hits = torch.zeros(N, device=x.device).index_add_(0, idx.reshape(-1), torch.ones(E * c, device=x.device))
            wanted = counts
            dropped = torch.zeros((), dtype=torch.long, device=x.device)
            self.aux_loss = torch.zeros((), device=x.device)
        else:
            choice = gate.argmax(-1)                                     # [N]
            onehot = (choice[:, None] == torch.arange(E, device=x.device)).long()  # [N, E], no sync
            pos = (onehot.cumsum(0) - 1).gather(1, choice[:, None]).squeeze(1)  # place in queue
            keep = pos < c
            wanted = onehot.sum(0)
            counts = torch.clamp(wanted, max=c).float()
            # [E*C] slots (+1 dump slot for the overflow), filled without host syncs. An
            # unused slot s points at token s (distinct tokens, weight 0): pointing them all
            # at one token would make the gather's backward accumulate thousands of
            # duplicates of one index, serially.
            target = torch.where(keep, choice * c + pos, E * c)
            tok = torch.arange(N, device=x.device)
            slot = torch.arange(E * c + 1, device=x.device).scatter(0, target, tok)[:E * c]
            w = gate.gather(1, choice[:, None]).squeeze(1)
            wslot = torch.zeros(E * c + 1, device=x.device, dtype=w.dtype).scatter(0, target, w)[:E * c]
            out = self._experts(flat, slot.view(E, c), wslot.view(E, c))
            hits = keep.float()
            dropped = (~keep).sum()
            if check:
                assert bool((counts <= c).all())
                assert int(dropped) == int(wanted.sum() - counts.sum()), "drop count disagrees with loads"
            # Switch load-balancing loss: E * sum_e (fraction routed to e) * (mean prob of e)
            self.aux_loss = self.aux_weight * E * (onehot.float().mean(0) * gate.mean(0)).sum()
        # tensors (no host sync in training); eval_moe reads them with int()/float()
        self.stats = {"tokens": N, "capacity": c, "counts": counts.detach(), "wanted": wanted.detach().float(),
                      "unprocessed": (hits == 0).sum(), "dropped": dropped}
        return out.view(b, n, d)


def load_cv(counts: torch.Tensor) -> float:
    """Coefficient of variation of tokens processed per expert (0 = perfectly balanced)."""
    c = counts.float()
    return float(c.std(unbiased=False) / c.mean().clamp_min(1e-12))
