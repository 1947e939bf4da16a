"""CUDA path: results equal the CPU kernels' (soft ops, backward, topk; adversarial rows,
the bracket's corner cases, the on-chip sort). Graphs, opcheck, compile and 64-bit indexing:
test_cuda_integration.py. Runs only with a CUDA device and the CUDA build."""
import math

import pytest
import torch

import fastlapsum

from conftest import (BUDGET_TOL, DTYPES, G_TOL, P_TOL, assert_b_matches_cpu, assert_exact_topk, budget_error, gen,
                      requires_cuda, ulp_above)

pytestmark = requires_cuda

ops = torch.ops.fastlapsum
F64 = torch.float64


def adversarial_rows(n=4096, seed=0):
    """float64 [rows, n] on the CPU: the shapes that break selectors and solvers."""
    g = gen(seed)
    i = torch.arange(n, dtype=F64)
    rows = [
        torch.randn(n, generator=g, dtype=F64),
        torch.randint(0, 5, (n,), generator=g).double(),  # ties everywhere
        torch.full((n,), 0.25, dtype=F64),  # constant
        i,  # sorted ascending
        i.flip(0),  # sorted descending
        (i % 64),  # period 64
        torch.where(i % 128 == 5, 10.0 + i / n, 0.0),  # one phase of period 128 holds the top
        1e4 + 1e-2 * torch.randn(n, generator=g, dtype=F64),  # |b| >> t
        1e-3 * torch.randn(n, generator=g, dtype=F64),  # all within t of each other
        torch.where(torch.rand(n, generator=g, dtype=F64) < 0.002, torch.randn(n, generator=g, dtype=F64),
                    torch.tensor(-math.inf, dtype=F64)),  # -inf but for a few
    ]
    r = torch.randn(n, generator=g, dtype=F64)
    r[[3, n // 4, n // 2]] = math.inf
    rows.append(r)
    return torch.stack(rows)


def budgets(rows, n):
    base = torch.tensor([1.0, 2.5, n / 16, n / 2 + 0.25, n - 1.5, 7.0, 31.0, 100.0, n / 3, 5.0, 2.0], dtype=F64)
    return base.repeat(rows // len(base) + 1)[:rows]


def to(x, dtype, device):
    return x.to(dtype).to(device)


# ---- CUDA == CPU -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("largest", [True, False])
def test_soft_matches_cpu(dtype, largest):
    xs = [adversarial_rows(4096, seed=1), torch.randn(16, 30000, generator=gen(2), dtype=F64)]
    for x64 in xs:
        rows, n = x64.shape
        k = budgets(rows, n)
        t = torch.linspace(0.05, 3.0, rows, dtype=F64)
        xc, xg = to(x64, dtype, "cpu"), to(x64, dtype, "cuda")
        for method in ("auto", "sort", "bracket"):
            pc = fastlapsum.soft_topk(xc, k, t, largest=largest, method=method)
            pg = fastlapsum.soft_topk(xg, k.cuda(), t.cuda(), largest=largest, method=method)
            assert pg.dtype == dtype and pg.device.type == "cuda"
            torch.testing.assert_close(pg.cpu().double(), pc.double(), rtol=0, atol=P_TOL[dtype])
            assert budget_error(pg, k.cuda()) <= BUDGET_TOL[dtype]
        lc = fastlapsum.log_soft_topk(xc, k, t, largest=largest)
        lg = fastlapsum.log_soft_topk(xg, k.cuda(), t.cuda(), largest=largest)
        torch.testing.assert_close(lg.cpu().double().exp(), lc.double().exp(), rtol=10 * P_TOL[dtype], atol=P_TOL[dtype])
        bc = fastlapsum.lapsum_threshold(xc, k, t, largest=largest)
        bg = fastlapsum.lapsum_threshold(xg, k.cuda(), t.cuda(), largest=largest)
        # fp32/fp16/bf16 scores: the GPU's exponentials are fp32 (<= 2 ulp), which moves b by
        # at most ~2.4e-7 t (the uncertain mass near b is <= t W); fp64 scores: exact
        b_tol = 1e-9 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(bg.cpu(), bc, rtol=b_tol, atol=b_tol * t.max().item())
        kh = k.round()
        hc = fastlapsum.soft_topk(xc, kh, t, largest=largest, hard=True)
        hg = fastlapsum.soft_topk(xg, kh.cuda(), t.cuda(), largest=largest, hard=True)
        assert torch.equal(hg.cpu(), hc), "hard masks differ (ties: the smaller index wins on both)"
        assert hg.double().sum(1).cpu().tolist() == kh.tolist()


@pytest.mark.parametrize("largest", [True, False])
def test_fp32_mask_outside_float_range_matches_cpu(largest):
    # Long fp32 rows take the fp32 mask kernel, whose float-float argument needs |b| <= 2^100
    # and 2^-60 <= 1/t <= 2^60; rows past those limits take its fp64 fallback.
    n = 6000
    g = gen(11)
    x = torch.stack([torch.randn(n, generator=g, dtype=F64),  # t = 1e25: every p near k/n
                     torch.randn(n, generator=g, dtype=F64),  # t = 1e-25: a hard mask
                     1e31 * torch.randn(n, generator=g, dtype=F64)])  # |b| > 2^100, t = 1e30
    k = torch.tensor([n / 16, 100.0, n / 3], dtype=F64)  # t = 1e-25: b anywhere in a gap gives 0/1
    t = torch.tensor([1e25, 1e-25, 1e30], dtype=F64)
    pc = fastlapsum.soft_topk(x.float(), k, t, largest=largest)
    pg = fastlapsum.soft_topk(x.float().cuda(), k.cuda(), t.cuda(), largest=largest)
    torch.testing.assert_close(pg.cpu().double(), pc.double(), rtol=0, atol=P_TOL[torch.float32])
    assert budget_error(pg, k.cuda()) <= BUDGET_TOL[torch.float32]


@pytest.mark.parametrize("n", [1000, 4096])  # the on-chip sort solver's two shapes
def test_subnormal_temperature_matches_cpu(n):
    # fp64 scores and t in the subnormal range: 1/t overflows (inv_temperature caps it), so the
    # on-chip solver must scale the differences, not multiply them by the capped reciprocal
    x = torch.randn(4, n, generator=gen(7), dtype=F64) * 1e-308
    k = torch.tensor([1.0, n / 16, n / 2 + 0.5, n - 3.0], dtype=F64)
    t = torch.tensor([1e-310, 3e-309, 1e-312, 2e-308], dtype=F64)
    bc = fastlapsum.lapsum_threshold(x, k, t)
    bg = fastlapsum.lapsum_threshold(x.cuda(), k.cuda(), t.cuda()).cpu()
    torch.testing.assert_close(bg, bc, rtol=1e-9, atol=1e-9 * float(t.min()))
    assert budget_error(fastlapsum.soft_topk(x.cuda(), k.cuda(), t.cuda()), k.cuda()) <= BUDGET_TOL[F64]


@pytest.mark.parametrize("largest", [True, False])
def test_fp32_scores_near_zero_match_cpu(largest):
    # fp32 scores of ~1e-36 (a row half exact zeros, a row of subnormals): every bracket end
    # lies within 2^-100 of zero, where the gathering pass needs its exact side tests (a
    # positive difference can be below 2^-126), not the one-multiply ones of ends far from 0
    g = gen(11)
    n = 20000
    x64 = torch.randn(3, n, generator=g, dtype=F64) * 1e-36
    x64[1] = torch.where(torch.rand(n, generator=g, dtype=F64) < 0.5, 0.0, x64[1])
    x64[2] *= 1e-3
    k = torch.tensor([n / 16, n / 3, 100.0], dtype=F64)
    t = torch.tensor([1e-37, 3e-37, 2e-37], dtype=F64)
    xc = x64.float()
    for method in ("auto", "bracket"):
        pc = fastlapsum.soft_topk(xc, k, t, largest=largest, method=method)
        pg = fastlapsum.soft_topk(xc.cuda(), k.cuda(), t.cuda(), largest=largest, method=method)
        torch.testing.assert_close(pg.cpu().double(), pc.double(), rtol=0, atol=P_TOL[torch.float32])
        assert budget_error(pg, k.cuda()) <= BUDGET_TOL[torch.float32]


@pytest.mark.parametrize("n", [512, 6000])  # the on-chip solver; the long-row solver
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_rows_match_cpu(dtype, n):
    x = adversarial_rows(n, seed=3)
    x[2, 17] = math.nan
    x[5] = math.nan
    k, t = budgets(x.shape[0], n), torch.full((x.shape[0],), 0.5, dtype=F64)
    ok = [r for r in range(x.shape[0]) if r not in (2, 5)]
    for hard in (False, True):
        kk = k.round() if hard else k
        pc = fastlapsum.soft_topk(to(x, dtype, "cpu"), kk, t, hard=hard)
        pg = fastlapsum.soft_topk(to(x, dtype, "cuda"), kk.cuda(), t.cuda(), hard=hard).cpu()
        assert bool(pg[[2, 5]].isnan().all())
        torch.testing.assert_close(pg[ok].double(), pc[ok].double(), rtol=0, atol=0 if hard else P_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("largest", [True, False])
def test_backward_matches_cpu(dtype, largest):
    x64 = torch.cat([adversarial_rows(2048, seed=4)[:9], torch.randn(4, 2048, generator=gen(5), dtype=F64)])
    rows, n = x64.shape
    k0, t0 = budgets(rows, n), torch.linspace(0.1, 2.0, rows, dtype=F64)
    w64 = torch.randn(rows, n, generator=gen(6), dtype=F64)
    grads = {}
    for dev in ("cpu", "cuda"):
        x = to(x64, dtype, dev).requires_grad_()
        k, t = k0.to(dev).requires_grad_(), t0.to(dev).requires_grad_()
        w = to(w64, dtype, dev)
        loss = ((fastlapsum.soft_topk(x, k, t, largest=largest) * w).double().sum()
                + (fastlapsum.soft_topk(x, k.detach().round(), t, largest=largest, hard=True) * w).double().sum()
                + fastlapsum.lapsum_threshold(x, k, t, largest=largest).sum())
        lp = fastlapsum.log_soft_topk(x, k, t, largest=largest)
        loss = loss + (torch.where(torch.isfinite(lp), lp, 0) * w).double().sum() * 1e-3
        grads[dev] = [g.cpu().double() for g in torch.autograd.grad(loss, (x, k, t))]
    for gc, gg in zip(grads["cpu"], grads["cuda"]):
        assert bool(torch.isfinite(gg).all())
        scale = gc.abs().max().clamp(min=1e-30)
        torch.testing.assert_close(gg / scale, gc / scale, rtol=0, atol=G_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("largest", [True, False])
def test_topk_matches_cpu(dtype, largest):
    x64 = torch.cat([adversarial_rows(8192, seed=7), torch.randn(8, 8192, generator=gen(8), dtype=F64)])
    x64[0, [10, 20]] = math.nan
    rows, n = x64.shape
    lengths = torch.tensor([0, 1, 2047, 2048, 2049, 4096, 8192, 100, 8191, 5000, 3000, 17, 8192, 0, 4000, 6000,
                            7000, 2048, 8192])[:rows]
    for r, l in enumerate(lengths.tolist()):  # garbage past L_r
        x64[r, l:] = math.inf if largest else -math.inf
    xc, xg = to(x64, dtype, "cpu"), to(x64, dtype, "cuda")
    for k in (1, 64, 2048):
        for lens in (None, lengths):
            vg, ig = fastlapsum.topk(xg, k, largest=largest, sorted=True,
                                     lengths=None if lens is None else lens.cuda())
            vc, ic = fastlapsum.topk(xc, k, largest=largest, sorted=True, lengths=lens)
            assert_exact_topk(xg, k, vg, ig, largest=largest, lengths=lens, sorted=True)
            torch.testing.assert_close(vg.cpu(), vc, rtol=0, atol=0, equal_nan=True)
            vu, iu = fastlapsum.topk(xg, k, largest=largest, lengths=None if lens is None else lens.cuda())
            assert_exact_topk(xg, k, vu, iu, largest=largest, lengths=lens)


@pytest.mark.parametrize("shape,k", [((64, 131072), 2048), ((2, 1 << 20), 2048), ((1, 1 << 24), 1 << 20)])
def test_topk_large_shapes(shape, k):
    """The execution mappings of DESIGN §2: many long rows, few long rows, one huge row."""
    x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(9))
    lengths = torch.linspace(0, shape[1], shape[0]).round().to(torch.int64).cuda() if shape[0] > 1 else None
    v, i = fastlapsum.topk(x, k, lengths=lengths)
    assert_exact_topk(x, k, v, i, lengths=lengths)
    vs, _ = fastlapsum.topk(x, k, sorted=True)
    torch.testing.assert_close(vs, torch.topk(x, k).values, rtol=0, atol=0)


@pytest.mark.parametrize("largest", [True, False])
def test_bracket_on_long_rows(largest):
    """Rows of 3M scores (a sample of ~66.7K keys, the cap): the bracket's thresholds equal the
    radix bracket's, the Gaussian row certifies on its first attempt with a small middle
    set, ties and |b| >> t rows stay exact."""
    n = 3_000_000
    g = gen(31)
    x = torch.stack([torch.randn(n, generator=g), torch.randint(0, 5, (n,), generator=g).float(),
                     1e4 + 1e-2 * torch.randn(n, generator=g)]).cuda()
    k = torch.tensor([n / 16, n / 2 + 0.25, 1000.5], dtype=F64).cuda()
    t = torch.tensor([1.0, 0.5, 1e-2], dtype=F64).cuda()
    bb = fastlapsum.lapsum_threshold(x, k, t, largest=largest, method="bracket").cpu()
    bs = fastlapsum.lapsum_threshold(x, k, t, largest=largest, method="sort").cpu()
    # fp32 rows: both paths sum fp32 exponentials (~2 ulp each) in fp64, against different
    # reference points, so they agree to ~1e-7 t, not to fp64 (2.3e-8 measured on row 0)
    assert ((bb - bs).abs() <= 1e-6 * t.cpu()).all(), (bb, bs)
    info = fastlapsum.lapsum_diagnostics(x, k, t, largest=largest, method="bracket")
    assert info.path[0].item() == fastlapsum.PATH_BRACKET and info.attempts[0].item() == 1
    assert 0 < info.middle_size[0].item() < n // 50, info.middle_size[0].item()
    p = fastlapsum.soft_topk(x, k, t, largest=largest, method="bracket")
    assert (budget_error(p, k) <= BUDGET_TOL[torch.float32]).all()


@pytest.mark.parametrize("copies", [1, 80, 2000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bracket_root_bin_with_ties(copies, dtype):
    """Ties packed at the root of a row of 1M scores: copies of the three scores nearest it
    (80 each: ~240 tied scores at the root; 2000 each: ~6000, and the middle set grows to
    ~8.6K). The bracket must give the radix bracket's threshold. fp64 rows go through the
    binning levels (the root's bin holds the ties); fp32 rows with a middle set that fits
    one CTA (copies 1 and 80, ~2.6K scores) are sorted on chip, and 2000 copies sit at the
    8192 limit, so which solver takes them depends on the draw."""
    n = 1_000_000
    g = gen(41 + copies)
    x = torch.randn(n, generator=g, dtype=F64)
    k = torch.tensor([n / 16], dtype=F64).cuda()
    t = torch.tensor([1.0], dtype=F64).cuda()
    b0 = fastlapsum.lapsum_threshold(x.to(dtype).cuda()[None], k, t, method="sort").item()
    near = x[(x - b0).abs().argsort()[:3]]
    x[torch.randperm(n, generator=g)[: 3 * copies]] = near.repeat_interleave(copies)
    xc = x.to(dtype).cuda()[None]
    bb = fastlapsum.lapsum_threshold(xc, k, t, method="bracket").item()
    bs = fastlapsum.lapsum_threshold(xc, k, t, method="sort").item()
    assert abs(bb - bs) <= (1e-6 if dtype == torch.float32 else 1e-9), (bb, bs)
    p = fastlapsum.soft_topk(xc, k, t, method="bracket")
    assert (budget_error(p, k) <= BUDGET_TOL[dtype]).all()


@pytest.mark.parametrize("rows, n", [(1, 100_000), (2, 500_000)])
def test_repeated_fp64_calls_match_cpu(rows, n):
    """fp64 rows of one tile a gathering block: no sorted middle kernel, so the chain's
    kernels read their rows' status before they wait. Ten calls on new data, each reusing the
    workspace memory of the one before (whose states say done), give the CPU's thresholds: a
    status read before this call wrote it would skip a pass and show here."""
    g = gen(70 + rows)
    k = torch.tensor([n / 16, n / 3][:rows], dtype=F64)
    t = torch.tensor([1.0, 0.3][:rows], dtype=F64)
    for call in range(10):
        x = torch.randn(rows, n, generator=g, dtype=F64)
        bc = fastlapsum.lapsum_threshold(x, k, t)
        bg = fastlapsum.lapsum_threshold(x.cuda(), k.cuda(), t.cuda(), method="bracket").cpu()
        assert ((bg - bc).abs() <= 1e-9 * t + 4 * ulp_above(bc)).all(), (call, bg, bc)


@pytest.mark.parametrize("n", [1000, 2000, 4096])  # the on-chip sort at 2, 4 and 8 scores a thread
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_on_chip_bucket_sort_matches_cpu(n, dtype):
    """The on-chip sort's bucket pass (one bucket per ~key by value, ranks counted inside) on
    rows it takes: distinct spread scores, pairs of equal scores (up to 12 ties a bucket),
    neighbouring floats (one ulp apart, t = 8 ulp: their order sets b); and rows it hands to
    the radix sort: an outlier that squeezes the rest into one bucket, a tight cluster, +-inf.
    Which rows take which sort is by construction (checked with a CPU model of the buckets),
    not observed. All must give the CPU's threshold, to 1e-9 t (fp64) or 1e-6 t (fp32
    scores) plus 4 ulp of b."""
    g = gen(61 + n)
    half = torch.randn(n // 2, generator=g, dtype=F64)
    pairs = half.repeat_interleave(2)[torch.randperm(n, generator=g)]
    ulp = float(torch.nextafter(torch.ones(1, dtype=dtype), torch.full((1,), 2.0, dtype=dtype))[0] - 1)
    neighbours = (1.0 + ulp * torch.randperm(n, generator=g).to(dtype)).double()
    outlier = torch.randn(n, generator=g, dtype=F64)
    outlier[7] = 1e6
    cluster = torch.where(torch.rand(n, generator=g, dtype=F64) < 0.5, 1e-6 * torch.rand(n, generator=g, dtype=F64),
                          torch.randn(n, generator=g, dtype=F64))
    infs = torch.randn(n, generator=g, dtype=F64)
    infs[[1, n // 3]] = math.inf
    infs[n // 2] = -math.inf
    x = torch.stack([torch.randn(n, generator=g, dtype=F64), pairs, neighbours, outlier, cluster, infs]).to(dtype)
    k = torch.tensor([n / 16, n / 2 + 0.25, 3.5, n - 2.5, n / 3, 100.0], dtype=F64)
    t = torch.tensor([1.0, 0.05, 8 * ulp, 2.0, 1e-7, 0.3], dtype=F64)
    bc = fastlapsum.lapsum_threshold(x, k, t)
    bg = fastlapsum.lapsum_threshold(x.cuda(), k.cuda(), t.cuda()).cpu()
    ulp_b = ulp_above(bc)
    b_tol = 1e-9 if dtype == F64 else 1e-6
    assert ((bg - bc).abs() <= b_tol * t + 4 * ulp_b).all(), (bg, bc)
    # DESIGN §1.2's bound: where |b| >> t and many scores lie within t of b (the neighbouring
    # floats), one ulp of b moves the budget by W ulp(b)
    p = fastlapsum.soft_topk(x.cuda(), k.cuda(), t.cuda()).cpu().double()
    w = (torch.minimum(p, 1 - p) / t[:, None]).sum(1)
    err = (p.sum(1) - k).abs() / k.clamp(min=1)
    assert (err <= BUDGET_TOL[dtype] + 4 * w * ulp_b / k.clamp(min=1)).all(), err


def test_bracket_middle_set_of_pairs():
    """A middle set sorted on chip whose scores come in equal pairs (ties inside the bucket
    pass's buckets) gives the radix bracket's threshold."""
    n = 1 << 18
    g = gen(71)
    x = torch.randn(n // 2, generator=g).repeat_interleave(2)[torch.randperm(n, generator=g)]
    xc = torch.stack([x, -x]).cuda()
    k = torch.tensor([n / 16, n / 8 + 0.5], dtype=F64).cuda()
    t = torch.tensor([1.0, 0.2], dtype=F64).cuda()
    bb = fastlapsum.lapsum_threshold(xc, k, t, method="bracket").cpu()
    bs = fastlapsum.lapsum_threshold(xc, k, t, method="sort").cpu()
    assert ((bb - bs).abs() <= 1e-6 * t.cpu()).all(), (bb, bs)
    info = fastlapsum.lapsum_diagnostics(xc, k, t, method="bracket")
    assert (info.path.cpu() == fastlapsum.PATH_BRACKET).all() and (info.middle_size.cpu() <= 8192).all(), info


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("largest", [True, False])
def test_bracket_sorted_middle_set(dtype, largest):
    """Rows up to 2^21 solve a gathered middle set that fits one CTA on chip, its tails
    outside the bracket folded in, sorted at 4, 8 or 16 scores a thread (the ~100, ~2.6K
    and ~5K sets below); a bigger set (t = 30: the bracket holds much of the row; a uniform
    row at its median) goes on to the binning levels or the fallback. All equal the radix
    bracket; the Gaussian rows certify on their first try."""
    n = 1 << 21
    g = gen(51)
    x = torch.stack([torch.randn(n, generator=g), torch.randn(n, generator=g), torch.rand(n, generator=g),
                     torch.randint(0, 3000, (n,), generator=g).float() / 3000, torch.randn(n, generator=g),
                     torch.randn(n, generator=g)])
    k = torch.tensor([n / 16, 3.5, n / 2 + 0.25, n - 1000.5, n / 16, n / 32], dtype=F64).cuda()
    t = torch.tensor([1.0, 0.05, 0.01, 1e-4, 30.0, 0.8], dtype=F64).cuda()
    xc = x.to(dtype).cuda()
    bb = fastlapsum.lapsum_threshold(xc, k, t, largest=largest, method="bracket").cpu()
    bs = fastlapsum.lapsum_threshold(xc, k, t, largest=largest, method="sort").cpu()
    assert ((bb - bs).abs() <= 1e-6 * t.cpu()).all(), (bb, bs)
    info = fastlapsum.lapsum_diagnostics(xc, k, t, largest=largest, method="bracket")
    for row in (0, 5):
        assert info.path[row].item() == fastlapsum.PATH_BRACKET and info.attempts[row].item() == 1
    middle = info.middle_size.tolist()
    assert 0 < middle[0] <= 8192 and 0 < middle[5] <= 8192 and 0 < middle[1] <= 2048, middle
    if dtype == torch.float32:  # bf16's coarse values tie: their sets differ
        assert 4096 < middle[0] and 2048 < middle[5] <= 4096, middle
    p = fastlapsum.soft_topk(xc, k, t, largest=largest, method="bracket")
    assert (budget_error(p, k) <= BUDGET_TOL[dtype]).all()


# ---- the fused tail: each scan and the solve in the last block of the launch before ------
# (threshold_cuda.cu; FASTLAPSUM_FUSED_TAIL=0 launches them on their own). Both sequences
# fold every sum in one fixed order, at two block sizes (512 threads fused, 256 on their own):
# the same paths, thresholds within a few ulps, and each sequence the same bits on every call.

METHOD = {"sort": 1, "bracket": 2}


def fused_tail_rows(rows, n, seed):
    """float64 [rows, n] with budgets and temperatures, cycling through: a Gaussian row (the
    bracket certifies), ties, a constant row (the bracket falls back to the radix levels),
    +-inf, a NaN (settled at the first scan), |b| >> t, and a uniform row at t = 30 (a middle
    set too big for the on-chip sort: the binning levels)."""
    g = gen(seed)
    kinds = [
        lambda: torch.randn(n, generator=g, dtype=F64),
        lambda: torch.randint(0, 5, (n,), generator=g).double(),
        lambda: torch.full((n,), 0.25, dtype=F64),
        lambda: torch.randn(n, generator=g, dtype=F64).index_fill_(0, torch.tensor([3, n // 2]), math.inf)
        .index_fill_(0, torch.tensor([n // 3]), -math.inf),
        lambda: torch.randn(n, generator=g, dtype=F64).index_fill_(0, torch.tensor([n // 4]), math.nan),
        lambda: 1e4 + 1e-2 * torch.randn(n, generator=g, dtype=F64),
        lambda: torch.rand(n, generator=g, dtype=F64),
    ]
    # the constant row's k near n/2: the GPU bracket then falls back (see
    # test_threshold_solvers.test_constant_row_falls_back_to_radix)
    ks = [n / 16, n / 2 + 0.25, n / 2 + 0.37, 100.0, n / 16, 1000.5, n / 2]
    ts = [1.0, 0.5, 0.3, 0.7, 1.0, 1e-2, 30.0]
    x = torch.stack([kinds[r % len(kinds)]() for r in range(rows)])
    k = torch.tensor([ks[r % len(ks)] for r in range(rows)], dtype=F64)
    t = torch.tensor([ts[r % len(ts)] for r in range(rows)], dtype=F64)
    return x, k, t


def bits(a):
    """The tensor's bits as integers (NaN == NaN, -0 != +0)."""
    return a.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()])


def fused_tail_outputs(monkeypatch, fused, x, k, t, largest, method):
    monkeypatch.setenv("FASTLAPSUM_FUSED_TAIL", "1" if fused else "0")
    b, edge, diag = ops.lapsum_threshold(x, k, t, largest, METHOD[method])
    p = fastlapsum.soft_topk(x, k, t, largest=largest, method=method)
    return {"b": b, "edge": edge, "diag": diag, "mask": p}


def assert_same_bits(got, want):
    for name in want:
        assert torch.equal(bits(got[name]), bits(want[name])), (name, got[name], want[name])


def assert_same_to_rounding(got, want):
    """The fused and the separate sequence: diagnostics (paths, middle sets, attempts) equal;
    b and edge alike in NaN and infinity, else within 1e-12 relative plus 1e-12 (the same fp64
    sums folded by another block size); the masks within one unit in their dtype's last place."""
    assert torch.equal(got["diag"], want["diag"]), (got["diag"], want["diag"])
    for name in ("b", "edge"):
        g, w = got[name], want[name]
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g[g.isinf()], w[w.isinf()]), name
        ok = w.isfinite()
        assert ((g - w)[ok].abs() <= 1e-12 * w[ok].abs() + 1e-12).all(), (name, (g - w)[ok].abs().max())
    p, q = got["mask"].double(), want["mask"].double()
    assert torch.equal(p.isnan(), q.isnan())
    eps = torch.finfo(got["mask"].dtype).eps
    assert ((p - q).nan_to_num(0.0).abs() <= eps * q.abs().nan_to_num(0.0) + 1e-30).all(), (p - q).abs().max()


# rows, n, dtype, method: lengths either side of the plan's branches (plan_soft.h): just past
# the on-chip rows, one tile a gathering block (self-propose, sorted middle set), ~1e6 scores,
# past 2^21 (binned middle sets), fp64 (binned), batches (a propose launch), the radix bracket
FUSED_TAIL_CELLS = [
    (1, 4097, torch.float32, "bracket"),
    (3, 100_000, torch.float32, "bracket"),
    (3, 1_000_000, torch.float32, "bracket"),
    (1, (1 << 21) + 4096, torch.float32, "bracket"),
    (3, 300_000, F64, "bracket"),
    (200, 5000, torch.float32, "bracket"),
    (200, 70_000, torch.bfloat16, "bracket"),
    (200, 5000, F64, "bracket"),
    (1, 4097, torch.float16, "sort"),
    (3, 100_000, torch.float32, "sort"),
    (200, 5000, F64, "sort"),
]


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("rows, n, dtype, method", FUSED_TAIL_CELLS)
def test_fused_tail_matches_separate(monkeypatch, rows, n, dtype, method, largest):
    x, k, t = fused_tail_rows(rows, n, seed=rows + n)
    x, k, t = x.to(dtype).cuda(), k.cuda(), t.cuda()
    want = fused_tail_outputs(monkeypatch, False, x, k, t, largest, method)
    got = fused_tail_outputs(monkeypatch, True, x, k, t, largest, method)
    assert_same_to_rounding(got, want)
    for fused, out in ((False, want), (True, got)):  # each sequence reproduces its own bits
        assert_same_bits(fused_tail_outputs(monkeypatch, fused, x, k, t, largest, method), out)
    if rows <= 3 and n >= 100_000:  # against the CPU op (not only fused == separate)
        bc = fastlapsum.lapsum_threshold(x.cpu(), k.cpu(), t.cpu(), largest=largest, method=method)
        assert_b_matches_cpu(got["b"], bc, t)
    # the rows took the paths the cells are for: the bracket, and its fallback to the radix
    # levels (the constant row; on the H200 rows of 5000 certify it, so only longer rows count)
    path = got["diag"].view(rows, 3)[:, 0].cpu()
    if method == "bracket" and rows >= 3:
        assert (path == fastlapsum.PATH_BRACKET).any(), path
        if n >= 65536:
            assert (path == fastlapsum.PATH_RADIX).any(), path


def test_fused_tail_cuda_graph(monkeypatch):
    """The fused sequence captured in a CUDA graph: its arrival counters start at zero in every
    replay (the captured fill) and are left at zero by each row's last block, so replays on
    new rows give the eager fused calls' bits (and the separate calls' to rounding)."""
    monkeypatch.setenv("FASTLAPSUM_FUSED_TAIL", "1")
    rows, n = 7, 100_000
    x, k, t = (a.cuda() for a in fused_tail_rows(rows, n, seed=90))
    x = x.float()

    def step():
        out = {}
        for method in ("bracket", "sort"):
            b, edge, diag = ops.lapsum_threshold(x, k, t, True, METHOD[method])
            out.update({f"b {method}": b, f"edge {method}": edge, f"diag {method}": diag})
        out["mask"] = fastlapsum.soft_topk(x, k, t, method="bracket")
        return out

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in (91, 92, 93):
        xs, ks, ts = fused_tail_rows(rows, n, seed)
        perm = torch.randperm(rows, generator=gen(seed))  # the row kinds move between replays
        x.copy_(xs[perm].float())
        k.copy_(ks[perm])
        t.copy_(ts[perm])
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bits(static, step())
        monkeypatch.setenv("FASTLAPSUM_FUSED_TAIL", "0")
        eager = step()
        monkeypatch.setenv("FASTLAPSUM_FUSED_TAIL", "1")
        for method in ("bracket", "sort"):
            assert_same_to_rounding({"diag": static[f"diag {method}"], "b": static[f"b {method}"],
                                     "edge": static[f"edge {method}"], "mask": static["mask"]},
                                    {"diag": eager[f"diag {method}"], "b": eager[f"b {method}"],
                                     "edge": eager[f"edge {method}"], "mask": eager["mask"]})


def threshold_kernels(x, k, t, method):
    """The long-row solver's kernels that one lapsum_threshold call launches, by kind (after a
    warm-up call), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    ops.lapsum_threshold(x, k, t, True, METHOD[method])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.lapsum_threshold(x, k, t, True, METHOD[method])
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {kind: sum(f"{kind}_kernel" in name for name in names) for kind in ("level", "scan", "sides", "solve")}


def test_fused_tail_launches(monkeypatch):
    """The override selects the sequence: fused, no scan or solve kernel runs; unfused, a scan
    after every binning level and one solve."""
    x, k, t = (a.cuda() for a in fused_tail_rows(2, 100_000, seed=95))
    x = x.float()

    def kernels(fused, method):
        if fused is not None:  # None: the plan's own choice
            monkeypatch.setenv("FASTLAPSUM_FUSED_TAIL", "1" if fused else "0")
        return threshold_kernels(x, k, t, method)

    levels = 2 + 3  # fp32: the gathering level, then a level a digit of the radix fallback
    assert kernels(True, "bracket") == {"level": levels, "scan": 0, "sides": 1, "solve": 0}
    assert kernels(False, "bracket") == {"level": levels, "scan": levels - 1, "sides": 1, "solve": 1}
    assert kernels(True, "sort") == {"level": levels, "scan": 0, "sides": 1, "solve": 0}
    assert kernels(False, "sort") == {"level": levels, "scan": levels, "sides": 1, "solve": 1}
    monkeypatch.delenv("FASTLAPSUM_FUSED_TAIL")
    assert kernels(None, "bracket")["scan"] == 0  # the plan's own choice: fused up to 2^21 scores


def test_fused_tail_only_up_to_its_bound(monkeypatch):
    """Without the override, rows over SoftLaunchTuning::fused_max_n (2^21) launch their scans
    and the solve on their own (their fused binning levels are slower), shorter rows do not."""
    monkeypatch.delenv("FASTLAPSUM_FUSED_TAIL", raising=False)

    def scans(n):
        x = torch.randn(1, n, device="cuda")
        k = torch.full((1,), n / 16, dtype=F64, device="cuda")
        c = threshold_kernels(x, k, torch.ones(1, dtype=F64, device="cuda"), "bracket")
        return c["scan"] + c["solve"]

    assert scans(1 << 21) == 0
    assert scans((1 << 21) + 4096) > 0


@pytest.mark.parametrize("method", ["bracket", "sort"])
def test_fused_tail_blocks_of_several_rows(monkeypatch, method):
    """More rows than a grid has block rows (65535): a block takes rows r and r + 65535 and
    claims each one's scan after its row loop. With this many rows the plan gives a row one
    block (chunks = 1), so each block claims its own rows; rows shared by several blocks are
    the other cells' (fewer rows). Constant rows (the bracket's fallback) and NaN rows among
    them."""
    rows, n = 65537, 4097
    x = torch.randn(rows, n, device="cuda", generator=torch.Generator("cuda").manual_seed(96))
    x[::3] = 0.25
    x[1::7, 5] = math.nan
    k = torch.linspace(1.5, n - 1.5, rows, dtype=F64, device="cuda")
    t = torch.full((rows,), 0.5, dtype=F64, device="cuda")
    out = []
    for fused in (False, True):
        monkeypatch.setenv("FASTLAPSUM_FUSED_TAIL", "1" if fused else "0")
        out.append(ops.lapsum_threshold(x, k, t, True, METHOD[method]))
    want, got = ({"b": o[0], "edge": o[1], "diag": o[2], "mask": o[0].new_zeros(1)} for o in out)
    assert_same_to_rounding(got, want)
    b = out[1][0]
    nan_row = torch.zeros(rows, dtype=torch.bool, device="cuda")
    nan_row[1::7] = True
    assert b[nan_row].isnan().all() and b[~nan_row].isfinite().all()
    # against the CPU op
    tail = [65532, 65534, 65536]  # constant, Gaussian, Gaussian (the last one a block's second row)
    bc = fastlapsum.lapsum_threshold(x[tail].cpu(), k[tail].cpu(), t[tail].cpu())
    assert_b_matches_cpu(b[tail], bc, t[tail])
