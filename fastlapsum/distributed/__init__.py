"""fastlapsum over a dimension sharded across a torch.distributed process group
(docs/DISTRIBUTED.md).

    soft_topk(x, k, temperature=1.0, *, dim=-1, largest=True, hard=False, group=None)
    log_soft_topk(x, k, temperature=1.0, *, dim=-1, largest=True, group=None)
    lapsum_threshold(x, k, temperature=1.0, *, dim=-1, largest=True, group=None)
    topk(x, k, *, dim=-1, largest=True, sorted=True, group=None)

Each rank passes its slice of the row along `dim` (unequal lengths allowed, also 0); the
row is the concatenation of the slices in rank order. The soft ops return this rank's
slice of the mask with the budget k holding over the whole row; lapsum_threshold returns
b, bit-identical on every rank; topk returns the top-k of the whole row (values and
global indices), identical on every rank. `k` and `temperature` must be the same on
every rank. A DTensor sharded on `dim` (Shard(dim) on one mesh dimension) takes its mesh
group and gives DTensors back. Every rank must call the op, and the backward, together.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .. import functional as _fn
from .._ops import MODE_HARD, MODE_LOG, MODE_SOFT
from . import _comm, dtensor as _dt
from .hard import topk_rows
from .soft import SoftFn, ThresholdFn

__all__ = ["soft_topk", "log_soft_topk", "lapsum_threshold", "topk"]


def _as_rows(x: torch.Tensor, d: int):
    """[..., n_r, ...] -> [rows, n_r] and the batch shape; n_r may be 0 on a rank."""
    xm = x.movedim(d, -1)
    batch = xm.shape[:-1]
    rows = 1
    for s in batch:
        rows *= s
    return xm.reshape(rows, xm.shape[-1]), batch


def _check_soft_x(x, dim, what: str) -> int:
    _fn._check_tensor(x, what)
    if not x.is_floating_point():
        raise TypeError(f"{what}: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension to select along")
    return _fn._check_dim(x, dim, what)


def _prepare_soft(x, k, temperature, dim, largest, mode, group, what):
    """Local checks, then the shared description (a local error raises on every rank)."""
    err = d = rows_x = batch = kk = tt = None
    try:
        if not isinstance(largest, bool):
            raise TypeError(f"{what}: largest must be a bool, got {type(largest).__name__}")
        d = _check_soft_x(x, dim, what)
        rows_x, batch = _as_rows(x, d)
        rows = rows_x.size(0)
        kk = _fn._per_row(k, "k", x, batch, rows, positive=False, integral=mode == MODE_HARD, what=what,
                          compiling=False)
        tt = _fn._per_row(temperature, "temperature", x, batch, rows, positive=True, what=what, compiling=False)
    except (TypeError, ValueError, IndexError) as e:
        err = e
    shard = _comm.describe(x, d, group, what, flags=0 if err else int(largest) + 2 * mode, err=err)
    return x, d, rows_x, batch, kk, tt, shard


def _check_topk_x(x, dim, what: str) -> int:
    _fn._check_tensor(x, what)
    if x.dtype not in _fn._TOPK_DTYPES:
        raise TypeError(f"{what}: x must be a floating-point, integer (uint8 to int64) or bool tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension to select along")
    return _fn._check_dim(x, dim, what)


def _soft(x, k, temperature, dim, largest, mode, group, what):
    if _dt.is_dtensor(x):
        return _dt.call_sharded(x, dim, what, lambda xl, d, g: _soft(
            xl, _dt.local_arg(k, "k", what), _dt.local_arg(temperature, "temperature", what), d, largest, mode,
            g, what), kind="slice")
    x, d, rows_x, batch, kk, tt, shard = _prepare_soft(x, k, temperature, dim, largest, mode, group, what)
    p = SoftFn.apply(rows_x, kk, tt, largest, mode, shard, what)
    return _fn._from_rows(p, batch, d)


def soft_topk(x: torch.Tensor, k, temperature=1.0, *, dim: int = -1, largest: bool = True,
              hard: bool = False, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This rank's slice of the LapSum soft top-k mask of the row sharded along `dim`:
    sum over every rank's slice == k. hard=True: the exact hard top-k mask of the whole
    row (k ones in all; smaller global index wins ties) with the soft mask's gradient."""
    if not isinstance(hard, bool):
        raise TypeError(f"soft_topk: hard must be a bool, got {type(hard).__name__}")
    return _soft(x, k, temperature, dim, largest, MODE_HARD if hard else MODE_SOFT, group, "soft_topk")


def log_soft_topk(x: torch.Tensor, k, temperature=1.0, *, dim: int = -1, largest: bool = True,
                  group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """log of soft_topk's slice, without cancellation."""
    return _soft(x, k, temperature, dim, largest, MODE_LOG, group, "log_soft_topk")


def lapsum_threshold(x: torch.Tensor, k, temperature=1.0, *, dim: int = -1, largest: bool = True,
                     group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The threshold b of the whole row (float64, x without `dim`), bit-identical on
    every rank; differentiable in this rank's x, k and temperature."""
    what = "lapsum_threshold"
    if _dt.is_dtensor(x):
        return _dt.call_sharded(x, dim, what, lambda xl, d, g: lapsum_threshold(
            xl, _dt.local_arg(k, "k", what), _dt.local_arg(temperature, "temperature", what), dim=d,
            largest=largest, group=g), kind="reduced")
    x, d, rows_x, batch, kk, tt, shard = _prepare_soft(x, k, temperature, dim, largest, MODE_SOFT, group, what)
    return ThresholdFn.apply(rows_x, kk, tt, largest, shard, what).reshape(batch)


def topk(x: torch.Tensor, k: int, *, dim: int = -1, largest: bool = True, sorted: bool = True,
         group: Optional[dist.ProcessGroup] = None) -> torch.return_types.topk:
    """Exact top-k of the row sharded along `dim` -> (values, indices) of the whole row,
    identical on every rank: indices are global (positions in the concatenated row),
    best first whatever `sorted` (ties: the smaller global index first; NaN ranks above
    +inf). The selection is fastlapsum.topk's on the concatenated row. values are
    differentiable: each rank sends its own upstream gradient to the elements it owns."""
    what = "topk"
    if _dt.is_dtensor(x):
        return _dt.call_sharded(x, dim, what, lambda xl, d, g: topk(
            xl, k, dim=d, largest=largest, group=g), kind="topk")
    err = d = None
    try:
        for name, v in (("largest", largest), ("sorted", sorted)):
            if not isinstance(v, bool):
                raise TypeError(f"{what}: {name} must be a bool, got {type(v).__name__}")
        d = _check_topk_x(x, dim, what)
        k = _fn._as_int(k, "k", what)
        if k < 0:
            raise ValueError(f"{what}: k must be >= 0, got {k}")
    except (TypeError, ValueError, IndexError) as e:
        err = e
    shard = _comm.describe(x, d, group, what, flags=0 if err else int(largest) + 2 * k, err=err)
    if k > shard.n:
        raise ValueError(f"{what}: k must be in [0, n] = [0, {shard.n}] (the concatenated row), got {k}")
    rows_x, batch = _as_rows(x, d)
    values, indices = topk_rows(rows_x, k, largest, shard)
    return torch.return_types.topk((_fn._from_rows(values, batch, d), _fn._from_rows(indices, batch, d)))
