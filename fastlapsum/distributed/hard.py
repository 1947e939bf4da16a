"""Exact hard top-k of a row sharded across ranks (docs/DISTRIBUTED.md §Hard).

Each rank selects its own top min(k, local n) with fastlapsum.topk (sorted, ties by the
smaller index), the candidates and their global indices are all-gathered (k per rank),
and every rank merges the world·k candidates in the same deterministic order: better
score first (NaN above +inf, -0.0 equal to +0.0, as fastlapsum.topk), then the smaller
global index. The first k are the top-k of the concatenated row, on every rank.
"""
from __future__ import annotations

import torch

from .. import functional as _fn
from . import _comm
from ._comm import Shard

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


def _order_key(v: torch.Tensor, largest: bool) -> torch.Tensor:
    """int64 key, larger = better: the order-preserving image of the value (floats via
    float64, -0.0 as +0.0, NaN above +inf), complemented for largest=False."""
    if v.is_floating_point():
        x = v.to(torch.float64) + 0.0  # -0.0 + 0.0 = +0.0: tied as in fastlapsum.topk
        bits = x.view(torch.int64)
        key = bits ^ ((bits >> 63) & _I64_MAX)
        key = torch.where(torch.isnan(x), torch.full_like(key, _I64_MAX), key)
    else:
        key = v.to(torch.int64)
    return key if largest else ~key


def _local_candidates(x_rows: torch.Tensor, k: int, largest: bool, shard: Shard):
    """This rank's sorted top min(k, n_r), padded to k (global index -1 marks padding)."""
    R, n_r = x_rows.shape
    take = min(k, n_r)
    vals = x_rows.new_zeros((R, k))
    gidx = torch.full((R, k), -1, dtype=torch.int64, device=x_rows.device)
    if take > 0:
        v, i = _fn._select_rows(x_rows.detach(), take, largest, True, None)
        vals[:, :take] = v
        gidx[:, :take] = i + shard.offset
    return vals, gidx


def merge_topk(x_rows: torch.Tensor, k: int, largest: bool, shard: Shard):
    """(values [R, k] in x's dtype, global indices [R, k] int64), best first, identical on
    every rank. Two all-gathers of R·k values and R·k int64 indices per rank."""
    R = x_rows.shape[0]
    dev = x_rows.device
    if k == 0 or R == 0:
        return x_rows.new_zeros((R, k)), torch.zeros((R, k), dtype=torch.int64, device=dev)
    vals, gidx = _local_candidates(x_rows, k, largest, shard)
    cdev = _comm.comm_device(x_rows, shard.group)
    wire = vals.to(torch.uint8) if vals.dtype == torch.bool else vals  # gloo has no bool
    all_v = _comm.gather(wire.to(cdev), shard).to(dev).to(vals.dtype)
    all_i = _comm.gather(gidx.to(cdev), shard).to(dev)
    cv = all_v.permute(1, 0, 2).reshape(R, -1)
    ci = all_i.permute(1, 0, 2).reshape(R, -1)
    key = _order_key(cv, largest)
    pad = ci < 0
    key = torch.where(pad, torch.full_like(key, _I64_MIN), key)
    tie = torch.where(pad, torch.full_like(ci, _I64_MAX), ci)  # padding loses every tie
    order = tie.sort(dim=1, stable=True).indices
    order = order.gather(1, key.gather(1, order).sort(dim=1, descending=True, stable=True).indices)[:, :k]
    return cv.gather(1, order), ci.gather(1, order)


class _TopK(torch.autograd.Function):
    """values are replicated: each rank sends its own upstream gradient of the values to
    the elements it owns (the DTensor Replicate convention); no communication."""

    @staticmethod
    def forward(ctx, x_rows, k, largest, shard):
        values, gidx = merge_topk(x_rows, k, largest, shard)
        ctx.n_r, ctx.offset = x_rows.shape[1], shard.offset
        ctx.save_for_backward(gidx)
        ctx.mark_non_differentiable(gidx)
        return values, gidx

    @staticmethod
    def backward(ctx, g_values, _g_idx):
        (gidx,) = ctx.saved_tensors
        loc = gidx - ctx.offset
        mine = (loc >= 0) & (loc < ctx.n_r)
        grad = g_values.new_zeros((gidx.shape[0], ctx.n_r + 1))  # column n_r takes the others
        grad.scatter_add_(1, torch.where(mine, loc, ctx.n_r), torch.where(mine, g_values, 0))
        return grad[:, :ctx.n_r], None, None, None


def topk_rows(x_rows: torch.Tensor, k: int, largest: bool, shard: Shard):
    if x_rows.is_floating_point() and torch.is_grad_enabled() and x_rows.requires_grad:
        return _TopK.apply(x_rows, k, largest, shard)
    return merge_topk(x_rows, k, largest, shard)


def hard_mask(x_rows: torch.Tensor, k_rows: torch.Tensor, largest: bool, shard: Shard) -> torch.Tensor:
    """The exact hard top-k mask of this rank's slice ([R, n_r], x's dtype) for an integral
    per-row budget k_rows (float64, the same on every rank)."""
    R, n_r = x_rows.shape
    kmax = int(k_rows.max()) if R else 0
    vals, gidx = merge_topk(x_rows.detach(), kmax, largest, shard)
    loc = gidx - shard.offset
    keep = (torch.arange(kmax, device=x_rows.device)[None, :] < k_rows[:, None]) & (loc >= 0) & (loc < n_r)
    mask = torch.zeros((R, n_r + 1), dtype=x_rows.dtype, device=x_rows.device)
    mask.scatter_(1, torch.where(keep, loc, n_r), torch.ones_like(vals, dtype=x_rows.dtype))
    return mask[:, :n_r].contiguous()
