"""Every autograd mode on the public functions: forward AD (forward_ad, torch.func.jvp),
double backward (gradgradcheck, HVPs), torch.func.grad / jacrev / jacfwd / hessian and
torch.vmap (a batching rule, no fallback), in float64 against finite differences and
against each other; first-order backward still runs the fused kernels."""
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import fastlapsum as fl

F64 = torch.float64


def scores(device, rows=3, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, n, generator=g, dtype=F64).to(device)


def per_row(device, *values):
    return torch.tensor(values, dtype=F64, device=device)


SOFT_OPS = {
    "soft": lambda x, k, t, largest: fl.soft_topk(x, k, t, largest=largest),
    "log": lambda x, k, t, largest: fl.log_soft_topk(x, k, t, largest=largest),
    "threshold": lambda x, k, t, largest: fl.lapsum_threshold(x, k, t, largest=largest),
}


# ---- double backward ---------------------------------------------------------------

@pytest.mark.parametrize("op", sorted(SOFT_OPS))
@pytest.mark.parametrize("largest", [True, False])
def test_gradgradcheck_numbers(device, op, largest):
    x = scores(device).requires_grad_()
    for k, t in ((1.0, 0.3), (2.5, 1.0), (5.5, 4.0)):
        fn = lambda a: SOFT_OPS[op](a, k, t, largest)  # noqa: E731
        assert gradcheck(fn, (x,))
        assert gradgradcheck(fn, (x,))


@pytest.mark.parametrize("op", sorted(SOFT_OPS))
def test_gradgradcheck_per_row_k_and_t(device, op):
    """k and temperature as per-row tensors requiring grad: all mixed second derivatives."""
    x = scores(device, seed=1).requires_grad_()
    k = per_row(device, 1.0, 3.5, 6.0).requires_grad_()
    t = per_row(device, 0.4, 1.0, 2.5).requires_grad_()
    for largest in (True, False):
        fn = lambda a, b, c: SOFT_OPS[op](a, b, c, largest)  # noqa: E731
        assert gradcheck(fn, (x, k, t))
        assert gradgradcheck(fn, (x, k, t))


def test_issue_hvp_is_not_zero(device):
    """The issue's example: the HVP of sum(p^2) equals finite differences of the gradient."""
    x = scores(device, rows=2, n=9, seed=2).requires_grad_()
    loss = lambda a: fl.soft_topk(a, 5.0, 0.7).pow(2).sum()  # noqa: E731
    (g,) = torch.autograd.grad(loss(x), x, create_graph=True)
    v = torch.linspace(-1, 1, x.numel(), dtype=F64, device=device).reshape(x.shape)
    (hvp,) = torch.autograd.grad((g * v).sum(), x)
    eps = 1e-6
    gp = torch.autograd.grad(loss(x + eps * v), x)[0]
    gm = torch.autograd.grad(loss(x - eps * v), x)[0]
    fd = (gp - gm) / (2 * eps)
    assert fd.abs().max() > 0.05
    torch.testing.assert_close(hvp, fd, rtol=1e-6, atol=1e-8)


def test_hard_second_order_is_the_soft_masks(device):
    """hard=True is straight-through: its first and second derivatives are the soft mask's."""
    x = scores(device, seed=3).requires_grad_()
    w = torch.linspace(-1, 2, x.shape[-1], dtype=F64, device=device)
    out = []
    for hard in (False, True):
        (g,) = torch.autograd.grad((fl.soft_topk(x, 3, 0.5, hard=hard) * w).sum(), x, create_graph=True)
        (h,) = torch.autograd.grad(g.pow(2).sum(), x)
        out.append((g, h))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=0)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=0, atol=0)


def test_create_graph_gradient_equals_fused_kernel(device):
    """The differentiable VJP (create_graph) agrees with the fused kernels' to rounding,
    including +-inf scores, a NaN row and a tiny temperature."""
    x = scores(device, rows=4, n=8, seed=4)
    x[1, 2], x[1, 5], x[2, 0] = float("inf"), float("-inf"), float("nan")
    k = per_row(device, 2.0, 1.5, 3.0, 4.0)
    t = per_row(device, 0.5, 1.0, 0.7, 1e-3)
    up = torch.linspace(-1, 1, 32, dtype=F64, device=device).reshape(4, 8)
    for op in SOFT_OPS.values():
        for largest in (True, False):
            xs, ks, ts = (v.clone().requires_grad_() for v in (x, k, t))
            out = op(xs, ks, ts, largest)
            u = up if out.dim() == 2 else up[:, 0]
            fused = torch.autograd.grad(out, (xs, ks, ts), u, retain_graph=True)
            graph = torch.autograd.grad(out, (xs, ks, ts), u, create_graph=True)
            for a, b in zip(graph, fused):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_first_order_backward_runs_fused_kernels(device):
    x = scores(device).requires_grad_()
    p, b = fl.soft_topk(x, 2.0, 0.5), fl.lapsum_threshold(x, 2.0, 0.5)
    with _OpLog() as log:
        (p.sum() + b.sum()).backward()
    assert "fastlapsum.soft_topk_backward.default" in log.names
    assert "fastlapsum.lapsum_threshold_backward.default" in log.names
    assert "aten.exp.default" not in log.names  # no PyTorch-op VJP


# ---- forward mode ----------------------------------------------------------------

def _directional(fn, primals, tangents, eps=1e-6):
    plus = fn(*(p + eps * t for p, t in zip(primals, tangents)))
    minus = fn(*(p - eps * t for p, t in zip(primals, tangents)))
    return (plus - minus) / (2 * eps)


@pytest.mark.parametrize("op", sorted(SOFT_OPS) + ["hard"])
@pytest.mark.parametrize("largest", [True, False])
def test_jvp_matches_finite_differences_and_jacrev(device, op, largest):
    x = scores(device, seed=5)
    k, t = per_row(device, 1.0, 2.5, 4.0), per_row(device, 0.3, 1.0, 2.0)
    dx = scores(device, seed=6)
    dk, dt = per_row(device, 0.3, -0.2, 0.5), per_row(device, 0.05, -0.1, 0.2)
    if op == "hard":
        fn = lambda a, b, c: fl.soft_topk(a, b.round(), c, largest=largest, hard=True)  # noqa: E731
        soft = lambda a, b, c: fl.soft_topk(a, b.round(), c, largest=largest)  # noqa: E731
        dk = torch.zeros_like(dk)
    else:
        fn = soft = lambda a, b, c: SOFT_OPS[op](a, b, c, largest)  # noqa: E731
    out, tangent = jvp(fn, (x, k, t), (dx, dk, dt))
    torch.testing.assert_close(out, fn(x, k, t), rtol=0, atol=0)
    fd = _directional(soft, (x, k, t), (dx, dk, dt))  # hard: the soft mask's derivative
    assert fd.abs().max() > 1e-3
    torch.testing.assert_close(tangent, fd, rtol=1e-6, atol=1e-8)
    jac = jacrev(soft, argnums=(0, 1, 2))(x, k, t)
    lead = tangent.dim()
    want = sum((j * d.reshape((1,) * lead + d.shape)).flatten(lead).sum(-1) for j, d in zip(jac, (dx, dk, dt)))
    torch.testing.assert_close(tangent, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", sorted(SOFT_OPS) + ["hard", "topk"])
def test_forward_ad_dual_tangent_is_set(device, op):
    """forward_ad.make_dual: a tangent (not None), equal to torch.func.jvp's."""
    fns = {**{n: (lambda f: lambda a: f(a, 2.0, 0.8, True))(f) for n, f in SOFT_OPS.items()},
           "hard": lambda a: fl.soft_topk(a, 2, 0.8, hard=True),
           "topk": lambda a: fl.topk(a, 3, sorted=True)[0]}
    x, dx = scores(device, seed=7), scores(device, seed=8)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(fns[op](fwAD.make_dual(x, dx))).tangent
    assert tangent is not None and bool((tangent != 0).any())
    torch.testing.assert_close(tangent, jvp(fns[op], (x,), (dx,))[1], rtol=0, atol=0)


@pytest.mark.parametrize("largest", [True, False])
def test_topk_jvp_is_gather(device, largest):
    x, dx = scores(device, rows=4, n=9, seed=9), scores(device, rows=4, n=9, seed=10)
    lengths = torch.tensor([9, 4, 2, 0], device=device)
    values, tangent = jvp(lambda a: fl.topk(a, 3, largest=largest, sorted=True, lengths=lengths)[0], (x,), (dx,))
    idx = fl.topk(x, 3, largest=largest, sorted=True, lengths=lengths)[1]
    want = torch.where(idx >= 0, dx.gather(-1, idx.clamp(min=0)), 0.0)
    torch.testing.assert_close(tangent, want, rtol=0, atol=0)
    assert bool((tangent[3] == 0).all())  # empty row: no valid index, no tangent


def test_forward_over_forward_is_refused(device):
    x = scores(device, rows=1, n=6)[0]
    with pytest.raises(RuntimeError, match="forward-over-forward"):
        jacfwd(jacfwd(lambda a: fl.soft_topk(a, 2.0, 0.5)))(x)


# ---- torch.func ------------------------------------------------------------------

@pytest.mark.parametrize("op", sorted(SOFT_OPS))
def test_func_grad_and_hessians(device, op):
    x = scores(device, rows=1, n=7, seed=11)[0]
    w = torch.linspace(-1, 1, 7, dtype=F64, device=device)
    loss = lambda a: (SOFT_OPS[op](a, 2.5, 0.6, True) * (w if op != "threshold" else 1)).pow(2).sum()  # noqa: E731
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(xr), xr)
    torch.testing.assert_close(grad(loss)(x), want, rtol=1e-12, atol=1e-14)
    h_rr = jacrev(jacrev(loss))(x)
    assert h_rr.abs().max() > 1e-3
    torch.testing.assert_close(hessian(loss)(x), h_rr, rtol=1e-9, atol=1e-12)  # forward over reverse
    torch.testing.assert_close(jacrev(jacfwd(loss))(x), h_rr, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(h_rr, h_rr.T, rtol=1e-9, atol=1e-12)


def test_func_vjp_and_per_row_jacobians(device):
    x, k, t = scores(device, seed=12), per_row(device, 1.5, 2.0, 3.0), per_row(device, 0.5, 0.9, 1.3)
    out, pull = vjp(lambda a, b, c: fl.soft_topk(a, b, c), x, k, t)
    up = scores(device, seed=13)
    xs, ks, ts = (v.clone().requires_grad_() for v in (x, k, t))
    want = torch.autograd.grad(fl.soft_topk(xs, ks, ts), (xs, ks, ts), up)
    for a, b in zip(pull(up), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    jk = jacrev(lambda b: fl.lapsum_threshold(x, b, t))(k)
    jt = jacfwd(lambda c: fl.lapsum_threshold(x, k, c))(t)
    assert torch.count_nonzero(jk - torch.diag(torch.diagonal(jk))) == 0  # rows are independent
    fd_k = _directional(lambda b: fl.lapsum_threshold(x, b, t), (k,), (torch.ones_like(k),))
    fd_t = _directional(lambda c: fl.lapsum_threshold(x, k, c), (t,), (torch.ones_like(t),))
    torch.testing.assert_close(torch.diagonal(jk), fd_k, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(torch.diagonal(jt), fd_t, rtol=1e-6, atol=1e-8)


def _no_fallback():
    """vmap must use the batching rules: its slow-fallback warning becomes an error."""
    w = warnings.catch_warnings()
    w.__enter__()
    warnings.filterwarnings("error", message=".*fallback.*")
    warnings.filterwarnings("error", message=".*performance drop.*")
    return w


@pytest.mark.parametrize("largest", [True, False])
def test_vmap_matches_loop(device, largest):
    X = torch.randn(4, 3, 9, generator=torch.Generator().manual_seed(14), dtype=F64).to(device)
    K = torch.tensor([1.0, 2.5, 4.0, 6.0], dtype=F64, device=device)
    T = torch.tensor([0.3, 0.6, 1.0, 2.0], dtype=F64, device=device)
    fns = [
        lambda a, b, c: fl.soft_topk(a, b, c, largest=largest),
        lambda a, b, c: fl.log_soft_topk(a, b, c, largest=largest),
        lambda a, b, c: fl.lapsum_threshold(a, b, c, largest=largest),
        lambda a, b, c: fl.soft_topk(a, b.round(), c, largest=largest, hard=True),
        lambda a, b, c: fl.topk(a, 3, largest=largest, sorted=True)[0],
        lambda a, b, c: fl.soft_topk(a, b / 3, c, dim=0, largest=largest),  # the vmapped dim is not the rows'
    ]
    w = _no_fallback()
    try:
        for fn in fns:
            got = vmap(fn)(X, K, T)
            want = torch.stack([fn(X[i], K[i], T[i]) for i in range(4)])
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        got = vmap(fns[0], in_dims=(1, None, None))(X, K[0], T[0])  # batch along a middle dim, shared k, t
        torch.testing.assert_close(got, fns[0](X.movedim(1, 0), K[0], T[0]), rtol=0, atol=0)
        jac = jacrev(lambda a: fl.soft_topk(a, 2.0, 0.5))(X[0])  # vmap over the backward kernel
        assert jac.shape == (3, 9, 3, 9)
    finally:
        w.__exit__(None, None, None)


def test_vmap_of_grad(device):
    X = torch.randn(5, 8, generator=torch.Generator().manual_seed(15), dtype=F64).to(device)
    loss = lambda a: fl.soft_topk(a, 3.0, 0.5).pow(2).sum()  # noqa: E731
    got = vmap(grad(loss))(X)
    Xr = X.clone().requires_grad_()
    (want,) = torch.autograd.grad(sum(loss(Xr[i]) for i in range(5)), Xr)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_direct_op_under_func_transform_is_refused(device):
    x = scores(device)
    k, t = per_row(device, 1.0, 2.0, 3.0), per_row(device, 1.0, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="public functions"):
        grad(lambda a: torch.ops.fastlapsum.soft_topk_forward(a, k, t, True, 0, 0)[0].sum())(x)


def test_saturated_row_stays_finite(device):
    """Every weight underflows (score gaps / t = 1e4): the Python formulas take ratios of
    rescaled weights, so tangents and second derivatives are finite, not 0/0, and the soft
    mask's k-tangent is the limit: the two scores around b share dk."""
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]], dtype=F64, device=device)
    k, t = per_row(device, 2.0), per_row(device, 1e-4)
    one = torch.ones_like(k)
    _, tangent = jvp(lambda c: fl.soft_topk(x, c, t), (k,), (one,))
    torch.testing.assert_close(tangent, torch.tensor([[0.0, 0.5, 0.5, 0.0]], dtype=F64, device=device))
    dx = torch.tensor([[0.1, -0.2, 0.3, 0.4]], dtype=F64, device=device)
    for name, op in SOFT_OPS.items():
        _, tangent = jvp(lambda a, b, c: op(a, b, c, True), (x, k, t), (dx, one, one))
        # db/dk = -1/W overflows float64 here, so the threshold's and the log mask's
        # k-tangents are exactly +-inf (docs/GRADIENTS.md); never NaN
        ok = torch.isfinite(tangent) if name == "soft" else ~torch.isnan(tangent)
        assert bool(ok.all())
        xs = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(op(xs, k, t, True).sum(), xs, create_graph=True)
        (h,) = torch.autograd.grad((g * dx).sum(), xs, allow_unused=True)
        assert bool(torch.isfinite(g).all()) and (h is None or bool(torch.isfinite(h).all()))


@pytest.mark.parametrize("op", sorted(SOFT_OPS) + ["hard"])
@pytest.mark.parametrize("largest", [True, False])
def test_jvp_in_x_only_matches_jacrev(device, op, largest):
    """A tangent in x alone takes the fused kernels (the soft mask's x-Jacobian is
    symmetric; the threshold's gradient is its VJP of 1): against jacrev and jacfwd's
    batched jvp."""
    x, dx = scores(device, seed=16), scores(device, seed=17)
    if op == "hard":
        fn = lambda a: fl.soft_topk(a, 2, 0.6, largest=largest, hard=True)  # noqa: E731
        soft = lambda a: fl.soft_topk(a, 2, 0.6, largest=largest)  # noqa: E731
    else:
        fn = soft = lambda a: SOFT_OPS[op](a, 2.5, 0.6, largest)  # noqa: E731
    _, tangent = jvp(fn, (x,), (dx,))
    jac = jacrev(soft)(x)
    lead = tangent.dim()
    want = (jac * dx).flatten(lead).sum(-1)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(tangent, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(jacfwd(soft)(x), jac, rtol=1e-10, atol=1e-12)
    with _OpLog() as log:
        jvp(fn, (x,), (dx,))
    fused = "soft_topk_backward" if op in ("soft", "hard") else ("lapsum_threshold_backward" if op == "threshold" else None)
    assert fused is None or f"fastlapsum.{fused}.default" in log.names
