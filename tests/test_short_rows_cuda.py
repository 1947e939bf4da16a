"""Short rows (n <= a few thousand): the on-chip sort solver, a warp per row up to the tuned
warp maximum (csrc/cuda/soft/tuning.cuh: 1024 scores, 512 for float64; rows of n <= 8 or 16
share a warp four or two ways) and a CTA per row above it. Each case is checked against the float64 oracle (budget, mask, log mask) on every
device, and on CUDA also against the CPU kernels (threshold, mask, diagnostics). The rows
mix the adversarial kinds with per-row k and temperature."""
import itertools
import math

import pytest
import torch

import fastlapsum as fl

from conftest import (BUDGET_TOL, DTYPES, F64, KINDS, P_TOL, assert_b_matches_cpu, budget_error,
                      check_against_oracle, gap_precision, outer_gap_test, requires_cuda, row_of_kind,
                      same_or_close)

NS = [1, 2, 3, 8, 9, 16, 17, 31, 32, 33, 64, 100, 255, 256, 257, 512, 513, 1000, 1024, 1025]
CPU_NS = [1, 9, 33, 257, 1025]  # the sweep on the CPU kernels (the oracle costs most of it)
TEMPS = [1e-6, 1e-2, 1.0, 1e3]


def budgets(n):
    return sorted({min(k, float(n)) for k in (0.0, 0.3, 1.0, n / 2, n - 1e-3, float(n))})


def batch(n, seed=0):
    """float64 rows [R, n] and per-row k, t: every (k, t) pair on three kinds of row (each kind
    meets every k and every t), plus one random row so that R is no multiple of a CTA's rows."""
    g = torch.Generator().manual_seed(seed + n)
    rows, ks, ts, kinds = [], [], [], []
    for j, (k, t) in enumerate(itertools.product(budgets(n), TEMPS)):
        for c in range(3):
            kind = (3 * j + c) % KINDS
            rows.append(row_of_kind(kind, n, g))
            ks.append(k)
            ts.append(t)
            kinds.append(kind)
    rows.append(torch.randn(n, generator=g, dtype=F64))
    ks.append(n / 3)
    ts.append(0.5)
    kinds.append(0)
    return torch.stack(rows), torch.tensor(ks, dtype=F64), torch.tensor(ts, dtype=F64), torch.tensor(kinds)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NS)
def test_short_rows_match_oracle(device, n, dtype, largest):
    if device == "cpu" and n not in CPU_NS:
        pytest.skip("the CPU kernels' short rows are swept in test_soft_topk.py; a few n here")
    x64, k, t, kinds = batch(n)
    x = x64.to(dtype).to(device)
    fails = check_against_oracle(x, k, t, kinds, largest)
    assert not fails, "\n".join(fails[:20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [8, 33, 256, 1025])
def test_budget_at_the_infinities(device, n, dtype):
    """k at and just past the boundaries the infinities set: k = #(+inf) (b = +inf, each +inf
    score gets 1), a hair more (a finite root just below the +inf scores), k = n - #(-inf)
    (b = -inf) and a hair less, with 3 +inf and 2 -inf scores; and rows all +inf / all -inf."""
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g, dtype=F64)
    base[[0, n // 2, n - 1]] = math.inf
    base[[1, n // 3 + 1]] = -math.inf
    ks = [3.0, 3.0 + 1e-9, 3.5, n - 2.0, n - 2.0 - 1e-9, n - 2.5, 2.0, n - 1.0]
    rows = [base] * len(ks) + [torch.full((n,), math.inf, dtype=F64), torch.full((n,), -math.inf, dtype=F64)]
    ks += [n / 2, n / 3]
    x = torch.stack(rows).to(dtype).to(device)
    k = torch.tensor(ks, dtype=F64)
    for t in (1e-6, 1.0):
        tt = torch.full_like(k, t)
        for largest in (True, False):
            fails = check_against_oracle(x, k, tt, torch.zeros(len(ks), dtype=torch.long), largest)
            assert not fails, "\n".join(fails[:20])


@requires_cuda
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NS)
def test_short_rows_match_cpu(n, dtype, largest):
    """The same rows on CUDA and on the CPU: thresholds (both solve the sorted row in fp64;
    the outer gap of 16/32-bit rows sums fp32 terms on CUDA: gap_precision),
    masks, log masks and the diagnostics (path, finite scores sorted, attempts)."""
    x64, k, t, _ = batch(n, seed=1)
    xc = x64.to(dtype)
    xg, kg, tg = xc.cuda(), k.cuda(), t.cuda()
    bc = fl.lapsum_threshold(xc, k, t, largest=largest)
    bg = fl.lapsum_threshold(xg, kg, tg, largest=largest).cpu()
    assert same_or_close(bg, bc, 1e-9, gap_precision("cuda", dtype) * t), (bg - bc).abs().max()
    # where |b| >> t, the thresholds' last bits (the two solvers round differently) move the
    # mask by up to a density (1/2) times a few ulps of b over t
    fin = torch.isfinite(bc)
    ulp_b = torch.where(fin, (torch.nextafter(bc, torch.full_like(bc, math.inf)) - bc).abs(), torch.zeros_like(bc))
    atol = (P_TOL[dtype] + 2 * ulp_b.nan_to_num(0.0) / t)[:, None]
    pc = fl.soft_topk(xc, k, t, largest=largest).double()
    pg = fl.soft_topk(xg, kg, tg, largest=largest).cpu().double()
    assert same_or_close(pg, pc, 0.0, atol), (pg - pc).abs().nan_to_num(0.0).max()
    lc = fl.log_soft_topk(xc, k, t, largest=largest).double()
    lg = fl.log_soft_topk(xg, kg, tg, largest=largest).cpu().double()
    assert same_or_close(lg.exp(), lc.exp(), 10 * P_TOL[dtype], atol)
    dc = fl.lapsum_diagnostics(xc, k, t, largest=largest)
    dg = fl.lapsum_diagnostics(xg, kg, tg, largest=largest)
    for name in ("path", "middle_size", "attempts"):
        assert torch.equal(getattr(dg, name).cpu(), getattr(dc, name)), name


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [5, 8, 16, 64, 256, 1024])
def test_many_short_rows_match_cpu(n, dtype):
    """A router-sized batch (many CTAs of the warp kernel, rows no multiple of a CTA's):
    every row solved by the outer gap (DESIGN §1.1.1) where its float64 test holds and sorted
    (PATH_SORT over all n) elsewhere, both paths taken, masks, budgets and thresholds as on
    the CPU."""
    rows = 5003
    g = torch.Generator().manual_seed(n)
    x = torch.randn(rows, n, generator=g, dtype=F64).to(dtype)
    k = torch.rand(rows, generator=g, dtype=F64) * (n - 0.5) + 0.25
    t = torch.rand(rows, generator=g, dtype=F64) * 2 + 0.05
    for largest in (True, False):
        pc = fl.soft_topk(x, k, t, largest=largest).double()
        pg = fl.soft_topk(x.cuda(), k.cuda(), t.cuda(), largest=largest).cpu().double()
        assert (pg - pc).abs().max().item() <= P_TOL[dtype]
        assert budget_error(pg, k).item() <= BUDGET_TOL[dtype]
    info = fl.lapsum_diagnostics(x.cuda(), k.cuda(), t.cuda())
    path, middle = info.path.cpu(), info.middle_size.cpu()
    gap = torch.tensor([outer_gap_test(x[r].double(), k[r].item(), t[r].item())[0] for r in range(rows)])
    ratio = torch.tensor([outer_gap_test(x[r].double(), k[r].item(), t[r].item())[1] for r in range(rows)])
    clear = (ratio - 1).abs() > gap_precision("cuda", dtype)  # sums may round either way at the boundary
    assert gap.any() and (~gap).any()
    assert (path[clear & gap] == fl.PATH_OUTER_GAP).all() and (path[clear & ~gap] == fl.PATH_SORT).all()
    assert (middle == torch.where(path == fl.PATH_SORT, n, 0)).all() and (info.attempts == 0).all()
    ic = fl.lapsum_diagnostics(x, k, t)
    assert torch.equal(path[clear], ic.path[clear])
    assert_b_matches_cpu(info.threshold, ic.threshold, t)


@requires_cuda
@pytest.mark.parametrize("n", [8, 100, 512, 1000])
def test_extreme_temperatures_match_cpu(n):
    """Subnormal temperatures on fp64 rows (1/t overflows: the scan scales its differences),
    and fp32 rows with t = 1e25 / 1e-25 and scores of 1e31 (the mask's 1/t and |b| far out
    of the usual range): thresholds, masks and budgets on CUDA as on the CPU."""
    g = torch.Generator().manual_seed(n)
    tiny = torch.randn(4, n, generator=g, dtype=F64) * 1e-308
    wide = torch.stack([torch.randn(n, generator=g, dtype=F64), torch.randn(n, generator=g, dtype=F64),
                        1e31 * torch.randn(n, generator=g, dtype=F64)]).float()
    cases = [(tiny, [1.0, n / 16, n / 2 + 0.5, n - 3.0], [1e-310, 3e-309, 1e-312, 2e-308]),
             (wide, [n / 16, n / 4, n / 3], [1e25, 1e-25, 1e30])]
    for x, k, t in cases:
        k, t = torch.tensor(k, dtype=F64), torch.tensor(t, dtype=F64)
        for largest in (True, False):
            bc = fl.lapsum_threshold(x, k, t, largest=largest)
            bg = fl.lapsum_threshold(x.cuda(), k.cuda(), t.cuda(), largest=largest).cpu()
            assert same_or_close(bg, bc, 1e-9, gap_precision("cuda", x.dtype) * t), (bg, bc)
            pc = fl.soft_topk(x, k, t, largest=largest).double()
            pg = fl.soft_topk(x.cuda(), k.cuda(), t.cuda(), largest=largest).cpu().double()
            assert (pg - pc).abs().max().item() <= P_TOL[x.dtype]
            assert budget_error(pg, k).item() <= BUDGET_TOL[x.dtype]
