"""Native CUDA exact top-k (csrc/cuda/topk/topk_cuda.cu) against the CPU op.

Exactness here is stronger than DESIGN §2's criterion: with sorted=True the CUDA op
must return the very same indices and values as the CPU op (the deterministic
"smaller index wins" tie-break), and with sorted=False the same index *set*.

Shapes are chosen to reach every execution path of the kernel file:
  tiny rows (n <= 2048): the warp-row kernel (n <= 32: a thread a row), see the tests at the end;
  per-row kernel (unless the grid path is chosen): short rows in shared memory (L <= cap),
  sampled path (L > cap), exact fallback (sample proposal fails, or take too large);
  grid path (rows <= 64 and n >= 65536 where its cost estimate is lower: long rows, or a
  budget too large for the per-row sampled path): sampled + candidate buffer, or fallback.
16-bit scores with 2.5 K <= 5632 take the per-row kernel's 256-thread build (four CTAs an SM,
a candidate buffer of at most 5632), larger K the 512-thread one.
"""
import math
import os
import sys

import pytest
import torch

import fastlapsum
from conftest import assert_exact_topk, gen, requires_cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))
from timing import capture_graph  # noqa: E402  (benchmarks/timing.py)

pytestmark = requires_cuda

LOW_DTYPES = [torch.float16, torch.bfloat16]


def check(x, k, *, largest=True, lengths=None):
    """CUDA == CPU: sorted (identical indices and values) and unsorted (same sets). CUDA
    lengths outside [0, n] are clamped on the device; the CPU op gets them clamped."""
    xc = x.cpu()
    xg = x.cuda() if not x.is_cuda else x
    lc = None if lengths is None else lengths.cpu().clamp(0, x.shape[1])
    lg = None if lengths is None else lengths.cuda()
    vc, ic = fastlapsum.topk(xc, k, largest=largest, sorted=True, lengths=lc)
    vg, ig = fastlapsum.topk(xg, k, largest=largest, sorted=True, lengths=lg)
    assert torch.equal(ig.cpu(), ic), "sorted indices differ from the CPU op"
    torch.testing.assert_close(vg.cpu(), vc, rtol=0, atol=0, equal_nan=True)
    vu, iu = fastlapsum.topk(xg, k, largest=largest, sorted=False, lengths=lg)
    assert_exact_topk(xg, k, vu, iu, largest=largest, lengths=lc)
    assert torch.equal(iu.cpu().sort(1).values, ic.sort(1).values), "unsorted index set differs from the CPU op"
    return iu


def hard_rows(rows, n, seed, *, stride_period=512):
    """Adversarial rows, cycled: gaussian, ties, constant, -inf but a few, sorted asc /
    desc, period = sampling stride, NaN / +-inf, 16-level ties."""
    g = gen(seed)
    out = []
    ar = torch.arange(n, dtype=torch.float32)
    for r in range(rows):
        kind = r % 10
        if kind == 0:
            row = torch.randn(n, generator=g)
        elif kind == 1:  # boundary ties: few distinct levels
            row = torch.randint(0, 5, (n,), generator=g).float()
        elif kind == 2:
            row = torch.full((n,), 0.5)
        elif kind == 3:  # -inf but for a few scores
            row = torch.full((n,), -math.inf)
            idx = torch.randperm(n, generator=g)[:37]
            row[idx] = torch.randn(37, generator=g)
        elif kind == 4:
            row = ar / n
        elif kind == 5:
            row = -ar / n
        elif kind == 6:  # periodic with the sampling stride as period: the view sees only one phase
            row = torch.where(ar % stride_period == 0, torch.full((n,), -1.0), torch.randn(n, generator=g))
            row[(ar % stride_period) == 3] = 5.0
        elif kind == 7:
            row = torch.randn(n, generator=g)
            row[torch.randperm(n, generator=g)[:50]] = math.nan
            row[torch.randperm(n, generator=g)[:70]] = math.inf
            row[torch.randperm(n, generator=g)[:90]] = -math.inf
        elif kind == 8:
            row = torch.randint(0, 16, (n,), generator=g).float()
        else:  # -0.0 / +0.0 mixed with tiny values
            row = torch.where(torch.rand(n, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
            row[::97] = 1e-30
        out.append(row)
    return torch.stack(out)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("shape,k", [
    ((70, 3000), 100),     # per-row, whole row in shared memory
    ((70, 40000), 100),    # per-row, sampled (cap 8192 < L), stride 64
    ((72, 70000), 2048),   # per-row, sampled, stride 64
    ((66, 30000), 12000),  # per-row, 2.5 take > cap: exact fallback over the row
    ((3, 100000), 3000),   # per-row, sampled (few rows short enough for the per-row kernel)
    ((3, 300000), 3000),   # grid path, sampled + candidates
    ((2, 70000), 30000),   # grid path, large k
])
def test_paths_match_cpu(shape, k, largest):
    x = hard_rows(*shape, seed=shape[1] + k)
    check(x, k, largest=largest)


def test_row_path_unsorted_order_is_deterministic():
    """The per-row kernel compacts its candidates and outputs by block scans, no atomics, so
    its unsorted output, order included, is the same on every call (the grid path's is not)."""
    x = hard_rows(70, 70000, seed=7).cuda()
    lengths = torch.randint(60000, 70001, (70,), generator=gen(8)).cuda()
    v0, i0 = fastlapsum.topk(x, 2048, sorted=False, lengths=lengths)
    for _ in range(3):
        v, i = fastlapsum.topk(x, 2048, sorted=False, lengths=lengths)
        assert torch.equal(i, i0), "the per-row kernel's unsorted order changed between calls"
        torch.testing.assert_close(v, v0, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_low_precision_ties(dtype):
    x = hard_rows(70, 20000, seed=3).to(dtype)  # fp16/bf16: many exact ties
    for k in (1, 257, 2048):
        check(x, k)
        check(x, k, largest=False)
    xg = hard_rows(3, 80000, seed=4).to(dtype)
    check(xg, 4096)


@pytest.mark.parametrize("dtype", [torch.float32] + LOW_DTYPES)
@pytest.mark.parametrize("rows,n,k", [(70, 30000, 2048), (4, 100000, 2048), (4, 300000, 2048),
                                      (66, 20000, 2252), (66, 20000, 2253)])  # 16-bit: last K of the 256-thread build, first past
def test_ragged_lengths_with_garbage(rows, n, k, dtype):
    g = gen(5)
    x = torch.randn(rows, n, generator=g).to(dtype)
    lengths = torch.randint(0, n + 1, (rows,), generator=g)
    lengths[:4] = torch.tensor([0, 1, k - 1, k])  # L_r <= K: all valid, then -1
    lengths[-1] = n
    for r, l in enumerate(lengths.tolist()):
        x[r, l:] = math.nan if r % 2 else math.inf
    check(x, k, lengths=lengths)
    check(x, k, largest=False, lengths=lengths)


def test_causal_rows_with_and_without_lengths():
    rows, n, k = 80, 40000, 2048
    x = torch.randn(rows, n, generator=gen(6))
    lengths = n - rows + 1 + torch.arange(rows)
    xm = x.clone()
    for r, l in enumerate(lengths.tolist()):
        xm[r, l:] = -math.inf
    check(xm, k)
    check(xm, k, lengths=lengths)


def test_row_pitch():
    base = torch.randn(70, 20003, generator=gen(7))
    for width in (20000, 19999):  # pitch 20003: rows not 16-byte aligned
        check(base[:, :width], 1000)
    big = torch.randn(3, 100004, generator=gen(8))
    check(big[:, :100000], 2048)  # pitch multiple of 4: aligned vector loads
    check(big[:, 1:100001], 2048)  # offset: unaligned rows


def test_split_equals_single_cta():
    """4 long rows take the grid (split) path, 65 rows the per-row path: same answer."""
    x = torch.randn(65, 300000, generator=gen(9)).cuda()
    v1, i1 = fastlapsum.topk(x, 2048, sorted=True)
    v2, i2 = fastlapsum.topk(x[:4], 2048, sorted=True)
    assert torch.equal(i1[:4], i2) and torch.equal(v1[:4], v2)


def test_fp64_and_edge_k():
    x = hard_rows(12, 5000, seed=10).double()
    for k in (0, 1, 4999, 5000):
        check(x, k)
    xf = x.float()
    for k in (0, 1, 4999, 5000):
        check(xf, k)
    v, i = fastlapsum.topk(torch.randn(0, 100, device="cuda"), 5)
    assert v.shape == (0, 5) and i.shape == (0, 5)


def test_cuda_graph_lengths_change():
    rows, n, k = 80, 30000, 2048
    x = torch.randn(rows, n, generator=gen(11)).cuda()
    lengths = torch.full((rows,), n, dtype=torch.int64, device="cuda")
    xs = torch.randn(2, 300000, generator=gen(12)).cuda()  # the grid path
    ls = torch.full((2,), 300000, dtype=torch.int64, device="cuda")

    def step():
        a = fastlapsum.topk(x, k, sorted=True, lengths=lengths)
        b = fastlapsum.topk(xs, k, lengths=ls)
        return a, b

    graph, out = capture_graph(step)
    for seed in (13, 14):
        g = gen(seed)
        lengths.copy_(torch.randint(0, n + 1, (rows,), generator=g))
        ls.copy_(torch.randint(0, 300001, (2,), generator=g))
        x.copy_(torch.randn(rows, n, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        (va, ia), (vb, ib) = out
        vc, ic = fastlapsum.topk(x.cpu(), k, sorted=True, lengths=lengths.cpu())
        assert torch.equal(ia.cpu(), ic) and torch.equal(va.cpu(), vc)
        assert_exact_topk(xs, k, vb, ib, lengths=ls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(70, 5000), (70, 30000), (2, 100000)])
def test_hard_mask_matches_cpu(dtype, shape):
    x = hard_rows(*shape, seed=15).to(dtype)
    rows, n = shape
    k = torch.linspace(0, n, rows, dtype=torch.float64).round()
    k[1] = 2048.0
    t = torch.ones(rows, dtype=torch.float64)
    for largest in (True, False):
        pc = fastlapsum.soft_topk(x, k, t, largest=largest, hard=True)
        pg = fastlapsum.soft_topk(x.cuda(), k.cuda(), t.cuda(), largest=largest, hard=True)
        torch.testing.assert_close(pg.cpu(), pc, rtol=0, atol=0, equal_nan=True)


# ---- tiny rows (n <= 2048): the warp-row kernel, a warp a row, the row in registers; rows
# of n <= 32 a thread a row (n <= 8, 16, 32 are its three builds) ----

TINY_N = [1, 2, 8, 16, 17, 31, 32, 33, 64, 255, 256, 257, 1000, 1024, 2048]


def tiny_rows(rows, n, seed):
    """Adversarial short rows, cycled: gaussian, 3-level ties, constant, NaN / +-inf / +-0
    sprinkled, -0/+0 only, all NaN, ascending, -inf but one."""
    g = gen(seed)
    out = []
    for r in range(rows):
        kind = r % 8
        if kind == 0:
            row = torch.randn(n, generator=g)
        elif kind == 1:
            row = torch.randint(0, 3, (n,), generator=g).float()
        elif kind == 2:
            row = torch.full((n,), -1.25)
        elif kind == 3:
            row = torch.randn(n, generator=g)
            u = torch.rand(n, generator=g)
            row[u < 0.1] = math.nan
            row[(u >= 0.1) & (u < 0.2)] = math.inf
            row[(u >= 0.2) & (u < 0.3)] = -math.inf
            row[(u >= 0.3) & (u < 0.4)] = -0.0
            row[(u >= 0.4) & (u < 0.5)] = 0.0
        elif kind == 4:
            row = torch.where(torch.rand(n, generator=g) < 0.5, torch.tensor(-0.0), torch.tensor(0.0))
        elif kind == 5:
            row = torch.full((n,), math.nan)
        elif kind == 6:
            row = torch.arange(n, dtype=torch.float32)
        else:
            row = torch.full((n,), -math.inf)
            row[int(torch.randint(0, n, (1,), generator=g))] = 3.0
        out.append(row)
    return torch.stack(out)


def tiny_ks(n):
    return sorted({k for k in (0, 1, 2, 8, 32, 64, n - 1, n) if 0 <= k <= n})


@pytest.mark.parametrize("dtype", [torch.float32] + LOW_DTYPES)
@pytest.mark.parametrize("n", TINY_N)
def test_tiny_rows_match_cpu(n, dtype):
    """Every k (sorted in the kernel up to 64, through at::sort above), both orders, with and
    without ragged lengths (0, 1, k, n and out-of-range values, clamped on the device)."""
    rows = 37  # not a multiple of the kernel's rows per CTA
    x = tiny_rows(rows, n, seed=100 + n).to(dtype)
    lengths = torch.randint(-2, n + 3, (rows,), generator=gen(n))
    lengths[:6] = torch.tensor([0, 1, n, n + 5, -1, n // 2])
    for k in tiny_ks(n):
        for largest in (True, False):
            check(x, k, largest=largest)
            check(x, k, largest=largest, lengths=lengths)


def filter_rows(n, seed):
    """Rows around the tiny-row kernel's lanes'-maxima filter (budgets <= 16, warp_filter):
    ascending and descending, periodic so that every lane's maximum ties (period 128, 4), the
    top 31-34 scores tied (about 32 pass the filter: its fallback's boundary), -inf but 20."""
    g = gen(seed)
    ar = torch.arange(n, dtype=torch.float32)
    out = [ar, ar.flip(0), ar % 128, ar % 4]
    for m in (31, 32, 33, 34):
        row = torch.randn(n, generator=g)
        row[torch.randperm(n, generator=g)[:m]] = 10.0
        out.append(row)
    row = torch.full((n,), -math.inf)
    row[torch.randperm(n, generator=g)[:20]] = torch.randn(20, generator=g)
    out.append(row)
    return torch.stack(out + [torch.randn(n, generator=g) for _ in range(7)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [40, 256, 1024])
def test_tiny_rows_filter_budgets(n, dtype):
    """Every budget the filter takes (1-16) and the first above, both orders, with and without
    ragged lengths; the straight-through mask at the same budgets."""
    x = filter_rows(n, seed=300 + n).to(dtype)
    rows = x.shape[0]
    lengths = torch.randint(1, n + 1, (rows,), generator=gen(301 + n))
    for k in range(1, 18):
        for largest in (True, False):
            check(x, k, largest=largest)
            check(x, k, largest=largest, lengths=lengths)
    kk = torch.randint(1, 18, (rows,), generator=gen(302 + n)).double()
    t = torch.ones(rows, dtype=torch.float64)
    pc = torch.ops.fastlapsum.soft_topk_forward(x, kk, t, True, 0, 2)[0]
    pg = torch.ops.fastlapsum.soft_topk_forward(x.cuda(), kk.cuda(), t.cuda(), True, 0, 2)[0]
    torch.testing.assert_close(pg.cpu(), pc, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_rows_unsorted_order(dtype):
    """sorted=False on tiny rows: the selected indices in ascending index order, the same on
    every call."""
    x = tiny_rows(64, 256, seed=21).to(dtype).cuda()
    lengths = torch.randint(0, 257, (64,), generator=gen(22)).cuda()
    for k in (2, 8, 100):
        v0, i0 = fastlapsum.topk(x, k, sorted=False, lengths=lengths)
        valid = i0 >= 0
        assert bool((i0[:, 1:] > i0[:, :-1])[valid[:, 1:]].all()), "unsorted tiny-row output not in index order"
        v1, i1 = fastlapsum.topk(x, k, sorted=False, lengths=lengths)
        assert torch.equal(i0, i1)
        torch.testing.assert_close(v0, v1, rtol=0, atol=0, equal_nan=True)


def test_tiny_rows_pitch_and_alignment():
    """Rows read in place with any pitch: unaligned starts, widths not a multiple of the
    vector, a single row."""
    base = torch.randn(37, 263, generator=gen(23)).cuda()  # views of it keep the pitch on the device
    for view in (base[:, :256], base[:, 1:257], base[:, 3:36], base[:, :255], base[:1, 5:261]):
        assert view.stride(0) == 263
        for k in (1, 8, 32):
            check(view, k)
            check(view, k, largest=False)
    half = base.half()
    for view in (half[:, 1:257], half[:, 2:202], half[:, 8:256]):
        check(view, 8)
    mask_in = base[:, 1:257]  # hard_mask reads rows in place too
    kk = torch.full((37,), 8.0, dtype=torch.float64)
    t = torch.ones(37, dtype=torch.float64)
    pg = torch.ops.fastlapsum.soft_topk_forward(mask_in, kk.cuda(), t.cuda(), True, 0, 2)[0]
    pc = torch.ops.fastlapsum.soft_topk_forward(mask_in.cpu(), kk, t, True, 0, 2)[0]
    torch.testing.assert_close(pg.cpu(), pc, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("shape,k", [((8192, 256), 8), ((4096, 64), 2), ((2048, 1024), 32), ((512, 2048), 64),
                                     ((8192, 8), 2), ((4096, 32), 4)])
def test_tiny_rows_router_shapes(shape, k):
    """MoE router shapes against the CPU op, and the values against torch.topk's."""
    x = torch.randn(*shape, generator=gen(24))
    check(x, k)
    v, _ = fastlapsum.topk(x.cuda(), k, sorted=True)
    torch.testing.assert_close(v, torch.topk(x.cuda(), k).values, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32] + LOW_DTYPES)
@pytest.mark.parametrize("n", [1, 16, 33, 256, 257, 2048])
def test_tiny_rows_hard_mask(n, dtype):
    """The straight-through mask on tiny rows: integral k in [0, n] -> exactly those ones; k
    not an integer in [0, n] -> a NaN row (through the op: the Python layer rejects it)."""
    rows = 24
    x = tiny_rows(rows, n, seed=200 + n).to(dtype)
    k = torch.randint(0, n + 1, (rows,), generator=gen(n)).double()
    k[:6] = torch.tensor([0.0, float(n), 2.5, -1.0, n + 1.0, min(8, n)])
    t = torch.ones(rows, dtype=torch.float64)
    for largest in (True, False):
        pc = torch.ops.fastlapsum.soft_topk_forward(x, k, t, largest, 0, 2)[0]
        pg = torch.ops.fastlapsum.soft_topk_forward(x.cuda(), k.cuda(), t.cuda(), largest, 0, 2)[0]
        torch.testing.assert_close(pg.cpu(), pc, rtol=0, atol=0, equal_nan=True)
        assert bool(pc[2:5].isnan().all())


def test_tiny_rows_cuda_graph():
    """One launch, no host sync: a captured tiny-row call follows new lengths and scores."""
    rows, n, k = 100, 256, 8
    x = torch.randn(rows, n, generator=gen(25)).cuda()
    lengths = torch.full((rows,), n, dtype=torch.int64, device="cuda")
    graph, out = capture_graph(lambda: fastlapsum.topk(x, k, sorted=True, lengths=lengths))
    for seed in (26, 27):
        g = gen(seed)
        lengths.copy_(torch.randint(0, n + 1, (rows,), generator=g))
        x.copy_(torch.randn(rows, n, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        vc, ic = fastlapsum.topk(x.cpu(), k, sorted=True, lengths=lengths.cpu())
        assert torch.equal(out[1].cpu(), ic) and torch.equal(out[0].cpu(), vc)
