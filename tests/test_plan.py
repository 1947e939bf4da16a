"""The plan's regimes (csrc/common/plan.h), asserted through the diagnostics: for every
(device x dtype x regime) cell of both ops, a shape that must take the regime, the regime
that lapsum_diagnostics / topk_diagnostics report for it (the dispatch's own decision, not
a Python copy), and the result on that shape checked against the float64 oracle and, on
CUDA, the CPU op. The shapes encode the tuning (csrc/cuda/soft/tuning.cuh,
csrc/cuda/topk/tuning.cuh): a retuned boundary fails here first."""
import pytest
import torch

import fastlapsum as fl
from fastlapsum._ops import MODE_HARD
from fastlapsum.reference import lapsum_threshold_reference, soft_topk_reference

from conftest import (BUDGET_TOL, DTYPES, assert_exact_topk, budget_error, gen, mask_floor, outer_gap_test,
                      requires_cuda, topk_oracle)

F32, F64 = torch.float32, torch.float64
FP64_SORT = "sort"  # float64 topk on CUDA: the ATen sort path, whatever the shape


def cell(device, *args):
    return pytest.param(device, *args, marks=requires_cuda) if device == "cuda" else (device, *args)


# ---- soft: lapsum_threshold / soft_topk ------------------------------------------------

# (device, n, method, regime); a dict regime is by dtype (float64's warp rows end at 512)
SOFT_CELLS = [
    cell("cpu", 300, "auto", "cpu-sort"),
    cell("cpu", 1536, "auto", "cpu-sort"),
    cell("cpu", 1537, "auto", "cpu-bracket"),
    cell("cpu", 5000, "sort", "cpu-sort"),
    cell("cpu", 5000, "auto", "cpu-bracket"),
    cell("cpu", 300, "bracket", "cpu-bracket"),
    cell("cuda", 8, "auto", "warp-rows"),  # rows of n <= 8 share a warp
    cell("cuda", 300, "auto", "warp-rows"),
    cell("cuda", 512, "sort", "warp-rows"),
    cell("cuda", 513, "auto", {F64: "cta-rows", None: "warp-rows"}),
    cell("cuda", 1024, "auto", {F64: "cta-rows", None: "warp-rows"}),
    cell("cuda", 1025, "auto", "cta-rows"),
    cell("cuda", 4096, "auto", "cta-rows"),
    cell("cuda", 4097, "auto", "long-rows"),
    cell("cuda", 300, "bracket", "long-rows"),
    cell("cuda", 5000, "sort", "radix-rows"),
]
# The per-row path of a row with an interior root in each regime. The sorting regimes first
# try the outer gap (DESIGN §1.1.1): a row whose root lies beyond its max or min reports
# PATH_OUTER_GAP there (SORTS_FIRST_TRY_GAP), the bracket regimes never.
SOFT_PATH = {"cpu-sort": fl.PATH_SORT, "warp-rows": fl.PATH_SORT, "cta-rows": fl.PATH_SORT,
             "cpu-bracket": fl.PATH_BRACKET, "long-rows": fl.PATH_BRACKET, "radix-rows": fl.PATH_RADIX}
SORTS_FIRST_TRY_GAP = {"cpu-sort", "warp-rows", "cta-rows"}


def expected_paths(regime, s, k, t):
    """SOFT_PATH[regime] per row of the signed float64 rows s, or PATH_OUTER_GAP where the
    regime tries the gap and its float64 test holds."""
    paths = torch.full((s.shape[0],), SOFT_PATH[regime], dtype=torch.int64)
    if regime in SORTS_FIRST_TRY_GAP:
        for r in range(s.shape[0]):
            if outer_gap_test(s[r], k[r].item(), t[r].item())[0]:
                paths[r] = fl.PATH_OUTER_GAP
    return paths


def by_dtype(regime, dtype):
    return regime.get(dtype, regime[None]) if isinstance(regime, dict) else regime


def soft_rows(n, dtype, seed):
    """Four well-conditioned rows (Gaussian, one uniform over 40 temperatures) with budgets
    from 1 to n - 1.5, rounded to dtype (which ties many scores below float32); k and t
    float64 [4]. Exact ties and non-finite scores are the topk cells' (and test_nonfinite's)."""
    g = gen(seed)
    x = torch.randn(4, n, generator=g, dtype=F64) * 2
    x[3] = torch.rand(n, generator=g, dtype=F64) * 40 - 20
    k = torch.tensor([1.0, n / 3 + 0.5, max(n - 1.5, 0.5), n / 4], dtype=F64).clamp(max=n - 0.5)
    t = torch.tensor([1.0, 0.3, 2.0, 1.0], dtype=F64)
    return x.to(dtype), k, t


def test_soft_cells_cover_every_regime():
    names = {by_dtype(p.values[3] if hasattr(p, "values") else p[3], d) for p in SOFT_CELLS for d in DTYPES}
    assert names == set(fl.SOFT_REGIME_NAMES)
    assert set(SOFT_PATH) == set(fl.SOFT_REGIME_NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device, n, method, regime", SOFT_CELLS)
def test_soft_regime(device, n, method, regime, dtype):
    regime = by_dtype(regime, dtype)
    x, k, t = soft_rows(n, dtype, seed=n)
    xd, kd, td = x.to(device), k.to(device), t.to(device)
    for largest in (True, False):
        info = fl.lapsum_diagnostics(xd, kd, td, largest=largest, method=method)
        assert info.regime == regime, (info.regime, regime)
        s = x.double() if largest else -x.double()
        want = expected_paths(regime, s, k, t)
        assert torch.equal(info.path.cpu(), want), ([fl.PATH_NAMES[c] for c in info.path.tolist()],
                                                    [fl.PATH_NAMES[c] for c in want.tolist()])
        if SOFT_PATH[regime] == fl.PATH_SORT:
            assert (want == fl.PATH_SORT).any()  # the cell still covers the sort
            sorted_n = torch.where(want == fl.PATH_SORT, n, 0)
            assert torch.equal(info.middle_size.cpu(), sorted_n) and (info.attempts.cpu() == 0).all()
        b_ref = lapsum_threshold_reference(s, k, t)[0]
        b = info.threshold.cpu()
        # CUDA long rows and the on-chip outer gap of 16/32-bit scores take fp32 exponentials:
        # b to ~1e-7 t (DESIGN §1.1.1, §1.2)
        fp32_exps = device == "cuda" and dtype != F64 and regime in ("long-rows", "warp-rows", "cta-rows")
        close = 2e-6 if fp32_exps else 1e-9
        assert torch.allclose(b if largest else -b, b_ref, rtol=1e-9, atol=close * t.max().item()), (b, b_ref)

        p = fl.soft_topk(xd, kd, td, largest=largest, method=method)
        assert p.dtype == dtype and p.device.type == device
        p = p.cpu()
        assert budget_error(p, k).item() <= BUDGET_TOL[dtype]
        p_ref = soft_topk_reference(x.double(), k, t, largest=largest)
        for r in range(x.shape[0]):
            err = (p[r].double() - p_ref[r]).abs().max().item()
            assert err <= 4 * mask_floor(p_ref[r], dtype) + 1e-12, (r, err)
        if device == "cuda":  # the same shape on the CPU op: the same thresholds
            bc = fl.lapsum_threshold(x, k, t, largest=largest, method=method)
            assert torch.allclose(b, bc, rtol=1e-9, atol=close * t.max().item())


def test_soft_regime_reads_no_data():
    """The diagnostic depends on the shape, dtype, method and device only."""
    for n, method in ((300, "auto"), (5000, "auto"), (5000, "sort"), (7, "bracket")):
        a = fl.lapsum_diagnostics(torch.randn(2, n), 1.0, method=method).regime
        b = fl.lapsum_diagnostics(torch.full((2, n), float("nan")), 1.0, method=method).regime
        assert a == b == fl.SOFT_REGIME_NAMES[torch.ops.fastlapsum.soft_regime(torch.empty(0, n), fl.functional.METHODS[method])]


# The branches of the long-row launch plan (plan_long_rows, csrc/cuda/soft/plan_soft.h; the
# comments give the H200's 132 SMs): whether the gathering level proposes for itself or a
# propose launch runs (and which instance: capped for three CTAs an SM, or uncapped where the
# propose grid fits one wave of one CTA an SM), whether the middle set is solved on chip or
# binned, the radix bracket.
LONG_PLAN_CELLS = [
    (1, 65536, torch.float32, "bracket"),  # one tile a block, all in flight: self-propose; on-chip middle set
    (64, 65536, torch.float32, "bracket"),  # blocks a row cut by the wave: a propose launch, 64 x 4 blocks: capped
    (2, (1 << 21) + 4096, torch.float32, "bracket"),  # two tiles a block, 2 x 33 propose blocks: uncapped; binned
    # middle set (past 2^21)
    (2, 300000, F64, "bracket"),  # fp64: binned middle set
    (2, 5000, torch.float32, "sort"),  # radix-rows: the radix bracket alone, a one-block propose
]


@requires_cuda
@pytest.mark.parametrize("rows, n, dtype, method", LONG_PLAN_CELLS)
def test_long_rows_plan(rows, n, dtype, method):
    """Gaussian rows certify on the first bracket (a middle slice too small for the set, or a
    grid that misses scores, would send them to the radix fallback or break the sums), and b
    matches the CPU op's."""
    g = gen(n + rows)
    x = torch.randn(rows, n, generator=g, dtype=F64).to(dtype)
    k = torch.full((rows,), n / 16, dtype=F64)
    t = torch.ones(rows, dtype=F64)
    xd = x.cuda()
    info = fl.lapsum_diagnostics(xd, k.cuda(), t.cuda(), method=method)
    regime = "radix-rows" if method == "sort" else "long-rows"
    assert info.regime == regime
    path = info.path.cpu()
    if regime == "long-rows":
        assert (path == fl.PATH_BRACKET).all() and (info.attempts.cpu() == 1).all(), (path, info.attempts)
    else:
        assert (path == fl.PATH_RADIX).all(), path
    bc = fl.lapsum_threshold(x, k, t, method=method)
    close = 2e-6 if dtype != F64 else 1e-9
    assert torch.allclose(info.threshold.cpu(), bc, rtol=1e-9, atol=close), (info.threshold, bc)
    p = fl.soft_topk(xd, k.cuda(), t.cuda(), method=method)
    assert (budget_error(p, k.cuda()) <= BUDGET_TOL[dtype]).all()


# ---- hard: topk and soft_topk(hard=True) --------------------------------------------------

# (device, rows, n, k, hard, regime); float64 takes FP64_SORT on CUDA
TOPK_CELLS = [
    cell("cpu", 16, 300, 7, False, "cpu"),
    cell("cpu", 4, 5000, 100, False, "cpu"),
    cell("cpu", 8, 300, 7, True, "cpu"),
    cell("cuda", 64, 20, 5, False, "thread-rows"),
    cell("cuda", 64, 32, 31, False, "thread-rows"),
    cell("cuda", 64, 33, 5, False, "warp-rows"),
    cell("cuda", 16, 2048, 64, False, "warp-rows"),
    cell("cuda", 16, 2048, 200, False, "warp-rows"),  # K above the in-kernel sort: sorted by at::sort
    cell("cuda", 8, 2049, 100, False, "row-cta"),
    cell("cuda", 4, 50000, 1000, False, "row-cta"),
    cell("cuda", 2, 65536, 12000, False, "grid"),  # 2.5 K over the row kernel's largest buffer
    cell("cuda", 64, 20, 5, True, "thread-rows"),
    cell("cuda", 16, 300, 7, True, "warp-rows"),
    cell("cuda", 8, 5000, 100, True, "row-cta"),
    # hard_mask with a number k plans as topk does with that k (k_max); with a tensor k (no
    # bound known) few long rows take the grid
    cell("cuda", 2, 65536, 1000, True, "row-cta"),
    cell("cuda", 2, 65536, 12000, True, "grid"),
]


def topk_rows(rows, n, dtype, seed, nonfinite=True):
    """Tie-heavy rows (a few levels, exact in every dtype), with +-inf and NaN in some."""
    g = gen(seed)
    x = torch.randint(0, 9, (rows, n), generator=g).double()
    if nonfinite and n >= 8:
        x[0, [1, n // 2]] = float("inf")
        x[min(1, rows - 1), [0, n - 1]] = float("-inf")
        x[min(2, rows - 1), n // 3] = float("nan")
    return x.to(dtype)


def test_topk_cells_cover_every_regime():
    names = {(p.values[5] if hasattr(p, "values") else p[5]) for p in TOPK_CELLS} | {FP64_SORT}
    assert names == set(fl.TOPK_REGIME_NAMES)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("device, rows, n, k, hard, regime", TOPK_CELLS)
def test_topk_regime(device, rows, n, k, hard, regime, dtype):
    if device == "cuda" and dtype == F64:
        regime = FP64_SORT
    x = topk_rows(rows, n, dtype, seed=n + k, nonfinite=not hard)
    xd = x.to(device)
    assert fl.topk_diagnostics(xd, k, hard=hard) == regime
    if hard:  # exactly k_r ones per row, at the oracle's top-k (the smaller index wins ties)
        # a number k (the diagnostic's plan, k_max = k) and per-row budgets (no bound known)
        for ks in (torch.full((rows,), float(k), dtype=F64),
                   torch.tensor([k if r % 2 == 0 else max(k // 3, 1) for r in range(rows)], dtype=F64)):
            uniform = bool((ks == k).all())
            p = fl.soft_topk(xd, k if uniform else ks.to(device), 0.5, hard=True)
            assert p.dtype == dtype
            want = torch.zeros(rows, n, dtype=dtype)
            for r in range(rows):
                want[r, topk_oracle(x[r], int(ks[r]))[1]] = 1
            assert torch.equal(p.cpu(), want)
        return
    for largest in (True, False):
        v, i = fl.topk(xd, k, largest=largest, sorted=True)
        wv, wi = topk_oracle(x, k, largest=largest)
        assert torch.equal(i.cpu(), wi)
        torch.testing.assert_close(v.cpu(), wv, rtol=0, atol=0, equal_nan=True)
        v, i = fl.topk(xd, k, largest=largest)
        assert_exact_topk(xd, k, v, i, largest=largest)
        assert torch.equal(i.cpu().sort(1).values, wi.sort(1).values)  # the same set: ties decided


@pytest.mark.parametrize("k_max", [-1, 0, 100, 1000, 65536])
def test_hard_mask_k_max_is_only_a_plan(device, k_max):
    """soft_topk_forward's k_max picks the hard mask's launch plan, never its answer: rows whose
    k_r exceeds the bound (or a bound of 0, or none) still get exactly k_r ones."""
    rows, n = 3, 65536
    x = topk_rows(rows, n, F32, seed=11, nonfinite=False).to(device)
    ks = torch.tensor([1000.0, 5000.0, 3.0], dtype=F64, device=device)
    t = torch.ones(rows, dtype=F64, device=device)
    p, _, _ = torch.ops.fastlapsum.soft_topk_forward(x, ks, t, True, 0, MODE_HARD, k_max)
    for r in range(rows):
        want = torch.zeros(n, dtype=F32)
        want[topk_oracle(x[r].cpu(), int(ks[r]))[1]] = 1
        assert torch.equal(p[r].cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64],
                         ids=str)
def test_topk_regime_integer_rows(device, dtype):
    """CUDA selects narrow integer rows in float32 (the float32 regime of the shape) and
    sorts int32/int64 rows; the CPU takes every dtype."""
    n, k = 300, 7
    x = torch.randint(0, 2 if dtype == torch.bool else 9, (16, n), generator=gen(3)).to(dtype)
    got = fl.topk_diagnostics(x.to(device), k)
    if device == "cpu":
        want = "cpu"
    elif dtype in (torch.int32, torch.int64):
        want = "sort"
    else:
        want = fl.topk_diagnostics(x.float().to(device), k)
    assert got == want
    v, i = fl.topk(x.to(device), k, sorted=True)
    wv, wi = topk_oracle(x, k)
    assert torch.equal(i.cpu(), wi) and torch.equal(v.cpu(), wv)


def test_topk_diagnostics_arguments():
    x = torch.randn(3, 10)
    assert fl.topk_diagnostics(x, 10) == fl.topk_diagnostics(x.T, 3, dim=0) == "cpu"
    assert fl.topk_diagnostics(torch.tensor(2.0), 1) == "cpu"  # 0-d, as topk
    with pytest.raises(ValueError, match="k must be in"):
        fl.topk_diagnostics(x, 11)
    with pytest.raises(IndexError, match="dim"):
        fl.topk_diagnostics(x, 1, dim=2)
    with pytest.raises(TypeError, match="hard"):
        fl.topk_diagnostics(x, 1, hard=1)
    with pytest.raises(TypeError, match="hard=True"):
        fl.topk_diagnostics(x.int(), 1, hard=True)
    with pytest.raises(TypeError, match="x must be"):
        fl.topk_diagnostics(x.to(torch.complex64), 1)


def test_regime_names_exported():
    """The names come from the extension (plan.h), indexed by the codes it also exports."""
    C = fl._C
    assert C.SOFT_REGIME_NAMES[C.SOFT_WARP_ROWS] == "warp-rows" and C.SOFT_REGIME_NAMES[C.SOFT_CPU_SORT] == "cpu-sort"
    assert C.TOPK_REGIME_NAMES[C.TOPK_GRID] == "grid" and C.TOPK_REGIME_NAMES[C.TOPK_CPU] == "cpu"
    assert len(set(C.SOFT_REGIME_NAMES)) == 6 and len(set(C.TOPK_REGIME_NAMES)) == 6
    assert fl.lapsum_diagnostics(torch.randn(2, 5), 1.0).regime in C.SOFT_REGIME_NAMES


def test_diagnostics_under_compile():
    """The regime ops return an int, which a graph cannot hold: compiled, lapsum_diagnostics
    still traces whole (regime left empty) and topk_diagnostics runs eagerly."""
    x = torch.randn(3, 10, generator=gen(5))
    info = torch.compile(lambda x: fl.lapsum_diagnostics(x, 2.0), fullgraph=True, backend="eager")(x)
    assert info.regime == "" and torch.equal(info.threshold, fl.lapsum_diagnostics(x, 2.0).threshold)
    assert torch.compile(lambda x: fl.topk_diagnostics(x, 2), backend="eager")(x) == "cpu"
