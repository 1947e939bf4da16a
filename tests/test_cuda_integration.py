"""CUDA integration: CUDA-graph capture and replay (soft, sorted middle set and the long-row
chain, topk with lengths), opcheck, torch.compile, fp64 gradcheck, and 64-bit indexing on a
row of more than 2**31 scores. Runs only with a CUDA device and the CUDA build."""
import os
import sys

import pytest
import torch

import fastlapsum

from conftest import BUDGET_TOL, P_TOL, assert_exact_topk, budget_error, gen, requires_cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))
from timing import capture_graph  # noqa: E402  (benchmarks/timing.py)

pytestmark = requires_cuda

ops = torch.ops.fastlapsum
F64 = torch.float64

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
