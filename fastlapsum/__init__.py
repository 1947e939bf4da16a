"""fastlapsum: exact-budget differentiable top-k (LapSum) and fast exact hard top-k.

    soft_topk(x, k, temperature=1.0, *, dim=-1, largest=True, hard=False, method="auto")
    log_soft_topk(x, k, temperature=1.0, *, dim=-1, largest=True)
    lapsum_threshold(x, k, temperature=1.0, *, dim=-1, largest=True)
    topk(x, k, *, dim=-1, largest=True, sorted=False, lengths=None)
    SoftTopK(k, temperature=1.0, *, dim=-1, hard=False)
    lapsum_diagnostics(...)  -> LapSumInfo(threshold, path, middle_size, attempts, regime)
    topk_diagnostics(x, k, *, dim=-1, hard=False)  -> the regime name topk takes

`fastlapsum.reference` holds the pure-PyTorch float64 oracle.
"""
from . import reference
from ._ops import has_cuda_kernels
from .functional import (
    PATH_BRACKET,
    PATH_BRACKET_RETRY,
    PATH_DIRECT,
    PATH_NAMES,
    PATH_OUTER_GAP,
    PATH_RADIX,
    PATH_SORT,
    SOFT_REGIME_NAMES,
    TOPK_REGIME_NAMES,
    LapSumInfo,
    lapsum_diagnostics,
    lapsum_threshold,
    log_soft_topk,
    soft_topk,
    topk,
    topk_diagnostics,
)
from .module import SoftTopK

__version__ = "0.1.0"

__all__ = [
    "soft_topk", "log_soft_topk", "lapsum_threshold", "topk", "SoftTopK", "lapsum_diagnostics",
    "LapSumInfo", "PATH_NAMES", "PATH_DIRECT", "PATH_SORT", "PATH_BRACKET", "PATH_BRACKET_RETRY",
    "PATH_RADIX", "PATH_OUTER_GAP", "SOFT_REGIME_NAMES", "TOPK_REGIME_NAMES", "topk_diagnostics", "has_cuda_kernels", "reference",
]
