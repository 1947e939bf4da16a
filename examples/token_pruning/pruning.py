"""Token pruning inside a timm `VisionTransformer` (see README.md next to this file).

`PrunedViT` runs the timm model's own modules (patch_embed, _pos_embed, blocks, norm,
forward_head) and, after the first `at` blocks, keeps K of the patch tokens (the CLS token
always stays). `at=0` (the default of train.py) prunes the patch embeddings (+ position
embedding) before any block: no attention has mixed the tokens yet, so a kept token holds
only its own patch and the pruning decides what the network can see. Methods:

  none  : no pruning (the timm model as it is)
  soft  : exact-budget soft router. A linear router scores the patch tokens; in training
          `fastlapsum.SoftTopK` turns the scores into a mask m with sum(m) == K per image;
          the tokens are multiplied by m and log(m) is added to every later block's
          attention logits, so a dropped token is (softly) absent and the router learns
          through the selection. The trainer anneals the temperature. At evaluation:
          hard top-K + gather.
  st    : the same router through `soft_topk(..., hard=True)` in training: the forward keeps
          exactly K tokens (the hard mask, as at evaluation: no soft mask for the network to
          read anything from), the backward is the soft mask's gradient (straight-through).
  gated : hard top-K on the router scores + gather, the kept tokens multiplied by
          sigmoid(score) (Mixture-of-Depths style), in training and evaluation: the router
          learns through the gate only.
  evit  : EViT-style: keep the K-1 patch tokens the CLS token attends to most and fuse the
          rest into one token (their attention-weighted mean): K tokens in all. The
          attention (averaged over heads) is that of block `at`-1 on its input, or with
          `at=0` that of block 0 on the embeddings (EViT prunes inside a block, between its
          attention and its MLP; here block 0 then runs on the kept tokens). No router
          parameters.

Every pruned forward records the number of patch tokens the later blocks ran on.
"""
from __future__ import annotations

import torch
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import fastlapsum

METHODS = ("none", "soft", "st", "gated", "evit")


def make_vit(dim: int, depth: int, heads: int, patch: int, img: int, classes: int = 10,
             mlp_ratio: float = 4.0) -> VisionTransformer:
    return VisionTransformer(img_size=img, patch_size=patch, in_chans=1, num_classes=classes,
                             embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=mlp_ratio,
                             global_pool="token", class_token=True)


def cls_attention(block, x: torch.Tensor) -> torch.Tensor:
    """[B, N-1]: the CLS token's attention to each patch token in `block` (a timm Block) on
    its input x [B, N, d], averaged over heads."""
    attn = block.attn
    b, n, d = x.shape
    qkv = attn.qkv(block.norm1(x)).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = attn.q_norm(qkv[0]), attn.k_norm(qkv[1])
    a = (q[:, :, :1] * attn.scale) @ k.transpose(-2, -1)  # [B, H, 1, N]
    return a.softmax(-1)[:, :, 0, 1:].mean(1)


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


class PrunedViT(nn.Module):
    def __init__(self, vit: VisionTransformer, method: str, keep: int, at: int):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        n = vit.patch_embed.num_patches
        if not 1 <= keep <= n or (method == "evit" and keep < 2):
            raise ValueError(f"keep must be in [1, {n}] (>= 2 for evit), got {keep}")
        if not 0 <= at < len(vit.blocks):
            raise ValueError(f"at must be in [0, {len(vit.blocks) - 1}], got {at}")
        self.vit, self.method, self.keep, self.at, self.n_patches = vit, method, keep, at, n
        dim = vit.embed_dim
        if method in ("soft", "st", "gated"):
            self.router = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 1))
        self.temperature = 1.0  # soft router; annealed by the trainer
        self.last_tokens_seen = 0      # patch tokens the blocks from `at` on ran on
        self.last_kept: torch.Tensor | None = None  # [B, K] indices kept (None: soft mask)
        self.last_mask: torch.Tensor | None = None  # [B, N] soft mask (soft, training)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        vit = self.vit
        x = vit.norm_pre(vit.patch_drop(vit._pos_embed(vit.patch_embed(img))))
        prev = x
        for blk in vit.blocks[:self.at]:
            prev, x = x, blk(x)
        bias = None
        self.last_kept, self.last_mask = None, None
        if self.method != "none" and self.keep < self.n_patches:
            cls, pt = x[:, :1], x[:, 1:]
            k = self.keep
            if self.method == "evit":
                a = (cls_attention(vit.blocks[self.at - 1], prev) if self.at
                     else cls_attention(vit.blocks[0], x))
                _, idx = fastlapsum.topk(a.detach(), k - 1, dim=-1)
                rest = a.scatter(1, idx, 0.0)
                fused = (rest.unsqueeze(-1) * pt).sum(1, keepdim=True) / rest.sum(1, keepdim=True)[..., None].clamp_min(1e-12)
                pt = torch.cat([gather_tokens(pt, idx), fused], 1)
                self.last_kept = idx
            else:
                s = self.router(pt).squeeze(-1)                      # [B, N]
                if self.method in ("soft", "st") and self.training:
                    # sum == K per image; st: exactly K ones, the soft mask's gradient
                    m = fastlapsum.soft_topk(s, k, self.temperature, dim=-1, hard=self.method == "st")
                    self.last_mask = m
                    pt = pt * m.unsqueeze(-1)
                    logm = torch.cat([torch.zeros_like(m[:, :1]), m.clamp_min(1e-30).log()], 1)
                    bias = logm[:, None, None, :]                    # [B, 1, 1, 1+N]
                else:
                    _, idx = fastlapsum.topk(s.detach(), k, dim=-1)
                    pt = gather_tokens(pt, idx)
                    if self.method == "gated":
                        pt = pt * s.gather(1, idx).sigmoid().unsqueeze(-1)
                    self.last_kept = idx
            x = torch.cat([cls, pt], 1)
        self.last_tokens_seen = x.shape[1] - 1
        for blk in vit.blocks[self.at:]:
            x = blk(x, attn_mask=bias)
        return vit.forward_head(vit.norm(x))
