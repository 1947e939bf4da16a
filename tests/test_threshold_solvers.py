"""The threshold solvers (DESIGN §1.1, §1.2): the sort solver, the certified sample
bracket with its retries, and the exact radix fallback.

The sample geometry below is computed exactly as csrc/common/bracket_rule.h does
(m = 4 n^(2/3) clamped to [1024, 65536], stride = n // m, per-row offset from mix32), so
that the periodic rows really show the sample a single phase of the row.
"""
import contextlib
import math

import numpy as np
import pytest
import torch

import fastlapsum as fl
from fastlapsum import reference

from conftest import BUDGET_TOL, DEVICES, budget_error, gen, mask_floor, outer_gap_test

EPS64 = torch.finfo(torch.float64).eps
INF = math.inf
M32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------
# the sample rule of bracket_rule.h, in Python


def mix32(x):
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


BRACKET_Z = 5.16  # kBracketZ of bracket_rule.h


def sample_geometry(n, row):
    """(m, stride, offset, count) of the systematic sample of row `row` of length n."""
    target = float(np.cbrt(np.float64(n)))
    m = int(4.0 * target * target)
    m = min(max(m, 1024), 1 << 16)
    stride = max(n // m, 1)
    offset = mix32((row & M32) ^ 0x5BD1E995) % stride
    count = (n - offset + stride - 1) // stride
    return m, stride, offset, count


def test_sample_geometry_matches_the_rule():
    # hand-checked values of the rule (4 n^(2/3) truncated, clamped)
    assert sample_geometry(50000, 0)[:2] == (5428, 9)
    assert sample_geometry(1000, 0)[:2] == (1024, 1)
    assert sample_geometry(10**9, 0)[:2] == (65536, 15258)
    for n, r in [(30000, 0), (50000, 3), (123457, 11)]:
        m, stride, offset, count = sample_geometry(n, r)
        assert 0 <= offset < stride and count == len(range(offset, n, stride))


# ---------------------------------------------------------------------------------
# adversarial rows


def periodic_row(n, row, huge_at_sample_phase, k_frac=None, seed=0):
    """Gaussian row plus one huge value per period, period = the sampling stride; the
    huge value sits at the sampled phase (the sample sees only huge values) or just
    after it (the sample sees none of them)."""
    _, stride, offset, _ = sample_geometry(n, row)
    x = torch.randn(n, generator=gen(seed), dtype=torch.float64)
    phase = offset if huge_at_sample_phase else (offset + 1) % stride
    idx = torch.arange(n)
    return torch.where(idx % stride == phase, 1e6 + x, x), stride


def adversarial_rows():
    """name -> (1-d float64 row, list of (k, t)). n between 20000 and 50000."""
    n = 30000
    g = gen(1)
    rows = {}
    gauss = torch.randn(n, generator=g, dtype=torch.float64)
    rows["gaussian"] = gauss
    u = torch.rand(n, generator=g, dtype=torch.float64)
    rows["cauchy"] = torch.tan(math.pi * (u - 0.5))
    rows["pareto"] = (torch.rand(n, generator=g, dtype=torch.float64) + 1e-12) ** -1.5
    rows["constant"] = torch.full((n,), 3.25, dtype=torch.float64)
    rows["ties16"] = torch.randint(0, 16, (n,), generator=g).double() * 0.5
    rows["binary"] = torch.randint(0, 2, (n,), generator=g).double()
    rows["ascending"] = torch.sort(torch.randn(n, generator=g, dtype=torch.float64)).values
    rows["descending"] = torch.sort(torch.randn(n, generator=g, dtype=torch.float64), descending=True).values
    rows["periodic_seen"] = periodic_row(n, 0, True, seed=2)[0]
    rows["periodic_missed"] = periodic_row(n, 0, False, seed=3)[0]
    levels = torch.randn(30, generator=g, dtype=torch.float64)
    rows["blocks"] = levels.repeat_interleave(n // 30)
    mixed = torch.randn(n, generator=g, dtype=torch.float64)
    perm = torch.randperm(n, generator=g)
    mixed[perm[:40]] = INF
    mixed[perm[40:2040]] = -INF
    rows["with_inf"] = mixed
    rows["wide_and_close"] = torch.cat([torch.randn(n // 2, generator=g, dtype=torch.float64) * 1e-6,
                                        torch.randn(n // 2, generator=g, dtype=torch.float64) * 1e3])
    return rows


# (k, t) pairs: k near 0 and near n, fractional and integral, tiny and huge temperatures
def cases_for(name, n):
    ks = [1e-3, 0.5, 3.0, n / 16, n / 3 + 0.37, n / 2, n - 1.0, n - 1e-3]
    ts = [1e-4, 1.0, 1e3, 1e-2]
    out = [(k, ts[i % len(ts)]) for i, k in enumerate(ks)]
    out += [(n / 16, 1e-4), (n / 2, 1e3), (1.0, 1.0)]
    if name == "with_inf":
        out += [(40.0, 1.0), (40.5, 1e-4), (n - 2000.0, 1.0), (n - 2000.5, 1.0)]
    if name == "periodic_missed":
        _, stride, _, _ = sample_geometry(n, 0)
        out += [(n / stride - 100.0, 1.0), (n / stride * 0.9, 1e-2)]
    return out


def oracle(x, k, t):
    """float64 oracle mask and threshold of a 1-d row, plus sum_i t*w_i (one thread)."""
    nt = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s = x.double().cpu()[None]
        kk = torch.tensor([k], dtype=torch.float64)
        tt = torch.tensor([t], dtype=torch.float64)
        b, edge = reference.lapsum_threshold_reference(s, kk, tt)
        p = reference.lapsum_mask_reference(s, b, tt, edge)[0]
        u = (s[0] - b) / t
        tw = torch.where(torch.isfinite(s[0]) & torch.isfinite(b), 0.5 * torch.exp(-u.abs()),
                         torch.zeros_like(u)).sum().item()
    finally:
        torch.set_num_threads(nt)
    return p, b.item(), tw


def mask_tol(dtype, p_ref, b, t, tw, k):
    """tests/test_soft_topk.py's rule (4x the same-precision error, plus for fp64 the
    threshold error admitted by the fp64 budget bound, capped at 1e-9), except that the cap
    is at least what two ulps of b move the mask by: where |b| >> t (a periodic row's huge
    values) b cannot be held closer."""
    sp = mask_floor(p_ref, dtype)
    tol = 4 * sp + (1e-15 if dtype == torch.float64 else 1e-12)
    if dtype == torch.float64:
        bb = abs(b) if math.isfinite(b) else 0.0
        cap = max(1e-9, 0.5 / t * 2 * math.ulp(bb))
        tol += min(0.5 / t * 8 * EPS64 * (1 + bb) + 0.5e-12 * max(k, 1.0) / max(tw, 1e-300), cap)
    return tol


def budget_bound(dtype, k, b, t, tw):
    """DESIGN §1.2: 1e-6 (fp32) / 1e-12 (fp64), plus 4 W ulp(b) / max(k, 1) where b itself
    cannot be held more precisely (|b| >> t with mass near b); W = sum w_i = tw / t."""
    extra = 4 * (tw / t) * math.ulp(b) / max(k, 1.0) if math.isfinite(b) else 0.0
    return BUDGET_TOL[dtype] + extra


ROWS = adversarial_rows()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(ROWS))
def test_sort_and_bracket_agree_on_adversarial_rows(device, name, dtype):
    x = ROWS[name].to(dtype).to(device)
    n = x.shape[0]
    fails = []
    for k, t in cases_for(name, n):
        p_ref, b_ref, tw = oracle(x, k, t)
        tol = mask_tol(dtype, p_ref, b_ref, t, tw, k)
        bound = budget_bound(dtype, k, b_ref, t, tw)
        masks = {}
        for method in ("sort", "bracket", "auto"):
            p = fl.soft_topk(x, k, t, method=method)
            masks[method] = p.double().cpu()
            be = budget_error(p, k).item()
            if not be <= bound:
                fails.append(f"{name} k={k} t={t} {method}: budget error {be:.3e} > {bound:.3e}")
            err = (masks[method] - p_ref).abs().max().item()
            if not err <= tol:
                fails.append(f"{name} k={k} t={t} {method}: mask error vs oracle {err:.3e} > {tol:.3e}")
        d = (masks["sort"] - masks["bracket"]).abs().max().item()
        if not d <= 2 * tol:
            fails.append(f"{name} k={k} t={t}: sort vs bracket {d:.3e} > {2 * tol:.3e}")
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("name", ["gaussian", "ties16", "periodic_seen", "with_inf", "constant"])
def test_sort_and_bracket_thresholds_agree(device, name):
    x = ROWS[name].to(device)
    n = x.shape[0]
    for k, t in [(n / 16, 1.0), (n / 3 + 0.37, 1e-2), (2.5, 1e3)]:
        bs = fl.lapsum_threshold(x, k, t, method="sort").item()
        bb = fl.lapsum_threshold(x, k, t, method="bracket").item()
        _, b_ref, tw = oracle(x, k, t)
        if not math.isfinite(b_ref):  # k <= #(+inf) or k >= n - #(-inf)
            assert bs == b_ref and bb == b_ref, (k, t, bs, bb, b_ref)
            continue
        tol = 16 * EPS64 * (1 + abs(b_ref)) + 1e-12 * max(k, 1) * t / max(tw, 1e-300)
        assert abs(bs - b_ref) <= tol and abs(bb - b_ref) <= tol, (k, t, bs, bb, b_ref, tol)


# ---------------------------------------------------------------------------------
# diagnostics prove the paths


def _check_exact(x, k, t, method):
    p = fl.soft_topk(x, k, t, method=method)
    p_ref, b_ref, tw = oracle(x, k, t)
    assert budget_error(p, k).item() <= budget_bound(x.dtype, k, b_ref, t, tw)
    assert (p.double().cpu() - p_ref).abs().max().item() <= mask_tol(x.dtype, p_ref, b_ref, t, tw, k)


# Both engines run the certified sample bracket. How a solver is *chosen* differs: on
# CUDA, auto and sort solve rows of up to 4096 scores on chip with the sort solver and
# longer rows with the bracket (auto) or the exact radix bracket (sort); the CPU switches
# at the same length (plan.h) and its sort handles rows of any length. The CUDA engine does not widen
# and retry: a bracket that fails goes straight to the radix bracket.
BRACKET_DEVICES = DEVICES
CPU_SOLVER_CHOICE = ["cpu"]


@pytest.mark.parametrize("device", BRACKET_DEVICES)
@pytest.mark.parametrize("method", ["bracket", "auto"])
def test_gaussian_row_takes_the_bracket_first_try(device, method):
    n = 50000
    x = torch.randn(n, generator=gen(20)).to(device)
    # the middle set is a slice of the row, not the row: with m = 1357 samples and
    # z = 5.16 the bracket spans about +-7% of the noised sample at k = n/2 (measured
    # 19% of the row at t = 1), far less away from the median
    for k, t, frac in [(n / 16, 1.0, 1 / 20), (n / 2, 1.0, 1 / 4), (n / 2, 0.1, 1 / 4), (100.5, 0.1, 1 / 50)]:
        info = fl.lapsum_diagnostics(x, k, t, method=method)
        assert info.path.item() == fl.PATH_BRACKET, fl.PATH_NAMES[info.path.item()]
        assert info.attempts.item() == 1
        assert 0 < info.middle_size.item() < n * frac, info.middle_size.item()
        _check_exact(x, k, t, method)


@pytest.mark.parametrize("device", BRACKET_DEVICES)
def test_batch_of_gaussian_rows_bracket_each_row(device):
    x = torch.randn(8, 40000, generator=gen(21)).to(device)
    info = fl.lapsum_diagnostics(x, 2500.0, 0.5, method="bracket")
    assert info.path.shape == (8,)
    assert (info.path == fl.PATH_BRACKET).all() and (info.attempts == 1).all()
    assert (info.middle_size < 40000 // 8).all() and (info.middle_size > 0).all()


@pytest.mark.parametrize("device", CPU_SOLVER_CHOICE)
def test_auto_switches_solver_at_the_crossover(device):
    """auto (csrc/common/plan.h): the CPU sorts rows of at most AUTO_SORT_MAX_N_CPU scores
    and brackets longer ones, decided on the row length (infinities count: the host
    decides without reading the row). CUDA's crossover: tests/test_plan.py."""
    c = fl.functional.AUTO_SORT_MAX_N_CPU
    x = torch.randn(c + 1000, generator=gen(22)).to(device)
    for n, path in [(c, fl.PATH_SORT), (c + 1, fl.PATH_BRACKET), (c + 1000, fl.PATH_BRACKET)]:
        info = fl.lapsum_diagnostics(x[:n], 100.5, 1.0, method="auto")
        assert info.path.item() == path, (n, fl.PATH_NAMES[info.path.item()])
        if path == fl.PATH_SORT:
            assert info.middle_size.item() == n and info.attempts.item() == 0
        else:
            assert info.attempts.item() == 1
    # a long row with more -inf scores than the crossover is still bracketed (over its finite scores)
    y = torch.randn(c + 500, generator=gen(23))
    y[:c + 100] = -INF
    info = fl.lapsum_diagnostics(y.to(device), 100.0, 1.0, method="auto")
    assert info.path.item() == fl.PATH_BRACKET


@pytest.mark.parametrize("k", [50000.0, 50000.37, 49990.0, 55000.0, 30000.5, 3.5])
def test_constant_row_falls_back_to_radix(device, k):
    """All scores equal. Near k = n/2 the bracket holds the constant (the noised sample
    straddles it: q = 1 - k/n within the bracket's half-width of 1/2) and so the whole
    row, too wide to gather: the exact radix fallback must run. Away from n/2 an empty
    middle set may be certified instead. Either way p_i = k / n."""
    n = 100000
    x = torch.full((n,), -7.625, device=device)
    info = fl.lapsum_diagnostics(x, k, 1.0, method="bracket")
    count, q = sample_geometry(n, 0)[3], 1 - k / n  # the sample the bracket is drawn from
    if abs(q - 0.5) < 0.5 * BRACKET_Z * math.sqrt(q * (1 - q) / count):  # well inside
        assert info.path.item() == fl.PATH_RADIX, fl.PATH_NAMES[info.path.item()]
    else:
        assert info.path.item() in (fl.PATH_BRACKET, fl.PATH_BRACKET_RETRY, fl.PATH_RADIX)
    p = fl.soft_topk(x, k, 1.0, method="bracket")
    torch.testing.assert_close(p.double().cpu(), torch.full((n,), k / n, dtype=torch.float64),
                               rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    assert budget_error(p, k).item() <= BUDGET_TOL[torch.float32]
    bt = fl.lapsum_threshold(x, k, 1.0, method="bracket").item()
    bs = fl.lapsum_threshold(x, k, 1.0, method="sort").item()
    # fp32 scores on the GPU: fp32 exponentials in the row passes move b by <= ~2.4e-7 t
    assert abs(bt - bs) <= (1e-12 * (1 + abs(bs)) if device == "cpu" else 1e-6), (bt, bs)


def first_bracket(y, n, k):
    """The first attempt's bracket ends (bracket_rule.h bracket_indices) over the noised sample y."""
    m, q = len(y), (n - k) / n
    half = BRACKET_Z * math.sqrt(m * q * (1 - q)) + 2
    lo, hi = math.floor(q * m - half), math.ceil(q * m + half)
    y = np.sort(y)
    return (-INF if lo < 0 else y[lo]), (INF if hi >= m else y[hi])


def laplace_noise(s):
    """lapsum_math.h laplace_noise of sample slot s."""
    u = (mix32((s * 2654435761 + 0x9E3779B9) & M32) + 0.5) / 4294967296.0
    return math.log(2 * u) if u < 0.5 else -math.log(2 * (1 - u))


def test_middle_wider_than_a_part_gather(device):
    """A periodic row: its sampled phase at -10, every other score inside the first bracket
    that this sample gives, with a small k. That middle set holds nearly the whole row, more
    than the bracket's capacity in each ~2^15-score part, which the CPU's certification pass
    stops gathering (it then widens upwards or falls back). Whatever path follows, b is the
    sort solver's."""
    n, k, t = 1 << 20, 1000.0, 1.0
    _, stride, offset, count = sample_geometry(n, 0)
    aL, aR = first_bracket([-10.0 + t * laplace_noise(s) for s in range(count)], n, k)
    assert math.isfinite(aL) and aL < aR
    hi = aR if math.isfinite(aR) else aL + t
    x = aL + (hi - aL) * torch.rand(n, generator=gen(3), dtype=torch.float64) * 0.999
    x[offset::stride] = -10.0
    x = x.to(device)
    info = fl.lapsum_diagnostics(x, k, t, method="bracket")
    assert info.path.item() in (fl.PATH_BRACKET_RETRY, fl.PATH_RADIX), fl.PATH_NAMES[info.path.item()]
    bt = fl.lapsum_threshold(x, k, t, method="bracket").item()
    bs = fl.lapsum_threshold(x, k, t, method="sort").item()
    assert abs(bt - bs) <= (1e-12 * (1 + abs(bs)) if device == "cpu" else 1e-6), (bt, bs)


def test_constant_row_with_infinities_radix(device):
    n = 100000
    x = torch.full((n,), 2.0, dtype=torch.float64)
    x[:100] = INF
    x[100:5000] = -INF
    x = x.to(device)
    k = 100 + 95000 * 0.5 + 0.37
    info = fl.lapsum_diagnostics(x, k, 0.1, method="bracket")
    assert info.path.item() == fl.PATH_RADIX, fl.PATH_NAMES[info.path.item()]
    p = fl.soft_topk(x, k, 0.1, method="bracket").cpu()
    assert (p[:100] == 1).all() and (p[100:5000] == 0).all()
    share = (k - 100) / 95000
    torch.testing.assert_close(p[5000:], torch.full((95000,), share, dtype=torch.float64), rtol=1e-14, atol=0)


def radix_rows():
    """Rows (n = 1e5) whose certified bracket holds a tie block too big to gather, so
    the radix fallback runs; with the (k, t) for which that was measured to happen."""
    n = 100000
    g = gen(40)
    gauss = torch.randn(n, generator=g, dtype=torch.float64)
    mostly_const = torch.where(torch.rand(n, generator=g) < 0.7, torch.full_like(gauss, 0.25), gauss)
    two_level = (torch.rand(n, generator=g) < 0.5).double() * 1e-3
    const_plus_far = torch.ones(n, dtype=torch.float64)
    const_plus_far[:100] = 1e6
    const_plus_far[100:200] = -1e6
    const_fine = 1.0 + torch.randint(0, 3, (n,), generator=g).double() * 1e-12  # 3 values, ulps apart
    half = n / 2
    return {
        "mostly_const": (mostly_const, [(half, 1e3), (half + 0.37, 1e3)]),
        "two_level": (two_level, [(half, 1e-2), (half + 0.37, 1.0), (half, 1e3)]),
        "const_plus_far": (const_plus_far, [(half, 1e-4), (half + 0.37, 1e-4), (half + 0.37, 1.0)]),
        "const_fine": (const_fine, [(half, 1e-4), (half + 0.37, 1e-4), (half + 0.37, 1.0)]),
    }


RADIX_ROWS = radix_rows()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(RADIX_ROWS))
def test_radix_fallback_rows_are_exact(device, name, dtype):
    x, cases = RADIX_ROWS[name]
    x = x.to(dtype).to(device)
    for k, t in cases:
        info = fl.lapsum_diagnostics(x, k, t, method="bracket")
        assert info.path.item() == fl.PATH_RADIX, (k, t, fl.PATH_NAMES[info.path.item()])
        _check_exact(x, k, t, "bracket")
        bs = fl.lapsum_threshold(x, k, t, method="sort").item()
        br = info.threshold.item()
        _, b_ref, tw = oracle(x, k, t)
        tol = 16 * EPS64 * (1 + abs(b_ref)) + 1e-12 * max(k, 1) * t / max(tw, 1e-300)
        assert abs(br - b_ref) <= tol and abs(bs - b_ref) <= tol, (k, t, br, bs, b_ref, tol)


def test_periodic_row_defeats_the_sample_and_stays_exact(device):
    """Period = stride, the huge value at the sampled phase: the sample sees only huge
    values. For k = n/2 and n/16 the root lies far from the sample's quantile (among the
    Gaussian scores, or deep inside the huge ones), so the first bracket misses; for
    k = 10.5 it lies past the largest huge values, and the first bracket may hold it. The
    answer matches the sort solver either way."""
    n = 50000
    x, stride = periodic_row(n, 0, True, seed=24)
    # the sample really is all huge values
    _, _, offset, count = sample_geometry(n, 0)
    assert (x[offset::stride] > 1e5).all() and x[offset::stride].numel() == count
    x = x.float().to(device)
    for k, t in [(n / 2, 1.0), (n / 16, 1e-2), (10.5, 1.0)]:
        info = fl.lapsum_diagnostics(x, k, t, method="bracket")
        if k >= n / 16:
            assert info.path.item() in (fl.PATH_BRACKET_RETRY, fl.PATH_RADIX), fl.PATH_NAMES[info.path.item()]
            if device == "cpu":  # the CUDA engine goes straight to the radix bracket
                assert info.attempts.item() > 1
        _check_exact(x, k, t, "bracket")
        torch.testing.assert_close(fl.lapsum_threshold(x, k, t, method="bracket"),
                                   fl.lapsum_threshold(x, k, t, method="sort"), rtol=1e-13, atol=1e-13)


def test_periodic_rows_per_row_offset(device):
    """Each row of a batch has its own sample offset: build every row against its own."""
    n, rows = 30000, 4
    xs = torch.stack([periodic_row(n, r, True, seed=30 + r)[0] for r in range(rows)])
    offsets = {sample_geometry(n, r)[2] for r in range(rows)}
    assert len(offsets) > 1  # the rows really are sampled at different phases
    xs = xs.to(device)
    info = fl.lapsum_diagnostics(xs, n / 2, 1.0, method="bracket")
    assert ((info.path == fl.PATH_BRACKET_RETRY) | (info.path == fl.PATH_RADIX)).all(), info.path
    if device == "cpu":  # the CUDA engine goes straight to the radix bracket
        assert (info.attempts > 1).all()
    p = fl.soft_topk(xs, n / 2, 1.0, method="bracket")
    ps = fl.soft_topk(xs, n / 2, 1.0, method="sort")
    assert budget_error(p, n / 2).item() <= BUDGET_TOL[torch.float64]
    torch.testing.assert_close(p, ps, rtol=0, atol=1e-12)


def test_periodic_row_missed_huge_values_retry(device):
    """The sample never sees the ~n/stride huge values and the budget falls among them:
    the first bracket's upper end is a Gaussian order statistic, below b: retry."""
    n = 50000
    x, stride = periodic_row(n, 0, False, seed=25)
    x = x.to(device)
    k = n / stride - 60.0  # b among the huge values, bracket end finite on the 1st try
    info = fl.lapsum_diagnostics(x, k, 1.0, method="bracket")
    assert info.path.item() in (fl.PATH_BRACKET_RETRY, fl.PATH_RADIX), fl.PATH_NAMES[info.path.item()]
    if device == "cpu":  # the CUDA engine goes straight to the radix bracket
        assert info.attempts.item() > 1
    _check_exact(x, k, 1.0, "bracket")


@pytest.mark.parametrize("device", CPU_SOLVER_CHOICE)
def test_sort_method_reports_sort(device):
    """A budget whose root lies among the scores (the outer gap's test fails: §1.1.1 would
    answer without a sort), forced onto the sort solver on long rows."""
    x = torch.randn(3, 30000, generator=gen(26), dtype=torch.float64)
    x[1, :10] = INF
    x[2, :10] = -INF
    assert not any(outer_gap_test(x[r], 1000.0, 1.0)[0] for r in range(3))
    info = fl.lapsum_diagnostics(x.to(device), 1000.0, 1.0, method="sort")
    assert (info.path == fl.PATH_SORT).all()
    assert info.middle_size.tolist() == [30000, 29990, 29990]
    assert (info.attempts == 0).all()
    _, b_ref, _ = oracle(x[0], 1000.0, 1.0)
    assert abs(info.threshold[0].item() - b_ref) <= 1e-12 * (1 + abs(b_ref))


@pytest.mark.parametrize("method", ["auto", "sort", "bracket"])
def test_direct_path_for_trivial_budgets(device, method):
    n = 40000
    x = torch.randn(n, generator=gen(27), dtype=torch.float64)
    for k in [0.0, float(n)]:
        info = fl.lapsum_diagnostics(x.to(device), k, 1.0, method=method)
        assert info.path.item() == fl.PATH_DIRECT and info.attempts.item() == 0
        assert info.threshold.item() == (INF if k == 0 else -INF)
    # budget used up by the +inf scores, or needing the -inf ones: no solve either
    y = x.clone()
    y[:5] = INF
    y[5:20] = -INF
    for k in [3.0, 5.0, n - 15.0, n - 1.0]:
        info = fl.lapsum_diagnostics(y.to(device), k, 1.0, method=method)
        assert info.path.item() == fl.PATH_DIRECT, (k, fl.PATH_NAMES[info.path.item()])
    # a NaN row
    y[100] = math.nan
    info = fl.lapsum_diagnostics(y.to(device), 1000.0, 1.0, method=method)
    assert info.path.item() == fl.PATH_DIRECT and math.isnan(info.threshold.item())


def test_diagnostics_threshold_equals_lapsum_threshold(device):
    x = torch.randn(2, 3, 20000, generator=gen(28)).to(device)
    k = torch.tensor([[5.0, 600.5, 19999.0], [1e-3, 10000.0, 2.0]], dtype=torch.float64, device=device)
    info = fl.lapsum_diagnostics(x, k, 0.3, method="bracket")
    assert info.threshold.shape == (2, 3) and info.path.shape == (2, 3)
    torch.testing.assert_close(info.threshold, fl.lapsum_threshold(x, k, 0.3, method="bracket"), rtol=0, atol=0)


# ---------------------------------------------------------------------------------
# determinism


@contextlib.contextmanager
def num_threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _determinism_inputs(device):
    x = torch.randn(3, 100000, generator=gen(29))  # > 1 part of 32768 per row
    x[1] = x[1].round()  # ties
    x[2, ::7] = -INF
    k = torch.tensor([6250.0, 33333.7, 1e-3], dtype=torch.float64)
    t = torch.tensor([1.0, 1e-2, 1e3], dtype=torch.float64)
    return x.to(device), k.to(device), t.to(device)


def _run_all(x, k, t):
    out = {}
    for method in ("sort", "bracket", "auto"):
        out[f"p_{method}"] = fl.soft_topk(x, k, t, method=method)
        out[f"b_{method}"] = fl.lapsum_threshold(x, k, t, method=method)
    xr = x.clone().requires_grad_(True)
    p = fl.soft_topk(xr, k, t)
    (p * torch.linspace(-1, 1, x.shape[-1], device=x.device)).sum().backward()
    out["grad"] = xr.grad
    out["const_radix"] = fl.soft_topk(torch.full((100000,), 1.5, device=x.device), 40000.5, 1.0, method="bracket")
    return out


def test_deterministic_same_call_twice(device):
    x, k, t = _determinism_inputs(device)
    a, b = _run_all(x, k, t), _run_all(x, k, t)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_independent_of_thread_count(device):
    x, k, t = _determinism_inputs(device)
    with num_threads(1):
        a = _run_all(x, k, t)
    with num_threads(2):
        b = _run_all(x, k, t)
    for key in a:
        assert torch.equal(a[key], b[key]), key
