"""The LapSum soft ops over a row sharded across ranks (docs/DISTRIBUTED.md §Soft).

b solves Ψ(b) = Σ_i F((s_i - b)/t) = k over the concatenated row: the non-finite counts
settle a row or leave the finite scores a budget (DESIGN §8), radix.py finds their root.
Each rank then writes its slice of the mask with the kernel of the single-process op. The
backward all-gathers each rank's VJP sums (_vjp.py).
"""
from __future__ import annotations

import math

import torch

from .._ops import MODE_HARD, MODE_LOG, ops
from . import _comm
from ._comm import Shard
from ._vjp import local_sums, mask_grads, row_sums, terms, threshold_grads
from .hard import hard_mask
from .radix import solve_finite

F64 = torch.float64


def solve(x_rows: torch.Tensor, k: torch.Tensor, t: torch.Tensor, largest: bool, shard: Shard, what: str):
    """b (x's units, float64 [R]) and the edge mass of each row of the sharded row
    (DESIGN §8's rules over the concatenated row), identical on every rank."""
    sign = 1.0 if largest else -1.0
    R = x_rows.shape[0]
    # 1. non-finite counts, k and t of every rank
    pinf, ninf = (x_rows == math.inf).sum(1).to(F64), (x_rows == -math.inf).sum(1).to(F64)
    head = torch.stack([pinf if largest else ninf, ninf if largest else pinf,
                        torch.isnan(x_rows).any(1).to(F64), k.detach(), t.detach()], 1)
    heads = _comm.exchange(head, shard)
    for col, name in ((3, "k"), (4, "temperature")):
        same = (heads[:, :, col] == heads[0:1, :, col]) | (heads[:, :, col].isnan() & heads[0:1, :, col].isnan())
        if not bool(same.all()):
            raise ValueError(f"{what}: {name} differs across ranks (every rank must pass the same)")
    tot = _comm.fold_sum(heads)
    P, N, nan = tot[:, 0], tot[:, 1], tot[:, 2]
    n = float(shard.n)
    kk, tt = heads[0, :, 3], heads[0, :, 4]
    if R and bool((kk > n).any()):
        raise ValueError(f"{what}: k must be finite and >= 0 and <= n = {shard.n} (the concatenated row), "
                         f"got max {float(kk.max())}")
    kf = kk - P
    bad = (nan > 0) | ~(kk >= 0) | ~(kk <= n) | ~(tt > 0) | ~torch.isfinite(tt)
    upper = ~bad & (kk <= P)
    lower = ~bad & ~upper & (kk >= n - N)
    active = ~bad & ~upper & ~lower

    # 2. the finite scores' root: the radix bracket over the row
    b_s = solve_finite(x_rows, sign, kf, tt, active, shard)
    inf = torch.full_like(b_s, math.inf)
    b_s = torch.where(upper, inf, torch.where(lower, -inf, b_s))
    b_s = torch.where(bad, torch.full_like(b_s, math.nan), b_s)
    one = torch.ones_like(b_s)
    edge = torch.where(upper, torch.where(P > 0, kk / P.clamp(min=1), 0 * one), one)
    edge = torch.where(lower, torch.where(N > 0, (kk - (n - N)) / N.clamp(min=1), one), edge)
    edge = torch.where(bad, torch.full_like(edge, math.nan), edge)
    return b_s * sign, edge


# ---- autograd: the forward solves once; the backward all-gathers the VJP sums --------

def _mask(x_rows, b, t, edge, largest: bool, mode: int, k, shard: Shard) -> torch.Tensor:
    if mode == MODE_HARD:
        p = hard_mask(x_rows, k, largest, shard)
        return torch.where(torch.isnan(b)[:, None], torch.full_like(p, math.nan), p)
    return ops.lapsum_mask(x_rows.contiguous(), b, t, edge, largest, mode == MODE_LOG)


def _row_sums(ctx, g, log_mode: bool):
    """The backward's per-element terms and the row's VJP sums (one all-gather)."""
    x_rows, b, t = ctx.saved_tensors
    sign = 1.0 if ctx.largest else -1.0
    b_s = b * sign
    a, d, gw, ga = terms(x_rows.to(F64) * sign, b_s, t, g, log_mode)
    return x_rows, sign, b_s, t, a, d, row_sums(local_sums(a, d, gw, ga, t), t, ctx.shard)


class SoftFn(torch.autograd.Function):
    """(x_rows, k, t) -> this rank's slice of the mask (or log mask, or hard mask)."""

    @staticmethod
    def forward(ctx, x_rows, k, t, largest, mode, shard, what):
        b, edge = solve(x_rows, k, t, largest, shard, what)
        tt = t.detach()
        p = _mask(x_rows, b, tt, edge, largest, mode, k.detach(), shard)
        ctx.largest, ctx.log_mode, ctx.shard = largest, mode == MODE_LOG, shard
        ctx.save_for_backward(x_rows, b, tt)
        return p

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gp):
        x_rows, sign, b_s, t, a, d, S = _row_sums(ctx, gp, ctx.log_mode)
        gs, gk, gt = mask_grads(S, a, d, gp, b_s, t, ctx.log_mode)
        return (gs * sign).to(x_rows.dtype), gk, gt, None, None, None, None


class ThresholdFn(torch.autograd.Function):
    """(x_rows, k, t) -> b (x's units), identical on every rank."""

    @staticmethod
    def forward(ctx, x_rows, k, t, largest, shard, what):
        b, _ = solve(x_rows, k, t, largest, shard, what)
        ctx.largest, ctx.shard = largest, shard
        ctx.save_for_backward(x_rows, b, t.detach())
        return b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gb):
        x_rows, sign, b_s, t, a, d, S = _row_sums(ctx, None, False)
        gs, gk, gt = threshold_grads(S, a, gb, b_s, t, sign)
        return (gs * sign).to(x_rows.dtype), gk, gt, None, None, None
