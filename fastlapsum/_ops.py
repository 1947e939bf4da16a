"""The custom ops' Python side: fake (meta) kernels; autograd and vmap in _autograd.py
(the Autograd kernels themselves are C++: csrc/autograd/autograd_kernels.cpp).

The schemas live in csrc/ops.cpp. Every op works on [rows, n] tensors with the
selection dim last; fastlapsum/functional.py does the reshaping and validation.
"""
from __future__ import annotations

import torch

from . import _C  # loads the op library; carries its constants

ops = torch.ops.fastlapsum
F64 = torch.float64

METHODS = {"auto": _C.METHOD_AUTO, "sort": _C.METHOD_SORT, "bracket": _C.METHOD_BRACKET}
MODE_SOFT, MODE_LOG, MODE_HARD = _C.MODE_SOFT, _C.MODE_LOG, _C.MODE_HARD


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA sources."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("fastlapsum::lapsum_mask", "CUDA")


# ---- fake kernels ------------------------------------------------------------------

def _row_outputs(x):
    rows = x.shape[0]
    return x.new_empty((rows,), dtype=F64), x.new_empty((rows, 3), dtype=torch.int64)


@torch.library.register_fake("fastlapsum::lapsum_threshold")
def _(x, k, t, largest, method):
    b, diag = _row_outputs(x)
    return b, torch.empty_like(b), diag


def _like_rows(x):
    """The kernels return contiguous [rows, n] tensors whatever x's strides."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("fastlapsum::soft_topk_forward")
def _(x, k, t, largest, method, mode, k_max=-1):
    b, diag = _row_outputs(x)
    return _like_rows(x), b, diag


@torch.library.register_fake("fastlapsum::lapsum_mask")
def _(x, b, t, edge, largest, log_mode):
    return _like_rows(x)


def _grads_like(x, b):
    return _like_rows(x), torch.empty_like(b), torch.empty_like(b)


@torch.library.register_fake("fastlapsum::soft_topk_backward")
def _(grad, x, b, t, largest, log_mode):
    return _grads_like(x, b)


@torch.library.register_fake("fastlapsum::lapsum_threshold_backward")
def _(grad_b, x, b, t, largest):
    return _grads_like(x, b)


@torch.library.register_fake("fastlapsum::topk")
def _(x, k, largest, sorted, lengths):
    rows = x.shape[0]
    return x.new_empty((rows, k)), x.new_empty((rows, k), dtype=torch.int64)


# On CUDA every op is a native kernel (csrc/cuda/): soft_topk_forward fuses the
# threshold and the mask for short rows and takes its hard mask from the exact selector.

from . import _autograd  # noqa: E402,F401  (registers the Python kernels the C++ autograd calls, and vmap rules)
