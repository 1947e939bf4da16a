"""Data and model for the token-pruning example (see README.md next to this file).

* `make_shapes`: a procedural image set — 24x24 grayscale images of one small shape
  (square outline, cross, ring, bar) at a random position in noise, so only the few
  patches that touch the shape carry the label.
* `TinyViT`: a 3-block vision transformer. After block 1 a router scores the patch tokens
  and keeps exactly K of them:
    - "learned": while training, `fastlapsum.SoftTopK` gives a soft mask with sum exactly K
      (temperature annealed by the trainer); the mask multiplies the tokens and log(mask)
      biases attention, so a dropped token is (softly) absent — the router gets gradients.
    - "hard": the baseline people use today — hard top-k on the router scores, detached, so
      the router never learns (it stays a random projection).
    - "none": no pruning.
  At evaluation both pruning modes take a hard top-k (`fastlapsum.topk`) and gather, so
  blocks 2 and 3 really run on K (+ CLS) tokens.
* `ExpertChoiceMoE`: block 2's MLP. Each expert picks exactly C tokens of the whole batch
  via `soft_topk(..., hard=True)` over the token axis (straight-through: forward exactly C
  ones, backward the soft mask's gradient), and asserts that it did.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import fastlapsum

IMG = 24
PATCH = 4
N_PATCHES = (IMG // PATCH) ** 2  # 36
CLASSES = ("square", "cross", "ring", "bar")


def make_shapes(n: int, seed: int, noise: float = 0.35) -> tuple[torch.Tensor, torch.Tensor]:
    """n images [n, 1, 24, 24] and labels [n]; deterministic in `seed`."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(len(CLASSES), (n,), generator=g)
    r = torch.randint(3, 5, (n, 1, 1), generator=g).float()  # half-size 3..4 px
    # centre anywhere the shape fits, so which patches matter changes per image
    cx = torch.randint(5, IMG - 5, (n, 1, 1), generator=g).float()
    cy = torch.randint(5, IMG - 5, (n, 1, 1), generator=g).float()
    ii, jj = torch.meshgrid(torch.arange(IMG).float(), torch.arange(IMG).float(), indexing="ij")
    dy, dx = (ii - cy).abs(), (jj - cx).abs()
    vertical = torch.rand(n, 1, 1, generator=g) < 0.5  # bars are horizontal or vertical
    shapes = torch.stack([
        (torch.maximum(dx, dy) <= r) & (torch.maximum(dx, dy) >= r - 1),          # square outline
        ((dx <= 0.5) & (dy <= r)) | ((dy <= 0.5) & (dx <= r)),                    # cross
        ((dx ** 2 + dy ** 2).sqrt() - r).abs() <= 0.7,                           # ring
        torch.where(vertical, (dx <= 1) & (dy <= r), (dy <= 1) & (dx <= r)),     # bar
    ], 1)  # [n, 4, H, W]
    img = shapes[torch.arange(n), y].float()
    img = img + noise * torch.randn(n, IMG, IMG, generator=g)
    return img.unsqueeze(1), y


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # key_bias [b, n] = log(mask): attention weight of token j is scaled by mask_j
        mask = None if key_bias is None else key_bias[:, None, None, :].to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class ExpertChoiceMoE(nn.Module):
    """Expert-choice MoE MLP: each of E experts takes exactly C of the batch's tokens.

    C = capacity_factor * (tokens in the batch) / E. The choice is
    `soft_topk(scores^T, C, t, hard=True)` over the flattened token axis, so the forward
    is the exact hard top-C per expert and the router still gets a gradient through the
    straight-through mask (and through the softmax gate weights).
    """

    def __init__(self, dim: int, hidden: int, experts: int = 4, capacity_factor: float = 1.0,
                 temperature: float = 0.5):
        super().__init__()
        self.experts = experts
        self.capacity_factor = capacity_factor
        self.temperature = temperature
        self.router = nn.Linear(dim, experts)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.b1 = nn.Parameter(torch.zeros(experts, 1, hidden))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))
        self.last_counts: torch.Tensor | None = None  # tokens each expert got, last call
        self.last_capacity = 0

    def capacity(self, n_tokens: int) -> int:
        return max(1, min(n_tokens, int(self.capacity_factor * n_tokens / self.experts)))

    def forward(self, x: torch.Tensor, n_effective: int | None = None,
                select_bias: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        flat = x.reshape(b * n, d)
        logits = self.router(flat)                          # [N, E]
        gate = logits.softmax(-1)                           # per-token mixing weight
        # Capacity from the tokens that are really there: with a soft token mask in
        # training that is B*K (n_effective), not B*n; select_bias = log(mask) steers the
        # experts away from tokens the pruning router has (softly) dropped.
        c = self.capacity(n_effective if n_effective is not None else b * n)
        scores = logits.t()                                 # [E, N]: experts choose tokens
        if select_bias is not None:
            scores = scores + select_bias.reshape(1, b * n)
        sel = fastlapsum.soft_topk(scores, c, self.temperature, dim=-1, hard=True)  # [E, N]
        _, idx = fastlapsum.topk(scores.detach(), c, dim=-1)                        # [E, C]
        counts = sel.detach().sum(-1)
        # the point of an exact-budget selector: every expert got exactly C tokens
        assert bool((counts == c).all()), f"expert capacity violated: {counts.tolist()} != {c}"
        picked = sel.gather(1, idx)                         # exactly 1.0 forward, soft grad backward
        assert bool((picked.detach() == 1).all()), "topk indices disagree with the hard mask"
        self.last_counts, self.last_capacity = counts, c

        xe = flat[idx]                                      # [E, C, d]: batched expert MLPs
        h = F.gelu(xe @ self.w1 + self.b1) @ self.w2        # [E, C, d]
        w = picked * gate.t().gather(1, idx)                # [E, C]
        out = torch.zeros_like(flat).index_add_(0, idx.reshape(-1), (w.unsqueeze(-1) * h).reshape(-1, d))
        return out.view(b, n, d)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, moe: bool = False):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.moe = moe
        self.mlp = ExpertChoiceMoE(dim, 2 * dim) if moe else nn.Sequential(
            nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, key_bias=None, n_effective=None):
        x = x + self.attn(self.n1(x), key_bias)
        if self.moe:
            return x + self.mlp(self.n2(x), n_effective, key_bias)
        return x + self.mlp(self.n2(x))


class TinyViT(nn.Module):
    """CLS + 36 patch tokens -> block 1 -> router keeps K patches -> block 2 (MoE) -> block 3."""

    def __init__(self, keep: int = N_PATCHES, prune: str = "none", dim: int = 64, heads: int = 4):
        super().__init__()
        assert prune in ("none", "learned", "hard")
        assert 1 <= keep <= N_PATCHES
        self.keep, self.prune = keep, prune
        self.embed = nn.Conv2d(1, dim, PATCH, PATCH)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(0.02 * torch.randn(1, N_PATCHES + 1, dim))
        self.block1 = Block(dim, heads)
        self.router_norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, 1)
        # training-time soft gate; the trainer anneals .temperature
        self.gate = fastlapsum.SoftTopK(k=keep, temperature=1.0, dim=-1)
        self.later = nn.ModuleList([Block(dim, heads, moe=True), Block(dim, heads)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, len(CLASSES))
        self.last_tokens_seen: list[int] = []  # patch tokens each later block ran on

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.embed(img).flatten(2).transpose(1, 2)      # [B, 36, d]
        b = x.shape[0]
        x = torch.cat([self.cls.expand(b, -1, -1), x], 1) + self.pos
        x = self.block1(x)
        cls, patches = x[:, :1], x[:, 1:]
        key_bias, n_eff = None, None
        if self.prune != "none" and self.keep < N_PATCHES:
            scores = self.router(self.router_norm(patches)).squeeze(-1)  # [B, 36]
            if self.prune == "learned" and self.training:
                # exact-budget soft mask: sum == K per image, gradients reach the router
                m = self.gate(scores)
                patches = patches * m.unsqueeze(-1)
                zero = torch.zeros(b, 1, dtype=m.dtype, device=m.device)  # CLS always kept
                key_bias = torch.cat([zero, m.clamp_min(1e-30).log()], 1)
                n_eff = b * (self.keep + 1)
            else:
                # hard top-k + gather: later blocks really run on K tokens. The "hard"
                # baseline trains this way too, with the router detached (no gradient).
                _, idx = fastlapsum.topk(scores.detach(), self.keep, dim=-1)
                patches = patches.gather(1, idx.unsqueeze(-1).expand(-1, -1, patches.shape[-1]))
        x = torch.cat([cls, patches], 1)
        self.last_tokens_seen = []
        for blk in self.later:
            self.last_tokens_seen.append(x.shape[1] - 1)
            x = blk(x, key_bias, n_eff)
        return self.head(self.norm(x[:, 0]))
