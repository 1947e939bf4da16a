"""Autograd for the custom ops in every mode; none of them silently zero.

The ops' Autograd kernels are C++ (csrc/autograd/autograd_kernels.cpp): first-order
reverse mode is a C++ autograd::Function whose backward calls the fused VJP op, so an
eager forward + backward runs no Python autograd code. Everything else is here: each
differentiable op (lapsum_threshold, soft_topk_forward, topk) has a
torch.autograd.Function (setup_context form: backward, jvp, generated vmap rule) for
forward mode (forward_ad, torch.func.jvp / jacfwd), torch.func.grad / vjp / jacrev /
hessian and torch.vmap; the public functions call it under a torch.func transform, the
C++ kernel calls it (through _<op>_python) for inputs with a forward-mode tangent, and
its differentiable VJPs (through _soft_topk_vjp_graph / _lapsum_threshold_vjp_graph)
when a backward must itself be differentiable (create_graph). Every op has a vmap
batching rule: a vmapped batch folds into the ops' rows. Refused with an error:
forward-over-forward (jacfwd(jacfwd)) of the soft ops, and torch.func transforms of
torch.ops.fastlapsum.* called directly.

First-order backward calls the fused kernels (ops.soft_topk_backward,
ops.lapsum_threshold_backward). Only when the backward must itself be differentiable
(create_graph, torch.func.grad, hessians) is the VJP built from PyTorch ops; there the
threshold enters as `_Attached(x, k, t, b)`, whose forward returns the saved b and
whose backward / jvp are the threshold's, so derivatives of every order follow without
re-solving. hard=True (straight-through) has the soft mask's tangent, as its VJP is
the soft mask's.

Math (DESIGN §1.3), per row, on the largest side s = sign * x, b_s = sign * b:
u_i = (s_i - b_s)/t, f_i = e^{-|u_i|}/2 (the Laplace density at u_i), sum_i F(u_i) = k.
  db_s = (sum f_i ds_i - dt/t sum f_i d_i - t dk) / sum f_i,   d_i = s_i - b_s
  dp_i = f_i (ds_i - db_s - d_i dt/t) / t,    d log p_i = dp_i / p_i.
Ratios of sums use the rescaled weights e_i = e^{-(|u_i| - min|u|)} (the largest is 1),
so they stay finite when every f_i underflows; absolute terms (t dk / sum f for the
threshold and the log mask) are taken as zero when sum f underflows to 0, as in the
kernels.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from ._ops import MODE_LOG

ops = torch.ops.fastlapsum
F64 = torch.float64
_lib = torch.library.Library("fastlapsum", "IMPL")


# ---- per-row terms and closed forms --------------------------------------------------

class _Terms(NamedTuple):
    sign: float
    d: Tensor  # s - b_s (0 where the term is void)
    u: Tensor  # d / t
    e: Tensor  # e^{-(|u| - min|u|)}: rescaled weights (the largest is 1)
    share: Tensor  # e / sum e = w / W, 0 in rows without a weight
    f: Tensor  # e^{-|u|}/2 = t * w
    W: Tensor  # sum f
    ok: Tensor  # finite score and finite threshold
    nan: Tensor  # [rows, 1]: the row's threshold is NaN


def _terms(x: Tensor, b: Tensor, t: Tensor, largest: bool) -> _Terms:
    """Per-element terms in float64; infinite scores and infinite thresholds are void
    (no weight), and the where's keep inf out of every differentiated branch."""
    sign = 1.0 if largest else -1.0
    s = x.to(F64) * sign
    bs = (b * sign)[:, None]
    fin_b = torch.isfinite(bs)
    ok = torch.isfinite(s) & fin_b
    zero = s.new_zeros(())
    d = torch.where(ok, s - torch.where(fin_b, bs, zero), zero)
    u = d / t[:, None]
    a = u.abs()
    m = torch.where(ok, a, math.inf).amin(1, keepdim=True).detach()  # cancels in every ratio
    m = torch.where(torch.isfinite(m), m, zero)
    e = torch.where(ok, torch.exp(m - a), zero)
    f = torch.where(ok, 0.5 * torch.exp(-a), zero)
    E = e.sum(1, keepdim=True)
    share = e / torch.where(E > 0, E, 1.0)
    return _Terms(sign, d, u, e, share, f, f.sum(1), ok, torch.isnan(bs))


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """num / den for an absolute den (sum f), 0 where it underflowed to 0: the kernels'
    "no gradient" rule."""
    pos = den > 0
    return torch.where(pos, num / torch.where(pos, den, 1.0), 0.0)


def _nan_rows(v: Tensor, nan: Tensor) -> Tensor:
    return torch.where(nan if v.dim() == 2 else nan[:, 0], math.nan, v)


def _as64(v: Optional[Tensor], like: Tensor) -> Tensor:
    return like.new_zeros(()) if v is None else v.to(F64)


def _tangent_parts(r: _Terms, t: Tensor, dx, dk, dt) -> tuple[Tensor, Tensor, Tensor]:
    """The pieces of t du_i = ds_i - db_s - d_i dt/t: core_i (the dx, dt part, through
    ratios of rescaled weights), the threshold's dx, dt part mean_e(ds) - dt/t mean_e(d),
    and dk (its part -t dk / sum f is absolute)."""
    ds = _as64(dx, r.d) * r.sign
    dt, dk = _as64(dt, r.d), _as64(dk, r.d)
    mean_ds = (r.share * ds).sum(1)
    mean_d = (r.share * r.d).sum(1)
    core = ds - mean_ds[:, None] - (dt / t)[:, None] * (r.d - mean_d[:, None])
    return core, mean_ds - dt / t * mean_d, dk


def _log_factor(r: _Terms) -> Tensor:
    """f / p: 1 below the threshold, e^{-u}/(2 - e^{-u}) above; 0 for void terms."""
    ea = 2 * r.f
    return torch.where(r.ok, torch.where(r.u <= 0, 1.0, ea / (2 - ea)), 0.0)


def soft_jvp(x, k, t, b, largest: bool, log_mode: bool, dx, dk, dt) -> Tensor:
    """Tangent of the soft (or log) mask; also hard=True's (straight-through).
    dp_i = f_i core_i / t + dk f_i / sum f, the last as dk * share_i (a ratio)."""
    r = _terms(x, b, t, largest)
    core, _, dk = _tangent_parts(r, t, dx, dk, dt)
    if log_mode:
        q = _log_factor(r)
        out = q * (core / t[:, None] + _ratio(dk.expand_as(t), r.W)[:, None])
    else:
        out = r.f * core / t[:, None] + dk.expand_as(t)[:, None] * r.share
    return _nan_rows(torch.where(r.ok, out, 0.0), r.nan).to(x.dtype)


def threshold_jvp(x, k, t, b, largest: bool, dx, dk, dt) -> Tensor:
    """db = sign (mean_e(ds) - dt/t mean_e(d) - t dk / sum f)."""
    r = _terms(x, b, t, largest)
    _, shift, dk = _tangent_parts(r, t, dx, dk, dt)
    return _nan_rows(r.sign * (shift - _ratio(t * dk, r.W)), r.nan)


def soft_vjp_graph(g, x, k, t, b, largest: bool, log_mode: bool) -> tuple:
    """ops.soft_topk_backward written with differentiable ops (b attached): for
    create_graph. -> (grad_x, grad_k, grad_t)."""
    r = _terms(x, _attach(x, k, t, b, largest), t, largest)
    g = g.to(F64)
    tc = t[:, None]
    if log_mode:
        G = g * _log_factor(r)
        SG = G.sum(1)
        ratio = _ratio(SG, r.W)  # absolute: <g/p, f> / sum f
        gs = (G - r.share * SG[:, None]) / tc
        gt = -((G * r.d).sum(1) - SG * (r.share * r.d).sum(1)) / (t * t)
    else:
        G = g * r.f
        ratio = (g * r.share).sum(1)  # <g, w> / W
        gs = (G - r.f * ratio[:, None]) / tc
        gt = -((G * r.d).sum(1) - ratio * (r.f * r.d).sum(1)) / (t * t)
    gx = _nan_rows(r.sign * gs, r.nan).to(x.dtype)
    return gx, _nan_rows(ratio, r.nan), _nan_rows(gt, r.nan)


def threshold_vjp_graph(gb, x, k, t, b, largest: bool) -> tuple:
    """ops.lapsum_threshold_backward with differentiable ops (b attached)."""
    r = _terms(x, _attach(x, k, t, b, largest), t, largest)
    gb = gb.to(F64)
    gx = gb[:, None] * r.share  # sign * db_s/ds_i * sign
    gk = -r.sign * gb * _ratio(t, r.W)
    gt = -r.sign * gb * (r.share * r.d).sum(1) / t
    return _nan_rows(gx, r.nan).to(x.dtype), _nan_rows(gk, r.nan), _nan_rows(gt, r.nan)


def _func_levels(kind: str) -> int:
    """How many torch.func transforms of this kind ("Grad", "Jvp", ...) are active."""
    if not torch._C._are_functorch_transforms_active():
        return 0
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    want = getattr(torch._C._functorch.TransformType, kind)
    return sum(i.key() == want for i in retrieve_all_functorch_interpreters())


def _graph_wanted(*tensors) -> bool:
    """The backward (or tangent) must itself be differentiable: create_graph with a
    differentiable input, or a torch.func grad level (whose tracking requires_grad does
    not show at the levels below it)."""
    if not torch.is_grad_enabled():
        return False
    return any(v is not None and v.requires_grad for v in tensors) or _func_levels("Grad") > 0


def threshold_vjp(gb, x, k, t, b, largest: bool) -> tuple:
    if _graph_wanted(gb, x, k, t):
        return threshold_vjp_graph(gb, x, k, t, b, largest)
    return ops.lapsum_threshold_backward.default(gb, x, b, t, largest)


# ---- the Functions -------------------------------------------------------------------

def _single_forward_level() -> None:
    """Refuses forward-over-forward: PyTorch runs a Function's jvp with forward AD off,
    so an outer jvp level would silently see a constant tangent."""
    if _func_levels("Jvp") > 1:
        raise RuntimeError(
            "fastlapsum: forward-over-forward AD (jvp of jvp, jacfwd(jacfwd(...))) is not "
            "supported; use torch.func.hessian (jacfwd(jacrev(...))) or jacrev(jacrev(...))")


def _below_autograd(op, *args) -> tuple:
    """The forward's op call, past the Autograd key (under a torch.func transform, a vmap
    layer of a generated vmap rule, through the dispatcher to that layer)."""
    if torch._C._are_functorch_transforms_active():
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def _save(ctx, x: Tensor, k: Tensor, t: Tensor, b: Tensor, largest: bool) -> None:
    ctx.set_materialize_grads(False)  # None, not zeros, for inputs without a tangent
    ctx.largest = largest
    ctx.save_for_backward(x, k, t, b)
    ctx.save_for_forward(x, k, t, b)


def _threshold_backward(ctx, gb: Optional[Tensor]) -> tuple:
    if gb is None:
        return (None,) * 5
    x, k, t, b = ctx.saved_tensors
    gx, gk, gt = threshold_vjp(gb, x, k, t, b, ctx.largest)
    _, need_k, need_t = ctx.needs_input_grad[:3]
    return gx, gk if need_k else None, gt if need_t else None, None, None


def _threshold_tangent(ctx, dx, dk, dt) -> Tensor:
    _single_forward_level()
    x, k, t, b = ctx.saved_tensors
    if not _graph_wanted(x, k, t, dx, dk, dt):
        # the fused VJP of grad_b = 1 is the gradient of b: one kernel and a dot product
        gx, gk, gt = ops.lapsum_threshold_backward(torch.ones_like(b), x, b, t, ctx.largest)
        db = gx.new_zeros(b.shape, dtype=F64) if dx is None else (gx.to(F64) * dx.to(F64)).sum(1)
        return db + gk * _as64(dk, b) + gt * _as64(dt, b)
    return threshold_jvp(x, k, t, _attach(x, k, t, b, ctx.largest), ctx.largest, dx, dk, dt)


class _Attached(torch.autograd.Function):
    """b = threshold(x, k, t) already solved: returns b, differentiable as the threshold."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, k, t, b, largest) -> Tensor:
        return b.clone()

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        _save(ctx, *inputs)

    @staticmethod
    def backward(ctx, gb) -> tuple:
        return _threshold_backward(ctx, gb)

    @staticmethod
    def jvp(ctx, dx, dk, dt, db, _) -> Tensor:
        return _threshold_tangent(ctx, dx, dk, dt)


class _Threshold(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, k, t, largest, method) -> tuple[Tensor, Tensor, Tensor]:
        return _below_autograd(ops.lapsum_threshold.default, x, k, t, largest, method)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, k, t, largest, _ = inputs
        b, edge, diag = output
        _save(ctx, x, k, t, b, largest)
        ctx.mark_non_differentiable(edge, diag)

    @staticmethod
    def backward(ctx, gb, g_edge, g_diag) -> tuple:
        return _threshold_backward(ctx, gb)

    @staticmethod
    def jvp(ctx, dx, dk, dt, _l, _m) -> tuple:
        return _threshold_tangent(ctx, dx, dk, dt), None, None


class _SoftTopK(torch.autograd.Function):
    """soft_topk_forward: the mask p is differentiable (hard mode: the soft mask's
    derivatives, straight-through); b and diag are not."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, k, t, largest, method, mode, k_max=-1) -> tuple[Tensor, Tensor, Tensor]:
        # k_max=-1 may come as a missing argument: the dispatcher leaves out trailing
        # arguments equal to their default when it calls a Python kernel.
        return _below_autograd(ops.soft_topk_forward.default, x, k, t, largest, method, mode, k_max)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        x, k, t, largest, _, mode = inputs[:6]
        _, b, diag = output
        ctx.log_mode = mode == MODE_LOG
        _save(ctx, x, k, t, b, largest)
        ctx.mark_non_differentiable(b, diag)

    @staticmethod
    def backward(ctx, gp, g_b, g_diag) -> tuple:
        n_inputs = len(ctx.needs_input_grad)  # 6 or 7: k_max may be left out (forward)
        if gp is None:
            return (None,) * n_inputs
        x, k, t, b = ctx.saved_tensors
        if _graph_wanted(gp, x, k, t):
            gx, gk, gt = soft_vjp_graph(gp, x, k, t, b, ctx.largest, ctx.log_mode)
        else:
            gx, gk, gt = ops.soft_topk_backward.default(gp, x, b, t, ctx.largest, ctx.log_mode)
        _, need_k, need_t = ctx.needs_input_grad[:3]
        return (gx, gk if need_k else None, gt if need_t else None) + (None,) * (n_inputs - 3)

    @staticmethod
    def jvp(ctx, dx, dk, dt, *_) -> tuple:
        _single_forward_level()
        x, k, t, b = ctx.saved_tensors
        if not ctx.log_mode and dx is not None and dk is None and dt is None and not _graph_wanted(x, dx):
            # the soft mask's Jacobian in x, diag(w) - w w^T / W, is symmetric: JVP = fused VJP
            return ops.soft_topk_backward(dx, x, b, t, ctx.largest, False)[0], None, None
        b = _attach(x, k, t, b, ctx.largest)  # reverse mode through the tangent (jacrev(jacfwd))
        return soft_jvp(x, k, t, b, ctx.largest, ctx.log_mode, dx, dk, dt), None, None


class _TopK(torch.autograd.Function):
    """topk: values are a gather of x (differentiable), indices are not."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, k, largest, sorted, lengths) -> tuple[Tensor, Tensor]:
        return _below_autograd(ops.topk.default, x, k, largest, sorted, lengths)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.x_shape = inputs[0].shape
        ctx.save_for_backward(output[1])
        ctx.save_for_forward(output[1])
        ctx.mark_non_differentiable(output[1])

    @staticmethod
    def backward(ctx, g_values, g_indices) -> tuple:
        (idx,) = ctx.saved_tensors
        return ops._topk_backward(g_values, idx, ctx.x_shape[1]), None, None, None, None

    @staticmethod
    def jvp(ctx, dx, *_) -> tuple:
        (idx,) = ctx.saved_tensors
        if dx is None:
            return None, None
        return torch.where(idx >= 0, dx.gather(1, idx.clamp(min=0)), 0), None


def _eager_variant(fn: type) -> type:
    """fn with a ctx-taking forward that runs setup_context itself: the same Function
    outside torch.func transforms (which need the setup_context form), without the
    per-call signature binding that Function.apply does for that form."""

    def forward(ctx, *args) -> tuple:
        out = fn.forward(*args)
        fn.setup_context(ctx, args, out)
        return out

    return type(f"{fn.__name__}Eager", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(fn.backward), "jvp": staticmethod(fn.jvp)})


for _fn in (_Attached, _Threshold, _SoftTopK, _TopK):
    _fn.eager = _eager_variant(_fn)


def _apply(fn: type, *args) -> Tensor | tuple:
    return (fn if torch._C._are_functorch_transforms_active() else fn.eager).apply(*args)


def _attach(x: Tensor, k: Tensor, t: Tensor, b: Tensor, largest: bool) -> Tensor:
    return _apply(_Attached, x, k, t, b, largest)


# ---- registration --------------------------------------------------------------------
# The ops' Autograd kernels are C++ (csrc/autograd/autograd_kernels.cpp): a C++
# autograd::Function for first-order reverse mode. It calls back into Python through these
# ops for what it cannot do itself.

_lib.impl("_soft_topk_vjp_graph", soft_vjp_graph, "CompositeImplicitAutograd")
_lib.impl("_lapsum_threshold_vjp_graph", threshold_vjp_graph, "CompositeImplicitAutograd")


def _python_autograd(fn: type) -> Callable:
    """An op through its Python Function: for inputs with a forward-mode tangent."""
    return lambda *args: fn.eager.apply(*args)


for _name, _fn in (("lapsum_threshold", _Threshold), ("soft_topk_forward", _SoftTopK), ("topk", _TopK)):
    _lib.impl(f"_{_name}_python", _python_autograd(_fn), "CompositeImplicitAutograd")


def _vmap_rows(op_name: str, n_out: int) -> None:
    """Batching rule of a row-wise op: each tensor argument's vmapped dim goes first,
    is broadcast to the batch and folded into the rows; outputs unfold again."""
    op = getattr(ops, op_name).default

    def rule(info, in_dims, *args) -> tuple:
        B = info.batch_size
        rows = None
        folded = []
        for a, d in zip(args, in_dims):
            if isinstance(a, Tensor):
                a = a.movedim(d, 0) if d is not None else a.unsqueeze(0)
                a = a.expand(B, *a.shape[1:])
                rows = a.shape[1] if rows is None else rows
                a = a.reshape(B * a.shape[1], *a.shape[2:])
            folded.append(a)
        out = op(*folded)
        out = out if isinstance(out, tuple) else (out,)
        unfolded = tuple(o.reshape(B, rows, *o.shape[1:]) for o in out)
        return (unfolded if n_out > 1 else unfolded[0]), ((0,) * n_out if n_out > 1 else 0)

    torch.library.register_vmap(f"fastlapsum::{op_name}", rule, lib=_lib)


for _name, _n in (("lapsum_threshold", 3), ("soft_topk_forward", 3), ("lapsum_mask", 1),
                  ("soft_topk_backward", 3), ("lapsum_threshold_backward", 3), ("topk", 2),
                  ("_topk_backward", 1)):
    _vmap_rows(_name, _n)


# ---- the public functions' entry points -----------------------------------------------
# Under a torch.func transform, the Python Function (setup_context form: functorch runs its
# backward, jvp and generated vmap rule); else the op, whose C++ Autograd kernel takes the
# cheapest route that serves the call: the kernel alone, the C++ Function, or the Python
# Function for inputs with a forward-mode tangent. Under torch.compile, the op (dynamo does
# not trace a Function with a custom jvp; AOTAutograd traces the op's Autograd kernel).

_func_active = torch._C._are_functorch_transforms_active
_is_compiling = torch.compiler.is_compiling
_SOFT_OP, _THRESHOLD_OP, _TOPK_OP = ops.soft_topk_forward.default, ops.lapsum_threshold.default, ops.topk.default


def _run(fn: type, op, *args) -> tuple:
    if _func_active() and not _is_compiling():
        return fn.apply(*args)
    return op(*args)


def soft_topk_forward(x: Tensor, k: Tensor, t: Tensor, largest: bool, method: int, mode: int,
                      k_max: int = -1) -> tuple:
    return _run(_SoftTopK, _SOFT_OP, x, k, t, largest, method, mode, k_max)


def lapsum_threshold(x: Tensor, k: Tensor, t: Tensor, largest: bool, method: int) -> tuple:
    return _run(_Threshold, _THRESHOLD_OP, x, k, t, largest, method)


def topk(x: Tensor, k: int, largest: bool, sorted: bool, lengths: Optional[Tensor]) -> tuple:
    return _run(_TopK, _TOPK_OP, x, k, largest, sorted, lengths)
