"""Forward correctness of the LapSum soft top-k (DESIGN §1, §3, §6).

Every mask is checked two ways: its budget |sum p - k| / max(k, 1) against the bound of
DESIGN §1.2, and its values against the float64 oracle of fastlapsum.reference with the
flash-attention tolerance rule (a small multiple of what rounding the oracle's own mask
to the output dtype costs). For float64 output that rounding cost is zero, so the floor
is the conditioning of the problem itself: a few ulps of b (or of x - b) and the
rounding of an n-term budget sum moved into b through dPsi/db = -W.
"""
import contextlib
import functools
import itertools
import math

import pytest
import torch

import fastlapsum as fl
from fastlapsum import reference

import conftest
from conftest import BUDGET_TOL, budget_error, mask_floor


@contextlib.contextmanager
def _one_thread():
    """The float64 oracle is a chain of small elementwise ops; on a loaded 2-core box
    intra-op threading makes it ~10x slower. It runs on one thread (the kernels under
    test keep the default thread count)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _single_threaded(f):
    @functools.wraps(f)
    def g(*args, **kwargs):
        with _one_thread():
            return f(*args, **kwargs)
    return g


soft_topk_reference = _single_threaded(reference.soft_topk_reference)
lapsum_threshold_reference = _single_threaded(reference.lapsum_threshold_reference)
lapsum_mask_reference = _single_threaded(reference.lapsum_mask_reference)
same_precision_error = _single_threaded(conftest.same_precision_error)

EPS64 = torch.finfo(torch.float64).eps
TEMPS = [1e-4, 1e-2, 1.0, 1e3]
METHODS = ["auto", "sort", "bracket"]
INF, NAN = math.inf, math.nan


def budgets(n):
    """k = 0, tiny, fractional, n/16, n/2, n - 1, n (deduplicated, in [0, n])."""
    ks = [0.0, 1e-3, min(n / 3 + 0.37, float(n)), n / 16, n / 2, float(max(n - 1, 0)), float(n)]
    return sorted(set(ks))


def scores(n, dtype, device, seed=0, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * scale + shift).to(dtype).to(device)


def oracle_rows(x2d, k, t, largest=True):
    """float64 oracle threshold b, mask p, and the weight sum sum_i t*w_i, per row."""
    s = x2d.double().cpu() * (1.0 if largest else -1.0)
    rows = s.shape[0]
    kk = torch.as_tensor(k, dtype=torch.float64).broadcast_to((rows,)).clone()
    tt = torch.as_tensor(t, dtype=torch.float64).broadcast_to((rows,)).clone()
    b, edge = lapsum_threshold_reference(s, kk, tt)
    p = lapsum_mask_reference(s, b, tt, edge)
    u = (s - b[:, None]) / tt[:, None]
    fin = torch.isfinite(s) & torch.isfinite(b)[:, None]
    tw = torch.where(fin, 0.5 * torch.exp(-u.abs()), torch.zeros_like(u)).sum(1)
    return b, p, tw


def mask_tolerance(dtype, p_ref, b, t, tw, k):
    """Tolerance of a mask of `dtype` against the float64 oracle mask p_ref (one row).

    4x the same-precision error (the oracle's mask rounded to dtype; the quantity of
    conftest.same_precision_error) plus, for float64 output, where that is zero, the
    conditioning floor: a few ulps of (x - b), and the threshold error that the fp64
    budget bound of DESIGN §1.2 admits (|db| = 1e-12 max(k, 1) / W), both times the
    largest density 1/(2t). Capped at 1e-9 so that nearly hard masks are still compared.
    """
    sp = mask_floor(p_ref, dtype)
    tol = 4 * sp + (1e-15 if dtype == torch.float64 else 1e-12)
    if dtype == torch.float64:
        bb = abs(b) if math.isfinite(b) else 0.0
        cond = 0.5 / t * 8 * EPS64 * (1 + bb) + 0.5e-12 * max(k, 1.0) / max(tw, 1e-300)
        tol += min(cond, 1e-9)
    return tol


def check_row(x, k, t, methods, *, largest=True, label=""):
    """Run soft_topk on a 1-d x with each method; return a list of failure messages."""
    b, p_ref, tw = oracle_rows(x[None], k, t, largest)
    p_ref = p_ref[0]
    tol = mask_tolerance(x.dtype, p_ref, b.item(), t, tw.item(), k)
    # DESIGN §1.2: the bound, plus 4 W ulp(b) / max(k, 1) where b cannot be held closer
    bv = b.item()
    bound = BUDGET_TOL[x.dtype] + (4 * tw.item() / t * math.ulp(bv) / max(k, 1.0) if math.isfinite(bv) else 0.0)
    fails = []
    for method in [methods] if isinstance(methods, str) else methods:
        where = f"{label} k={k} t={t} {method}"
        p = fl.soft_topk(x, k, t, method=method, largest=largest)
        if p.dtype != x.dtype or p.shape != x.shape or p.device != x.device:
            fails.append(f"{where}: output {p.dtype}/{tuple(p.shape)}/{p.device}")
            continue
        be = budget_error(p, k).item()
        if not be <= bound:
            fails.append(f"{where}: budget error {be:.3e} > {bound:.3e}")
        err = (p.double().cpu() - p_ref).abs().max().item()
        if not err <= tol:
            fails.append(f"{where}: mask error {err:.3e} > tol {tol:.3e}")
    return fails


# ---------------------------------------------------------------------------------
# budget + oracle sweep


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 7, 100, 4096])
def test_sweep_small_n_full_product(device, dtype, n):
    """Every k x every temperature x every method at small n."""
    x = scores(n, dtype, device, seed=n)
    fails = []
    for k, t in itertools.product(budgets(n), TEMPS):
        fails += check_row(x, k, t, METHODS, label=f"n={n}")
    assert not fails, "\n".join(fails)


def _diagonal(n, every_t_at=True):
    """Each budget once with the temperatures cycling (and every temperature at k = n/16)."""
    ks = budgets(n)
    cases = [(k, TEMPS[i % len(TEMPS)]) for i, k in enumerate(ks)]
    if every_t_at:
        cases += [(n / 16, t) for t in TEMPS if (n / 16, t) not in cases]
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [20000, 10**5])
def test_sweep_large_n_diagonal(device, dtype, n):
    x = scores(n, dtype, device, seed=n + 1)
    fails = []
    for k, t in _diagonal(n, every_t_at=n <= 20000):
        fails += check_row(x, k, t, METHODS, label=f"n={n}")
    assert not fails, "\n".join(fails)


def test_million_fp32(device):
    """n = 1e6, fp32, k = n/16, t = 1 with each method."""
    n = 10**6
    x = scores(n, torch.float32, device, seed=6)
    fails = check_row(x, n / 16, 1.0, METHODS, label="n=1e6")
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("method", ["sort", "bracket"])
def test_shifted_scores_large_offset(device, method):
    """|b| >> t: b must be held in float64, or the budget moves (DESIGN §1.2)."""
    n = 20000
    x = scores(n, torch.float32, device, seed=3, scale=10.0, shift=1e4)
    fails = []
    for k, t in [(n / 16, 1e-2), (n / 2, 1.0), (1e-3, 1.0), (n / 3 + 0.37, 1e3)]:
        fails += check_row(x, k, t, method, label="shifted")
    assert not fails, "\n".join(fails)


def test_same_precision_helper_agrees(device):
    """The tolerance here uses the same quantity as conftest.same_precision_error."""
    x = scores(300, torch.float32, device, seed=11)
    _, p_ref, _ = oracle_rows(x[None], 37.5, 0.5)
    sp = mask_floor(p_ref[0], torch.float32)
    assert sp == pytest.approx(same_precision_error(x.cpu(), 37.5, 0.5), rel=0, abs=0)
    assert sp > 0


# ---------------------------------------------------------------------------------
# shapes, per-row parameters, layouts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_rows_per_row_k_and_temperature(device, dtype):
    rows, n = 6, 500
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, n, generator=g, dtype=torch.float64).to(dtype).to(device)
    k = torch.tensor([0.0, 1e-3, 7.5, 250.0, 499.0, 500.0], dtype=torch.float64, device=device)
    t = torch.tensor([1e-4, 1e-2, 1.0, 1e3, 0.3, 2.0], dtype=dtype, device=device)
    p = fl.soft_topk(x, k, t)
    assert p.shape == x.shape and p.dtype == dtype
    sums = p.double().sum(1).cpu()
    err = ((sums - k.cpu()).abs() / k.cpu().clamp(min=1)).max().item()
    assert err <= BUDGET_TOL[dtype]
    p_ref = soft_topk_reference(x.cpu(), k.cpu(), t.cpu().double())
    for r in range(rows):
        b, pr, tw = oracle_rows(x[r:r + 1], k[r].item(), t[r].item())
        tol = mask_tolerance(dtype, pr[0], b.item(), t[r].item(), tw.item(), k[r].item())
        assert (p[r].double().cpu() - p_ref[r]).abs().max().item() <= tol, f"row {r}"
    # each row is the same as solving it alone
    for r in range(rows):
        alone = fl.soft_topk(x[r], k[r].item(), t[r].item())
        torch.testing.assert_close(p[r], alone, rtol=0, atol=0)


def test_per_row_k_broadcasts_over_batch(device):
    """k of shape [3] for x of shape [2, 3, n] (batch shape [2, 3])."""
    x = torch.randn(2, 3, 200, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device)
    k = torch.tensor([1.0, 10.5, 100.0], dtype=torch.float64, device=device)
    p = fl.soft_topk(x, k, 0.5)
    sums = p.sum(-1).cpu()
    torch.testing.assert_close(sums, k.cpu().expand(2, 3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(p.cpu(), soft_topk_reference(x.cpu(), k.cpu().expand(2, 3), 0.5),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_dim_not_last(device, dim):
    x = torch.randn(40, 30, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(device)
    batch = list(x.shape)
    n = batch.pop(dim)
    k = torch.rand(batch, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * n
    k = k.to(device)
    p = fl.soft_topk(x, k, 0.7, dim=dim)
    assert p.shape == x.shape
    torch.testing.assert_close(p.sum(dim).cpu(), k.cpu(), rtol=1e-12, atol=1e-12)
    ref = soft_topk_reference(x.cpu(), k.cpu(), 0.7, dim=dim)
    torch.testing.assert_close(p.cpu(), ref, rtol=0, atol=1e-12)
    moved = fl.soft_topk(x.movedim(dim, -1), k, 0.7).movedim(-1, dim)
    torch.testing.assert_close(p, moved, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["sort", "bracket"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_largest_false_is_soft_topk_of_negated(device, dtype, method):
    x = scores(5000, dtype, device, seed=5)
    for k, t in [(1.5, 0.3), (100.0, 1e-2), (2500.3, 1.0), (4999.0, 1e3)]:
        a = fl.soft_topk(x, k, t, largest=False, method=method)
        b = fl.soft_topk(-x, k, t, method=method)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        # and it really selects the smallest: the smallest score carries the most mass
        assert a[x.argmin()] == a.max() and a[x.argmax()] == a.min()
        ta = fl.lapsum_threshold(x, k, t, largest=False, method=method)
        tb = fl.lapsum_threshold(-x, k, t, method=method)
        torch.testing.assert_close(ta, -tb, rtol=0, atol=0)
    fails = check_row(x, 37.25, 0.5, method, largest=False, label="largest=False")
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("layout", ["transposed", "strided_cols", "strided_rows", "expanded"])
def test_non_contiguous_inputs(device, layout):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(64, 400, generator=g).to(device)
    if layout == "transposed":
        x = base.t()  # [400, 64], rows not contiguous
    elif layout == "strided_cols":
        x = base[:, ::3]
    elif layout == "strided_rows":
        x = base[::2, 5:305]
    else:
        x = base[:1].expand(4, 400)
    assert not x.is_contiguous()
    n = x.shape[-1]
    k = torch.linspace(0.5, n - 0.5, x.shape[0], dtype=torch.float64, device=device)
    p = fl.soft_topk(x, k, 0.25)
    pc = fl.soft_topk(x.contiguous(), k, 0.25)
    torch.testing.assert_close(p, pc, rtol=0, atol=0)
    assert budget_error(p, k).item() <= BUDGET_TOL[torch.float32]
    ref = soft_topk_reference(x.cpu(), k.cpu(), 0.25)
    assert (p.double().cpu() - ref).abs().max().item() <= 4 * same_precision_error(x.cpu(), k.cpu(), 0.25) + 1e-12
    # dim=0 on the transposed view is the contiguous base along its rows
    p0 = fl.soft_topk(base.t(), 13.0, 0.25, dim=0) if layout == "transposed" else None
    if p0 is not None:
        torch.testing.assert_close(p0.t(), fl.soft_topk(base, 13.0, 0.25), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["sort", "bracket"])
@pytest.mark.parametrize("rows,n", [(3, 3000), (1, 40000)])
def test_half_precision_inputs(device, dtype, method, rows, n):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(8)).to(dtype).to(device)
    for k, t in [(1e-3, 1.0), (n / 16, 1e-2), (n / 3 + 0.37, 1.0), (n - 1.0, 1e3), (187.0, 0.1), (n / 2, 1e-4)]:
        p = fl.soft_topk(x, k, t, method=method)
        assert p.dtype == dtype and p.shape == x.shape
        assert budget_error(p, k).item() <= BUDGET_TOL[dtype], (k, t)
        ref = soft_topk_reference(x.cpu(), k, t)  # oracle on the same (rounded) scores
        sp = mask_floor(ref, dtype)  # = same_precision_error
        err = (p.double().cpu() - ref).abs().max().item()
        assert err <= 4 * sp + 1e-12, (k, t, err, sp)


# ---------------------------------------------------------------------------------
# log mask and threshold


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_soft_topk_matches_log_of_oracle(device, dtype):
    n = 2000
    x = scores(n, dtype, device, seed=9, scale=3.0)
    for k, t in [(1e-3, 1.0), (10.0, 0.05), (n / 3 + 0.37, 1.0), (n - 1.0, 0.2), (n / 2, 1e3)]:
        lp = fl.log_soft_topk(x, k, t)
        assert lp.dtype == dtype and bool(torch.isfinite(lp).all())
        p_ref = soft_topk_reference(x.cpu(), k, t)
        ok = p_ref > 1e-280
        log_ref = torch.log(p_ref)
        # rounding the oracle's log to dtype, plus a few float64 ulps of (x - b)/t
        sp = (log_ref[ok].to(dtype).double() - log_ref[ok]).abs().max().item()
        cond = 16 * EPS64 * (1 + x.abs().max().item()) / t
        err = (lp.double().cpu()[ok] - log_ref[ok]).abs().max().item()
        assert err <= 4 * sp + cond + 1e-13, (k, t, err, sp)
        # exp(log p) is the soft mask (to the rounding of log p, amplified by |log p|)
        p = fl.soft_topk(x, k, t).double().cpu()
        lpd = lp.double().cpu()
        eps, tiny = torch.finfo(dtype).eps, torch.finfo(dtype).tiny
        normal = lpd.exp() >= tiny  # where the plain mask has not underflowed
        assert bool(((lpd.exp() - p).abs() <= 2 * eps * (2 + lpd.abs()) * p)[normal].all()), (k, t)
        assert bool((p[~normal] <= tiny).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_soft_topk_finite_where_p_underflows(device, dtype):
    # two scores on top, the rest 1e4 below: p there is e^{-1e4}/2 ~ 0 but log p is finite
    x = torch.tensor([5.0, 4.0, -1e4, -1e4 - 1, -2e4, -3e4], dtype=dtype, device=device)
    k, t = 1.5, 1.0
    p = fl.soft_topk(x, k, t)
    lp = fl.log_soft_topk(x, k, t)
    assert (p[2:] == 0).all()  # underflow in the plain mask
    assert bool(torch.isfinite(lp).all())
    b = lapsum_threshold_reference(x.double().cpu()[None], torch.tensor([k], dtype=torch.float64),
                                   torch.tensor([t], dtype=torch.float64))[0].item()
    expect = (x.double().cpu() - b) / t + math.log(0.5)  # log F(u) = u + log 1/2 for u <= 0
    torch.testing.assert_close(lp[2:].double().cpu(), expect[2:], rtol=2 * torch.finfo(dtype).eps, atol=0)
    log_ref = soft_topk_reference(x.cpu(), k, t, log=True)
    torch.testing.assert_close(lp.double().cpu(), log_ref, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lapsum_threshold_matches_reference(device, dtype, largest, method):
    rows, n = 4, 20000
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    scale = torch.tensor([[1.0], [1.0], [5.0], [1.0]], dtype=torch.float64)
    shift = torch.tensor([[0.0], [1e3], [0.0], [-3.0]], dtype=torch.float64)
    x = x * scale + shift
    x = x.to(dtype).to(device)
    k = torch.tensor([1e-3, 1250.0, n / 3 + 0.37, n - 1.0], dtype=torch.float64)
    t = torch.tensor([1.0, 1e-2, 1e3, 0.3], dtype=torch.float64)
    b = fl.lapsum_threshold(x, k.to(device), t.to(device), largest=largest, method=method)
    assert b.dtype == torch.float64 and b.shape == (rows,)
    b_ref, _, tw = oracle_rows(x, k, t, largest)
    sign = 1.0 if largest else -1.0
    for r in range(rows):
        # b to a few ulps, plus the threshold error the fp64 budget bound admits:
        # 1e-12 max(k, 1) / W with W = sum w_i = tw / t (DESIGN §1.2)
        tol = 16 * EPS64 * (1 + abs(b_ref[r].item())) + 1e-12 * max(k[r].item(), 1) * t[r].item() / tw[r].item()
        if device != "cpu" and dtype != torch.float64:
            tol += 1e-6 * t[r].item()  # the GPU's fp32 exponentials (<= 2 ulp) move b by <= ~2.4e-7 t
        assert abs(b[r].item() - sign * b_ref[r].item()) <= tol, (r, b[r].item(), sign * b_ref[r].item(), tol)


def test_threshold_is_the_mask_threshold(device):
    """soft_topk's mask is F((x - b)/t) with b = lapsum_threshold."""
    x = scores(777, torch.float64, device, seed=12)
    for k, t in [(3.3, 0.2), (400.0, 2.0)]:
        b = fl.lapsum_threshold(x, k, t).item()
        u = (x.cpu() - b) / t
        expect = torch.where(u <= 0, 0.5 * torch.exp(u.clamp(max=0)), 1 - 0.5 * torch.exp(-u.clamp(min=0)))
        torch.testing.assert_close(fl.soft_topk(x, k, t).cpu(), expect, rtol=4 * EPS64, atol=1e-300)


# ---------------------------------------------------------------------------------
# special values (DESIGN §6)


@pytest.mark.parametrize("method", ["sort", "bracket"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k_zero_and_k_n(device, dtype, method):
    x = scores(1000, dtype, device, seed=13)
    p0 = fl.soft_topk(x, 0, 1.0, method=method)
    pn = fl.soft_topk(x, 1000, 1.0, method=method)
    assert (p0 == 0).all() and (pn == 1).all()
    assert (fl.log_soft_topk(x, 1000, 1.0) == 0).all()
    assert (fl.log_soft_topk(x, 0, 1.0) == -INF).all()


@pytest.mark.parametrize("method", ["sort", "bracket"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plus_inf_scores(device, dtype, method):
    x = torch.tensor([1.0, INF, 0.0, INF, -INF, 2.0], dtype=dtype, device=device)
    fin = torch.tensor([True, False, True, False, False, True])
    # k below #(+inf): the +inf scores share k equally, the rest get 0
    for k in [0.5, 1.0, 2.0]:
        p = fl.soft_topk(x, k, 1.0, method=method).cpu()
        expect = torch.where(x.cpu() == INF, torch.full((6,), k / 2, dtype=torch.float64),
                             torch.zeros(6, dtype=torch.float64)).to(dtype)
        torch.testing.assert_close(p, expect, rtol=0, atol=0)
        lp = fl.log_soft_topk(x, k, 1.0, method=method).cpu()  # log(k/2) and -inf
        torch.testing.assert_close(lp.double(), torch.log(expect.double()), rtol=0, atol=1e-7)
    # k above #(+inf): +inf get exactly 1, the finite scores solve for the rest, -inf get 0
    for k in [2.5, 3.0, 4.9]:
        p = fl.soft_topk(x, k, 1.0, method=method).cpu()
        assert (p[x.cpu() == INF] == 1).all() and (p[x.cpu() == -INF] == 0).all()
        sub = x.cpu()[fin]
        ref = soft_topk_reference(sub, k - 2, 1.0)
        assert (p[fin].double() - ref).abs().max().item() <= 4 * same_precision_error(sub, k - 2, 1.0) + 1e-15
        assert budget_error(p, k).item() <= BUDGET_TOL[dtype]


@pytest.mark.parametrize("method", ["sort", "bracket"])
def test_minus_inf_scores_share_leftover(device, method):
    x = torch.tensor([-INF, 3.0, -INF, 1.0, -INF], dtype=torch.float64, device=device)
    for k in [2.0, 2.6, 3.5, 5.0]:  # k >= #finite: -inf share k - 2
        p = fl.soft_topk(x, k, 1.0, method=method).cpu()
        share = (k - 2) / 3
        expect = torch.where(x.cpu() == -INF, torch.full((5,), share, dtype=torch.float64),
                             torch.ones(5, dtype=torch.float64))
        torch.testing.assert_close(p, expect, rtol=0, atol=0)
    p = fl.soft_topk(x, 1.5, 1.0, method=method).cpu()  # interior: -inf get exactly 0
    assert (p[x.cpu() == -INF] == 0).all()
    ref = soft_topk_reference(torch.tensor([3.0, 1.0], dtype=torch.float64), 1.5, 1.0)
    torch.testing.assert_close(p[[1, 3]], ref, rtol=0, atol=1e-15)
    # +inf and -inf together, k beyond #finite + #(+inf)
    y = torch.tensor([INF, -INF, 0.0, -INF], dtype=torch.float64, device=device)
    p = fl.soft_topk(y, 3.0, 1.0, method=method).cpu()
    torch.testing.assert_close(p, torch.tensor([1.0, 0.5, 1.0, 0.5], dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("method", ["auto", "sort", "bracket"])
def test_inf_scores_in_a_long_row(device, method):
    n = 40000
    x = scores(n, torch.float32, device, seed=14)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(15))
    x[idx[:50].to(device)] = INF
    x[idx[50:3000].to(device)] = -INF
    for k, t in [(10.0, 1.0), (50.0, 1.0), (60.5, 0.01), (n / 2, 1.0), (n - 2990.0, 1.0), (n - 100.0, 1.0)]:
        p = fl.soft_topk(x, k, t, method=method)
        assert budget_error(p, k).item() <= BUDGET_TOL[torch.float32], (k, t)
        ref = soft_topk_reference(x.cpu(), k, t)
        sp = same_precision_error(x.cpu(), k, t)
        assert (p.double().cpu() - ref).abs().max().item() <= 4 * sp + 1e-12, (k, t)


@pytest.mark.parametrize("method", ["sort", "bracket"])
def test_nan_row_is_nan_other_rows_exact(device, method):
    x = torch.randn(3, 500, generator=torch.Generator().manual_seed(16), dtype=torch.float64).to(device)
    x[1, 17] = NAN
    k = torch.tensor([5.5, 5.5, 100.0], dtype=torch.float64, device=device)
    p = fl.soft_topk(x, k, 0.5, method=method)
    assert p[1].isnan().all()
    assert not p[[0, 2]].isnan().any()
    for r in (0, 2):
        torch.testing.assert_close(p[r], fl.soft_topk(x[r], k[r].item(), 0.5, method=method), rtol=0, atol=0)
        assert abs(p[r].sum().item() - k[r].item()) <= 1e-12 * max(k[r].item(), 1)
    assert fl.lapsum_threshold(x, k, 0.5)[1].isnan()
    assert fl.log_soft_topk(x, k, 0.5)[1].isnan().all()
    # straight-through forward: the NaN row is NaN, the others are exact top-k masks
    kh = torch.tensor([5.0, 5.0, 100.0], dtype=torch.float64, device=device)
    ph = fl.soft_topk(x, kh, 0.5, hard=True, method=method)
    assert ph[1].isnan().all()
    for r in (0, 2):
        top = x[r].topk(int(kh[r].item())).indices
        expect = torch.zeros_like(x[r]).index_fill_(0, top, 1.0)
        torch.testing.assert_close(ph[r], expect, rtol=0, atol=0)
