"""The C++ autograd kernels (csrc/autograd/autograd_kernels.cpp): first-order reverse mode of
lapsum_threshold, soft_topk_forward and topk is a C++ autograd::Function, so an eager forward +
backward runs no Python autograd code; the modes it cannot serve (forward-mode tangents,
create_graph, torch.func) reach the Python Functions of fastlapsum/_autograd.py and stay right,
called through the public functions or the ops directly."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd import gradcheck, gradgradcheck
from torch.func import grad, hessian, jvp
from torch.profiler import ProfilerActivity, profile

import fastlapsum as fl
from fastlapsum import _autograd as A

ops = torch.ops.fastlapsum
F64 = torch.float64
MODE_SOFT, MODE_LOG, MODE_HARD = 0, 1, 2


def scores(device, rows=3, n=9, seed=0):
    return torch.randn(rows, n, generator=torch.Generator().manual_seed(seed), dtype=F64).to(device)


def per_row(device, *values):
    return torch.tensor(values, dtype=F64, device=device)


def run_logged(fn) -> tuple:
    """fn()'s result and every fastlapsum op the dispatcher ran in it, composite ones included."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, [e.name for e in prof.events() if e.name.startswith("fastlapsum::")]


@pytest.fixture
def python_forwards(monkeypatch):
    """Counts the forwards of the Python autograd.Functions (their eager variants call them)."""
    calls = []
    for fn in (A._Threshold, A._SoftTopK, A._TopK):
        forward = fn.forward
        monkeypatch.setattr(fn, "forward", staticmethod(
            (lambda f, name: lambda *a: calls.append(name) or f(*a))(forward, fn.__name__)))
    return calls


def _soft_case(public, largest, mode):
    return (public,
            lambda x, k, t: ops.soft_topk_forward(x, k, t, largest, 0, mode)[0],
            lambda x, k, t: A._SoftTopK.apply(x, k, t, largest, 0, mode, -1)[0])


# (public function, the op called directly, the Python Function torch.func uses)
CASES = {
    "soft": _soft_case(lambda x, k, t: fl.soft_topk(x, k, t), True, MODE_SOFT),
    "log": _soft_case(lambda x, k, t: fl.log_soft_topk(x, k, t, largest=False), False, MODE_LOG),
    "hard": _soft_case(lambda x, k, t: fl.soft_topk(x, k, t, hard=True), True, MODE_HARD),
    "threshold": (lambda x, k, t: fl.lapsum_threshold(x, k, t),
                  lambda x, k, t: ops.lapsum_threshold(x, k, t, True, 0)[0],
                  lambda x, k, t: A._Threshold.apply(x, k, t, True, 0)[0]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_order_is_the_cpp_function(device, case, python_forwards):
    """Forward + backward in x, k and t: the C++ node, the fused VJP, no Python Function, and
    the Python Function's gradients bit for bit."""
    public, _, python = CASES[case]
    x, k, t = scores(device), per_row(device, 2.0, 3.0, 5.0), per_row(device, 0.4, 1.0, 2.0)
    up = scores(device, seed=1)
    xs, ks, ts = (v.clone().requires_grad_() for v in (x, k, t))
    out = public(xs, ks, ts)
    assert "CppNode<fastlapsum::" in out.grad_fn.name()
    u = up if out.dim() == 2 else up[:, 0]
    got, names = run_logged(lambda: torch.autograd.grad(out, (xs, ks, ts), u))
    assert not python_forwards
    fused = "lapsum_threshold_backward" if case == "threshold" else "soft_topk_backward"
    assert names == [f"fastlapsum::{fused}"], names
    xp, kp, tp = (v.clone().requires_grad_() for v in (x, k, t))
    want = torch.autograd.grad(python(xp, kp, tp), (xp, kp, tp), u)
    assert python_forwards
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_topk_first_order_and_double_backward(device, python_forwards):
    x = scores(device, rows=4, n=9, seed=2).requires_grad_()
    lengths = torch.tensor([9, 4, 2, 0], device=device)
    values, idx = fl.topk(x, 3, sorted=True, lengths=lengths)
    assert "TopKFunction" in values.grad_fn.name() and not idx.requires_grad
    up = scores(device, rows=4, n=3, seed=3)
    (g,) = torch.autograd.grad(values, x, up)
    want = torch.zeros_like(x).scatter_add(1, idx.clamp(min=0), torch.where(idx >= 0, up, 0.0))
    torch.testing.assert_close(g, want, rtol=0, atol=0)
    assert bool((g[3] == 0).all())  # an empty row gets no gradient
    assert not python_forwards
    fn = lambda a: fl.topk(a, 3, sorted=True)[0]  # noqa: E731  (padding values are infinite)
    assert gradcheck(fn, (x,)) and gradgradcheck(fn, (x,))


@pytest.mark.parametrize("case", sorted(CASES))
def test_create_graph_takes_the_differentiable_vjp(device, case):
    """create_graph on the C++ node: the VJP from PyTorch ops (a Python kernel), equal to the
    fused one, and its derivative equal to torch.func.hessian's (the Python path)."""
    public = CASES[case][0]
    x, k, t = scores(device, rows=1, seed=4), per_row(device, 3.0), per_row(device, 0.7)
    w = torch.linspace(-1, 1, x.shape[-1], dtype=F64, device=device)
    loss = lambda a: (public(a, k, t) * (w if case != "threshold" else 1)).pow(2).sum()  # noqa: E731
    xs = x.clone().requires_grad_()
    (g,), names = run_logged(lambda: torch.autograd.grad(loss(xs), xs, create_graph=True))
    graph_op = "_lapsum_threshold_vjp_graph" if case == "threshold" else "_soft_topk_vjp_graph"
    assert f"fastlapsum::{graph_op}" in names and g.requires_grad
    (fused,) = torch.autograd.grad(loss(xs), xs)
    torch.testing.assert_close(g, fused, rtol=1e-12, atol=1e-14)
    v = torch.linspace(0.5, -1, x.numel(), dtype=F64, device=device).reshape(x.shape)
    (hv,) = torch.autograd.grad((g * v).sum(), xs)
    h = hessian(loss)(x).reshape(x.numel(), x.numel())
    assert h.abs().max() > 1e-3
    torch.testing.assert_close(hv.reshape(-1), h @ v.reshape(-1), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_direct_op_call_with_a_tangent(device, case):
    """Forward AD through torch.ops.fastlapsum.* called directly: the Python Function's jvp,
    the public function's tangent."""
    public, direct, _ = CASES[case]
    x, dx = scores(device, seed=5), scores(device, seed=6)
    k, t = per_row(device, 2.0, 3.0, 5.0), per_row(device, 0.4, 1.0, 2.0)
    dk, dt = per_row(device, 0.0, 0.3, -0.2), per_row(device, 0.1, -0.1, 0.05)
    if case == "hard":
        dk = torch.zeros_like(dk)
    with fwAD.dual_level():
        out = direct(fwAD.make_dual(x, dx), fwAD.make_dual(k, dk), fwAD.make_dual(t, dt))
        tangent = fwAD.unpack_dual(out).tangent
    want = jvp(public, (x, k, t), (dx, dk, dt))[1]
    assert tangent is not None and bool((want != 0).any())
    torch.testing.assert_close(tangent, want, rtol=0, atol=0)


def test_direct_topk_with_a_tangent(device):
    x, dx = scores(device, seed=7), scores(device, seed=8)
    with fwAD.dual_level():
        values, idx = ops.topk(fwAD.make_dual(x, dx), 3, True, True, None)
        tangent = fwAD.unpack_dual(values).tangent
    torch.testing.assert_close(tangent, dx.gather(1, idx), rtol=0, atol=0)


def test_direct_ops_under_func_transforms_are_refused(device):
    x, dx = scores(device), scores(device, seed=9)
    k, t = per_row(device, 1.0, 2.0, 3.0), per_row(device, 1.0, 1.0, 1.0)
    for fn in (lambda a: ops.soft_topk_forward(a, k, t, True, 0, 0)[0].sum(),
               lambda a: ops.lapsum_threshold(a, k, t, True, 0)[0].sum(),
               lambda a: ops.topk(a, 2, True, False, None)[0].sum()):
        with pytest.raises(RuntimeError, match="public functions"):
            grad(fn)(x)
        with pytest.raises(RuntimeError, match="public functions"):
            jvp(fn, (x,), (dx,))


def test_graph_bookkeeping(device):
    """Non-differentiable outputs, no node without grad, retain_graph, and the second
    backward through freed buffers refused."""
    x, k, t = scores(device).requires_grad_(), per_row(device, 2.0, 3.0, 5.0), per_row(device, 1.0, 1.0, 1.0)
    p, b, diag = ops.soft_topk_forward(x, k, t, True, 0, MODE_SOFT)
    assert p.requires_grad and not b.requires_grad and not diag.requires_grad
    b2, edge, diag2 = ops.lapsum_threshold(x, k, t, True, 0)
    assert b2.requires_grad and not edge.requires_grad and not diag2.requires_grad
    with torch.no_grad():
        assert fl.soft_topk(x, 2, 1.0).grad_fn is None
    with torch.inference_mode():
        assert not fl.lapsum_threshold(x, 2, 1.0).requires_grad
    loss = fl.soft_topk(x, 2, 0.5).pow(2).sum()
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(loss, x)
    # only b is used: p's gradient is not materialised as zeros, and x still gets b's
    (gb,) = torch.autograd.grad(ops.soft_topk_forward(x, k, t, True, 0, 0)[0][:, :0].sum()
                                + fl.lapsum_threshold(x, k, t).sum(), x)
    (want,) = torch.autograd.grad(fl.lapsum_threshold(x, k, t).sum(), x)
    torch.testing.assert_close(gb, want, rtol=0, atol=0)


def test_compiled_autograd():
    """The C++ Functions are traceable by compiled autograd: its backward equals eager's."""
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    x = scores("cpu", seed=10).requires_grad_()
    k = per_row("cpu", 2.0, 3.0, 5.0).requires_grad_()
    w = torch.linspace(-1, 1, x.shape[-1], dtype=F64)

    def loss():
        return ((fl.soft_topk(x, k, 0.5) * w).sum() + fl.lapsum_threshold(x, k, 0.8).sum()
                + fl.topk(x, 2)[0].sum())

    want = torch.autograd.grad(loss(), (x, k))
    x.grad = k.grad = None
    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss().backward()
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=0)
    torch.testing.assert_close(k.grad, want[1], rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint(device, reentrant):
    """torch.utils.checkpoint (saved-tensor hooks, or a recomputed forward) gives the plain
    gradients."""
    from torch.utils.checkpoint import checkpoint

    x = scores(device, seed=11).requires_grad_()
    k = per_row(device, 2.0, 3.0, 5.0).requires_grad_()
    w = torch.linspace(-1, 1, x.shape[-1], dtype=F64, device=device)
    f = lambda a, b: (fl.soft_topk(a * 1.5, b, 0.7) * w).sum() + fl.lapsum_threshold(a, b, 0.9).sum()  # noqa: E731
    want = torch.autograd.grad(f(x, k), (x, k))
    checkpoint(f, x, k, use_reentrant=reentrant).backward()  # reentrant: no autograd.grad
    for a, b in zip((x.grad, k.grad), want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
