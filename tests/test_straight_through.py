"""The straight-through forward (soft_topk(hard=True), soft_topk_forward mode 2).

Its mask is fastlapsum.topk's selection: exactly k_r ones per row, the k_r best scores with
ties to the smaller index, +inf above every finite score and -inf below; a NaN row where
the row's threshold b is NaN (a NaN score) or
where k_r is not an integer in [0, n] (the raw op; the Python layer rejects such k). The
op still returns the threshold op's b for the backward. Rows cover every selector
mapping on CUDA: a thread a row (n <= 32), a warp a row (n <= 2048), a CTA a row and the
grid path (few rows of n >= 2^16); CUDA results must equal the CPU op's exactly.
"""
import math

import pytest
import torch

import fastlapsum as fl

from conftest import CUDA

MODE_SOFT, MODE_HARD = 0, 2
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# (rows, n): thread rows, warp rows, CTA rows, the grid path's few long rows
SHAPES = [(9, 16), (9, 300), (6, 4100), (4, 70000)]


def op(x, k, t, largest=True, method=0, mode=MODE_HARD):
    return torch.ops.fastlapsum.soft_topk_forward(x, k, t, largest, method, mode)


def scores(rows, n, dtype, device, seed):
    """Integer-valued scores from a small range (many ties, exact in every dtype) with
    +inf / -inf sprinkled in, and rows of all +inf and all -inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-40, 40, (rows, n), generator=g).double()
    x[torch.rand(rows, n, generator=g) < 0.02] = math.inf
    x[torch.rand(rows, n, generator=g) < 0.02] = -math.inf
    x[1] = math.inf
    x[2] = -math.inf
    return x.to(dtype).to(device)


def budgets(rows, n, seed):
    """Integral k per row, including 0 and n."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, n + 1, (rows,), generator=g).double()
    k[0], k[1], k[2] = 0.0, float(n), float(n // 3)
    k[3 % rows] = float(n)
    return k


def topk_mask(x, k, largest):
    """The mask of fastlapsum.topk's selection with each row's own budget: the first k_r of
    its sorted order (best first, ties to the smaller index)."""
    rows, n = x.shape
    order = fl.topk(x, n, largest=largest, sorted=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(n, device=x.device).expand(rows, n))
    return (rank < k.to(x.device).view(-1, 1)).to(x.dtype)


def t_ones(rows, device):
    return torch.ones(rows, dtype=torch.float64, device=device)


@pytest.mark.parametrize("temperature", [1.0, 0.01])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", SHAPES)
def test_mask_is_topk_selection(device, rows, n, dtype, largest, temperature):
    """t = 0.01 puts the k-th score among those the CPU's solve orders (its sort, the bracket's
    middle set), whose order the mask then reuses instead of selecting again."""
    x = scores(rows, n, dtype, device, seed=n + rows)
    k = budgets(rows, n, seed=n).to(device)
    tt = t_ones(rows, device) * temperature
    p, b, _ = op(x, k, tt, largest)
    assert p.dtype == dtype and p.shape == x.shape
    torch.testing.assert_close(p, topk_mask(x, k, largest), rtol=0, atol=0)
    assert torch.equal(p.double().sum(1), k)
    # b is the threshold op's (solved for the backward)
    b_ref = torch.ops.fastlapsum.lapsum_threshold(x, k, tt, largest, 0)[0]
    torch.testing.assert_close(b, b_ref, rtol=0, atol=0, equal_nan=True)
    if device == "cuda":
        pc = op(x.cpu(), k.cpu(), tt.cpu(), largest)[0]
        torch.testing.assert_close(p.cpu(), pc, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", SHAPES)
def test_nan_rows(device, rows, n, dtype):
    """A NaN score (NaN b) or a budget that is not an integer in [0, n]: a whole NaN row,
    whatever the selector; the other rows are topk's selection."""
    g = torch.Generator().manual_seed(7 * n)
    x = torch.randn(rows, n, generator=g).to(dtype)
    x[0, n // 2] = math.nan  # topk ranks it first; the mask's row is NaN
    x[1, 0] = math.nan  # also among infinite scores
    x[1, 1:] = math.inf
    x[1, n // 2:] = -math.inf
    k = torch.full((rows,), float(min(5, n)), dtype=torch.float64)
    k[2] = 2.5
    t = t_ones(rows, "cpu")
    x, k, t = x.to(device), k.to(device), t.to(device)
    p, b, _ = op(x, k, t)
    nan_rows = torch.zeros(rows, dtype=torch.bool)
    nan_rows[:3] = True
    assert bool(b[:2].isnan().all())
    assert bool(p[nan_rows.to(device)].isnan().all())
    good = ~nan_rows.to(device)
    torch.testing.assert_close(p[good], topk_mask(x[good], k[good], True), rtol=0, atol=0)
    for bad in (-1.0, n + 1.0, math.nan, math.inf):
        kb = k.clone()
        kb[-1] = bad
        pb = op(x, kb, t)[0]
        assert bool(pb[-1].isnan().all())
        torch.testing.assert_close(pb[:-1], p[:-1], rtol=0, atol=0, equal_nan=True)
    if device == "cuda":
        torch.testing.assert_close(p.cpu(), op(x.cpu(), k.cpu(), t.cpu())[0], rtol=0, atol=0, equal_nan=True)


def test_python_layer(device):
    """soft_topk(hard=True): the mask of the op, any dim; non-integral k is rejected."""
    x = scores(4, 300, torch.float32, device, seed=3).transpose(0, 1)  # dim 0, a strided view
    p = fl.soft_topk(x, 37, 0.5, dim=0, hard=True)
    k = torch.full((4,), 37.0, dtype=torch.float64, device=device)
    torch.testing.assert_close(p, topk_mask(x.t().contiguous(), k, True).t(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="integral"):
        fl.soft_topk(x, 2.5, dim=0, hard=True)
    kt = torch.tensor([1.0, 2.5, 3.0, 4.0], device=device)
    if device == "cpu":
        with pytest.raises(ValueError, match="integral"):
            fl.soft_topk(x, kt, dim=0, hard=True)
    else:  # a device tensor's values are not read on the host: the op's NaN row
        p = fl.soft_topk(x, kt, dim=0, hard=True)
        assert bool(p[:, 1].isnan().all()) and not bool(p[:, [0, 2, 3]].isnan().any())


@pytest.mark.parametrize("method,n", [(0, 5000), (1, 5000), (2, 300)])
def test_soft_forward_is_threshold_then_mask(device, method, n):
    """The fused forward's rows that do not take the on-chip kernel (long rows, the bracket
    method): its b and p are the threshold op's and the mask op's."""
    rows = 5
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(n + method)).to(device)
    k = torch.linspace(0.5, n - 0.5, rows, dtype=torch.float64, device=device)
    t = torch.linspace(0.1, 3.0, rows, dtype=torch.float64, device=device)
    for largest in (True, False):
        p, b, diag = op(x, k, t, largest, method, MODE_SOFT)
        b_ref, edge, diag_ref = torch.ops.fastlapsum.lapsum_threshold(x, k, t, largest, method)
        torch.testing.assert_close(b, b_ref, rtol=0, atol=0)
        assert torch.equal(diag, diag_ref)
        p_ref = torch.ops.fastlapsum.lapsum_mask(x, b_ref, t, edge, largest, False)
        torch.testing.assert_close(p, p_ref, rtol=0, atol=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and the CUDA build")
def test_cuda_graph_nan_rows():
    """Captured: the NaN-row rule follows the scores of each replay (read on the device)."""
    rows, n = 8, 4100
    x = torch.randn(rows, n, device="cuda")
    k = torch.full((rows,), 9.0, dtype=torch.float64, device="cuda")
    t = t_ones(rows, "cuda")
    op(x, k, t)  # warm up (kernel attributes) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, k, t)[0]
    for row in (3, 5):
        x.copy_(torch.randn(rows, n, device="cuda"))
        x[row, 17] = math.nan
        graph.replay()
        torch.cuda.synchronize()
        assert bool(out[row].isnan().all())
        others = torch.arange(rows, device="cuda") != row
        torch.testing.assert_close(out[others], topk_mask(x[others], k[others], True), rtol=0, atol=0)
