"""The custom ops of csrc/ops.cpp: torch.library.opcheck (schema, autograd registration,
fake kernel, AOT dispatch) on realistic inputs, their values against the float64
reference, and torch.compile(fullgraph=True) of the public functions (DESIGN §3)."""
import logging

import pytest
import torch

import fastlapsum
from fastlapsum import reference

from conftest import BUDGET_TOL, budget_error

ops = torch.ops.fastlapsum
F64 = torch.float64
OP_NAMES = ["lapsum_threshold", "soft_topk_forward", "lapsum_mask", "soft_topk_backward",
            "lapsum_threshold_backward", "topk"]
MODE_SOFT, MODE_LOG, MODE_HARD = 0, 1, 2


def opcheck(op, args):
    # raises OpCheckError on any failure; the result must also say SUCCESS everywhere
    res = torch.library.opcheck(op, args)
    assert all(v == "SUCCESS" for v in res.values()), res


def sample(device, dtype, rows=5, n=64, requires_grad=False, seed=0, integral_k=False):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(rows, n, generator=g, dtype=F64)).to(dtype).to(device)
    k = torch.tensor([1.0, 2.5, 17.0, 40.25, 63.0], dtype=F64)[:rows]
    if integral_k:
        k = k.round()
    t = torch.tensor([0.1, 0.5, 1.0, 2.0, 5.0], dtype=F64)[:rows]
    k, t = k.to(device), t.to(device)
    if requires_grad:
        x, k, t = x.requires_grad_(), k.requires_grad_(), t.requires_grad_()
    return x, k, t


def signed(x, largest):
    return x.double() if largest else -x.double()


def test_all_ops_registered():
    for name in OP_NAMES:
        op = getattr(ops, name)
        assert isinstance(op, torch._ops.OpOverloadPacket)
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastlapsum::{name}", "CPU"), name
    for name in ("lapsum_threshold", "soft_topk_forward", "topk"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastlapsum::{name}", "Autograd"), name
    for name in OP_NAMES:  # vmap batching rules (fastlapsum/_autograd.py), not the slow fallback
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastlapsum::{name}", "FuncTorchBatched"), name


# ---- opcheck, op by op ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("largest", [True, False])
def test_lapsum_threshold(device, dtype, largest):
    x, k, t = sample(device, dtype, requires_grad=True)
    opcheck(ops.lapsum_threshold, (x, k, t, largest, 0))
    b, edge, diag = ops.lapsum_threshold(x, k, t, largest, 0)
    # forcing a solver must not change the answer (beyond the b error the fp32
    # exponentials of the GPU passes admit for fp32 scores: <= ~2.4e-7 t)
    b_tol = 1e-12 if dtype == F64 or device == "cpu" else 1e-6
    for method in (1, 2):
        bm, em, _ = ops.lapsum_threshold(x, k, t, largest, method)
        torch.testing.assert_close(bm, b, rtol=b_tol, atol=b_tol * t.max().item())
        torch.testing.assert_close(em, edge)
    assert b.dtype == F64 and b.shape == (5,) and diag.shape == (5, 3) and diag.dtype == torch.int64
    rb, redge = reference.lapsum_threshold_reference(signed(x.detach(), largest), k.detach(), t.detach())
    rb = rb if largest else -rb
    torch.testing.assert_close(b, rb, rtol=1e-6 if dtype == torch.float32 else 1e-10, atol=1e-6)
    torch.testing.assert_close(edge, redge)
    if dtype == torch.float64:
        opcheck(ops.lapsum_threshold, (x.detach(), k.detach(), t.detach(), largest, 2))  # no grad


@pytest.mark.parametrize("dtype,largest", [(torch.float32, True), (torch.float64, False)])
@pytest.mark.parametrize("mode", [MODE_SOFT, MODE_LOG, MODE_HARD])
def test_soft_topk_forward(device, dtype, mode, largest):
    x, k, t = sample(device, dtype, requires_grad=True, integral_k=mode == MODE_HARD)
    opcheck(ops.soft_topk_forward, (x, k, t, largest, mode, mode))  # method = mode: all three solvers
    p, b, diag = ops.soft_topk_forward(x, k, t, largest, 0, mode)
    assert p.dtype == dtype and p.shape == x.shape
    ref = reference.soft_topk_reference(x.detach(), k.detach(), t.detach(), largest=largest, log=mode == MODE_LOG)
    if mode == MODE_HARD:
        order = x.detach().double().argsort(1, descending=largest)
        expect = torch.zeros_like(p).scatter_(1, order, (torch.arange(64, device=device) < k.detach()[:, None]).to(dtype))
        torch.testing.assert_close(p, expect, rtol=0, atol=0)
    else:
        tol = 1e-5 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(p.double(), ref, rtol=tol, atol=tol)
        if mode == MODE_SOFT:
            assert budget_error(p, k.detach()) <= BUDGET_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("log_mode", [False, True])
@pytest.mark.parametrize("largest", [True, False])
def test_lapsum_mask(device, dtype, log_mode, largest):
    x, k, t = sample(device, dtype)
    b, edge, _ = ops.lapsum_threshold(x, k, t, largest, 0)
    opcheck(ops.lapsum_mask, (x, b, t, edge, largest, log_mode))
    p = ops.lapsum_mask(x, b, t, edge, largest, log_mode)
    bs = b if largest else -b
    ref = reference.lapsum_mask_reference(signed(x, largest), bs, t, edge, log=log_mode)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(p.double(), ref, rtol=tol, atol=tol)
    # +inf threshold with its edge mass (a budget used up by +inf scores)
    xi = x.clone()
    xi[:, :3] = float("inf") if largest else float("-inf")
    kk = torch.full_like(k, 1.5)
    b2, edge2, _ = ops.lapsum_threshold(xi, kk, t, largest, 0)
    if dtype == torch.float32:
        opcheck(ops.lapsum_mask, (xi, b2, t, edge2, largest, log_mode))
    p2 = ops.lapsum_mask(xi, b2, t, edge2, largest, log_mode)
    p2 = p2.double().exp() if log_mode else p2.double()
    torch.testing.assert_close(p2[:, :3], torch.full((5, 3), 0.5, dtype=F64, device=device))
    assert bool((p2[:, 3:] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("log_mode", [False, True])
@pytest.mark.parametrize("largest", [True, False])
def test_soft_topk_backward(device, dtype, log_mode, largest):
    x, k, t = sample(device, dtype, seed=1)
    b, edge, _ = ops.lapsum_threshold(x, k, t, largest, 0)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=F64).to(dtype).to(device)
    opcheck(ops.soft_topk_backward, (g, x, b, t, largest, log_mode))
    gx, gk, gt = ops.soft_topk_backward(g, x, b, t, largest, log_mode)
    assert gx.dtype == dtype and gx.shape == x.shape and gk.shape == (5,) and gt.shape == (5,)
    s, bs = signed(x, largest), (b if largest else -b)
    gp = g.double()
    if log_mode:  # d log p = dp / p
        gp = gp / reference.lapsum_mask_reference(s, bs, t, edge)
    rx, rk, rt = reference.lapsum_vjp_reference(s, bs, t, gp)
    rx = rx if largest else -rx
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(gx.double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(gk.double(), rk, rtol=tol, atol=tol)
    torch.testing.assert_close(gt.double(), rt, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("largest", [True, False])
def test_lapsum_threshold_backward(device, dtype, largest):
    x, k, t = sample(device, dtype, seed=3)
    b, _, _ = ops.lapsum_threshold(x, k, t, largest, 0)
    gb = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.25], dtype=F64, device=device)
    opcheck(ops.lapsum_threshold_backward, (gb, x, b, t, largest))
    gx, gk, gt = ops.lapsum_threshold_backward(gb, x, b, t, largest)
    # implicit function theorem on Psi(b) = k: db/dx_i = w_i/W, db/dk = -1/W (largest side),
    # db/dt = -sum w_i (x_i - b) / (t W)
    s, bs = signed(x, largest), (b if largest else -b)
    d = s - bs[:, None]
    w = torch.exp(-d.abs() / t[:, None]) / (2 * t[:, None])
    W = w.sum(1)
    sg = 1.0 if largest else -1.0  # b = -b_s on the smallest side
    rx = gb[:, None] * w / W[:, None]  # d(sg*b_s)/dx = sg * sg * (w/W)
    rk = sg * gb * (-1.0 / W)
    rt = sg * gb * (-(w * d).sum(1) / (t * W))
    tol = 1e-4 if dtype == torch.float32 else 1e-9
    torch.testing.assert_close(gx.double(), rx, rtol=tol, atol=tol)
    torch.testing.assert_close(gk, rk, rtol=tol, atol=tol)
    torch.testing.assert_close(gt, rt, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("sorted_", [False, True])
def test_topk(device, dtype, with_lengths, sorted_):
    x, _, _ = sample(device, dtype, requires_grad=True, seed=4)
    lengths = torch.tensor([0, 3, 64, 8, 33], device=device) if with_lengths else None
    opcheck(ops.topk, (x, 8, not sorted_, sorted_, lengths))
    if dtype == torch.float32 and sorted_:
        opcheck(ops.topk, (x, 0, True, sorted_, lengths))
        opcheck(ops.topk, (x, 64, False, sorted_, lengths))
    v, i = ops.topk(x, 8, True, True, lengths)
    L = [0, 3, 64, 8, 33] if with_lengths else [64] * 5
    for r in range(5):
        m = min(L[r], 8)
        ref = torch.topk(x.detach()[r, :L[r]], m)
        torch.testing.assert_close(v[r, :m], ref.values, rtol=0, atol=0)
        assert i[r, m:].tolist() == [-1] * (8 - m)


def test_topk_backward(device):
    """topk's backward op (both autograd Functions call it): the gradient of the selected
    values scattered to their indices, padding (-1) contributing nothing; differentiable."""
    g = torch.randn(3, 4, dtype=F64, device=device, requires_grad=True)
    idx = torch.tensor([[5, 0, 2, -1], [1, 1 + 6, 3, 4], [-1, -1, -1, -1]], device=device)
    opcheck(ops._topk_backward, (g, idx, 9))
    got = ops._topk_backward(g, idx, 9)
    want = torch.zeros(3, 9, dtype=F64, device=device)
    for r in range(3):
        for j in range(4):
            if idx[r, j] >= 0:
                want[r, idx[r, j]] += g[r, j].detach()
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    torch.autograd.gradcheck(lambda a: ops._topk_backward(a, idx, 9), (g,))


def test_gradcheck_through_ops(device):
    """The registered autograd formulas against finite differences (fp64)."""
    x, k, t = sample(device, F64, rows=3, n=12, requires_grad=True, seed=5)
    k = torch.tensor([1.0, 2.5, 6.0], dtype=F64, device=device, requires_grad=True)
    for largest in (True, False):
        torch.autograd.gradcheck(lambda a, b, c: ops.lapsum_threshold(a, b, c, largest, 0)[0], (x, k, t))
        for mode in (MODE_SOFT, MODE_LOG):
            torch.autograd.gradcheck(lambda a, b, c: ops.soft_topk_forward(a, b, c, largest, 0, mode)[0], (x, k, t))


@pytest.mark.parametrize("name", ["lapsum_threshold", "soft_topk_forward", "lapsum_mask", "soft_topk_backward",
                                  "lapsum_threshold_backward", "topk"])
def test_opcheck_non_contiguous_rows(device, name):
    """x [rows, n] as a transposed view (what soft_topk(..., dim=0) passes down): the fake
    kernel must describe the real output's strides, or torch.compile fails at run time."""
    x = torch.randn(64, 5, generator=torch.Generator().manual_seed(6), dtype=F64).to(device).t()
    assert not x.is_contiguous()
    _, k, t = sample(device, F64)
    b, edge, _ = ops.lapsum_threshold(x, k, t, True, 0)
    g = torch.randn(64, 5, dtype=F64, device=device).t()
    args = {
        "lapsum_threshold": (x, k, t, True, 0),
        "soft_topk_forward": (x, k, t, True, 0, MODE_SOFT),
        "lapsum_mask": (x, b, t, edge, True, False),
        "soft_topk_backward": (g, x, b, t, True, False),
        "lapsum_threshold_backward": (torch.ones_like(b), x, b, t, True),
        "topk": (x, 5, True, True, None),
    }[name]
    opcheck(getattr(ops, name), args)
    # and the values do not depend on the layout
    xc = x.contiguous()
    args_c = tuple(xc if a is x else (a.contiguous() if isinstance(a, torch.Tensor) else a) for a in args)
    out, out_c = getattr(ops, name)(*args), getattr(ops, name)(*args_c)
    out = out if isinstance(out, tuple) else (out,)
    out_c = out_c if isinstance(out_c, tuple) else (out_c,)
    for a, c in zip(out, out_c):
        torch.testing.assert_close(a, c, rtol=0, atol=0, equal_nan=True)


# ---- torch.compile ---------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _quiet_compile_trace():
    """pytest's log capture hooks torch's always-DEBUG structured-trace logger and makes
    every compile several times slower; nothing here reads that trace."""
    trace = logging.getLogger("torch.__trace")
    old = trace.disabled
    trace.disabled = True
    yield
    trace.disabled = old


def _forward_all(x, kt, tt, lengths):
    F = fastlapsum
    return (
        F.soft_topk(x, 3, 0.5),  # Python numbers
        F.soft_topk(x, kt, tt),  # per-row tensors
        F.soft_topk(x, 4, tt, largest=False, method="sort"),
        F.soft_topk(x, 3, 0.5, hard=True, largest=False),
        F.log_soft_topk(x, 2.5, 1.0),
        F.lapsum_threshold(x, kt, tt),
        *F.topk(x, 4, lengths=lengths, sorted=True),
        *F.topk(x, 5, largest=False),
    )


def _loss(x, kt, tt):
    p = fastlapsum.soft_topk(x, kt, tt)
    w = torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype, device=x.device)
    lp = fastlapsum.log_soft_topk(x, 2.0, tt, largest=False)
    h = fastlapsum.soft_topk(x, 3, tt, hard=True)
    v, _ = fastlapsum.topk(x, 4)
    return ((p * w).sum() + (lp.exp() * w).sum() + fastlapsum.lapsum_threshold(x, kt, tt).sum()
            + (h * w).sum() + v.sum())


def test_compile(device):
    """torch.compile(fullgraph=True) of every public function equals eager, forward and
    backward (through soft_topk, log_soft_topk, lapsum_threshold, hard mode and topk).
    On the CPU this broad graph uses the aot_eager backend (the same tracing, fake
    kernels and AOT autograd; inductor's C++ build costs minutes on 2 cores): inductor
    itself runs in test_compile_inductor and test_compile_dim0."""
    backend = "aot_eager" if device == "cpu" else "inductor"
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 40, generator=g).to(device)
    kt = torch.linspace(1, 30, 6, dtype=F64, device=device)
    tt = torch.linspace(0.1, 2, 6, device=device)
    lengths = torch.tensor([0, 2, 4, 5, 39, 40], device=device)
    torch._dynamo.reset()
    fwd = torch.compile(_forward_all, fullgraph=True, backend=backend)
    loss = torch.compile(_loss, fullgraph=True, backend=backend)
    for x_, kt_, l_ in ((x, kt, lengths), (torch.randn(6, 40, generator=g).to(device), kt.flip(0), lengths.flip(0))):
        got, want = fwd(x_, kt_, tt, l_), _forward_all(x_, kt_, tt, l_)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert budget_error(got[1], kt_) <= BUDGET_TOL[torch.float32]
        xg, kg, tg = (a.detach().double().requires_grad_() for a in (x_, kt_, tt))
        got = torch.autograd.grad(loss(xg, kg, tg), (xg, kg, tg))
        want = torch.autograd.grad(_loss(xg, kg, tg), (xg, kg, tg))
        for a, b in zip(got, want):
            assert bool((a != 0).any())
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _small(x, kt, tt):
    p = fastlapsum.soft_topk(x, kt, tt)
    v, _ = fastlapsum.topk(x, 3, lengths=torch.tensor([3, 1, 0, 7], device=x.device))
    b = fastlapsum.lapsum_threshold(x, kt, tt)
    return p, v, b, (p * x).sum() + v.clamp(min=-10).sum() + b.sum()


def test_compile_inductor(device):
    """Inductor (the default backend) on a small graph, forward and backward."""
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(10), dtype=F64).to(device)
    kt = torch.tensor([1.0, 2.5, 3.0, 6.0], dtype=F64, device=device)
    tt = torch.tensor([0.5, 1.0, 0.2, 2.0], dtype=F64, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(_small, fullgraph=True)
    xs = [a.clone().requires_grad_() for a in (x, kt, tt)]
    xe = [a.clone().requires_grad_() for a in (x, kt, tt)]
    got, want = compiled(*xs), _small(*xe)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(got[-1], xs), torch.autograd.grad(want[-1], xe)):
        assert bool((a != 0).any())
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_compile_dim0(device):
    """soft_topk / log_soft_topk along dim 0 of a 2-d tensor compile and match eager."""
    def f(x):
        return fastlapsum.soft_topk(x, 2.0, 0.5, dim=0), fastlapsum.log_soft_topk(x, 1.5, dim=0)

    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(9)).to(device)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x)
    for a, b in zip(got, f(x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
