"""Public functions (DESIGN.md §3): argument checks, reshaping to [rows, n], dispatch."""
from __future__ import annotations

import math
import numbers
import operator
from typing import NamedTuple, Optional, Union

import torch

from . import _autograd as _ad
from ._ops import METHODS, MODE_HARD, MODE_LOG, MODE_SOFT, ops

Number = Union[int, float]
Budget = Union[Number, torch.Tensor]

__all__ = ["soft_topk", "log_soft_topk", "lapsum_threshold", "lapsum_diagnostics", "topk", "topk_diagnostics",
           "LapSumInfo"]

# Solver paths reported by lapsum_diagnostics, the plan's crossover and the regime names by
# code (csrc/common/plan.h).
from ._C import AUTO_SORT_MAX_N_CPU, AUTO_SORT_MAX_N_CUDA, PATH_BRACKET, PATH_BRACKET_RETRY, PATH_DIRECT, PATH_RADIX, PATH_SORT  # noqa: E402
from ._C import PATH_OUTER_GAP  # noqa: E402
from ._C import PATH_NAMES, SOFT_REGIME_NAMES, TOPK_REGIME_NAMES, TOPK_SORT  # noqa: E402


class LapSumInfo(NamedTuple):
    """Per-row solver diagnostics, shaped like x without `dim` (no host sync)."""

    threshold: torch.Tensor  # b, float64, in x's units
    path: torch.Tensor  # int64 code, see PATH_NAMES
    middle_size: torch.Tensor  # scores the exact solve ordered (sorted set or middle set)
    attempts: torch.Tensor  # bracket attempts (0 for the sort solver)
    regime: str = ""  # how the call was mapped onto its device (SOFT_REGIME_NAMES); "" compiled


def _as_int(v, name: str, what: str) -> int:
    """An integer argument as torch takes one: a Python or NumPy integer, or an integer
    tensor of one element; never a bool (True is not dim 1) or a float."""
    if type(v) is int:
        return v
    if isinstance(v, torch.Tensor):
        if v.dtype == torch.bool or v.is_floating_point() or v.is_complex() or v.numel() != 1:
            raise TypeError(f"{what}: {name} must be an int, got a {v.dtype} tensor of shape {tuple(v.shape)}")
        return int(v.item())
    if isinstance(v, bool):
        raise TypeError(f"{what}: {name} must be an int, not a bool")
    try:
        return operator.index(v)
    except TypeError:
        raise TypeError(f"{what}: {name} must be an int, got {type(v).__name__}") from None


def _check_tensor(x, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")


def _check_dim(x: torch.Tensor, dim, what: str) -> int:
    """dim as an int in [0, x.dim()); a 0-d x takes dim 0 or -1, as in torch."""
    d = _as_int(dim, "dim", what)
    nd = max(x.dim(), 1)
    if not -nd <= d < nd:
        raise IndexError(f"{what}: dim {d} out of range for a {x.dim()}-d tensor")
    return d % nd


def _check_x(x: torch.Tensor, dim, what: str) -> tuple[int, int]:
    """-> (n, dim in [0, x.dim()))."""
    _check_tensor(x, what)
    if not x.is_floating_point():
        raise TypeError(f"{what}: x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension to select along")
    d = _check_dim(x, dim, what)
    n = x.shape[d]
    if n == 0:
        raise ValueError(f"{what}: the selection dimension is empty")
    return n, d


def _as_rows(x: torch.Tensor, dim: int):
    """[..., n, ...] -> [rows, n] and the batch shape (x without dim); dim in [0, x.dim()).
    With dim last, a 2-d x passes as it is and others are only reshaped: no movedim (a
    permute here, a node in the backward); the kernels make their input contiguous."""
    if dim == x.dim() - 1:
        return (x if dim == 1 else x.reshape(-1, x.shape[-1])), x.shape[:-1]
    xm = x.movedim(dim, -1)
    return xm.reshape(-1, xm.shape[-1]), xm.shape[:-1]


def _from_rows(y: torch.Tensor, batch, dim: int) -> torch.Tensor:
    """[rows, m] -> x's shape with m at dim (the inverse of _as_rows)."""
    if dim == len(batch):  # dim was last
        return y if dim == 1 else y.reshape(*batch, y.shape[-1])
    return y.reshape(*batch, y.shape[-1]).movedim(-1, dim)


def _from_row_values(v: torch.Tensor, batch) -> torch.Tensor:
    """[rows] -> the batch shape."""
    return v if len(batch) == 1 else v.reshape(batch)


def _checking_values() -> bool:
    # Data-dependent checks on tensors would break a compiled graph: skip them there.
    return not torch.compiler.is_compiling()


_NUMBERS = (int, float)  # exactly these types take the fast path (not bool, not NumPy)


def _tensor_per_row(v: torch.Tensor, name: str, x: torch.Tensor, batch, rows: int, *, positive: bool, upper,
                    integral: bool, what: str, compiling: bool) -> torch.Tensor:
    if v.is_complex() or v.dtype == torch.bool:
        raise TypeError(f"{what}: {name} must be a real number or a real tensor, got {v.dtype}")
    if v.device != x.device and not (v.dim() == 0 and v.device.type == "cpu"):
        raise ValueError(f"{what}: {name} is on {v.device} but x is on {x.device}")
    try:
        v64 = v.to(device=x.device, dtype=torch.float64).broadcast_to(batch).reshape(rows)
    except RuntimeError as e:
        raise ValueError(f"{what}: {name} of shape {tuple(v.shape)} does not broadcast to "
                         f"{tuple(batch)} (x without dim)") from e
    # Data-dependent checks would break a compiled graph, and .item() fails under vmap.
    if (v.device.type == "cpu" and not compiling and v.numel() > 0
            and not torch._C._functorch.is_functorch_wrapped_tensor(v)):
        _check_values(v.detach().double(), name, positive=positive, upper=upper, integral=integral, what=what)
    return v64


def _per_row(v, name: str, x: torch.Tensor, batch, rows: int, *, positive: bool, upper=None, integral=False,
             what: str, compiling: bool) -> torch.Tensor:
    """A number or a tensor broadcastable to the batch shape -> float64 [rows]."""
    if compiling or type(v) not in _NUMBERS:  # else the eager fast path
        if isinstance(v, torch.Tensor):
            return _tensor_per_row(v, name, x, batch, rows, positive=positive, upper=upper, integral=integral,
                                   what=what, compiling=compiling)
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise TypeError(f"{what}: {name} must be a real number or a tensor, got {type(v).__name__}")
        if compiling:
            # A float that changes between calls is symbolic here: a Python check on it, or
            # torch.full's fill value, would break the graph or specialize it (a recompile per
            # value); a multiply keeps it a graph input. Unchecked, like tensor values.
            return torch.ones(rows, dtype=torch.float64, device=x.device) * v
    return _constant_rows((_number(v, name, positive=positive, upper=upper, integral=integral, what=what),),
                          rows, x)[0]


def _number(v, name: str, *, positive: bool, upper=None, integral=False, what: str) -> float:
    """A real number's checks -> float."""
    f = float(v)
    if not math.isfinite(f) or (f <= 0 if positive else f < 0) or (upper is not None and f > upper):
        bound = "> 0" if positive else (f">= 0 and <= n = {upper}" if upper is not None else ">= 0")
        raise ValueError(f"{what}: {name} must be finite and {bound}, got {f}")
    if integral and f != round(f):
        raise ValueError(f"{what}: {name} must be integral when hard=True, got {f}")
    return f


# Per-row k / t tensors of Python numbers, reused across calls (the kernels and autograd
# only read them). Keyed by the values, rows, device and, on CUDA, the stream the fill ran
# on. At most 32 entries of up to two tensors of up to 2^16 rows (32 MiB); more rows are
# filled per call, a cost small next to the kernels' at that size.
_CONSTANT_ROWS: dict = {}
_CONSTANT_ROWS_MAX = 32
_CONSTANT_ROWS_MAX_ROWS = 1 << 16


def _cache_key(rows: int, x: torch.Tensor) -> Optional[tuple]:
    """(rows, device[, stream]) when per-row constants for x may come from the cache, else
    None: not under a dispatch mode or a torch.func transform (fake, traced or wrapped
    tensors, which must not outlive them) nor during CUDA-graph capture (the fill would not
    have run, and a graph must not read memory the cache may free)."""
    if (rows > _CONSTANT_ROWS_MAX_ROWS or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._are_functorch_transforms_active()):
        return None
    if x.is_cuda:
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        device = x.device
        return rows, device, torch._C._cuda_getCurrentStream(device.index)[0]
    return (rows, "cpu") if x.is_cpu else None


def _constant_rows(values: tuple, rows: int, x: torch.Tensor) -> tuple:
    """One float64 [rows] tensor on x's device per value, filled with it; from the cache
    when it can be."""
    key = _cache_key(rows, x)
    got = None if key is None else _CONSTANT_ROWS.get(key := values + key)
    if got is None:
        with torch.inference_mode(False):  # also usable outside inference mode later
            got = tuple(torch.full((rows,), f, dtype=torch.float64, device=x.device) for f in values)
        if key is not None:
            if len(_CONSTANT_ROWS) >= _CONSTANT_ROWS_MAX:
                _CONSTANT_ROWS.clear()
            _CONSTANT_ROWS[key] = got
    return got


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
    n, d = _check_x(x, dim, what)
    rows_x, batch = _as_rows(x, d)
    rows, compiling = rows_x.shape[0], torch.compiler.is_compiling()
    if not compiling and type(k) in _NUMBERS and type(temperature) in _NUMBERS:  # the common call
        kk, tt = _constant_rows((_number(k, "k", positive=False, upper=n, integral=integral, what=what),
                                 _number(temperature, "temperature", positive=True, what=what)), rows, x)
    else:
        kk = _per_row(k, "k", x, batch, rows, positive=False, upper=n, integral=integral, what=what,
                      compiling=compiling)
        tt = _per_row(temperature, "temperature", x, batch, rows, positive=True, what=what, compiling=compiling)
    return rows_x, batch, d, kk, tt, _method(method, what)


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
    rows_x, batch, d, kk, tt, m = _prepare(x, k, temperature, dim, method, "soft_topk", integral=hard)
    # A number k bounds every row's budget: the hard mask's selector plans its launch with it
    # (not under torch.compile, where an int argument would specialize the graph on k).
    k_max = int(k) if hard and type(k) in _NUMBERS and not torch.compiler.is_compiling() else -1
    p, _, _ = _ad.soft_topk_forward(rows_x, kk, tt, largest, m, MODE_HARD if hard else MODE_SOFT, k_max)
    return _from_rows(p, batch, d)


def log_soft_topk(x: torch.Tensor, k: Budget, temperature: Budget = 1.0, *, dim: int = -1,
                  largest: bool = True, method: str = "auto") -> torch.Tensor:
    """log of soft_topk's mask, computed without cancellation (log p ~ (x - b)/t + log 1/2
    far below the threshold, where p itself underflows)."""
    rows_x, batch, d, kk, tt, m = _prepare(x, k, temperature, dim, method, "log_soft_topk")
    p, _, _ = _ad.soft_topk_forward(rows_x, kk, tt, largest, m, MODE_LOG)
    return _from_rows(p, batch, d)


def lapsum_threshold(x: torch.Tensor, k: Budget, temperature: Budget = 1.0, *, dim: int = -1,
                     largest: bool = True, method: str = "auto") -> torch.Tensor:
    """The threshold b of each row, float64, shaped like x without `dim`; differentiable
    in x, k and temperature. For largest=False the mask is F((b - x_i)/t)."""
    rows_x, batch, d, kk, tt, m = _prepare(x, k, temperature, dim, method, "lapsum_threshold")
    b, _, _ = _ad.lapsum_threshold(rows_x, kk, tt, largest, m)
    return _from_row_values(b, batch)


def lapsum_diagnostics(x: torch.Tensor, k: Budget, temperature: Budget = 1.0, *, dim: int = -1,
                       largest: bool = True, method: str = "auto") -> LapSumInfo:
    """Threshold plus which solver path each row took (PATH_NAMES), the size of the set it
    ordered exactly and the bracket attempts. Stays on x's device: no host sync."""
    rows_x, batch, d, kk, tt, m = _prepare(x, k, temperature, dim, method, "lapsum_diagnostics")
    with torch.no_grad():
        b, _, diag = _ad.lapsum_threshold(rows_x, kk, tt, largest, m)
    info = diag.reshape(*batch, 3)
    regime = ("" if torch.compiler.is_compiling() else
              SOFT_REGIME_NAMES[_regime("soft_regime", rows_x.shape[0], rows_x.shape[1], rows_x.dtype, x.device, m)])
    return LapSumInfo(b.reshape(batch), info[..., 0], info[..., 1], info[..., 2], regime)


@torch.compiler.disable
def _regime(op: str, rows: int, n: int, dtype: torch.dtype, device: torch.device, *args) -> int:
    """A regime op's answer for x [rows, n] of this dtype and device. The ops read no data, so
    they get one element expanded to the shape (a diagnostic neither copies nor allocates x).
    They return an int, which a compiled graph cannot hold: torch.compile runs this eagerly."""
    return getattr(ops, op)(torch.empty((), dtype=dtype, device=device).expand(rows, n), *args)


# torch.topk's dtypes, plus bool. CUDA's selector takes floating rows; integer rows of
# 16 bits or less are exact in float32 and use it, wider ones a stable sort (see topk).
_TOPK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                torch.int16, torch.int32, torch.int64, torch.bool)
_EXACT_IN_FP32 = (torch.bool, torch.uint8, torch.int8, torch.int16)


def topk(x: torch.Tensor, k: int, *, dim: int = -1, largest: bool = True, sorted: bool = False,
         lengths: Optional[torch.Tensor] = None) -> torch.return_types.topk:
    """Exact hard top-k along `dim` -> torch.return_types.topk (values, indices).

    Takes what torch.topk takes (float16/bfloat16/float32/float64 and integer x, also
    bool; 0-d x; k an int or a one-element integer tensor) and gives the same values.
    Differences: order is unspecified unless sorted=True (torch sorts by default); among
    tied scores the smaller index wins; `lengths` (integer tensor shaped like x without
    `dim`) gives each row's valid prefix, and rows with length <= k return their valid
    indices then -1 (values -inf, or +inf for largest=False; for integer x the dtype's
    lowest or highest value, for bool False or True). NaN ranks above +inf, as in
    torch.topk. values are differentiable.
    """
    what = "topk"
    d, k, n = _check_topk(x, k, dim, what, largest=largest, sorted=sorted)
    if x.dim() == 0:  # as torch.topk: the element itself (also for k = 0), 0-d
        v, i = topk(x.reshape(1), 1, largest=largest, sorted=sorted, lengths=lengths)
        return torch.return_types.topk((v.reshape(()), i.reshape(())))
    batch = x.shape[:d] + x.shape[d + 1:]
    len_rows = _topk_lengths(lengths, x, batch, n)
    if n == 0:  # k == 0: nothing to select
        values = x.narrow(d, 0, 0).clone()
        return torch.return_types.topk((values, torch.empty(values.shape, dtype=torch.int64, device=x.device)))
    rows_x, _ = _as_rows(x, d)
    values, indices = _select_rows(rows_x, k, largest, sorted, len_rows)
    return torch.return_types.topk((_from_rows(values, batch, d), _from_rows(indices, batch, d)))


def topk_diagnostics(x: torch.Tensor, k: int, *, dim: int = -1, hard: bool = False) -> str:
    """The regime (TOPK_REGIME_NAMES) that topk(x, k, dim=dim) takes on x's device: on CUDA
    "thread-rows", "warp-rows", "row-cta" (a CTA a row), "grid" (several CTAs a row) or "sort"
    (float64 and int32/int64 rows); "cpu" on the CPU. hard=True: the regime of the exact
    mask of soft_topk(x, k, dim=dim, hard=True) instead. Reads only x's shape, dtype and
    device; a call with no output element launches nothing. Eager (a graph break under
    torch.compile)."""
    what = "topk_diagnostics"
    d, k, n = _check_topk(x, k, dim, what)
    if not isinstance(hard, bool):
        raise TypeError(f"{what}: hard must be a bool, got {type(hard).__name__}")
    if hard and not x.is_floating_point():
        raise TypeError(f"{what}: hard=True takes float16, bfloat16, float32 or float64 x, got {x.dtype}")
    rows = math.prod(x.shape[:d] + x.shape[d + 1:]) if x.dim() else 1
    dtype = _selector_dtype(x.dtype, x.device)
    if dtype is None:
        return TOPK_REGIME_NAMES[TOPK_SORT]
    return TOPK_REGIME_NAMES[_regime("topk_regime", rows, n, dtype, x.device, k, hard)]


def _check_topk(x, k, dim, what: str, **flags) -> tuple[int, int, int]:
    """topk's arguments checked as torch.topk checks them -> (dim in [0, x.dim()), k, n)."""
    _check_tensor(x, what)
    if x.dtype not in _TOPK_DTYPES:
        raise TypeError(f"{what}: x must be a floating-point, integer (uint8 to int64) or bool tensor, "
                        f"got {x.dtype}")
    d = _check_dim(x, dim, what)
    k = _as_int(k, "k", what)
    for name, v in flags.items():
        if not isinstance(v, bool):
            raise TypeError(f"{what}: {name} must be a bool, got {type(v).__name__}")
    n = x.shape[d] if x.dim() else 1
    if not 0 <= k <= n:
        raise ValueError(f"{what}: k must be in [0, n] = [0, {n}], got {k}")
    return d, k, n


def _topk_lengths(lengths, x: torch.Tensor, batch, n: int) -> Optional[torch.Tensor]:
    """lengths -> int64 [rows], checked (values only on the CPU, outside a compiled graph)."""
    if lengths is None:
        return None
    if not isinstance(lengths, torch.Tensor):
        raise TypeError("topk: lengths must be an integer tensor")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise TypeError(f"topk: lengths must be an integer tensor, got {lengths.dtype}")
    if lengths.device != x.device:
        raise ValueError(f"topk: lengths is on {lengths.device} but x is on {x.device}")
    rows = math.prod(batch)
    try:
        len_rows = lengths.to(torch.int64).broadcast_to(batch).reshape(rows)
    except RuntimeError as e:
        raise ValueError(f"topk: lengths of shape {tuple(lengths.shape)} does not broadcast to "
                         f"{tuple(batch)} (x without dim)") from e
    if lengths.device.type == "cpu" and _checking_values() and rows > 0:
        if not bool(((len_rows >= 0) & (len_rows <= n)).all()):
            raise ValueError(f"topk: lengths must lie in [0, n] = [0, {n}]")
    return len_rows


def _select_rows(rows_x: torch.Tensor, k: int, largest: bool, sorted: bool,
                 len_rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row of [rows, n]. The CPU kernel takes every dtype exactly; CUDA's
    selector takes floating rows, so narrow integer rows go to it as float32 (exact) and
    int32/int64 rows take a stable sort (O(n log n), torch.sort's cost)."""
    if rows_x.is_floating_point():
        return _ad.topk(rows_x, k, largest, sorted, len_rows)
    dtype = _selector_dtype(rows_x.dtype, rows_x.device)
    if dtype == rows_x.dtype:
        return ops.topk(rows_x, k, largest, sorted, len_rows)
    if dtype is not None:
        indices = ops.topk(rows_x.to(dtype), k, largest, sorted, len_rows)[1]
    else:
        indices = _topk_indices_by_sort(rows_x, k, largest, len_rows)
    return _gather_padded(rows_x, indices, largest), indices


def _selector_dtype(dtype: torch.dtype, device: torch.device) -> Optional[torch.dtype]:
    """The dtype in which topk's kernel selects rows of `dtype` (shared by topk and
    topk_diagnostics): its own for floating rows and on the CPU; on CUDA float32 for narrow
    integer rows (exact), none for int32/int64 rows (they take a stable sort)."""
    if dtype.is_floating_point or device.type != "cuda":
        return dtype
    return torch.float32 if dtype in _EXACT_IN_FP32 else None


def _worst_int(dtype: torch.dtype, largest: bool) -> Union[int, bool]:
    """The padding value of an integer or bool row: its worst score in the requested order."""
    if dtype == torch.bool:
        return not largest
    info = torch.iinfo(dtype)
    return info.min if largest else info.max


def _topk_indices_by_sort(rows_x: torch.Tensor, k: int, largest: bool,
                          len_rows: Optional[torch.Tensor]) -> torch.Tensor:
    """Exact top-k indices of integer rows by a stable sort: among equal scores the smaller
    index comes first. Positions past a row's length get the worst key; being the last
    positions, the stable sort keeps them behind every valid score, which they then pad."""
    key = rows_x.to(torch.int64)
    if len_rows is not None:
        invalid = torch.arange(key.shape[1], device=key.device) >= len_rows.unsqueeze(1)
        key = key.masked_fill(invalid, _worst_int(torch.int64, largest))
    indices = key.sort(dim=1, descending=largest, stable=True).indices[:, :k]
    if len_rows is not None:
        indices = indices.masked_fill(torch.arange(k, device=key.device) >= len_rows.unsqueeze(1), -1)
    return indices.contiguous()


def _gather_padded(rows_x: torch.Tensor, indices: torch.Tensor, largest: bool) -> torch.Tensor:
    """Values of integer rows at indices, with the padding value where the index is -1."""
    values = rows_x.gather(1, indices.clamp(min=0))
    return values.masked_fill(indices < 0, _worst_int(rows_x.dtype, largest))
