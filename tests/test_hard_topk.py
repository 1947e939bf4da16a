"""fastlapsum.topk: the exact hard selector (DESIGN §2).

Every test checks the exactness criterion of §2 with `assert_exact_topk`: the K indices
of a row are distinct and valid (< L_r), the smallest selected score is >= the largest
unselected valid score (NaN ranking above +inf), values == x.gather(indices), and rows
with L_r <= K end in -1 padding with values -inf (+inf for largest=False).
"""
import math

import pytest
import torch

import fastlapsum

from conftest import DTYPES, assert_exact_topk, gen, order_key


def run_and_check(x, k, *, largest=True, lengths=None, sorted=False, dim=-1):
    values, indices = fastlapsum.topk(x, k, dim=dim, largest=largest, sorted=sorted, lengths=lengths)
    xr = x.movedim(dim, -1)
    batch = xr.shape[:-1]
    vr = values.movedim(dim, -1).reshape(-1, k)
    ir = indices.movedim(dim, -1).reshape(-1, k)
    assert tuple(values.movedim(dim, -1).shape) == (*batch, k)
    lr = None if lengths is None else lengths.broadcast_to(batch).reshape(-1)
    assert_exact_topk(xr.reshape(-1, xr.shape[-1]), k, vr, ir, largest=largest, lengths=lr, sorted=sorted)
    return values, indices


def randn(shape, dtype, device, seed=0):
    return torch.randn(shape, generator=gen(seed), dtype=torch.float64).to(dtype).to(device)


# ---- the helper itself must be able to fail ------------------------------------------

def test_criterion_catches_wrong_answers():
    x = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0]])
    good_v, good_i = torch.tensor([[5.0, 4.0]]), torch.tensor([[0, 2]])
    assert_exact_topk(x, 2, good_v, good_i)
    for v, i in [
        (torch.tensor([[5.0, 3.0]]), torch.tensor([[0, 4]])),  # not the top 2
        (torch.tensor([[5.0, 5.0]]), torch.tensor([[0, 0]])),  # duplicate
        (torch.tensor([[5.0, 1.0]]), torch.tensor([[0, 2]])),  # wrong value
        (torch.tensor([[5.0, -math.inf]]), torch.tensor([[0, -1]])),  # padding without lengths
    ]:
        with pytest.raises(AssertionError):
            assert_exact_topk(x, 2, v, i)
    with pytest.raises(AssertionError):  # index past the valid length
        assert_exact_topk(x, 2, good_v, good_i, lengths=torch.tensor([2]))
    with pytest.raises(AssertionError):  # NaN ranks above everything
        xn = torch.tensor([[1.0, math.nan, 3.0]])
        assert_exact_topk(xn, 1, torch.tensor([[3.0]]), torch.tensor([[2]]))
    with pytest.raises(AssertionError):  # not sorted
        assert_exact_topk(x, 2, torch.tensor([[4.0, 5.0]]), torch.tensor([[2, 0]]), sorted=True)


# ---- random scores -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("largest", [True, False])
def test_random(device, dtype, largest):
    x = randn((16, 2000), dtype, device, seed=1)
    for k in (1, 7, 1999):
        run_and_check(x, k, largest=largest)
    v, _ = run_and_check(x, 300, largest=largest, sorted=True)
    ref = torch.topk(x.cpu().double(), 300, largest=largest, sorted=True).values
    torch.testing.assert_close(v.cpu().double(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("shape,k", [((2, 131072), 2048), ((1, 200003), 12500), ((64, 4096), 2048)])
def test_sparse_attention_shapes(device, shape, k):
    """Long rows with a large K (the indexer and straight-through shapes)."""
    x = randn(shape, torch.float32, device, seed=2)
    run_and_check(x, k)
    rows = shape[0]
    lengths = torch.linspace(0, shape[1], rows).round().to(torch.int64).to(device)
    run_and_check(x, k, lengths=lengths)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sorted_equals_torch_topk(device, dtype):
    x = randn((8, 1000), dtype, device, seed=3)
    for largest in (True, False):
        v, i = run_and_check(x, 64, largest=largest, sorted=True)
        ref = torch.topk(x, 64, largest=largest, sorted=True).values
        torch.testing.assert_close(v, ref, rtol=0, atol=0)
        assert torch.equal(x.gather(1, i), v)


# ---- adversarial rows --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_boundary_ties(device, dtype):
    """Many equal scores straddling the k-th: any of the tied indices may be taken, but
    exactly as many as needed."""
    g = gen(4)
    x = torch.randint(0, 6, (12, 2000), generator=g).to(dtype).to(device)
    for k in (1, 333, 1000, 1999):
        for largest in (True, False):
            run_and_check(x, k, largest=largest)
    # one big tie group: 1 score above, 1000 tied, the rest below; k cuts the tie group
    row = torch.cat([torch.full((1,), 3.0), torch.full((1000,), 2.0), torch.full((999,), 1.0)])
    x = torch.stack([row, row.flip(0), row[torch.randperm(2000, generator=g)]]).to(dtype).to(device)
    for k in (2, 500, 1000, 1001):
        run_and_check(x, k)
    # tiny differences in fp32 next to exact ties (distinct after the low digits)
    base = torch.full((4, 5000), 1.0, dtype=torch.float32)
    base[:, ::3] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    base[:, 1::7] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    run_and_check(base.to(device), 1667)
    run_and_check(base.to(device), 1668)
    run_and_check(base.to(device), 20, largest=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_rows(device, dtype):
    for value in (0.0, -0.0, 1.5, -7.0, math.inf, -math.inf):
        x = torch.full((3, 777), value, dtype=dtype, device=device)
        for k in (1, 100, 777):
            run_and_check(x, k)
            run_and_check(x, k, largest=False)
    # -0.0 and +0.0 are equal scores
    x = torch.zeros(2, 100, dtype=dtype, device=device)
    x[:, ::2] = -0.0
    run_and_check(x, 30)


def test_mostly_neg_inf_rows(device):
    """Rows that are -inf but for a few scores: the few are taken first, the rest of the
    budget is -inf scores with real indices (no lengths given, so no -1)."""
    n = 5000
    x = torch.full((6, n), -math.inf, device=device)
    g = gen(5)
    for r in range(6):
        pos = torch.randperm(n, generator=g)[: r + 1]
        x[r, pos.to(device)] = torch.randn(r + 1, generator=g).to(device)
    for k in (1, 3, 10, 2048):
        v, i = run_and_check(x, k)
        assert bool((i >= 0).all())
        finite = torch.isfinite(v).sum(1).cpu()
        assert torch.equal(finite, torch.arange(1, 7).clamp(max=k))
    run_and_check(x, 10, largest=False)
    # and the mirror: +inf everywhere but a few, smallest side
    run_and_check(-x, 10, largest=False)


def test_sorted_input_rows(device):
    n = 8192
    asc = torch.arange(n, dtype=torch.float32)
    rows = torch.stack([asc, asc.flip(0), asc * 1e-3, (asc - n / 2) ** 3]).to(device)
    for k in (1, 100, 2048, 4096):
        for largest in (True, False):
            v, i = run_and_check(rows, k, largest=largest)
    v, i = fastlapsum.topk(rows[:1], 5, sorted=True)
    assert i.cpu().tolist() == [[n - 1, n - 2, n - 3, n - 4, n - 5]]


@pytest.mark.parametrize("period", [64, 128])
def test_periodic_rows(device, period):
    """Rows with the period of the sampling stride: a strided sample sees one phase only."""
    n = 64 * 128
    i = torch.arange(n)
    rows = []
    for phase in (0, 1, 17, period - 1):
        r = torch.zeros(n)
        r[i % period == phase] = 10.0 + torch.arange(n // period, dtype=torch.float32)  # a lone spike
        rows.append(r)
    rows.append((i % period).float())  # sawtooth: ties in groups of n/period
    rows.append(((i * 37) % period).float() + i.float() * 1e-6)
    x = torch.stack(rows).to(device)
    for k in (1, n // period, n // period + 1, 2048, n // 2):
        run_and_check(x, k)
        run_and_check(x, k, largest=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_cpu_sample_filter_rows(dtype):
    """The CPU selector's sampled pre-filter (select_cpu.h: rows of >= 1024 scores, k <= n/8, a
    sample every n/256 scores): spikes on exactly the sampled positions (all 256 pass; budgets
    above fall back to the whole row), spikes just off them, ties at the threshold, and the
    sorted order with the smaller index first among ties."""
    n = 4096
    i = torch.arange(n)
    rows = [torch.randn(n, generator=gen(40)) * 100]
    for phase in (0, 1):
        r = torch.randn(n, generator=gen(41 + phase))
        r[i % 16 == phase] = 1000.0 + (i[i % 16 == phase] % 7).float()  # ties among the spikes
        rows.append(r)
    rows.append((i % 16 == 0).float() * 5 + (i % 3).float())  # the sample sees only the top levels
    rows.append(torch.full((n,), 2.0))
    x = torch.stack(rows).round().to(dtype)
    for k in (1, 29, 255, 256, 257, 400, 512):
        for largest in (True, False):
            run_and_check(x, k, largest=largest)
            v, idx = fastlapsum.topk(x, k, largest=largest, sorted=True)
            key = order_key(x.float(), largest)
            assert torch.equal(idx, key.sort(dim=1, descending=True, stable=True).indices[:, :k])
    lengths = torch.tensor([4096, 2000, 1024, 1023, 3000])
    run_and_check(x, 100, lengths=lengths)


def test_nan_ranks_above_inf(device):
    n = 1000
    g = gen(6)
    x = torch.randn(5, n, generator=g)
    x[0, [3, 500, 999]] = math.nan
    x[1, [10, 20]] = math.inf
    x[1, [30, 40]] = math.nan
    x[2] = math.nan
    x[3, 7] = -math.nan  # sign bit set: still NaN
    x[4, 0] = -math.inf
    x = x.to(device)
    v, i = run_and_check(x, 4, sorted=True)
    assert set(i[0].cpu().tolist()[:3]) == {3, 500, 999}
    assert i[1].cpu().tolist()[:2] in ([30, 40], [40, 30]) and set(i[1].cpu().tolist()[2:]) == {10, 20}
    assert 7 in i[3].cpu().tolist()
    ref = torch.topk(x.cpu(), 4, sorted=True).values
    torch.testing.assert_close(v.cpu(), ref, rtol=0, atol=0, equal_nan=True)
    # smallest: NaN last, picked only when nothing else is left
    v, i = run_and_check(x, n - 1, largest=False)
    assert int(v[0].isnan().sum()) == 2  # row 0 has 3 NaN: 2 of them must be taken
    assert int(v[4].isnan().sum()) == 0
    assert int(v[2].isnan().sum()) == n - 1


# ---- ragged lengths ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("largest", [True, False])
def test_lengths(device, dtype, largest):
    n, k = 600, 50
    L = torch.tensor([0, 1, 10, 49, 50, 51, 300, 599, 600])
    x = randn((len(L), n), torch.float32, "cpu", seed=7)
    # garbage past L_r that would win if it were read
    for r, l in enumerate(L.tolist()):
        tail = x[r, l:]
        tail[0::3] = math.inf if largest else -math.inf
        tail[1::3] = math.nan
        tail[2::3] = 1e4 if largest else -1e4
    x = x.to(dtype).to(device)
    lengths = L.to(device)
    v, i = run_and_check(x, k, largest=largest, lengths=lengths)
    for sorted_ in (True, False):
        v, i = run_and_check(x, k, largest=largest, lengths=lengths, sorted=sorted_)
        assert not bool(v.isnan().any()), "garbage NaN past L_r was selected"
    # rows with L_r <= K return exactly their valid indices
    for r, l in enumerate(L.tolist()):
        if l <= k:
            assert sorted(i[r, :l].cpu().tolist()) == list(range(l))
    # sorted values agree with torch.topk on the valid prefix
    v, i = fastlapsum.topk(x, k, largest=largest, sorted=True, lengths=lengths)
    for r, l in enumerate(L.tolist()):
        m = min(l, k)
        ref = torch.topk(x[r, :l].cpu(), m, largest=largest).values
        torch.testing.assert_close(v[r, :m].cpu(), ref, rtol=0, atol=0)


def test_lengths_broadcast_and_dtypes(device):
    x = randn((3, 4, 100), torch.float32, device, seed=8)
    for lengths in (torch.tensor(37), torch.tensor([5, 100, 0, 64]), torch.tensor([[3], [30], [90]])):
        for ldt in (torch.int64, torch.int32, torch.int16):
            run_and_check(x, 40, lengths=lengths.to(ldt).to(device))
    # the same answer as slicing the row
    v, i = fastlapsum.topk(x, 10, sorted=True, lengths=torch.tensor(37, device=device))
    ref = torch.topk(x[..., :37], 10, sorted=True).values
    torch.testing.assert_close(v, ref, rtol=0, atol=0)


def test_lengths_all_zero_and_k_zero(device):
    x = randn((4, 64), torch.float32, device, seed=9)
    v, i = fastlapsum.topk(x, 8, lengths=torch.zeros(4, dtype=torch.int64, device=device))
    assert bool((i == -1).all()) and bool((v == -math.inf).all())
    v, i = fastlapsum.topk(x, 8, largest=False, lengths=torch.zeros(4, dtype=torch.int64, device=device))
    assert bool((i == -1).all()) and bool((v == math.inf).all())
    v, i = fastlapsum.topk(x, 0, lengths=torch.full((4,), 10, device=device))
    assert v.shape == (4, 0) and i.shape == (4, 0)


# ---- tie-break, shapes, k edge cases --------------------------------------------------

def test_deterministic_tie_break_cpu():
    """CPU: among tied scores the smaller index wins (DESIGN §2, deterministic mode)."""
    g = gen(10)
    x = torch.randint(0, 4, (10, 3000), generator=g).float()
    x[3] = 1.0
    for largest in (True, False):
        key = order_key(x, largest)
        expect = key.sort(dim=1, descending=True, stable=True).indices  # ties: smaller index first
        for k in (1, 500, 1500, 2999):
            v, i = fastlapsum.topk(x, k, largest=largest)
            assert torch.equal(i.sort(1).values, expect[:, :k].sort(1).values)
            v, i = fastlapsum.topk(x, k, largest=largest, sorted=True)
            assert torch.equal(i, expect[:, :k])
        # with lengths, ties still resolve to the smallest indices of the valid prefix
        L = torch.tensor([0, 5, 100, 1000, 2999, 3000, 17, 1, 2, 2500])
        v, i = fastlapsum.topk(x, 200, largest=largest, sorted=True, lengths=L)
        for r, l in enumerate(L.tolist()):
            m = min(l, 200)
            kr = order_key(x[r, :l], largest)
            assert i[r, :m].tolist() == kr.sort(descending=True, stable=True).indices[:m].tolist()


def test_repeatable(device):
    x = torch.randint(0, 3, (32, 4096), generator=gen(11)).float().to(device)
    a = fastlapsum.topk(x, 1000, lengths=torch.arange(32, device=device) * 128)
    b = fastlapsum.topk(x, 1000, lengths=torch.arange(32, device=device) * 128)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dim", [0, 1, 2, -2])
def test_dim_and_batched(device, dim):
    x = randn((30, 40, 50), torch.float32, device, seed=12)
    k = 9
    v, i = run_and_check(x, k, dim=dim, sorted=True)
    ref = torch.topk(x, k, dim=dim, sorted=True).values
    torch.testing.assert_close(v, ref, rtol=0, atol=0)
    assert torch.equal(x.gather(dim, i), v)
    # lengths shaped like x without dim
    batch = list(x.shape)
    n = batch.pop(dim)
    lengths = torch.randint(0, n + 1, batch, generator=gen(13)).to(device)
    run_and_check(x, k, dim=dim, lengths=lengths, largest=False)


def test_non_contiguous_input(device):
    x = randn((200, 64), torch.float32, device, seed=14)
    xt = x.t()  # [64, 200] view
    v, i = run_and_check(xt, 20)
    v2, i2 = run_and_check(xt.contiguous(), 20)
    assert torch.equal(v.sort(1).values, v2.sort(1).values)
    run_and_check(x[:, ::2], 5)


def test_k_zero_and_k_n(device):
    x = randn((5, 33), torch.float32, device, seed=15)
    v, i = fastlapsum.topk(x, 0)
    assert v.shape == (5, 0) and i.shape == (5, 0) and i.dtype == torch.int64
    for largest in (True, False):
        v, i = run_and_check(x, 33, largest=largest, sorted=True)
        assert torch.equal(i.sort(1).values.cpu(), torch.arange(33).expand(5, 33))
        ref = x.sort(1, descending=largest).values
        torch.testing.assert_close(v, ref, rtol=0, atol=0)
    x1 = randn((4, 1), torch.float32, device, seed=16)
    v, i = fastlapsum.topk(x1, 1)
    assert torch.equal(v, x1) and bool((i == 0).all())


# ---- gradient ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradient_scatters(device, dtype):
    x = randn((6, 200), dtype, device, seed=17).requires_grad_()
    L = torch.tensor([0, 3, 20, 21, 150, 200], device=device)
    v, i = fastlapsum.topk(x, 20, lengths=L)
    g = randn(v.shape, dtype, device, seed=18)
    (gx,) = torch.autograd.grad(v, x, g)
    expect = torch.zeros_like(x)
    for r, j in (i >= 0).nonzero().tolist():
        expect[r, i[r, j]] += g[r, j]
    assert int((expect != 0).sum()) == int((i >= 0).sum()) == 3 + 20 + 20 + 20 + 20
    torch.testing.assert_close(gx, expect, rtol=0, atol=0)
    # dim != -1 goes back to the right place too
    x3 = randn((7, 4, 5), dtype, device, seed=19).requires_grad_()
    v3, i3 = fastlapsum.topk(x3, 3, dim=0)
    v3.sum().backward()
    expect3 = torch.zeros_like(x3).scatter_(0, i3, 1.0)
    torch.testing.assert_close(x3.grad, expect3, rtol=0, atol=0)


def test_gradcheck_values(device):
    x = randn((3, 12), torch.float64, device, seed=20).requires_grad_()
    L = torch.tensor([12, 5, 4], device=device)  # no -inf padding: finite differences
    torch.autograd.gradcheck(lambda a: fastlapsum.topk(a, 4, lengths=L)[0], (x,))
    torch.autograd.gradcheck(lambda a: fastlapsum.topk(a, 4, largest=False, sorted=True)[0], (x,))
