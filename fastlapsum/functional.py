"""Public functions (DESIGN.md §3): argument checks, reshaping to [rows, n], dispatch."""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional, Union

import torch

from . import _autograd as _ad
from ._ops import METHODS, MODE_HARD, MODE_LOG, MODE_SOFT

Number = Union[int, float]
Budget = Union[Number, torch.Tensor]

__all__ = ["soft_topk", "log_soft_topk", "lapsum_threshold", "lapsum_diagnostics", "topk", "LapSumInfo"]

# Solver paths reported by lapsum_diagnostics (same codes as csrc/common/lapsum_math.h).
PATH_DIRECT, PATH_SORT, PATH_BRACKET, PATH_BRACKET_RETRY, PATH_RADIX = range(5)
PATH_NAMES = ("direct", "sort", "bracket", "bracket-retry", "radix-fallback")


class LapSumInfo(NamedTuple):
    """Per-row solver diagnostics, shaped like x without `dim` (no host sync)."""

    threshold: torch.Tensor  # b, float64, in x's units
    path: torch.Tensor  # int64 code, see PATH_NAMES
    middle_size: torch.Tensor  # scores the exact solve ordered (sorted set or middle set)
    attempts: torch.Tensor  # bracket attempts (0 for the sort solver)


def _check_x(x: torch.Tensor, dim: int, what: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{what}: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension to select along")
    if not -x.dim() <= dim < x.dim():
        raise IndexError(f"{what}: dim {dim} out of range for a {x.dim()}-d tensor")
    n = x.shape[dim]
    if n == 0:
        raise ValueError(f"{what}: the selection dimension is empty")
    return n


def _as_rows(x: torch.Tensor, dim: int):
    """[..., n, ...] -> contiguous [rows, n] and the batch shape (x without dim)."""
    xm = x.movedim(dim, -1)
    return xm.reshape(-1, xm.shape[-1]), xm.shape[:-1]


def _from_rows(y: torch.Tensor, batch, dim: int) -> torch.Tensor:
    return y.reshape(*batch, y.shape[-1]).movedim(-1, dim)


def _checking_values() -> bool:
    # Data-dependent checks on tensors would break a compiled graph: skip them there.
    return not torch.compiler.is_compiling()


def _per_row(v, name: str, x: torch.Tensor, batch, *, positive: bool, upper=None, integral=False,
             what: str) -> torch.Tensor:
    """A number or a tensor broadcastable to the batch shape -> float64 [rows]."""
    rows = math.prod(batch)
    if isinstance(v, torch.Tensor):
        if v.is_complex() or v.dtype == torch.bool:
            raise TypeError(f"{what}: {name} must be a real number or a real tensor, got {v.dtype}")
        if v.device != x.device and not (v.dim() == 0 and v.device.type == "cpu"):
            raise ValueError(f"{what}: {name} is on {v.device} but x is on {x.device}")
        try:
            v64 = v.to(device=x.device, dtype=torch.float64).broadcast_to(batch).reshape(rows)
        except RuntimeError as e:
            raise ValueError(f"{what}: {name} of shape {tuple(v.shape)} does not broadcast to "
                             f"{tuple(batch)} (x without dim)") from e
        if (v.device.type == "cpu" and _checking_values() and v.numel() > 0
                and not torch._C._functorch.is_functorch_wrapped_tensor(v)):  # no .item() under vmap
            _check_values(v.detach().double(), name, positive=positive, upper=upper, integral=integral, what=what)
        return v64
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        raise TypeError(f"{what}: {name} must be a real number or a tensor, got {type(v).__name__}")
    if torch.compiler.is_compiling():
        # A float that changes between calls is symbolic here: a Python check on it, or
        # torch.full's fill value, would break the graph or specialize it (a recompile per
        # value); a multiply keeps it a graph input. Unchecked, like tensor values.
        return torch.ones(rows, dtype=torch.float64, device=x.device) * v
    f = float(v)
    if not math.isfinite(f) or (f <= 0 if positive else f < 0) or (upper is not None and f > upper):
        bound = "> 0" if positive else (f">= 0 and <= n = {upper}" if upper is not None else ">= 0")
        raise ValueError(f"{what}: {name} must be finite and {bound}, got {f}")
    if integral and f != round(f):
        raise ValueError(f"{what}: {name} must be integral when hard=True, got {f}")
    return torch.full((rows,), f, dtype=torch.float64, device=x.device)


def _check_values(v: torch.Tensor, name, *, positive, upper, integral, what) -> None:
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{what}: {name} must be finite")
    if positive and not bool((v > 0).all()):
        raise ValueError(f"{what}: {name} must be > 0, got min {float(v.min())}")
    if not positive and not bool((v >= 0).all()):
        raise ValueError(f"{what}: {name} must be >= 0, got min {float(v.min())}")
    if upper is not None and not bool((v <= upper).all()):
        raise ValueError(f"{what}: {name} must be <= n = {upper}, got max {float(v.max())}")
    if integral and not bool((v == v.round()).all()):
        raise ValueError(f"{what}: {name} must be integral when hard=True")


def _method(method: str, what: str) -> int:
    if method not in METHODS:
        raise ValueError(f"{what}: method must be one of {sorted(METHODS)}, got {method!r}")
    return METHODS[method]


def _prepare(x, k, temperature, dim, method, what, integral=False) -> tuple:
    n = _check_x(x, dim, what)
    rows_x, batch = _as_rows(x, dim)
    kk = _per_row(k, "k", x, batch, positive=False, upper=n, integral=integral, what=what)
    tt = _per_row(temperature, "temperature", x, batch, positive=True, what=what)
    return rows_x, batch, kk, tt, _method(method, what)


def soft_topk(x: torch.Tensor, k: Budget, temperature: Budget = 1.0, *, dim: int = -1,
              largest: bool = True, hard: bool = False, method: str = "auto") -> torch.Tensor:
    """LapSum soft top-k mask p with sum(p) == k along `dim` (exact to float precision).

    p_i = F((x_i - b)/t) with F the Laplace CDF and b solving sum_i p_i = k. `k` (real,
    0 <= k <= n) and `temperature` (> 0) are numbers or tensors broadcastable to x without
    `dim`; tensors that require grad get gradients. `largest=False` selects the smallest.
    `hard=True` (integral k) returns the exact hard top-k mask (exactly k ones; smaller
    index wins ties) with the soft mask's gradient and forward-mode tangent
    (straight-through). `method` forces the solver ("sort" or "bracket"); the answer
    does not depend on it.
    Rows with NaN give NaN; +inf scores get 1 while the budget allows, -inf get 0.
    """
    rows_x, batch, kk, tt, m = _prepare(x, k, temperature, dim, method, "soft_topk", integral=hard)
    p, _, _ = _ad.soft_topk_forward(rows_x, kk, tt, largest, m, MODE_HARD if hard else MODE_SOFT)
    return _from_rows(p, batch, dim)


def log_soft_topk(x: torch.Tensor, k: Budget, temperature: Budget = 1.0, *, dim: int = -1,
                  largest: bool = True, method: str = "auto") -> torch.Tensor:
    """log of soft_topk's mask, computed without cancellation (log p ~ (x - b)/t + log 1/2
    far below the threshold, where p itself underflows)."""
    rows_x, batch, kk, tt, m = _prepare(x, k, temperature, dim, method, "log_soft_topk")
    p, _, _ = _ad.soft_topk_forward(rows_x, kk, tt, largest, m, MODE_LOG)
    return _from_rows(p, batch, dim)


def lapsum_threshold(x: torch.Tensor, k: Budget, temperature: Budget = 1.0, *, dim: int = -1,
                     largest: bool = True, method: str = "auto") -> torch.Tensor:
    """The threshold b of each row, float64, shaped like x without `dim`; differentiable
    in x, k and temperature. For largest=False the mask is F((b - x_i)/t)."""
    rows_x, batch, kk, tt, m = _prepare(x, k, temperature, dim, method, "lapsum_threshold")
    b, _, _ = _ad.lapsum_threshold(rows_x, kk, tt, largest, m)
    return b.reshape(batch)


def lapsum_diagnostics(x: torch.Tensor, k: Budget, temperature: Budget = 1.0, *, dim: int = -1,
                       largest: bool = True, method: str = "auto") -> LapSumInfo:
    """Threshold plus which solver path each row took (PATH_NAMES), the size of the set it
    ordered exactly and the bracket attempts. Stays on x's device: no host sync."""
    rows_x, batch, kk, tt, m = _prepare(x, k, temperature, dim, method, "lapsum_diagnostics")
    with torch.no_grad():
        b, _, diag = _ad.lapsum_threshold(rows_x, kk, tt, largest, m)
    d = diag.reshape(*batch, 3)
    return LapSumInfo(b.reshape(batch), d[..., 0], d[..., 1], d[..., 2])


def topk(x: torch.Tensor, k: int, *, dim: int = -1, largest: bool = True, sorted: bool = False,
         lengths: Optional[torch.Tensor] = None):
    """Exact hard top-k along `dim` -> (values, indices).

    `lengths` (integer tensor shaped like x without `dim`) gives each row's valid prefix;
    rows with length <= k return their valid indices then -1 (values -inf, or +inf for
    largest=False). Order is unspecified unless sorted=True. NaN ranks above +inf; among
    tied scores the smaller index wins. values are differentiable.
    """
    n = _check_x(x, dim, "topk")
    if not isinstance(k, numbers.Integral) or isinstance(k, bool):
        raise TypeError(f"topk: k must be an int, got {type(k).__name__}")
    if not 0 <= k <= n:
        raise ValueError(f"topk: k must be in [0, n] = [0, {n}], got {k}")
    rows_x, batch = _as_rows(x, dim)
    rows = rows_x.shape[0]
    len_rows = None
    if lengths is not None:
        if not isinstance(lengths, torch.Tensor):
            raise TypeError("topk: lengths must be an integer tensor")
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise TypeError(f"topk: lengths must be an integer tensor, got {lengths.dtype}")
        if lengths.device != x.device:
            raise ValueError(f"topk: lengths is on {lengths.device} but x is on {x.device}")
        try:
            len_rows = lengths.to(torch.int64).broadcast_to(batch).reshape(rows)
        except RuntimeError as e:
            raise ValueError(f"topk: lengths of shape {tuple(lengths.shape)} does not broadcast to "
                             f"{tuple(batch)} (x without dim)") from e
        if lengths.device.type == "cpu" and _checking_values() and rows > 0:
            if not bool(((len_rows >= 0) & (len_rows <= n)).all()):
                raise ValueError(f"topk: lengths must lie in [0, n] = [0, {n}]")
    values, indices = _ad.topk(rows_x, k, largest, sorted, len_rows)
    return _from_rows(values, batch, dim), _from_rows(indices, batch, dim)
