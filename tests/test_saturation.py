"""Gradients at saturation (docs/GRADIENTS.md): rows whose scores sit so many t from the
threshold b that every weight e^{-|s - b|/t} underflows in fp32 or even fp64. The ratios
of the VJPs (d L/dk of the mask, a weighted mean of g; db/dx_i = w_i/W) stay well defined
and are compared against a float64 closed form with log-domain weights, checked itself
against mpmath (when installed) and against fastlapsum.reference where nothing underflows.
On CUDA the same rows are also compared with the CPU."""
import math

import pytest
import torch

import fastlapsum as fl
from fastlapsum import reference
from conftest import gen, requires_cuda

F64 = torch.float64
INF = math.inf
LOW = [torch.float32, torch.float16, torch.bfloat16]


def _times_exp(x, y):
    """x e^y elementwise without overflowing e^y alone (x = 0 gives 0; may be +-inf)."""
    return torch.where(x == 0, torch.zeros_like(x), torch.sign(x) * torch.exp(torch.log(x.abs()) + y))


def vjp_oracle(s, b, t, g, log=False):
    """(grad_s, grad_k, grad_t) of L = <g, p> (or <g, log p>) for scores s [rows, n] (largest
    side) at thresholds b, float64, two-pass: the weights relative to the row's largest
    (wh_i = e^{-(|d_i| - m)/t}, m = min |d|), the distances centred on the nearest score's.
    Also returns the scales of grad_t's and grad_s's terms (the sums of their magnitudes),
    to which the kernels' rounding is relative, and the parts of them from elements whose
    weight is below 2^-120 of the largest (fp32 weights may drop those: docs/GRADIENTS.md)."""
    s, b, t, g = (v.to(F64) for v in (s, b, t, g))
    tc = t[:, None]
    d = s - b[:, None]
    ok = torch.isfinite(d)
    d0 = torch.where(ok, d, torch.zeros_like(d))
    a = torch.where(ok, d0.abs(), torch.full_like(d, INF))
    m, near = a.min(1)
    has = torch.isfinite(m)
    m0 = torch.where(has, m, torch.zeros_like(m))
    wh = torch.where(ok, torch.exp(-(a - m0[:, None]) / tc), torch.zeros_like(d))
    S = wh.sum(1).clamp(min=1e-300)
    dc = d0 - d0.gather(1, near[:, None])  # d - dref
    dev = dc - ((wh * dc).sum(1) / S)[:, None]  # d - dbar
    lm = m0 / t  # e^{-lm}: the largest weight's scale
    if log:
        above, below = ok & (d0 > 0), ok & (d0 <= 0)
        p = 1 - 0.5 * torch.exp(-a.clamp(max=1e300) / tc)
        qa = torch.where(below, g, torch.zeros_like(g))  # d log p/du = 1 below b
        qw = torch.where(above, g / p, torch.zeros_like(g))  # times tw = wh e^{-lm}/2 above
    else:
        qa, qw = torch.zeros_like(g), torch.where(ok, g, torch.zeros_like(g))
    rw = (qw * wh).sum(1) / S
    ra = qa.sum(1) / (S / 2)
    grad_k = rw + _times_exp(ra, lm)
    ta = (qa * dev).sum(1)
    tr = (qw * wh * dev).sum(1) / 2
    grad_t = -(ta + _times_exp(tr, -lm)) / t**2
    small = wh < 2.0**-120
    term_t = (qw.abs() + rw.abs()[:, None]) * wh * dev.abs() / 2
    scale_t = ((qa * dev).abs().sum(1) + _times_exp(term_t.sum(1), -lm)) / t**2
    small_t = _times_exp((term_t * small).sum(1), -lm) / t**2
    c = _times_exp(1 / t, -lm)[:, None]  # e^{-lm}/t
    grad_s = (qa - wh / 2 * ra[:, None]) / tc + c * wh / 2 * (qw - rw[:, None])
    scale_s = (qa.abs() + wh / 2 * ra.abs()[:, None]) / tc + c * wh / 2 * (qw.abs() + rw.abs()[:, None])
    small_s = torch.where(small, wh / 2 * ra.abs()[:, None] / tc + c * wh / 2 * (qw.abs() + rw.abs()[:, None]), 0)
    zero = torch.zeros_like(grad_k)
    grad_s = torch.where(has[:, None] & ok, grad_s, torch.zeros_like(grad_s))
    grad_k, grad_t = torch.where(has, grad_k, zero), torch.where(has, grad_t, zero)
    nan = b.isnan()
    return (torch.where(nan[:, None], math.nan, grad_s), torch.where(nan, math.nan, grad_k),
            torch.where(nan, math.nan, grad_t), scale_t, scale_s, small_t, small_s)


def threshold_oracle(s, b, t, gb):
    """(grad_s, grad_k, grad_t) of L = gb * b_s with b_s the threshold of scores s."""
    s, b, t, gb = (v.to(F64) for v in (s, b, t, gb))
    d = s - b[:, None]
    ok = torch.isfinite(d)
    a = torch.where(ok, d.abs(), torch.full_like(d, INF))
    m = a.min(1).values
    wh = torch.where(ok, torch.exp(-(a - m[:, None]) / t[:, None]), torch.zeros_like(d))
    S = wh.sum(1)
    dbar = (wh * torch.where(ok, d, 0)).sum(1) / S
    term_t = wh * (torch.where(ok, d, 0) - dbar[:, None]).abs()
    scale_t = gb.abs() * (wh * torch.where(ok, d, 0).abs()).sum(1) / S / t
    small = wh < 2.0**-120
    small_t = gb.abs() * (term_t * small).sum(1) / S / t
    grad_s = gb[:, None] * wh / S[:, None]
    return (grad_s, _times_exp(-gb * t / (S / 2), m / t), -gb * dbar / t, scale_t, torch.zeros_like(grad_s),
            small_t, torch.where(small, grad_s.abs(), 0))


def saturated_problem(n, t, spread, seed, dtype=F64):
    """Rows of one length with per-row k in {0.3, 1, 2.5, n/2, n-1, n-0.2, random}, scores
    spread times N(0, 1) around an offset (exact in dtype), tiny or per-row t."""
    g = gen(seed)
    ks = [0.3, 1.0, 2.5, n / 2, n - 1.0, n - 0.2, torch.rand(1, generator=g).item() * n]
    ks = [k for k in ks if 0 < k < n]
    rows = len(ks)
    x = (torch.randn(rows, n, generator=g, dtype=F64) * spread + 3.0).to(dtype)
    k = torch.tensor(ks, dtype=F64)
    tt = torch.as_tensor(t, dtype=F64).broadcast_to((rows,)).clone()
    up = torch.randn(rows, n, generator=g, dtype=F64).to(dtype)
    return x, k, tt, up


# (n, t, spread): t per row where a list; the nearest score sits up to thousands of t from b
PROBLEMS = [(2, 0.01, 1.0), (7, 0.5, 100.0), (100, 0.5, 100.0), (9, 1e-3, 1.0), (64, 0.05, 30.0),
            (5, [1e-4, 0.02, 0.5, 3.0], 10.0), (300, 1e-6, 1.0)]


def _run(op, x, k, t, up, largest, device):
    xr = x.to(device).requires_grad_(True)
    kr, tr = k.to(device).requires_grad_(True), t.to(device).requires_grad_(True)
    fn = {"soft": fl.soft_topk, "log": fl.log_soft_topk, "threshold": fl.lapsum_threshold}[op]
    out = fn(xr, kr, tr, largest=largest)
    return [v.cpu() for v in torch.autograd.grad(out, (xr, kr, tr), up.to(device))]


def _problem(case, dtype):
    n, t, spread = PROBLEMS[case]
    x, k, tt, up = saturated_problem(n, t if not isinstance(t, list) else 1.0, spread, seed=case, dtype=dtype)
    if isinstance(t, list):  # one temperature per row
        tt = torch.tensor([t[i % len(t)] for i in range(len(k))], dtype=F64)
    return x, k, tt, up


def _truth(op, x, k, t, up, largest, b=None):
    """The oracle's VJP at the reference threshold (or at b, of the scores' largest side)."""
    sign = 1.0 if largest else -1.0
    s = sign * x.double()
    if b is None:
        b, _ = reference.lapsum_threshold_reference(s, k, t)
    if op == "threshold":  # b = sign b_s, s = sign x: d b/dx = d b_s/ds
        gs, gk, gt, scale_t, scale_x, small_t, small_x = threshold_oracle(s, b, t, up.double())
        return gs, sign * gk, sign * gt, scale_t, scale_x, up.double().abs(), small_t, small_x
    gs, gk, gt, scale_t, scale_x, small_t, small_x = vjp_oracle(s, b, t, up.double(), log=op == "log")
    return sign * gs, gk, gt, scale_t, scale_x, torch.zeros_like(gt), small_t, small_x


def _assert_k_close(got, want, tol, name):
    """Equal infinities, else |got - want| <= tol (per row)."""
    inf = torch.isinf(want)
    assert (got[inf] == want[inf]).all(), f"{name}: {got[inf]} vs {want[inf]}"
    err = (got[~inf] - want[~inf]).abs()
    assert (err <= tol[~inf]).all(), f"{name}: err {err.max().item():.3g} rows {(err > tol[~inf]).nonzero().flatten().tolist()}"


def _assert_close_to_truth(got, truth, up, db, t, dtype, precise):
    """precise: fp64 weights (CPU, CUDA fp64); else fp32 weights (CUDA fp16/bf16/fp32).
    db: per row, a few ulps of b (the kernels' b and the oracle's may differ by that much):
    they move a weight by db/t relative, and the threshold's d b/dt = -dbar/t by db/t."""
    gs, gk, gt, scale_t, scale_x, shift_t, small_t, small_x = truth
    gmax = up.double().abs().amax(1)
    rel = (1e-9 if precise else 4e-6) + db / t
    _assert_k_close(got[1], gk, rel * (gk.abs().nan_to_num(0, 0, 0) + gmax), "grad_k")
    err_t = (got[2] - gt).abs()
    if not precise:  # fp32 weights may drop the terms of weights below 2^-120 of the largest
        err_t = err_t - small_t
    assert (err_t <= rel * (gt.abs() + scale_t) + shift_t * db / t + 1e-300).all(), \
        f"grad_t: {got[2].tolist()} vs {gt.tolist()}"
    # the exact value rounded to x's dtype may overflow it (w = 1/(2t) is 5e5 at t = 1e-6)
    big = gs.to(dtype).isinf()
    assert (got[0][big] == gs.to(dtype)[big]).all(), "grad_x overflow"
    row = gs.masked_fill(big, 0).abs().amax(1, keepdim=True)
    eps = torch.finfo(dtype).eps
    tol = (8 * eps + rel[:, None]) * (row + scale_x) + torch.finfo(dtype).tiny + (0 if precise else small_x)
    assert ((got[0].double() - gs).abs()[~big] <= tol.expand_as(gs)[~big]).all(), "grad_x"


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("op", ["soft", "log", "threshold"])
@pytest.mark.parametrize("dtype", [F64] + LOW)
@pytest.mark.parametrize("case", range(len(PROBLEMS)))
def test_saturated_rows_match_float64_truth(device, case, dtype, op, largest):
    x, k, t, up = _problem(case, dtype)
    if op == "threshold":
        up = torch.randn(len(k), generator=gen(100 + case), dtype=F64)
    got = _run(op, x, k, t, up, largest, device)
    truth = _truth(op, x, k, t, up, largest)
    assert not got[0].isnan().any() and not got[1].isnan().any() and torch.isfinite(got[2]).all()
    precise = device == "cpu" or dtype == F64
    up_rows = up[:, None] if op == "threshold" else up
    db = 32 * torch.finfo(F64).eps * (x.double().abs().amax(1) + 1)
    _assert_close_to_truth(got, truth, up_rows, db, t, dtype, precise)


@requires_cuda
@pytest.mark.parametrize("op", ["soft", "log", "threshold"])
@pytest.mark.parametrize("dtype", [F64] + LOW)
@pytest.mark.parametrize("case", range(len(PROBLEMS)))
def test_cuda_matches_cpu_at_saturation(case, dtype, op):
    """The same saturated rows on CUDA and on the CPU: equal to the fp32 weights' tolerance
    (fp64 rows: to fp64's), with the oracle's scales for the terms."""
    x, k, t, up = _problem(case, dtype)
    if op == "threshold":
        up = torch.randn(len(k), generator=gen(100 + case), dtype=F64)
    cpu = _run(op, x, k, t, up, True, "cpu")
    cuda = _run(op, x, k, t, up, True, "cuda")
    truth = _truth(op, x, k, t, up, True)
    db = 32 * torch.finfo(F64).eps * (x.double().abs().amax(1) + 1)
    as_truth = (cpu[0].double(), cpu[1], cpu[2]) + tuple(truth[3:])
    up_rows = up[:, None] if op == "threshold" else up
    _assert_close_to_truth(cuda, as_truth, up_rows, db, t, dtype, precise=dtype == F64)


def _mp_vjp(s, b, t, g, op):
    """mpmath VJP from the definitions: p_i = F(u_i), u_i = (s_i - b)/t, b from the implicit
    function sum F = k (db/ds_i = w_i/W, db/dk = -1/W, db/dt = -sum w d/(t W)); with digits
    enough for terms that cancel down to e^{-max |u|} of their size."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 40 + int(max(abs(v - b) for v in s) / t / 2.3)
    s = [mp.mpf(v) for v in s]
    b, t = mp.mpf(b), mp.mpf(t)
    u = [(v - b) / t for v in s]
    f = [mp.e ** (-abs(x)) / 2 for x in u]
    w = [fi / t for fi in f]
    W = sum(w)
    dbdt = -sum(wi * (si - b) for wi, si in zip(w, s)) / (t * W)
    if op == "threshold":
        gb = mp.mpf(g)
        return [float(gb * wi / W) for wi in w], float(-gb / W), float(gb * dbdt)
    F = [mp.e ** x / 2 if x <= 0 else 1 - mp.e ** (-x) / 2 for x in u]
    dphi = [fi / Fi for fi, Fi in zip(f, F)] if op == "log" else f  # d phi(u)/du
    q = [mp.mpf(gi) * di for gi, di in zip(g, dphi)]
    Q = sum(q)
    gs = [(qi - wi / W * Q) / t for qi, wi in zip(q, w)]
    gt = sum(qi * (-(si - b) / t - dbdt) / t for qi, si in zip(q, s))
    return [float(v) for v in gs], float(Q / (t * W)), float(gt)


@pytest.mark.parametrize("op", ["soft", "log", "threshold"])
@pytest.mark.parametrize("case", [0, 1, 3])
def test_oracle_matches_mpmath(case, op):
    """The float64 oracle itself, against exact-enough arithmetic on the definitions (mpmath,
    when installed) on saturated rows."""
    x, k, t, up = _problem(case, F64)
    gb = torch.randn(len(k), generator=gen(100 + case), dtype=F64)
    g = gb if op == "threshold" else up
    b, _ = reference.lapsum_threshold_reference(x, k, t)
    gs, gk, gt, scale_t, scale_x = _truth(op, x, k, t, g, True)[:5]
    for r in range(len(k)):
        ms, mk, mt = _mp_vjp(x[r].tolist(), b[r].item(), t[r].item(), g[r].tolist(), op)
        assert gk[r].item() == pytest.approx(mk, rel=1e-12, abs=1e-300)
        assert abs(gt[r].item() - mt) <= 1e-12 * (abs(mt) + scale_t[r].item())
        torch.testing.assert_close(gs[r], torch.tensor(ms, dtype=F64), rtol=1e-12,
                                   atol=1e-12 * (gs[r].abs().max().item() + scale_x[r].max().item()))


def test_oracle_matches_reference_where_nothing_underflows():
    """Unsaturated rows: the oracle is fastlapsum.reference's closed form (mask; the log
    mask as the mask's VJP of g / p)."""
    g = gen(7)
    x = torch.randn(3, 40, generator=g, dtype=F64)
    k = torch.tensor([3.5, 20.0, 36.2], dtype=F64)
    t = torch.tensor([0.3, 1.0, 2.0], dtype=F64)
    up = torch.randn(3, 40, generator=g, dtype=F64)
    b, edge = reference.lapsum_threshold_reference(x, k, t)
    want = reference.lapsum_vjp_reference(x, b, t, up)
    got = vjp_oracle(x, b, t, up)[:3]
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-13)
    p = reference.lapsum_mask_reference(x, b, t, edge)
    want = reference.lapsum_vjp_reference(x, b, t, up / p)
    got = vjp_oracle(x, b, t, up, log=True)[:3]
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_log_mask_saturated_row(device, dtype):
    """A row of 100 N(0, 1) scores, t = 0.1, k = 1: the nearest score sits 955 t from b, so
    every fp64 weight underflows. d L/dt of <g, log p> is finite (mpmath: -30236.0...) and
    d L/dk = sum_{below} g / W overflows to -inf (docs/GRADIENTS.md)."""
    x = (torch.randn(1, 10, generator=gen(18), dtype=F64) * 100).to(dtype).to(device)
    g = torch.randn(1, 10, generator=gen(1), dtype=F64).to(dtype).to(device)
    k = torch.tensor([1.0], dtype=F64, device=device)
    t = torch.tensor([0.1], dtype=F64, device=device)
    gx, gk, gt = _run("log", x, k, t, g, True, device)
    want = _truth("log", x.cpu(), k.cpu(), t.cpu(), g.cpu(), True)
    assert gk.item() == -math.inf and want[1].item() == -math.inf
    assert gt.item() == pytest.approx(want[2].item(), rel=4e-6)
    assert gt.item() == pytest.approx(-30236.0, rel=1e-4)
    torch.testing.assert_close(gx.double(), want[0], rtol=4e-6, atol=4e-6 * want[0].abs().max().item())


@pytest.mark.parametrize("op", ["soft", "log", "threshold"])
def test_long_saturated_rows(device, op):
    """Rows long enough to be reduced in parts (CPU) and blocks (CUDA) whose nearest score
    lies in a late part, one with every score nearer b than the ones before it (each one
    rescales the sums so far): the online rescaling across parts and merges. The oracle
    takes the op's own threshold (the reference's sort is slow on long rows)."""
    n = 40_000
    g = gen(21)
    near_last = torch.linspace(0.0, 50.0, n, dtype=F64) + torch.rand(n, generator=g, dtype=F64) * 1e-3
    spread = torch.randn(n, generator=g, dtype=F64) * 3e4
    x = torch.stack([near_last, spread])
    k = torch.tensor([1.0, n // 3], dtype=F64)  # b in a gap hundreds of t wide
    t = torch.tensor([1e-6, 1e-3], dtype=F64)
    up = torch.randn(2, n, generator=g, dtype=F64) if op != "threshold" else torch.tensor([0.8, -1.7], dtype=F64)
    for dtype in ([F64, torch.float32] if device == "cpu" else [F64, torch.float32, torch.bfloat16]):
        xd = x.to(dtype)
        upd = up if op == "threshold" else up.to(dtype)
        got = _run(op, xd, k, t, upd, True, device)
        truth = _truth(op, xd, k, t, upd, True, b=fl.lapsum_threshold(xd, k, t).cpu())
        db = 32 * torch.finfo(F64).eps * (xd.double().abs().amax(1) + 1)
        up_rows = up[:, None] if op == "threshold" else upd
        _assert_close_to_truth(got, truth, up_rows, db, t, dtype, precise=device == "cpu" or dtype == F64)
