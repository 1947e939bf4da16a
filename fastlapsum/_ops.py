"""The custom ops' Python side: fake (meta) kernels and autograd formulas.

The schemas live in csrc/ops.cpp. Every op works on [rows, n] tensors with the
selection dim last; fastlapsum/functional.py does the reshaping and validation.
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the op library)

ops = torch.ops.fastlapsum
F64 = torch.float64

METHODS = {"auto": 0, "sort": 1, "bracket": 2}
MODE_SOFT, MODE_LOG, MODE_HARD = 0, 1, 2


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
def _(x, k, t, largest, method, mode):
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


# ---- autograd ----------------------------------------------------------------------

def _setup_soft(ctx, inputs, output):
    x, k, t, largest, method, mode = inputs
    _, b, diag = output
    ctx.save_for_backward(x, b, t)
    ctx.largest = largest
    ctx.log_mode = mode == MODE_LOG
    ctx.mark_non_differentiable(b, diag)


def _backward_soft(ctx, grad_p, grad_b, grad_diag):
    x, b, t = ctx.saved_tensors
    gx, gk, gt = ops.soft_topk_backward(grad_p, x, b, t, ctx.largest, ctx.log_mode)
    return gx, gk, gt, None, None, None


torch.library.register_autograd("fastlapsum::soft_topk_forward", _backward_soft, setup_context=_setup_soft)


def _setup_threshold(ctx, inputs, output):
    x, k, t, largest, method = inputs
    b, edge, diag = output
    ctx.save_for_backward(x, b, t)
    ctx.largest = largest
    ctx.mark_non_differentiable(edge, diag)


def _backward_threshold(ctx, grad_b, grad_edge, grad_diag):
    x, b, t = ctx.saved_tensors
    gx, gk, gt = ops.lapsum_threshold_backward(grad_b, x, b, t, ctx.largest)
    return gx, gk, gt, None, None


torch.library.register_autograd("fastlapsum::lapsum_threshold", _backward_threshold, setup_context=_setup_threshold)


def _setup_topk(ctx, inputs, output):
    x = inputs[0]
    ctx.x_shape = x.shape
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])


def _backward_topk(ctx, grad_values, grad_indices):
    (indices,) = ctx.saved_tensors
    valid = indices >= 0
    grad = grad_values.new_zeros(ctx.x_shape)
    return grad.scatter_add(1, indices.clamp(min=0), torch.where(valid, grad_values, 0)), None, None, None, None


torch.library.register_autograd("fastlapsum::topk", _backward_topk, setup_context=_setup_topk)


# On CUDA every op is a native kernel (csrc/cuda/): soft_topk_forward fuses the
# threshold and the mask for short rows and takes its hard mask from the exact selector.
