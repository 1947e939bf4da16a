"""Tiny rows in large batches (MoE routers): the warp-per-row kernel (regime "warp-rows",
csrc/cuda/soft/short_rows_cuda.cu and warp_rows.cuh: a warp, or 8 / 16 lanes, per row, the
row in registers, a bitonic network in its flip form, the §1.1 scan, the mask in fp32 below
fp64). Checked on every device against the float64 oracle, and on CUDA against the CPU
kernels (both solve the sorted row in fp64; the outer gap of 16/32-bit rows sums fp32 terms
on CUDA). Rows of a batch mix kinds, budgets and temperatures, so that rows which settle
without a solve (NaN, k at 0 or n, infinities) sit in the same warp as rows that sort."""
import math

import pytest
import torch

import fastlapsum as fl

from conftest import (BUDGET_TOL, DTYPES, F64, KINDS, NAN_KIND, P_TOL, budget_error, check_against_oracle,
                      gap_precision, requires_cuda, row_of_kind, same_or_close)
TINY_NS = [8, 16, 64, 100, 256, 1000]


def mixed_batch(n, rows, seed):
    """rows float64 rows of n scores, kinds in turn, with per-row k (edges included) and t
    (tiny to huge)."""
    g = torch.Generator().manual_seed(seed)
    kinds = torch.arange(rows) % KINDS
    x = torch.stack([row_of_kind(int(c), n, g) for c in kinds])
    ks = [0.0, 0.5, 1.0, min(8.0, n - 0.5), n / 2, n - 1.0, float(n), 1e-9, n - 1e-9]
    ts = [1e-30, 1e-6, 1e-2, 0.3, 1.0, 1e3, 1e30]
    k = torch.tensor([ks[(7 * r) % len(ks)] for r in range(rows)], dtype=F64).clamp(0, n)
    t = torch.tensor([ts[(5 * r + r // 7) % len(ts)] for r in range(rows)], dtype=F64)
    return x, k, t, kinds


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", TINY_NS)
def test_tiny_rows_match_oracle(device, n, dtype):
    rows = 72 if device == "cpu" else 288
    x64, k, t, kinds = mixed_batch(n, rows, seed=n)
    for largest in (True, False):
        fails = check_against_oracle(x64.to(dtype).to(device), k, t, kinds, largest)
        assert not fails, "\n".join(fails[:20])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_shape_budget(device, dtype):
    """The MoE router shape (rows of 256 logits, k = 8, t = 1): every row's budget within the
    dtype's bound, rows independent of their neighbours."""
    rows = 256 if device == "cpu" else 8192
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(rows, 256, generator=g)).to(dtype).to(device)
    p = fl.soft_topk(x, 8.0, 1.0)
    assert p.dtype == dtype and bool(p.isfinite().all()) and bool(((p >= 0) & (p <= 1)).all())
    assert budget_error(p, 8.0).item() <= BUDGET_TOL[dtype]
    # each row alone (a different place in its warp and CTA) gives the same mask
    for r in (0, 1, rows // 2 + 3, rows - 1):
        assert torch.equal(fl.soft_topk(x[r:r + 1], 8.0, 1.0), p[r:r + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [8, 13, 16, 64, 100, 256, 1000])
def test_permutations_give_one_threshold(device, n, dtype):
    """The sort network sees every order: permutations of one row (ties, infinities, distinct
    scores) give bitwise the same threshold and the permuted mask."""
    g = torch.Generator().manual_seed(11 + n)
    bases = [torch.randn(n, generator=g, dtype=F64),
             torch.randint(0, 3, (n,), generator=g).double(),
             row_of_kind(6, n, g)]
    perms = 4 if device == "cpu" else 32
    for base in bases:
        order = torch.stack([torch.randperm(n, generator=g) for _ in range(perms)])
        x = base.to(dtype)[order].to(device)
        k = torch.full((perms,), n / 3, dtype=F64, device=device)
        b = fl.lapsum_threshold(x, k, 0.7)
        assert torch.equal(b, b[:1].expand_as(b)), b
        p = fl.soft_topk(x, k, 0.7).cpu()
        back = torch.empty_like(p)
        back.scatter_(1, order, p)  # each row's mask in the base row's order
        assert torch.equal(back, back[:1].expand_as(back))


@pytest.mark.parametrize("n", [8, 16, 256])
def test_settled_rows_next_to_solved_ones(device, n):
    """Rows that settle without a solve (NaN, k = 0, k = n, all +inf, b = +-inf) between rows
    that sort, in one warp for n <= 16 (4 or 2 rows a warp): each as it is alone."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(12, n, generator=g, dtype=F64)
    x[1, 0] = math.nan
    x[4] = math.inf
    x[6, :3] = math.inf
    x[9, 1:] = -math.inf
    k = torch.tensor([1.0, 1.0, 0.0, float(n), 2.0, 3.5, 2.0, 1.5, n / 2, float(n) - 0.5, 1.0, 0.25], dtype=F64)
    for dtype in (torch.float32, torch.float16, torch.float64):
        xd, kd = x.to(dtype).to(device), k.to(device)
        p, b = fl.soft_topk(xd, kd, 0.5), fl.lapsum_threshold(xd, kd, 0.5)
        for r in range(x.shape[0]):
            pr = fl.soft_topk(xd[r:r + 1], kd[r:r + 1], 0.5)
            assert torch.equal(pr.isnan(), p[r:r + 1].isnan())
            assert torch.equal(pr.nan_to_num(-1.0), p[r:r + 1].nan_to_num(-1.0)), r
            br = fl.lapsum_threshold(xd[r:r + 1], kd[r:r + 1], 0.5)
            assert same_or_close(br, b[r:r + 1], 0.0, 0.0), r


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", TINY_NS)
def test_tiny_rows_match_cpu(n, dtype):
    """Thresholds on CUDA and the CPU within 1e-9 relative and gap_precision in units of t
    (the outer gap of 16/32-bit rows sums fp32 terms on CUDA), masks within P_TOL plus a
    density times a few ulps of b over t (as test_short_rows_match_cpu)."""
    x64, k, t, kinds = mixed_batch(n, 576, seed=100 + n)
    keep = kinds != NAN_KIND
    xc, k, t = x64[keep].to(dtype), k[keep], t[keep]
    for largest in (True, False):
        bc = fl.lapsum_threshold(xc, k, t, largest=largest)
        bg = fl.lapsum_threshold(xc.cuda(), k.cuda(), t.cuda(), largest=largest).cpu()
        assert same_or_close(bg, bc, 1e-9, gap_precision("cuda", dtype) * t), (bg - bc).nan_to_num(0.0).abs().max()
        pc = fl.soft_topk(xc, k, t, largest=largest).double()
        pg = fl.soft_topk(xc.cuda(), k.cuda(), t.cuda(), largest=largest).cpu().double()
        fin = torch.isfinite(bc)
        ulp_b = torch.where(fin, (torch.nextafter(bc, torch.full_like(bc, math.inf)) - bc).abs(), torch.zeros_like(bc))
        tol = P_TOL[dtype] + 2 * ulp_b.nan_to_num(0.0) / t
        assert bool(((pg - pc).abs() <= tol[:, None]).all()), (pg - pc).abs().max()
