"""The outer-gap closed form (DESIGN §1.1.1): a short row whose root lies above its max (or,
mirrored, below its min) is solved in O(n) without a sort. The diagnostics report
PATH_OUTER_GAP exactly where the float64 test S >= 2 kf (or S' >= 2 (nf - kf)) holds, the
sort path elsewhere; b matches the float64 oracle and the budget is exact, on adversarial
rows, every dtype and both `largest`; on CUDA the warp and CTA kernels agree with the CPU."""
import math

import pytest
import torch

import fastlapsum as fl
from fastlapsum import reference

from conftest import (BUDGET_TOL, DTYPES, P_TOL, assert_b_matches_cpu, budget_error, gap_precision, gen, outer_gap_test,
                      requires_cuda, ulp_above)

F64 = torch.float64
INF = math.inf


def oracle_b(x, k, t, largest):
    s = x.double().cpu() * (1.0 if largest else -1.0)
    b, _ = reference.lapsum_threshold_reference(s, k, t)
    return b * (1.0 if largest else -1.0)


def assert_b_close(b, b_ref, t, rtol=1e-9):
    """b against the oracle: NaN and infinite rows alike, the others within rtol t plus a
    few ulps of b (rtol: gap_precision; 1e-9 is what an fp64 threshold can be held to)."""
    b = b.cpu()
    same = (b == b_ref) | (torch.isnan(b) & torch.isnan(b_ref))
    fin = torch.isfinite(b_ref)
    assert same[~fin].all(), (b, b_ref)
    err = (b - b_ref)[fin].abs()
    assert (err <= rtol * t[fin] + 8 * ulp_above(b_ref[fin])).all(), (err.max(), b, b_ref)


def assert_paths_follow_test(x, k, t, path, largest, margin=1e-9):
    """PATH_OUTER_GAP exactly where the float64 test holds (rows within `margin` of its
    boundary are left out: the kernels' sums may round either way there; gap_precision),
    PATH_SORT where it fails, PATH_DIRECT where the row settles."""
    s = x.double().cpu() * (1.0 if largest else -1.0)
    for r in range(s.shape[0]):
        got = fl.PATH_NAMES[int(path[r])]
        test = outer_gap_test(s[r], k[r].item(), t[r].item())
        if test is None:
            assert got == "direct", (r, got)
        elif abs(test[1] - 1.0) > margin:
            assert got == ("outer-gap" if test[0] else "sort"), (r, got, test)


def adversarial(n, seed):
    """float64 rows [R, n] with per-row k and t around the outer gap's edge cases."""
    g = gen(seed)
    r = lambda: torch.randn(n, generator=g, dtype=F64)  # noqa: E731
    rows, ks, ts = [], [], []

    def add(row, k, t):
        rows.append(row)
        ks.append(float(k))
        ts.append(float(t))

    add(r(), 8, 1.0)                      # the MoE router: above the max
    add(r(), n - 8, 1.0)                  # the mirror: below the min
    add(r(), 8, 0.01)                     # small t: the root among the scores (sort)
    add(r(), n - 8, 0.01)
    add(r(), 0.3, 0.01)                   # k < 1: S >= 1 >= 2 kf always
    add(r(), n - 0.3, 0.01)
    tied = r()
    tied[: n // 4] = tied.max() + 1.0     # n/4 ties at the max: S = n/4 for small t
    add(tied, n / 16, 1e-3)               # 2 kf = n/8 <= n/4: above the max, b = m + t ln 2
    add(tied, n / 4 + 1, 1e-3)            # the ties cannot hold it: sort
    add(torch.full((n,), 0.25, dtype=F64), n / 2, 1.0)    # constant, S = 2 kf exactly: b = m
    add(torch.full((n,), 0.25, dtype=F64), n / 3, 1.0)    # constant, above
    add(torch.full((n,), 0.25, dtype=F64), 2 * n / 3, 1.0)  # constant, below
    out = r()
    out[n // 3] = 1e6                     # one huge outlier: S = 1
    add(out, 0.5, 1.0)                    # holds exactly at 2 kf = 1: b = m
    add(out, 8, 1.0)                      # fails: sort
    add(out.clone(), n - 8, 1.0)          # the mirror side ignores the outlier
    infs = r()
    infs[[1, 5, 9 % n]] = INF
    infs[[2, 6]] = -INF
    add(infs, 8, 1.0)                     # kf = 8 - #(+inf): above the finite max
    add(infs.clone(), n - 8, 1.0)         # below the finite min
    add(infs.clone(), 2, 1.0)             # settled: b = +inf
    nan = r()
    nan[4] = math.nan
    add(nan, 8, 1.0)                      # NaN row: b = NaN
    add(r(), 8, 1e-30)                    # tiny t: no term but the max's, sort
    # n/3 ties at the max and at the min, tiny t: b = m + t ln(c/2) is representable next to m
    add((torch.arange(n, dtype=F64) % 3 - 2) * 1e-28, 1, 1e-30)
    add(r(), 8, 1e30)                     # huge t: S = nf, b far above the max
    add(r(), n - 8, 1e30)
    add(r(), n / 2 - 0.5, 1e3)            # kf just under nf / 2: above, barely
    add(r(), n / 2 + 0.5, 1e3)            # just over: below, barely
    return torch.stack(rows), torch.tensor(ks, dtype=F64), torch.tensor(ts, dtype=F64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("largest", [True, False])
def test_router_rows_take_the_outer_gap(device, dtype, largest):
    """MoE routing shapes (256 scores, k = 8; 64 scores, k = 2; t = 1): most Gaussian rows
    have their root above the max (S about 25 >= 16; a row with an outlying max does not),
    exactly those take the outer gap and sort nothing; b as the oracle's, the budget exact."""
    for n, k in [(256, 8.0), (64, 2.0)]:
        x = torch.randn(64, n, generator=gen(n), dtype=F64).to(dtype)
        kk, tt = torch.full((64,), k, dtype=F64), torch.ones(64, dtype=F64)
        info = fl.lapsum_diagnostics(x.to(device), k, 1.0, largest=largest)
        path = info.path.cpu()
        tol = gap_precision(device, dtype)
        assert_paths_follow_test(x, kk, tt, path, largest, tol)
        assert (path == fl.PATH_OUTER_GAP).double().mean() > 0.6, [fl.PATH_NAMES[c] for c in path.tolist()]
        gap = path == fl.PATH_OUTER_GAP
        assert (info.middle_size.cpu()[gap] == 0).all() and (info.attempts.cpu() == 0).all()
        assert_b_close(info.threshold, oracle_b(x, kk, tt, largest), tt, tol)
        p = fl.soft_topk(x.to(device), k, 1.0, largest=largest)
        assert budget_error(p.cpu(), k).item() <= BUDGET_TOL[dtype]


@pytest.mark.parametrize("largest", [True, False])
def test_mirror_side_near_full_budget(device, largest):
    """k close to n: the root below the min (the complementary budget nf - kf above -s's max)."""
    x = torch.randn(32, 256, generator=gen(3), dtype=F64)
    k = torch.linspace(248.0, 255.5, 32, dtype=F64)
    t = torch.ones(32, dtype=F64)
    info = fl.lapsum_diagnostics(x.to(device), k.to(device), t.to(device), largest=largest)
    assert_paths_follow_test(x, k, t, info.path.cpu(), largest)
    gap = info.path.cpu() == fl.PATH_OUTER_GAP
    assert gap.double().mean() > 0.6, [fl.PATH_NAMES[c] for c in info.path.tolist()]
    assert_b_close(info.threshold, oracle_b(x, k, t, largest), t)
    s = x if largest else -x
    b = info.threshold.cpu() * (1.0 if largest else -1.0)
    assert (b[gap] <= s.min(1).values[gap]).all()  # below every score


def test_small_temperature_keeps_the_sort(device):
    """t = 0.01 on Gaussian rows: the terms beside the max's vanish, S < 2 kf, the sort path
    solves (and sorts every finite score)."""
    x = torch.randn(16, 256, generator=gen(4), dtype=F64)
    info = fl.lapsum_diagnostics(x.to(device), 8.0, 0.01)
    assert (info.path.cpu() == fl.PATH_SORT).all() and (info.middle_size.cpu() == 256).all()
    assert_b_close(info.threshold, oracle_b(x, torch.full((16,), 8.0, dtype=F64), torch.full((16,), 0.01, dtype=F64),
                                             True), torch.full((16,), 0.01, dtype=F64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("n", [64, 256])
def test_adversarial_rows(device, n, dtype, largest):
    """Ties at the max, constant rows, a huge outlier, +-inf and NaN among the scores,
    t = 1e-30 and 1e30, k < 1, kf either side of nf / 2: the path follows the float64 test,
    b matches the oracle, the budget is exact, the log mask agrees with the mask."""
    x64, k, t = adversarial(n, seed=n)
    x = x64.to(dtype)  # rounding may tie more scores; the oracle sees the rounded row
    xd, kd, td = x.to(device), k.to(device), t.to(device)
    info = fl.lapsum_diagnostics(xd, kd, td, largest=largest)
    tol = gap_precision(device, dtype)
    assert_paths_follow_test(x, k, t, info.path.cpu(), largest, tol)
    names = {fl.PATH_NAMES[c] for c in info.path.tolist()}
    assert {"outer-gap", "sort", "direct"} <= names, names
    gap = info.path.cpu() == fl.PATH_OUTER_GAP
    assert (info.middle_size.cpu()[gap] == 0).all()
    assert_b_close(info.threshold, oracle_b(x, k, t, largest), t, tol)
    p = fl.soft_topk(xd, kd, td, largest=largest).cpu()
    ok = ~torch.isnan(info.threshold.cpu())
    assert budget_error(p[ok], k[ok]).item() <= BUDGET_TOL[dtype]
    lp = fl.log_soft_topk(xd, kd, td, largest=largest).cpu()
    assert ((lp[ok].double().exp() - p[ok].double()).abs() <= 10 * P_TOL[dtype]).all()


def test_exact_values(device):
    """Closed forms the test can write down: a constant row with kf = nf / 2 gives b = m
    exactly; c ties at the max with t -> 0 give b = m + t ln(c / 2 kf)."""
    x = torch.full((1, 64), 0.25, dtype=F64)
    info = fl.lapsum_diagnostics(x.to(device), 32.0, 1.0)
    assert info.path.item() == fl.PATH_OUTER_GAP and info.threshold.item() == 0.25
    x = torch.cat([torch.full((16,), 3.0, dtype=F64), torch.zeros(48, dtype=F64)])[None]
    info = fl.lapsum_diagnostics(x.to(device), 2.0, 1e-3)
    assert info.path.item() == fl.PATH_OUTER_GAP
    assert info.threshold.item() == pytest.approx(3.0 + 1e-3 * math.log(16 / 4), rel=0, abs=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_permutations_give_one_threshold(device, dtype):
    """The gap's sum is held in fixed point: permuted rows give bitwise the same b."""
    g = gen(5)
    base = torch.randn(256, generator=g, dtype=F64).to(dtype)
    order = torch.stack([torch.randperm(256, generator=g) for _ in range(16)])
    for k in (2.0, 254.0):
        info = fl.lapsum_diagnostics(base[order].to(device), k, 1.0)
        assert (info.path.cpu() == fl.PATH_OUTER_GAP).all()
        b = info.threshold
        assert torch.equal(b, b[:1].expand_as(b)), b


def test_long_rows_keep_the_bracket():
    """Rows past the CPU's sort crossover keep the sample bracket (the outer gap is tried
    only before a sort), even where the closed form would hold."""
    n = fl.functional.AUTO_SORT_MAX_N_CPU + 1
    x = torch.randn(1, n, generator=gen(6), dtype=F64)
    info = fl.lapsum_diagnostics(x, 8.0, 1.0)
    assert info.path.item() in (fl.PATH_BRACKET, fl.PATH_BRACKET_RETRY), fl.PATH_NAMES[info.path.item()]
    assert outer_gap_test(x[0], 8.0, 1.0)[0]


# ---- CUDA: the warp and the CTA kernel against the CPU --------------------------------------

@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("n, regime", [(8, "warp-rows"), (64, "warp-rows"), (256, "warp-rows"),
                                       (1280, "cta-rows")])
def test_cuda_matches_cpu(n, regime, dtype, largest):
    """Both on-chip kernels take the outer gap on the rows where the CPU's sort path does
    (router rows and the adversarial ones; n within the CPU's sort crossover), with the CPU's
    b and mask."""
    x64, k, t = adversarial(n, seed=n + 1)
    router = torch.randn(97, n, generator=gen(n), dtype=F64)  # rows no multiple of a CTA's
    x = torch.cat([x64, router]).to(dtype)
    k = torch.cat([k, torch.full((97,), {8: 1.0, 64: 2.0}.get(n, 8.0), dtype=F64)])
    t = torch.cat([t, torch.ones(97, dtype=F64)])
    xg, kg, tg = x.cuda(), k.cuda(), t.cuda()
    ic = fl.lapsum_diagnostics(x, k, t, largest=largest)
    ig = fl.lapsum_diagnostics(xg, kg, tg, largest=largest)
    assert ig.regime == regime, ig.regime
    # the same path as the CPU's except within gap_precision of the gap test's boundary
    margin = gap_precision("cuda", dtype)
    s = x.double() * (1.0 if largest else -1.0)
    tests = [outer_gap_test(s[r], k[r].item(), t[r].item()) for r in range(x.shape[0])]
    clear = torch.tensor([c is None or abs(c[1] - 1.0) > margin for c in tests])
    assert clear.double().mean() > 0.9
    assert torch.equal(ig.path.cpu()[clear], ic.path[clear]), (ig.path, ic.path)
    assert torch.equal(ig.middle_size.cpu()[clear], ic.middle_size[clear])
    assert (ic.path[-97:] == fl.PATH_OUTER_GAP).double().mean() > 0.5
    assert_b_matches_cpu(ig.threshold, ic.threshold, t)
    pc = fl.soft_topk(x, k, t, largest=largest).double()
    pg = fl.soft_topk(xg, kg, tg, largest=largest).cpu().double()
    ok = ~torch.isnan(pc)
    assert torch.equal(ok, ~torch.isnan(pg)) and ((pg - pc)[ok].abs() <= P_TOL[dtype]).all()
