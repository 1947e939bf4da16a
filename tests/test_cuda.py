"""CUDA path: results equal the CPU kernels', CUDA-graph capture and replay, opcheck,
torch.compile, fp64 gradcheck, and 64-bit indexing on a row of more than 2**31 scores.
Runs only with a CUDA device and the CUDA build (conftest.requires_cuda)."""
import math
import os
import sys

import pytest
import torch

import fastlapsum

from conftest import BUDGET_TOL, DTYPES, G_TOL, P_TOL, assert_exact_topk, budget_error, gen, requires_cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))
from timing import capture_graph  # noqa: E402  (benchmarks/timing.py)

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


def ulp_above(b):
    """The gap from each b to the next representable value: a threshold held in fp64 can be
    no closer than a few of these."""
    return (torch.nextafter(b, torch.full_like(b, math.inf)) - b).abs()


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


# ---- CUDA graphs -------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1000, 5000])  # the on-chip path and the bracket
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_soft_topk(dtype, n):
    rows = 8
    g = gen(10)
    x = torch.randn(rows, n, generator=g).to(dtype).cuda().requires_grad_()
    k = torch.linspace(1, n / 2, rows, dtype=F64).cuda().requires_grad_()
    t = torch.linspace(0.1, 2, rows).cuda().requires_grad_()
    w = torch.randn(rows, n, generator=g).to(dtype).cuda()
    kh = torch.full((rows,), 64.0, device="cuda")

    def step():
        p = fastlapsum.soft_topk(x, k, t)
        lp = fastlapsum.log_soft_topk(x, 3.0, 0.5, largest=False)
        h = fastlapsum.soft_topk(x, kh, t, hard=True)
        b = fastlapsum.lapsum_threshold(x, k, t)
        loss = (p * w).float().sum() + (h * w).float().sum() + b.sum() + (lp.clamp(min=-30) * w).float().sum()
        gx, gk, gt = torch.autograd.grad(loss, (x, k, t))
        return p.detach(), lp.detach(), h.detach(), b.detach(), gx, gk, gt

    graph, static_out = capture_graph(step)
    for seed in (11, 12):
        g = gen(seed)
        with torch.no_grad():
            x.copy_(torch.randn(rows, n, generator=g).to(dtype))
            k.copy_(torch.rand(rows, generator=g, dtype=F64) * n)
            t.copy_(torch.rand(rows, generator=g) + 0.05)
            w.copy_(torch.randn(rows, n, generator=g).to(dtype))
            kh.copy_(torch.randint(0, n + 1, (rows,), generator=g).float())
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        names = ("p", "log p", "hard", "b", "grad x", "grad k", "grad t")
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # reductions may reassociate; bf16 ulp is 2**-8
        for name, a, b in zip(names, static_out, want):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
        assert budget_error(static_out[0], k.detach()) <= BUDGET_TOL[dtype]
        assert static_out[2].double().sum(1).tolist() == kh.double().tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_graph_sorted_set_and_chain(dtype):
    """Rows up to 2^21 are solved by the sorted middle set or, left unsolved by it, by the
    binning chain after it (its launches skip solved rows). Graph replays where some rows
    need the chain (a constant row at k = n/2: a middle set of the whole row, then the
    fallback; a uniform row at its median with t = 0.01: ~17K middle scores, too many for one
    CTA) and replays where none does (Gaussian rows at k = n/16, ~2K) give the eager answers.
    fp64 rows have no sorted middle kernel: every row takes the chain, whose kernels read the
    rows' status before they wait (rows_settled_early), so one launch has rows certified at
    its first scan next to rows still in the fallback. The masks, eager and replayed, equal the
    CPU path's."""
    rows, n = 3, 1 << 19
    x = torch.zeros(rows, n, device="cuda", dtype=dtype)
    k = torch.zeros(rows, dtype=F64, device="cuda")
    t = torch.ones(rows, dtype=F64, device="cuda")

    def step():
        return (fastlapsum.soft_topk(x, k, t, method="bracket"),
                fastlapsum.lapsum_threshold(x, k, t, method="bracket"))

    def fill(seed, constant_row, wide_row):
        g = gen(seed)
        x.copy_(torch.randn(rows, n, generator=g).to(dtype))
        k.fill_(n / 16)
        t.fill_(1.0)
        if constant_row:
            x[1] = 0.25
            k[1] = n / 2
        if wide_row:
            x[2] = torch.rand(n, generator=g).to(dtype)
            k[2] = n / 2 + 0.25
            t[2] = 0.01

    fill(60, False, False)
    graph, static_out = capture_graph(step)
    for seed, constant_row, wide_row in [(61, False, False), (62, True, False), (63, False, True),
                                         (64, True, True), (65, False, False)]:
        fill(seed, constant_row, wide_row)
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        info = fastlapsum.lapsum_diagnostics(x, k, t, method="bracket")
        # the rows meant to need the chain really do (a sorted set holds at most 8192 scores)
        chained = [info.path[r].item() == fastlapsum.PATH_RADIX or info.middle_size[r].item() > 8192
                   for r in range(rows)]
        assert chained == [False, constant_row, wide_row], (info.path, info.middle_size)
        for name, a, b in zip(("p", "b"), static_out, want):  # the same kernels: a stale row is far off
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert budget_error(static_out[0], k) <= BUDGET_TOL[dtype]
        # every row's mask written, from its own final b (solved by the sorted kernel or the chain)
        p_cpu = fastlapsum.soft_topk(x.cpu(), k.cpu(), t.cpu(), method="bracket")
        torch.testing.assert_close(static_out[0].cpu().double(), p_cpu.double(), rtol=0, atol=P_TOL[dtype])
        torch.testing.assert_close(want[0].cpu().double(), p_cpu.double(), rtol=0, atol=P_TOL[dtype])


def test_cuda_graph_topk_lengths():
    rows, n, k = 16, 20000, 512
    x = torch.randn(rows, n, device="cuda")
    lengths = torch.full((rows,), n, dtype=torch.int64, device="cuda")

    def step():
        return fastlapsum.topk(x, k, lengths=lengths, sorted=True) + fastlapsum.topk(x, k, largest=False,
                                                                                        lengths=lengths)

    graph, static_out = capture_graph(step)
    for seed in (13, 14):
        g = gen(seed)
        x.copy_(torch.randn(rows, n, generator=g))
        new_len = torch.randint(0, n + 1, (rows,), generator=g)
        new_len[:4] = torch.tensor([0, k - 1, k, k + 1])
        lengths.copy_(new_len)
        graph.replay()
        torch.cuda.synchronize()
        v, i, vs, is_ = static_out
        assert_exact_topk(x, k, v, i, lengths=lengths, sorted=True)
        assert_exact_topk(x, k, vs, is_, largest=False, lengths=lengths)
        want = fastlapsum.topk(x, k, lengths=lengths, sorted=True)
        torch.testing.assert_close(v, want[0], rtol=0, atol=0)
        assert torch.equal(i, want[1])


# ---- opcheck, compile, gradcheck on CUDA ---------------------------------------------------

def test_opcheck_cuda():
    g = gen(15)
    x = torch.randn(6, 300, generator=g, dtype=F64).cuda().requires_grad_()
    k = torch.tensor([1.0, 2.5, 30.0, 150.0, 299.0, 7.0], dtype=F64, device="cuda", requires_grad=True)
    t = torch.tensor([0.1, 0.5, 1.0, 2.0, 5.0, 0.3], dtype=F64, device="cuda", requires_grad=True)
    for largest in (True, False):
        torch.library.opcheck(ops.lapsum_threshold, (x, k, t, largest, 0))
        for mode in (0, 1):
            torch.library.opcheck(ops.soft_topk_forward, (x, k, t, largest, 0, mode))
        torch.library.opcheck(ops.soft_topk_forward, (x, k.detach().round(), t, largest, 0, 2))
        torch.library.opcheck(ops.topk, (x, 20, largest, False, torch.tensor([0, 5, 20, 21, 299, 300], device="cuda")))
        xd, kd, td = x.detach(), k.detach(), t.detach()
        b, edge, _ = ops.lapsum_threshold(xd, kd, td, largest, 0)
        bc, ec, _ = ops.lapsum_threshold(xd.cpu(), kd.cpu(), td.cpu(), largest, 0)
        torch.testing.assert_close(b.cpu(), bc, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(edge.cpu(), ec)
        gp = torch.randn(xd.shape, generator=g, dtype=F64)
        for log_mode in (False, True):
            torch.library.opcheck(ops.lapsum_mask, (xd, b, td, edge, largest, log_mode))
            torch.library.opcheck(ops.soft_topk_backward, (gp.cuda(), xd, b, td, largest, log_mode))
            # the CUDA kernels against the CPU ones on the same (b, edge)
            pc = ops.lapsum_mask(xd.cpu(), bc, td.cpu(), ec, largest, log_mode)
            torch.testing.assert_close(ops.lapsum_mask(xd, b, td, edge, largest, log_mode).cpu(), pc,
                                       rtol=1e-9, atol=1e-11)
            want = ops.soft_topk_backward(gp, xd.cpu(), bc, td.cpu(), largest, log_mode)
            got = ops.soft_topk_backward(gp.cuda(), xd, b, td, largest, log_mode)
            for a, c in zip(got, want):
                torch.testing.assert_close(a.cpu(), c, rtol=1e-8, atol=1e-10)
        gb = torch.randn(6, generator=g, dtype=F64)
        torch.library.opcheck(ops.lapsum_threshold_backward, (gb.cuda(), xd, b, td, largest))
        want = ops.lapsum_threshold_backward(gb, xd.cpu(), bc, td.cpu(), largest)
        for a, c in zip(ops.lapsum_threshold_backward(gb.cuda(), xd, b, td, largest), want):
            torch.testing.assert_close(a.cpu(), c, rtol=1e-8, atol=1e-10)
    for largest in (True, False):  # without lengths (last: a stride mismatch here stops the test)
        for sorted_ in (False, True):
            torch.library.opcheck(ops.topk, (x.float(), 20, largest, sorted_, None))


def test_compile_cuda():
    """fullgraph compile (default and reduce-overhead, i.e. CUDA graphs) equals eager."""
    def f(x, k, t, lengths):
        p = fastlapsum.soft_topk(x, k, t)
        h = fastlapsum.soft_topk(x, 16, 0.5, hard=True)
        v, i = fastlapsum.topk(x, 16, lengths=lengths, sorted=True)
        w = torch.linspace(-1, 1, x.shape[-1], device=x.device, dtype=x.dtype)
        loss = (p * w).sum() + (h * w).sum() + v.clamp(min=-1e4).sum() + fastlapsum.lapsum_threshold(x, k, t).sum()
        return p, h, v, i, loss

    g = gen(16)
    x0 = torch.randn(8, 1000, generator=g).cuda()
    k = torch.linspace(1, 500, 8, dtype=F64, device="cuda")
    t = torch.linspace(0.1, 2, 8, device="cuda")
    lengths = torch.tensor([0, 1, 15, 16, 17, 500, 999, 1000], device="cuda")
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        cf = torch.compile(f, fullgraph=True, mode=mode)
        for it in range(3):
            x = (x0 + it).requires_grad_()
            got = cf(x, k, t, lengths)
            (gx,) = torch.autograd.grad(got[-1], (x,))
            xe = (x0 + it).requires_grad_()
            want = f(xe, k, t, lengths)
            (gxe,) = torch.autograd.grad(want[-1], (xe,))
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(gx, gxe, rtol=1e-5, atol=1e-7)


def test_compile_reduce_overhead_long_rows():
    """torch.compile's CUDA graphs (cudagraph trees) over rows of the long-row solver, its
    calls alternating between rows the sorted middle kernel solves and a row left to the
    binning chain and its radix fallback (a constant row at k = n/2), equal eager."""
    n = 1 << 18

    def f(x, k):
        return fastlapsum.soft_topk(x, k, 1.0, method="bracket"), fastlapsum.lapsum_threshold(x, k, 1.0, method="bracket")

    g = gen(18)
    k = torch.full((2,), n / 16, dtype=F64, device="cuda")
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for it in range(5):
        x = torch.randn(2, n, generator=g).cuda()
        if it % 2:  # a constant row at k = n/2: the chain and its radix fallback
            x[1] = 0.5
            k[1] = n / 2
        else:
            k[1] = n / 16
        got = [v.clone() for v in cf(x, k)]
        want = f(x, k)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_gradcheck_cuda_fp64():
    g = gen(17)
    x = torch.randn(3, 16, generator=g, dtype=F64).cuda().requires_grad_()
    k = torch.tensor([1.0, 3.5, 12.0], dtype=F64, device="cuda", requires_grad=True)
    t = torch.tensor([0.3, 1.0, 2.5], dtype=F64, device="cuda", requires_grad=True)
    for largest in (True, False):
        torch.autograd.gradcheck(lambda a, b, c: fastlapsum.soft_topk(a, b, c, largest=largest), (x, k, t))
        torch.autograd.gradcheck(lambda a, b, c: fastlapsum.log_soft_topk(a, b, c, largest=largest), (x, k, t))
        torch.autograd.gradcheck(lambda a, b, c: fastlapsum.lapsum_threshold(a, b, c, largest=largest), (x, k, t))
        torch.autograd.gradcheck(lambda a: fastlapsum.topk(a, 5, largest=largest)[0], (x,))
    x3 = torch.randn(4, 10, 3, generator=g, dtype=F64).cuda().requires_grad_()
    torch.autograd.gradcheck(lambda a: fastlapsum.soft_topk(a, 2.5, 0.7, dim=1), (x3,))


# ---- 64-bit indexing ------------------------------------------------------------------------

@pytest.mark.slow
def test_row_longer_than_2_pow_31():
    """One fp16 row of 2**31 + 5 scores through the native threshold solver, the mask and
    the backward kernels.
    Elements past 2**31 and the row reductions must be right: 32-bit indexing would
    wrap onto the front of the row or drop the tail."""
    n = 2**31 + 5
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip(f"needs ~24 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    x = torch.empty(1, n, dtype=torch.float16, device="cuda")
    x.normal_(generator=torch.Generator("cuda").manual_seed(18))
    # mark both ends so a wrapped index shows
    x[0, :8] = -3.0
    x[0, -8:] = torch.tensor([4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5], dtype=torch.float16)
    b = torch.tensor([1.25], dtype=F64, device="cuda")
    t = torch.tensor([0.75], dtype=F64, device="cuda")
    edge = torch.ones(1, dtype=F64, device="cuda")

    def mask_ref(seg):
        u = (seg.double() - 1.25) / 0.75
        return torch.where(u <= 0, 0.5 * torch.exp(u.clamp(max=0)), 1 - 0.5 * torch.exp(-u.clamp(min=0)))

    chunk = 1 << 28
    # the native solver on the whole row: Psi(b) = k, summed in fp64 in chunks
    k = torch.tensor([n / 16], dtype=F64, device="cuda")
    info = fastlapsum.lapsum_diagnostics(x[0], k[0], 0.75)
    assert info.path.item() == fastlapsum.PATH_BRACKET, fastlapsum.PATH_NAMES[info.path.item()]
    b_solved = info.threshold.item()
    psi = 0.0
    for s in range(0, n, chunk):
        u = (x[0, s:s + chunk].double() - b_solved) / 0.75
        psi += torch.where(u <= 0, 0.5 * torch.exp(u.clamp(max=0)), 1 - 0.5 * torch.exp(-u.clamp(min=0))).sum().item()
        del u
    assert abs(psi - n / 16) <= 1e-6 * n / 16, (psi, n / 16)  # fp32 exponentials: ~1e-8 measured

    p = ops.lapsum_mask(x, b, t, edge, True, False)
    assert p.shape == (1, n) and p.dtype == torch.float16
    for sl in (slice(0, 4096), slice(2**31 - 4096, 2**31 + 5)):
        torch.testing.assert_close(p[0, sl].double(), mask_ref(x[0, sl]), rtol=0, atol=1e-3)
    # same-precision rule: compare with the fp64 mask rounded to fp16 (fp16 rounding of
    # 2**31 values in [0, 1] is biased by ~1e-6 of the sum; that is the floor, not ours)
    total = sum(p[0, s:s + chunk].double().sum().item() for s in range(0, n, chunk))
    want = sum(mask_ref(x[0, s:s + chunk]).half().double().sum().item() for s in range(0, n, chunk))
    # fp16 masks come from an fp32 exponential (<= 2 ulp of fp32) rounded to fp16: the
    # rounding of a few values in 2**31 lands on the other side (measured 6e-8 of the sum)
    assert abs(total - want) <= 2e-7 * want, (total, want)
    del p

    # backward with g = x (no second row-sized input): closed form of DESIGN §1.3 in chunks
    gx, gk, gt = ops.soft_topk_backward(x, x, b, t, True, False)
    W = gw = wd = gwd = 0.0
    for s in range(0, n, chunk):
        seg = x[0, s:s + chunk].double()
        d = seg - 1.25
        w = torch.exp(-d.abs() / 0.75) / 1.5
        W += w.sum().item()
        gw += (seg * w).sum().item()
        wd += (w * d).sum().item()
        gwd += (seg * w * d).sum().item()
        del seg, d, w
    ratio, rbar = gw / W, wd / W
    gt_ref = -(gwd - gw * rbar) / 0.75
    assert abs(gk.item() - ratio) <= 1e-6 * max(1.0, abs(ratio)), (gk.item(), ratio)
    assert abs(gt.item() - gt_ref) <= 1e-5 * max(1.0, abs(gt_ref)), (gt.item(), gt_ref)
    for sl in (slice(0, 4096), slice(2**31 - 4096, 2**31 + 5)):
        seg = x[0, sl].double()
        w = torch.exp(-(seg - 1.25).abs() / 0.75) / 1.5
        torch.testing.assert_close(gx[0, sl].double(), w * (seg - ratio), rtol=2e-3, atol=1e-4)
