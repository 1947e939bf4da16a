"""Rows whose finite scores cannot carry the budget (README "Non-finite scores").

For largest=True, with P scores +inf, M scores -inf and n in all (largest=False: the
same on -x, so -inf and +inf swap roles):
  * k <= P: b = +inf; the +inf scores share k equally (k / P each), every other score 0;
  * P < k < n - M: b finite; +inf scores get 1, -inf scores 0, the finite scores the
    LapSum mask of the budget k - P;
  * k >= n - M: b = -inf; every score but the -inf ones gets 1 and the -inf scores share
    what is left equally, (k - (n - M)) / M each (a row of only -inf: k / n each).
log_soft_topk gives the log of these (log 0 = -inf); hard=True gives exactly k ones, by
the order with ties to the smaller index (so among tied -inf scores the first ones);
gradients of a row with an infinite b are 0 (x, k and temperature). A NaN row is NaN.
The CPU and CUDA kernels share these rules (settle_row and lapsum_prob in
csrc/common/lapsum_math.h); the long rows below take the bracket / long-row paths.
"""
import math

import pytest
import torch

import fastlapsum as fl
from fastlapsum.reference import lapsum_threshold_reference, soft_topk_reference

from conftest import BUDGET_TOL, DTYPES, budget_error

INF = math.inf
METHODS = ["auto", "sort", "bracket"]


def soft_ops(x, k, t, method, largest=True):
    """p, log p, b and the hard mask (k integral) of one call each."""
    p = fl.soft_topk(x, k, t, method=method, largest=largest)
    lp = fl.log_soft_topk(x, k, t, method=method, largest=largest)
    b = fl.lapsum_threshold(x, k, t, method=method, largest=largest)
    h = fl.soft_topk(x, k, t, method=method, largest=largest, hard=True) if float(k) == round(float(k)) else None
    return p, lp, b, h


def expected(x, k, largest=True):
    """The policy above, per element (float64, CPU), and b's sign (+1, -1) or 0 if finite."""
    s = (x if largest else -x).double().cpu()
    n = s.shape[-1]
    P, M = int((s == INF).sum()), int((s == -INF).sum())
    def fill(where, inside, outside):  # float64 (torch.where of two numbers gives float32)
        return torch.where(where, torch.tensor(inside, dtype=torch.float64), torch.tensor(outside, dtype=torch.float64))

    if k <= P:
        return fill(s == INF, k / P if P else 0.0, 0.0), (1.0 if largest else -1.0)
    if k >= n - M:
        return fill(s == -INF, (k - (n - M)) / M if M else 0.0, 1.0), (-1.0 if largest else 1.0)
    return None, 0.0


def first_k_mask(x, k, largest=True):
    """The hard mask of the order with ties to the smaller index (stable sort)."""
    s = (x if largest else -x).double().cpu()
    idx = s.sort(descending=True, stable=True).indices[:k]
    return torch.zeros(s.shape, dtype=torch.float64).index_fill_(0, idx, 1.0)


def check_settled(x, k, largest, method, dtype):
    p_want, b_sign = expected(x, k, largest)
    assert p_want is not None
    p, lp, b, h = soft_ops(x, k, 1.0, method, largest)
    torch.testing.assert_close(p.cpu(), p_want.to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(lp.cpu(), torch.log(p_want).to(dtype), rtol=0, atol=0)
    assert b.item() == b_sign * INF
    if h is not None:
        torch.testing.assert_close(h.cpu().double(), first_k_mask(x, int(k), largest), rtol=0, atol=0)
    if dtype == torch.float64:
        assert budget_error(p, k).item() <= BUDGET_TOL[dtype]


# ---- the settled cases, short and long rows --------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [10, 5000])
def test_all_minus_inf_row(device, dtype, n):
    """Every score -inf: each gets k / n (the issue's example: k = 3 of 10 gives 0.3)."""
    x = torch.full((n,), -INF, dtype=dtype, device=device)
    for method in METHODS:
        for k in (1, 3, n // 2, n - 1, n):
            check_settled(x, k, True, method, dtype)
            check_settled(-x, k, False, method, dtype)  # the mirror: all +inf, smallest
        # k = 0: b = +inf, all 0
        p, lp, b, h = soft_ops(x, 0, 1.0, method)
        assert (p == 0).all() and (lp == -INF).all() and (h == 0).all() and b.item() == INF
    p = fl.soft_topk(x, 3, 1.0).cpu()
    assert p.double().sum().item() == pytest.approx(3.0, rel=BUDGET_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_plus_inf_row(device, dtype):
    """Every score +inf: they share k equally too (b = +inf, or -inf at k = n)."""
    x = torch.full((8,), INF, dtype=dtype, device=device)
    for k in (0, 1, 5, 8):
        check_settled(x, k, True, "auto", dtype)
        check_settled(-x, k, False, "auto", dtype)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("largest", [True, False])
def test_fewer_finite_scores_than_k(device, method, largest):
    """+inf and finite scores get 1, the -inf scores share the rest equally."""
    base = torch.tensor([-INF, 2.0, -INF, INF, -1.0, -INF, 0.5, -INF], dtype=torch.float64)
    x = (base if largest else -base).to(device)
    # n - M = 4: k from 4 up
    for k in (4, 4.5, 5, 6.2, 7, 8):
        check_settled(x, k, largest, method, torch.float64)
    # just below: b finite, the -inf scores get exactly 0, the +inf score 1
    p, lp, b, h = soft_ops(x, 3.9, 1.0, method, largest)
    assert math.isfinite(b.item())
    assert (p.cpu()[base == -INF] == 0).all() and (p.cpu()[base == INF] == 1).all()
    fin = torch.isfinite(base)
    ref = soft_topk_reference(base[fin], 2.9, 1.0)
    torch.testing.assert_close(p.cpu()[fin], ref, rtol=0, atol=1e-14)
    assert budget_error(p, 3.9).item() <= BUDGET_TOL[torch.float64]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("largest", [True, False])
def test_budget_within_the_plus_inf_scores(device, method, largest):
    """k <= #(+inf): only the +inf scores get mass, k / P each; hard: the first k of them."""
    base = torch.tensor([1.0, INF, -INF, INF, 3.0, INF, 0.0], dtype=torch.float64)
    x = (base if largest else -base).to(device)
    for k in (0.5, 1, 2, 2.5, 3):
        check_settled(x, k, largest, method, torch.float64)


@pytest.mark.parametrize("method", METHODS)
def test_long_mostly_minus_inf_rows(device, method):
    """Long rows (the bracket and long-row paths) with fewer finite scores than k."""
    n = 6000
    g = torch.Generator().manual_seed(3)
    x = torch.full((4, n), -INF, dtype=torch.float64)
    for r, few in enumerate((0, 1, 17, 300)):
        pos = torch.randperm(n, generator=g)[:few]
        x[r, pos] = torch.randn(few, generator=g, dtype=torch.float64)
    x = x.to(device)
    for k in (300.0, 1000.0, 1234.5):
        p = fl.soft_topk(x, k, 0.5, method=method)
        b = fl.lapsum_threshold(x, k, 0.5, method=method)
        for r in range(4):
            want, _ = expected(x[r], k)
            torch.testing.assert_close(p[r].cpu(), want, rtol=0, atol=0)
        assert (b.cpu() == -INF).all()
        assert budget_error(p, k).item() <= BUDGET_TOL[torch.float64]
    # a budget the finite scores carry in the widest row: b finite there, -inf get 0
    p = fl.soft_topk(x, 150.0, 0.5, method=method)
    assert math.isfinite(fl.lapsum_threshold(x[3], 150.0, 0.5, method=method).item())
    assert (p[3].cpu()[x[3].cpu() == -INF] == 0).all()
    torch.testing.assert_close(p[3].cpu(), soft_topk_reference(x[3].cpu(), 150.0, 0.5), rtol=0, atol=1e-13)


@pytest.mark.parametrize("largest", [True, False])
def test_mixed_batch_rows_are_independent(device, largest):
    """Settled rows next to ordinary rows: each row equals its own single-row call."""
    x = torch.tensor([[-INF] * 6, [1.0, -INF, 2.0, -INF, -INF, -INF], [0.3, 1.0, -2.0, 4.0, 0.0, 1.5],
                      [INF, INF, 0.0, 1.0, -INF, INF], [INF] * 6], dtype=torch.float64, device=device)
    x = x if largest else -x
    k = torch.tensor([2.0, 4.0, 3.0, 2.0, 5.0], dtype=torch.float64, device=device)
    p = fl.soft_topk(x, k, 0.7, largest=largest)
    h = fl.soft_topk(x, k, 0.7, largest=largest, hard=True)
    b = fl.lapsum_threshold(x, k, 0.7, largest=largest)
    for r in range(5):
        kr = k[r].item()
        torch.testing.assert_close(p[r], fl.soft_topk(x[r], kr, 0.7, largest=largest), rtol=0, atol=0)
        torch.testing.assert_close(h[r].cpu().double(), first_k_mask(x[r], int(kr), largest), rtol=0, atol=0)
        torch.testing.assert_close(b[r], fl.lapsum_threshold(x[r], kr, 0.7, largest=largest), rtol=0, atol=0)
    bref = lapsum_threshold_reference((x if largest else -x).cpu(), k.cpu(), torch.full((5,), 0.7, dtype=torch.float64))
    bref = bref[0] if isinstance(bref, tuple) else bref
    torch.testing.assert_close(b.cpu(), bref if largest else -bref, rtol=0, atol=1e-12)


def test_mirror_is_exact(device):
    """largest=False on x is largest=True on -x, for every op, non-finite rows included."""
    x = torch.tensor([[-INF, 1.0, INF, -INF, 0.0], [INF] * 5, [-INF] * 5, [0.0, -INF, -INF, -INF, 2.0]],
                     dtype=torch.float32, device=device)
    for k in (0.0, 1.0, 2.0, 3.5, 5.0):
        for f in (fl.soft_topk, fl.log_soft_topk):
            torch.testing.assert_close(f(x, k, 1.0, largest=False), f(-x, k, 1.0), rtol=0, atol=0)
        torch.testing.assert_close(fl.lapsum_threshold(x, k, 1.0, largest=False), -fl.lapsum_threshold(-x, k, 1.0),
                                   rtol=0, atol=0)
        if k == round(k):
            torch.testing.assert_close(fl.soft_topk(x, k, 1.0, largest=False, hard=True),
                                       fl.soft_topk(-x, k, 1.0, hard=True), rtol=0, atol=0)


def test_settled_rows_have_zero_gradient(device):
    """Rows with an infinite threshold: zero gradient for x, k and temperature, no NaN;
    an ordinary row in the same batch keeps its gradient."""
    x = torch.tensor([[-INF] * 5, [1.0, -INF, INF, -INF, 0.0], [INF, INF, 1.0, 0.0, -1.0],
                      [0.5, 1.0, -0.3, 2.0, 0.1]], dtype=torch.float64, device=device).requires_grad_()
    k = torch.tensor([3.0, 4.0, 1.5, 2.0], dtype=torch.float64, device=device, requires_grad=True)
    t = torch.full((4,), 0.8, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.linspace(-1, 2, 5, dtype=torch.float64, device=device)
    for out, g_out in ((fl.soft_topk(x, k, t), w.expand(4, 5)), (fl.lapsum_threshold(x, k, t), torch.ones(4).to(x))):
        gx, gk, gt = torch.autograd.grad(out, (x, k, t), g_out)
        for g in (gx, gk, gt):
            assert not g.isnan().any()
        assert (gx[:3] == 0).all() and (gk[:3] == 0).all() and (gt[:3] == 0).all()
        assert (gx[3] != 0).any() and gk[3] != 0 and gt[3] != 0
