"""Gradients of the LapSum operator (DESIGN §1.3, §1.4): finite differences, the closed
form of fastlapsum.reference, autograd through an independent pure-torch implicit
formulation, straight-through mode, degenerate rows and the nn.Module."""
import math

import pytest
import torch

import fastlapsum as fl
from fastlapsum import reference

from conftest import gen

F64 = torch.float64
INF, NAN = math.inf, math.nan


def separated_scores(rows, n, seed, spacing=0.7, device="cpu"):
    """Shuffled, well-separated fp64 scores (finite differences stay on one branch)."""
    g = gen(seed)
    base = torch.arange(n, dtype=F64) * spacing
    out = []
    for _ in range(rows):
        jitter = torch.rand(n, generator=g, dtype=F64) * 0.2 * spacing
        out.append((base + jitter)[torch.randperm(n, generator=g)] - n * spacing / 2)
    return torch.stack(out).to(device)


def assert_grads_close(got, want, rtol, atol_rel):
    """Each pair of (x, k, t) gradients close: rtol, plus atol relative to the largest."""
    for a, b, name in zip(got, want, ("x", "k", "t")):
        atol = atol_rel * b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"grad {name}: {m}")


def grads(fn, inputs, g):
    """autograd grads of <g, fn(*inputs)> w.r.t. inputs that require grad."""
    out = fn(*inputs)
    req = [v for v in inputs if isinstance(v, torch.Tensor) and v.requires_grad]
    return torch.autograd.grad(out, req, g)


# ---------------------------------------------------------------------------------
# gradcheck (float64 finite differences)


@pytest.mark.parametrize("method", ["sort", "bracket"])
@pytest.mark.parametrize("largest", [True, False])
def test_gradcheck_soft_topk(device, largest, method):
    x = separated_scores(2, 9, seed=1, device=device).requires_grad_(True)
    k = torch.tensor([2.7, 5.0], dtype=F64, device=device, requires_grad=True)
    t = torch.tensor([0.6, 1.3], dtype=F64, device=device, requires_grad=True)
    f = lambda x, k, t: fl.soft_topk(x, k, t, largest=largest, method=method)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, k, t), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("dim", [0, 1])
def test_gradcheck_soft_topk_dim_and_scalar_tensor_k(device, dim):
    x = separated_scores(3, 7, seed=2, device=device)
    x = (x if dim == 1 else x.t().contiguous()).requires_grad_(True)
    k = torch.tensor(3.3, dtype=F64, device=device, requires_grad=True)  # one k for all rows
    t = torch.tensor(0.8, dtype=F64, device=device, requires_grad=True)
    f = lambda x, k, t: fl.soft_topk(x, k, t, dim=dim)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, k, t), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("largest", [True, False])
def test_gradcheck_log_soft_topk(device, largest):
    x = separated_scores(2, 8, seed=3, spacing=0.5, device=device).requires_grad_(True)
    k = torch.tensor([1.6, 6.2], dtype=F64, device=device, requires_grad=True)
    t = torch.tensor([0.9, 0.4], dtype=F64, device=device, requires_grad=True)
    f = lambda x, k, t: fl.log_soft_topk(x, k, t, largest=largest)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, k, t), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("method", ["sort", "bracket"])
@pytest.mark.parametrize("largest", [True, False])
def test_gradcheck_lapsum_threshold(device, largest, method):
    x = separated_scores(3, 10, seed=4, device=device).requires_grad_(True)
    k = torch.tensor([0.4, 4.5, 9.2], dtype=F64, device=device, requires_grad=True)
    t = torch.tensor([0.5, 1.0, 2.0], dtype=F64, device=device, requires_grad=True)
    f = lambda x, k, t: fl.lapsum_threshold(x, k, t, largest=largest, method=method)  # noqa: E731
    assert torch.autograd.gradcheck(f, (x, k, t), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_with_infinite_scores(device):
    """+inf / -inf scores take no gradient; the finite ones see the remaining budget."""
    x = torch.tensor([[0.3, INF, -1.1, 2.0, -INF, 0.9]], dtype=F64, device=device, requires_grad=True)
    k = torch.tensor([2.4], dtype=F64, device=device, requires_grad=True)
    t = torch.tensor([0.7], dtype=F64, device=device, requires_grad=True)
    p = fl.soft_topk(x, k, t)
    gx, gk, gt = torch.autograd.grad(p, (x, k, t), torch.linspace(-1, 1, 6, dtype=F64, device=device)[None])
    assert gx[0, 1] == 0 and gx[0, 4] == 0 and torch.isfinite(gx).all()
    fin = [0, 2, 3, 5]
    xs = x.detach()[:, fin].clone().requires_grad_(True)
    ks = (k.detach() - 1).requires_grad_(True)
    ts = t.detach().clone().requires_grad_(True)
    ps = fl.soft_topk(xs, ks, ts)
    g2 = torch.autograd.grad(ps, (xs, ks, ts), torch.linspace(-1, 1, 6, dtype=F64, device=device)[None, fin])
    torch.testing.assert_close(gx[:, fin], g2[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gk, g2[1], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gt, g2[2], rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------
# against the closed form and an independent autograd formulation


def laplace_cdf(u):
    return torch.where(u <= 0, 0.5 * torch.exp(u.clamp(max=0)), 1 - 0.5 * torch.exp(-u.clamp(min=0)))


def implicit_torch_threshold(x, k, t, largest=True):
    """b(x, k, t) as a differentiable pure-torch expression: the oracle's root b0
    (detached) plus one Newton step b0 - (Psi(b0) - k) / Psi'(b0) with Psi' detached.
    At the root its derivatives are exactly the implicit-function ones."""
    sign = 1.0 if largest else -1.0
    s = sign * x
    kk = k.broadcast_to(x.shape[:-1])
    tt = t.broadcast_to(x.shape[:-1])
    b0, _ = reference.lapsum_threshold_reference(s.detach().reshape(-1, x.shape[-1]).cpu(),
                                                 kk.detach().reshape(-1).cpu(), tt.detach().reshape(-1).cpu())
    b0 = b0.reshape(x.shape[:-1]).to(x.device)
    psi = laplace_cdf((s - b0[..., None]) / tt[..., None]).sum(-1)
    slope = (0.5 * torch.exp(-((s.detach() - b0[..., None]) / tt.detach()[..., None]).abs())
             / tt.detach()[..., None]).sum(-1)  # W = -dPsi/db
    b = b0 + (psi - kk) / slope
    return sign * b


def implicit_torch_soft_topk(x, k, t, largest=True):
    b = implicit_torch_threshold(x, k, t, largest)
    sign = 1.0 if largest else -1.0
    return laplace_cdf(sign * (x - b[..., None]) / t.broadcast_to(x.shape[:-1])[..., None])


def _random_problem(device, dtype=F64, rows=3, n=1000, seed=5):
    g = gen(seed)
    x = (torch.randn(rows, n, generator=g, dtype=F64) * torch.tensor([[1.0], [3.0], [0.2]], dtype=F64)).to(dtype)
    k = torch.tensor([17.3, 500.0, 990.5], dtype=F64)
    t = torch.tensor([0.5, 1.0, 0.05], dtype=F64)
    up = torch.randn(rows, n, generator=g, dtype=F64)
    return x.to(device), k.to(device), t.to(device), up.to(device)


@pytest.mark.parametrize("method", ["sort", "bracket"])
@pytest.mark.parametrize("largest", [True, False])
def test_vjp_matches_closed_form_reference(device, largest, method):
    x, k, t, up = _random_problem(device)
    xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
    gx, gk, gt = grads(lambda x, k, t: fl.soft_topk(x, k, t, largest=largest, method=method), (xr, kr, tr), up)
    sign = 1.0 if largest else -1.0
    s = (sign * x).cpu()
    b, _ = reference.lapsum_threshold_reference(s, k.cpu(), t.cpu())
    rs, rk, rt = reference.lapsum_vjp_reference(s, b, t.cpu(), up.cpu())
    torch.testing.assert_close(gx.cpu(), sign * rs, rtol=1e-9, atol=1e-12 * rs.abs().max().item())
    torch.testing.assert_close(gk.cpu(), rk, rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(gt.cpu(), rt, rtol=1e-9, atol=1e-13)
    # the k-gradient is a weighted mean of the upstream gradient, and sum_i dL/dx_i = 0
    assert (gx.sum(-1).abs() <= 1e-10 * gx.abs().sum(-1)).all()


@pytest.mark.parametrize("largest", [True, False])
def test_vjp_matches_autograd_of_implicit_torch(device, largest):
    x, k, t, up = _random_problem(device, seed=6)
    xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
    got = grads(lambda x, k, t: fl.soft_topk(x, k, t, largest=largest), (xr, kr, tr), up)
    xe, ke, te = (v.clone().requires_grad_(True) for v in (x, k, t))
    want = grads(lambda x, k, t: implicit_torch_soft_topk(x, k, t, largest), (xe, ke, te), up)
    assert_grads_close(got, want, rtol=1e-8, atol_rel=1e-11)


@pytest.mark.parametrize("largest", [True, False])
def test_threshold_vjp_matches_autograd_of_implicit_torch(device, largest):
    x, k, t, _ = _random_problem(device, seed=7)
    gb = torch.tensor([0.7, -1.3, 2.0], dtype=F64, device=device)
    xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
    got = grads(lambda x, k, t: fl.lapsum_threshold(x, k, t, largest=largest), (xr, kr, tr), gb)
    xe, ke, te = (v.clone().requires_grad_(True) for v in (x, k, t))
    want = grads(lambda x, k, t: implicit_torch_threshold(x, k, t, largest), (xe, ke, te), gb)
    assert_grads_close(got, want, rtol=1e-8, atol_rel=1e-11)
    # db/dk = -1/W < 0 for largest (a bigger budget lowers the threshold), > 0 otherwise
    gk1 = torch.autograd.grad(fl.lapsum_threshold(x, kr, t, largest=largest).sum(), kr)[0]
    assert ((gk1 < 0) if largest else (gk1 > 0)).all()


def test_log_vjp_matches_reference(device):
    x, k, t, up = _random_problem(device, seed=8)
    xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
    got = grads(lambda x, k, t: fl.log_soft_topk(x, k, t), (xr, kr, tr), up)
    b, edge = reference.lapsum_threshold_reference(x.cpu(), k.cpu(), t.cpu())
    p = reference.lapsum_mask_reference(x.cpu(), b, t.cpu(), edge)
    assert (p > 1e-250).all()  # g / p is representable: the reference applies
    rs, rk, rt = reference.lapsum_vjp_reference(x.cpu(), b, t.cpu(), up.cpu() / p)
    torch.testing.assert_close(got[0].cpu(), rs, rtol=1e-8, atol=1e-12 * rs.abs().max().item())
    torch.testing.assert_close(got[1].cpu(), rk, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(got[2].cpu(), rt, rtol=1e-8, atol=1e-12)
    # and autograd through the implicit formulation of log p
    xe, ke, te = (v.clone().requires_grad_(True) for v in (x, k, t))
    want = grads(lambda x, k, t: torch.log(implicit_torch_soft_topk(x, k, t)), (xe, ke, te), up)
    assert_grads_close(got, want, rtol=1e-8, atol_rel=1e-11)


def log_laplace_cdf(u):
    return torch.where(u <= 0, u + math.log(0.5), torch.log1p(-0.5 * torch.exp(-u.clamp(min=0))))


def test_log_vjp_where_p_underflows(device):
    """Far below the threshold p underflows but log p = (x - b)/t + log 1/2 is finite and
    so is its gradient: d log p_i / dx_i = 1/t - w_i/(W t), d log p_i / dx_j = -w_j/(W t),
    d/dk = 1/(W t), d/dt = -(x_i - b)/t^2 - (db/dt)/t. The upstream gradient of such an
    element must not be dropped with its (underflowed) weight."""
    x = torch.tensor([[5.0, 4.0, 3.5, -1e4, -2e4]], dtype=F64, device=device)
    k = torch.tensor([1.5], dtype=F64, device=device)
    t = torch.tensor([1.0], dtype=F64, device=device)
    g = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]], dtype=F64, device=device)
    xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
    lp = fl.log_soft_topk(xr, kr, tr)
    assert torch.isfinite(lp).all()
    got = torch.autograd.grad(lp, (xr, kr, tr), g)
    assert all(torch.isfinite(v).all() for v in got)
    xe, ke, te = (v.clone().requires_grad_(True) for v in (x, k, t))

    def log_mask(x, k, t):
        b = implicit_torch_threshold(x, k, t)
        return log_laplace_cdf((x - b[..., None]) / t[..., None])

    want = torch.autograd.grad(log_mask(xe, ke, te), (xe, ke, te), g)
    assert want[0][0, 3].item() == pytest.approx(1.0)  # the element's own 1/t term
    assert_grads_close(got, want, rtol=1e-10, atol_rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_vjp_low_precision_inputs(device, dtype):
    """fp32/fp16/bf16 scores: gradients in x's dtype, close to the fp64 closed form at
    the (rounded) inputs, to the precision of the output dtype."""
    x, k, t, up = _random_problem(device, dtype=dtype, seed=9)
    xr = x.clone().requires_grad_(True)
    kr, tr = k.clone().requires_grad_(True), t.clone().requires_grad_(True)
    gx, gk, gt = grads(lambda x, k, t: fl.soft_topk(x, k, t), (xr, kr, tr), up.to(dtype))
    assert gx.dtype == dtype and gk.dtype == F64 and gt.dtype == F64
    s = x.double().cpu()
    b, _ = reference.lapsum_threshold_reference(s, k.cpu(), t.cpu())
    rs, rk, rt = reference.lapsum_vjp_reference(s, b, t.cpu(), up.to(dtype).double().cpu())
    eps = torch.finfo(dtype).eps
    scale = rs.abs().max().item()
    assert (gx.double().cpu() - rs).abs().max().item() <= 8 * eps * scale
    # k/t gradients are fp64 reductions of the weights of the rounded scores: exact fp64
    # weights on the CPU; on CUDA fp32 exponentials (<= 2 ulp each, as a same-precision
    # implementation pays), so about 1e-7 relative there
    # (measured 1.4e-7; grad_k is a weighted mean of g, so its error scales with |g|)
    rtol, atol = (1e-9, 1e-12) if device == "cpu" else (2e-6, 1e-6 * up.abs().max().item())
    torch.testing.assert_close(gk.cpu(), rk, rtol=rtol, atol=atol)
    torch.testing.assert_close(gt.cpu(), rt, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------
# straight-through


def hard_reference(x, k, largest=True):
    """Exact top-k indicator of a 1-d row; among tied scores the smaller index wins."""
    vals = x.tolist()
    order = sorted(range(len(vals)), key=lambda i: ((-vals[i] if largest else vals[i]), i))
    out = torch.zeros(len(vals), dtype=x.dtype)
    out[order[:k]] = 1
    return out


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_hard_forward_exact_k_ones_with_ties(device, dtype, largest):
    g = gen(10)
    x = torch.randint(0, 6, (4, 300), generator=g).to(dtype)  # heavy ties everywhere
    x[3] = 2.0  # one row all tied
    for k in [0, 1, 37, 150, 299, 300]:
        p = fl.soft_topk(x.to(device), k, 0.5, hard=True, largest=largest)
        assert p.dtype == dtype
        assert ((p == 0) | (p == 1)).all()
        assert (p.double().sum(-1) == k).all()
        for r in range(4):
            torch.testing.assert_close(p[r].cpu(), hard_reference(x[r], k, largest), rtol=0, atol=0)


def test_hard_boundary_tie_smaller_index_wins(device):
    x = torch.tensor([3.0, 1.0, 2.0, 2.0, 2.0, 0.0, 2.0], device=device)
    p = fl.soft_topk(x, 3, 1.0, hard=True)
    assert p.tolist() == [1, 0, 1, 1, 0, 0, 0]
    p = fl.soft_topk(x, 3, 1.0, hard=True, largest=False)
    assert p.tolist() == [0, 1, 1, 0, 0, 1, 0]


@pytest.mark.parametrize("largest", [True, False])
def test_hard_backward_equals_soft_backward(device, largest):
    x, k, t, up = _random_problem(device, seed=11)
    k = torch.tensor([17.0, 500.0, 990.0], dtype=F64, device=device)
    outs = []
    for hard in (False, True):
        xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
        outs.append(grads(lambda x, k, t: fl.soft_topk(x, k, t, hard=hard, largest=largest), (xr, kr, tr), up))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert outs[1][0].abs().max() > 0  # a real gradient, not zeros
    # the hard forward really is hard and exact
    p = fl.soft_topk(x, k, t, hard=True, largest=largest)
    assert (p.sum(-1) == k).all() and ((p == 0) | (p == 1)).all()


def test_hard_rejects_fractional_k(device):
    x = torch.randn(10, device=device)
    with pytest.raises(ValueError):
        fl.soft_topk(x, 2.5, 1.0, hard=True)
    k = torch.tensor(2.5, dtype=F64, device=device)
    if device == "cpu":
        with pytest.raises(ValueError):
            fl.soft_topk(x, k, 1.0, hard=True)
    else:  # CUDA tensors are not checked on the host (a sync): the row is NaN instead
        assert fl.soft_topk(x, k, 1.0, hard=True).isnan().all()


# ---------------------------------------------------------------------------------
# degenerate rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_saturated_row_gradients(device, dtype):
    """Every weight e^{-|x - b|/t} underflows (docs/GRADIENTS.md): b = 3.5e4 sits 5e6 t from
    its two nearest scores. The mask's dL/dk is the mean of g over them, its dL/dx and dL/dt
    are exactly 0 (e^{-5e6} small); the log mask keeps its absolute terms (log p = u + log 1/2
    below b) and its dL/dk = sum_{below} g / W overflows to +inf; db/dx is 1/2 at the two
    nearest scores and db/dk = -1/W = -inf."""
    x = torch.stack([torch.arange(6, dtype=F64) * 1e4,
                     torch.linspace(-1, 1, 6, dtype=F64)]).to(dtype).to(device)
    k = torch.tensor([2.0, 2.0], dtype=F64, device=device)
    t = torch.tensor([1e-3, 0.5], dtype=F64, device=device)
    up = torch.tensor([[1.0, -2.0, 3.0, 0.5, 4.0, -1.0]] * 2, dtype=dtype, device=device)

    def run(fn, g):
        xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
        out = fn(xr, kr, tr)
        return out, torch.autograd.grad(out, (xr, kr, tr), g)

    p, (gx, gk, gt) = run(fl.soft_topk, up)
    assert p[0].tolist() == [0, 0, 0, 0, 1, 1]
    assert (gx[0] == 0).all() and gt[0] == 0
    assert gk[0].item() == pytest.approx(2.25, rel=1e-7)  # (g_3 + g_4) / 2
    assert torch.isfinite(gx).all() and torch.isfinite(gk).all() and torch.isfinite(gt).all()
    # the other row of the batch is unaffected
    x1, k1, t1 = (v[1:].clone().requires_grad_(True) for v in (x, k, t))
    g1 = torch.autograd.grad(fl.soft_topk(x1, k1, t1), (x1, k1, t1), up[1:])
    torch.testing.assert_close(gx[1:], g1[0], rtol=0, atol=0)
    assert gx[1].abs().max() > 0

    _, (gx, gk, gt) = run(fl.log_soft_topk, up)
    # below b: g_i/t, less the nearest scores' share of sum_{below} g / t = 2500
    want = torch.tensor([1000.0, -2000.0, 3000.0, 500.0 - 1250.0, -1250.0, 0.0], dtype=F64)
    torch.testing.assert_close(gx[0].double().cpu(), want, rtol=1e-6, atol=1e-9)
    assert gk[0].item() == math.inf
    # -sum_{below} g_i (x_i - b) / t^2, b = 3.5e4 (dbar = 0)
    assert gt[0].item() == pytest.approx(3.25e10, rel=1e-6)

    _, (gx, gk, gt) = run(fl.lapsum_threshold, torch.tensor([1.0, 1.0], dtype=F64, device=device))
    torch.testing.assert_close(gx[0].double().cpu(), torch.tensor([0, 0, 0, 0.5, 0.5, 0], dtype=F64),
                               rtol=1e-6, atol=0)
    assert gk[0].item() == -math.inf and abs(gt[0].item()) < 1e-3


def test_infinite_threshold_rows_have_zero_gradient(device):
    """b = +inf (k <= the number of +inf scores) or -inf (k = n): the finite scores' mask is
    constant; the gradients are 0, not NaN (docs/GRADIENTS.md)."""
    x = torch.tensor([[INF, INF, 0.5, -1.0], [0.2, 1.0, -0.3, 2.0]], dtype=F64, device=device)
    k = torch.tensor([1.0, 4.0], dtype=F64, device=device)
    t = torch.tensor([0.5, 0.5], dtype=F64, device=device)
    up = torch.randn(2, 4, generator=gen(17), dtype=F64).to(device)
    for fn in (fl.soft_topk, fl.log_soft_topk):
        xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
        gx, gk, gt = torch.autograd.grad(fn(xr, kr, tr), (xr, kr, tr), up)
        assert (gx == 0).all() and (gk == 0).all() and (gt == 0).all()


@pytest.mark.parametrize("op", ["soft", "log", "threshold"])
def test_nan_row_gives_nan_gradient_only_there(device, op):
    x = torch.randn(3, 50, generator=gen(12), dtype=F64)
    x[1, 7] = NAN
    x = x.to(device)
    k = torch.tensor([5.5, 5.5, 30.0], dtype=F64, device=device)
    t = torch.tensor([0.5, 0.5, 2.0], dtype=F64, device=device)
    fn = {"soft": fl.soft_topk, "log": fl.log_soft_topk, "threshold": fl.lapsum_threshold}[op]
    up = torch.randn(3, 50, generator=gen(13), dtype=F64).to(device) if op != "threshold" else \
        torch.tensor([1.0, 1.0, -0.5], dtype=F64, device=device)
    xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
    gx, gk, gt = torch.autograd.grad(fn(xr, kr, tr), (xr, kr, tr), up)
    assert gx[1].isnan().all() and gk[1].isnan() and gt[1].isnan()
    keep = [0, 2]
    assert torch.isfinite(gx[keep]).all() and torch.isfinite(gk[keep]).all() and torch.isfinite(gt[keep]).all()
    xs, ks, ts = (v[keep].clone().requires_grad_(True) for v in (x, k, t))
    want = torch.autograd.grad(fn(xs, ks, ts), (xs, ks, ts), up[keep])
    torch.testing.assert_close(gx[keep], want[0], rtol=0, atol=0)
    torch.testing.assert_close(gk[keep], want[1], rtol=0, atol=0)
    torch.testing.assert_close(gt[keep], want[2], rtol=0, atol=0)


# ---------------------------------------------------------------------------------
# nn.Module


@pytest.mark.parametrize("hard", [False, True])
def test_module_equals_functional(device, hard):
    x = torch.randn(4, 64, 3, generator=gen(14), dtype=F64).to(device)
    k_param = torch.nn.Parameter(torch.tensor([[5.0, 9.0, 20.0]] * 4, dtype=F64, device=device))
    t = 0.4
    mod = fl.SoftTopK(k_param, t, dim=1, hard=hard)
    up = torch.randn(4, 64, 3, generator=gen(15), dtype=F64).to(device)

    xa = x.clone().requires_grad_(True)
    pa = mod(xa)
    (pa * up).sum().backward()
    ga_x, ga_k = xa.grad.clone(), k_param.grad.clone()

    k_param.grad = None
    xb = x.clone().requires_grad_(True)
    pb = fl.soft_topk(xb, k_param, t, dim=1, hard=hard)
    (pb * up).sum().backward()
    torch.testing.assert_close(pa, pb, rtol=0, atol=0)
    torch.testing.assert_close(ga_x, xb.grad, rtol=0, atol=0)
    torch.testing.assert_close(ga_k, k_param.grad, rtol=0, atol=0)
    assert ga_k.abs().max() > 0
    torch.testing.assert_close(pa.sum(1), k_param.detach(), rtol=1e-12, atol=1e-12)


def test_module_schedule_and_largest(device):
    x = torch.randn(2, 100, generator=gen(16)).to(device)
    mod = fl.SoftTopK(10, 1.0, largest=False)
    torch.testing.assert_close(mod(x), fl.soft_topk(x, 10, 1.0, largest=False), rtol=0, atol=0)
    mod.k, mod.temperature = 25.5, 0.1  # a schedule changes the attributes between steps
    torch.testing.assert_close(mod(x), fl.soft_topk(x, 25.5, 0.1, largest=False), rtol=0, atol=0)
    assert "k=25.5" in repr(mod)
