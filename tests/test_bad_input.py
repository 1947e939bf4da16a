"""Bad input (DESIGN §6): clear Python exceptions naming the argument, never a crash,
silent garbage, or damage to other rows; and the specified non-finite score rules."""
import math

import pytest
import torch

import fastlapsum
from fastlapsum import reference

from conftest import BUDGET_TOL, budget_error, requires_cuda

ops = torch.ops.fastlapsum
SOFT_FUNCS = {
    "soft_topk": fastlapsum.soft_topk,
    "log_soft_topk": fastlapsum.log_soft_topk,
    "lapsum_threshold": fastlapsum.lapsum_threshold,
}


def x_of(device, rows=3, n=10, dtype=torch.float32, seed=0):
    return torch.randn(rows, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype).to(device)


# ---- k, temperature, hard ------------------------------------------------------------

@pytest.mark.parametrize("name", list(SOFT_FUNCS))
@pytest.mark.parametrize("k", [-1, -1e-9, 10.5, 11, math.inf, -math.inf, math.nan])
def test_k_out_of_range(device, name, k):
    x = x_of(device)
    with pytest.raises(ValueError, match=r"\bk\b"):
        SOFT_FUNCS[name](x, k)
    kt = torch.tensor([1.0, k, 2.0], device=device)
    if device == "cpu":  # a CUDA tensor is not read back (no host sync): see test_cuda_tensor_k_bad_rows
        with pytest.raises(ValueError, match=r"\bk\b"):
            SOFT_FUNCS[name](x, kt)
    with pytest.raises(ValueError, match=r"\bk\b"):  # a 0-d CPU tensor is read like a number
        SOFT_FUNCS[name](x, torch.tensor(k))


def test_k_edges_are_legal(device):
    x = x_of(device)
    assert bool((fastlapsum.soft_topk(x, 0) == 0).all())
    assert bool((fastlapsum.soft_topk(x, 10) == 1).all())
    assert bool((fastlapsum.soft_topk(x, torch.tensor([0.0, 10.0, 5.0], device=device)).sum(1).cpu()
                 - torch.tensor([0.0, 10.0, 5.0])).abs().max() < 1e-5)
    assert bool((fastlapsum.soft_topk(x, 0, hard=True) == 0).all())
    assert bool((fastlapsum.soft_topk(x, 10, hard=True) == 1).all())


@pytest.mark.parametrize("k", [2.5, 0.1, 9.999])
def test_non_integral_k_with_hard(device, k):
    x = x_of(device)
    with pytest.raises(ValueError, match=r"\bk\b.*integral"):
        fastlapsum.soft_topk(x, k, hard=True)
    if device == "cpu":
        with pytest.raises(ValueError, match=r"\bk\b.*integral"):
            fastlapsum.soft_topk(x, torch.tensor([1.0, k, 3.0]), hard=True)
    with pytest.raises(ValueError, match=r"\bk\b.*integral"):
        fastlapsum.SoftTopK(k, hard=True)(x)
    # integral floats and integer tensors are fine
    p = fastlapsum.soft_topk(x, 3.0, hard=True)
    assert bool((p.sum(1) == 3).all())
    p = fastlapsum.soft_topk(x, torch.tensor([1, 2, 3], device=device), hard=True)
    assert p.sum(1).tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("name", list(SOFT_FUNCS))
@pytest.mark.parametrize("t", [0.0, -0.0, -1.0, -1e-300, math.inf, -math.inf, math.nan])
def test_bad_temperature(device, name, t):
    x = x_of(device)
    with pytest.raises(ValueError, match="temperature"):
        SOFT_FUNCS[name](x, 2, t)
    with pytest.raises(ValueError, match="temperature"):
        SOFT_FUNCS[name](x, 2, torch.tensor(t))
    if device == "cpu":
        with pytest.raises(ValueError, match="temperature"):
            SOFT_FUNCS[name](x, 2, torch.tensor([1.0, t, 1.0]))


@pytest.mark.parametrize("bad", ["2", None, [1, 2, 3], True, 2 + 0j])
def test_k_and_temperature_types(device, bad):
    x = x_of(device)
    with pytest.raises(TypeError, match=r"\bk\b"):
        fastlapsum.soft_topk(x, bad)
    with pytest.raises(TypeError, match="temperature"):
        fastlapsum.soft_topk(x, 2, bad)


def test_k_tensor_dtypes_and_shapes(device):
    x = x_of(device)
    for dt in (torch.complex64, torch.bool):
        with pytest.raises(TypeError, match=r"\bk\b"):
            fastlapsum.soft_topk(x, torch.ones(3, dtype=dt, device=device))
        with pytest.raises(TypeError, match="temperature"):
            fastlapsum.soft_topk(x, 2, torch.ones(3, dtype=dt, device=device))
    for shape in ((2,), (4,), (3, 3), (1, 2)):
        with pytest.raises(ValueError, match=r"\bk\b.*broadcast"):
            fastlapsum.soft_topk(x, torch.ones(shape, device=device))
        with pytest.raises(ValueError, match="temperature.*broadcast"):
            fastlapsum.soft_topk(x, 2, torch.ones(shape, device=device))
    # broadcastable shapes are fine
    for shape in ((), (1,), (3,)):
        p = fastlapsum.soft_topk(x, torch.full(shape, 2.0, device=device), torch.full(shape, 0.5, device=device))
        assert budget_error(p, 2.0) <= BUDGET_TOL[torch.float32]


# ---- x -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64,
                                   torch.complex128])
def test_bad_x_dtype(device, dtype):
    x = torch.ones(3, 10, dtype=dtype, device=device)
    for f in SOFT_FUNCS.values():
        with pytest.raises(TypeError, match=r"\bx\b.*" + str(dtype).replace("torch.", "")):
            f(x, 2)
    with pytest.raises(TypeError, match=r"\bx\b"):
        fastlapsum.soft_topk(x, 2, hard=True)
    if x.is_complex():  # topk takes integer and bool x (tests/test_topk_parity.py)
        with pytest.raises(TypeError, match=r"\bx\b"):
            fastlapsum.topk(x, 2)


def test_x_not_a_tensor():
    with pytest.raises(TypeError, match=r"\bx\b"):
        fastlapsum.soft_topk([1.0, 2.0, 3.0], 1)
    with pytest.raises(TypeError, match=r"\bx\b"):
        fastlapsum.topk((1.0, 2.0), 1)


@pytest.mark.parametrize("shape,dim", [((3, 0), -1), ((0,), 0), ((4, 0, 5), 1), ((2, 3, 0), 2)])
def test_empty_selection_dim(device, shape, dim):
    x = torch.empty(shape, device=device)
    for f in SOFT_FUNCS.values():
        with pytest.raises(ValueError, match="empty"):
            f(x, 0, dim=dim)
    with pytest.raises(ValueError, match="empty"):
        fastlapsum.soft_topk(x, 0, dim=dim, hard=True)
    # topk takes an empty selection dim with k = 0, as torch.topk does
    assert fastlapsum.topk(x, 0, dim=dim).values.shape == x.shape
    with pytest.raises(ValueError, match=r"\bk\b"):
        fastlapsum.topk(x, 1, dim=dim)


def test_empty_batch_is_fine(device):
    """Zero rows (but a non-empty selection dim) is legal and gives empty outputs."""
    x = torch.empty(0, 10, device=device)
    assert fastlapsum.soft_topk(x, 2).shape == (0, 10)
    assert fastlapsum.soft_topk(x, 2, hard=True).shape == (0, 10)
    assert fastlapsum.log_soft_topk(x, 2).shape == (0, 10)
    assert fastlapsum.lapsum_threshold(x, 2).shape == (0,)
    v, i = fastlapsum.topk(x, 3, lengths=torch.empty(0, dtype=torch.int64, device=device))
    assert v.shape == (0, 3) and i.shape == (0, 3)
    x3 = torch.empty(2, 0, 7, device=device)
    assert fastlapsum.soft_topk(x3, 1).shape == (2, 0, 7)
    assert fastlapsum.topk(x3, 1)[1].shape == (2, 0, 1)


def test_zero_dim_x(device):
    x = torch.tensor(1.0, device=device)
    for f in SOFT_FUNCS.values():
        with pytest.raises(ValueError, match=r"\bx\b.*dimension"):
            f(x, 0)
    # topk takes a 0-d x, as torch.topk does (tests/test_topk_parity.py)
    assert fastlapsum.topk(x, 1).values.shape == ()


@pytest.mark.parametrize("dim", [2, -3, 5, 100])
def test_dim_out_of_range(device, dim):
    x = x_of(device)
    for f in SOFT_FUNCS.values():
        with pytest.raises(IndexError, match="dim"):
            f(x, 2, dim=dim)
    with pytest.raises(IndexError, match="dim"):
        fastlapsum.topk(x, 2, dim=dim)
    with pytest.raises(IndexError, match="dim"):
        fastlapsum.SoftTopK(2, dim=dim)(x)


@pytest.mark.parametrize("method", ["bisect", "", "SORT", None, 1])
def test_unknown_method(device, method):
    x = x_of(device)
    for name in ("soft_topk", "log_soft_topk", "lapsum_threshold"):
        with pytest.raises(ValueError, match="method"):
            SOFT_FUNCS[name](x, 2, method=method)


# ---- topk: k and lengths ----------------------------------------------------------------

@pytest.mark.parametrize("k", [11, 100, -1])
def test_topk_k_out_of_range(device, k):
    x = x_of(device)
    with pytest.raises(ValueError, match=r"\bk\b"):
        fastlapsum.topk(x, k)


@pytest.mark.parametrize("k", [2.0, 2.5, "2", None, True, torch.tensor(2.0)])
def test_topk_k_not_int(device, k):
    x = x_of(device)
    with pytest.raises(TypeError, match=r"\bk\b"):
        fastlapsum.topk(x, k)


def test_topk_k_numpy_int_is_fine(device):
    np = pytest.importorskip("numpy")
    x = x_of(device)
    v, i = fastlapsum.topk(x, np.int64(3), sorted=True)
    torch.testing.assert_close(v, torch.topk(x, 3).values, rtol=0, atol=0)


@pytest.mark.parametrize("lengths", [[1, 11, 2], [1, -1, 2], [10**12, 0, 0], [-(2**40), 1, 1]])
def test_lengths_out_of_range(lengths):
    x = x_of("cpu")
    with pytest.raises(ValueError, match="lengths"):
        fastlapsum.topk(x, 2, lengths=torch.tensor(lengths))
    with pytest.raises(ValueError, match="lengths"):
        fastlapsum.topk(x, 2, lengths=torch.tensor(next(v for v in lengths if not 0 <= v <= 10)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bool, torch.complex64])
def test_lengths_not_integer(device, dtype):
    x = x_of(device)
    with pytest.raises(TypeError, match="lengths"):
        fastlapsum.topk(x, 2, lengths=torch.tensor([1, 2, 3], device=device).to(dtype))


def test_lengths_not_a_tensor(device):
    x = x_of(device)
    for lengths in ([1, 2, 3], 5, (1, 2, 3)):
        with pytest.raises(TypeError, match="lengths"):
            fastlapsum.topk(x, 2, lengths=lengths)


@pytest.mark.parametrize("shape", [(2,), (4,), (3, 2), (2, 3)])
def test_lengths_shape_not_broadcastable(device, shape):
    x = x_of(device)
    with pytest.raises(ValueError, match="lengths.*broadcast"):
        fastlapsum.topk(x, 2, lengths=torch.ones(shape, dtype=torch.int64, device=device))


# ---- devices ---------------------------------------------------------------------------

@requires_cuda
def test_mismatched_devices():
    xc, xg = x_of("cpu"), x_of("cuda")
    kc, kg = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 3.0], device="cuda")
    for f in SOFT_FUNCS.values():
        with pytest.raises(ValueError, match=r"\bk\b.*cuda"):
            f(xc, kg)
        with pytest.raises(ValueError, match=r"\bk\b.*cpu"):
            f(xg, kc)
        with pytest.raises(ValueError, match="temperature.*cuda"):
            f(xc, 2, kg)
        with pytest.raises(ValueError, match="temperature.*cpu"):
            f(xg, 2, kc)
    with pytest.raises(ValueError, match="lengths"):
        fastlapsum.topk(xg, 2, lengths=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="lengths"):
        fastlapsum.topk(xc, 2, lengths=torch.tensor([1, 2, 3], device="cuda"))
    with pytest.raises(ValueError, match="lengths"):
        fastlapsum.topk(xg, 2, lengths=torch.tensor(2))  # lengths must live with x
    # a 0-d CPU k / temperature is a scalar and is accepted for CUDA x
    p = fastlapsum.soft_topk(xg, torch.tensor(2.0), torch.tensor(0.5))
    torch.testing.assert_close(p, fastlapsum.soft_topk(xg, 2.0, 0.5), rtol=0, atol=0)


@requires_cuda
def test_cuda_tensor_k_bad_rows():
    """A CUDA tensor k / temperature is not read back (no host sync). A bad entry must
    then give a clear error or NaN in its own row only, never garbage elsewhere."""
    x = x_of("cuda", rows=4)
    good = fastlapsum.soft_topk(x, torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda"))
    for kbad in (-1.0, 11.0, math.nan, math.inf):
        try:
            p = fastlapsum.soft_topk(x, torch.tensor([1.0, kbad, 3.0, 4.0], device="cuda"))
        except ValueError as e:
            assert "k" in str(e)
            continue
        assert bool(p[1].isnan().all()), f"k={kbad}: row 1 must be NaN, got {p[1]}"
        torch.testing.assert_close(p[[0, 2, 3]], good[[0, 2, 3]], rtol=0, atol=0)
    for tbad in (0.0, -1.0, math.nan, math.inf):
        try:
            p = fastlapsum.soft_topk(x, torch.tensor([1.0, 2.0, 3.0, 4.0], device="cuda"),
                                     torch.tensor([1.0, tbad, 1.0, 1.0], device="cuda"))
        except ValueError as e:
            assert "temperature" in str(e)
            continue
        assert bool(p[1].isnan().all()), f"t={tbad}: row 1 must be NaN, got {p[1]}"
        torch.testing.assert_close(p[[0, 2, 3]], good[[0, 2, 3]], rtol=0, atol=0)


# ---- the ops themselves: shape mismatches must not read out of bounds ------------------

def _op_sample():
    x = x_of("cpu", rows=3, n=10, dtype=torch.float64)
    k = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    t = torch.ones(3, dtype=torch.float64)
    b, edge, _ = ops.lapsum_threshold(x, k, t, True, 0)
    return x, k, t, b, edge


@pytest.mark.parametrize("case", [
    "threshold_k_rows", "forward_t_rows", "forward_x_1d", "topk_lengths_rows", "topk_lengths_range",
    "topk_k_range", "mask_b_rows", "mask_t_rows", "mask_edge_rows", "backward_grad_shape", "backward_b_rows",
    "threshold_backward_grad_rows", "threshold_backward_t_rows",
])
def test_op_shape_checks(case):
    """torch.ops.fastlapsum.* are callable directly: mismatched per-row tensors must raise,
    not read past the end of a buffer (DESIGN §6: no out-of-bounds reads). CPU only: on
    CUDA an out-of-bounds read could poison the context of the whole test session."""
    x, k, t, b, edge = _op_sample()
    g = torch.ones_like(x)
    call = {
        "threshold_k_rows": lambda: ops.lapsum_threshold(x, k[:2], t, True, 0),
        "forward_t_rows": lambda: ops.soft_topk_forward(x, k, t[:2], True, 0, 0),
        "forward_x_1d": lambda: ops.soft_topk_forward(x[0], k, t, True, 0, 0),
        "topk_lengths_rows": lambda: ops.topk(x, 2, True, False, torch.tensor([1, 2])),
        "topk_lengths_range": lambda: ops.topk(x, 2, True, False, torch.tensor([1, 2, 11])),
        "topk_k_range": lambda: ops.topk(x, 11, True, False, None),
        "mask_b_rows": lambda: ops.lapsum_mask(x, b[:2], t, edge, True, False),
        "mask_t_rows": lambda: ops.lapsum_mask(x, b, t[:2], edge, True, False),
        "mask_edge_rows": lambda: ops.lapsum_mask(x, b, t, edge[:2], True, False),
        "backward_grad_shape": lambda: ops.soft_topk_backward(g[:2], x, b, t, True, False),
        "backward_b_rows": lambda: ops.soft_topk_backward(g, x, b[:2], t, True, False),
        "threshold_backward_grad_rows": lambda: ops.lapsum_threshold_backward(b[:2], x, b, t, True),
        "threshold_backward_t_rows": lambda: ops.lapsum_threshold_backward(b, x, b, t[:2], True),
    }[case]
    with pytest.raises(RuntimeError):
        call()


# ---- non-finite scores -----------------------------------------------------------------

def _nan_rows(device, dtype):
    x = x_of(device, rows=4, n=50, dtype=dtype, seed=1)
    xn = x.clone()
    xn[1, 7] = math.nan
    xn[3] = math.nan
    return x, xn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_nan_row_is_contained(device, dtype):
    """A row containing NaN yields NaN for that row only; other rows are unchanged."""
    x, xn = _nan_rows(device, dtype)
    ok = [0, 2]
    k = torch.tensor([3.0, 4.0, 5.5, 6.0], device=device)
    for largest in (True, False):
        for method in ("auto", "sort", "bracket"):
            p, pn = (fastlapsum.soft_topk(a, k, 0.7, largest=largest, method=method) for a in (x, xn))
            assert bool(pn[[1, 3]].isnan().all()), "a NaN row must be all NaN"
            torch.testing.assert_close(pn[ok], p[ok], rtol=0, atol=0)
            lp, lpn = (fastlapsum.log_soft_topk(a, k, 0.7, largest=largest, method=method) for a in (x, xn))
            assert bool(lpn[[1, 3]].isnan().all())
            torch.testing.assert_close(lpn[ok], lp[ok], rtol=0, atol=0)
            b, bn = (fastlapsum.lapsum_threshold(a, k, 0.7, largest=largest, method=method) for a in (x, xn))
            assert bool(bn[[1, 3]].isnan().all())
            torch.testing.assert_close(bn[ok], b[ok], rtol=0, atol=0)
        kh = k.round()
        h, hn = (fastlapsum.soft_topk(a, kh, 0.7, largest=largest, hard=True) for a in (x, xn))
        assert bool(hn[[1, 3]].isnan().all()), "hard mode: a NaN row must be all NaN"
        torch.testing.assert_close(hn[ok], h[ok], rtol=0, atol=0)
        assert h[ok].sum(1).tolist() == kh[ok].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_row_gradient_is_contained(device, dtype):
    x, xn = _nan_rows(device, dtype)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype).to(device)
    grads = []
    for a in (x, xn):
        a = a.clone().requires_grad_()
        k = torch.tensor([3.0, 4.0, 5.5, 6.0], dtype=torch.float64, device=device, requires_grad=True)
        t = torch.full((4,), 0.7, dtype=torch.float64, device=device, requires_grad=True)
        loss = (fastlapsum.soft_topk(a, k, t) * w).nansum() + fastlapsum.lapsum_threshold(a, k, t).nansum()
        grads.append(torch.autograd.grad(loss, (a, k, t)))
    for g, gn in zip(*grads):
        assert bool(torch.isfinite(g).all())
        torch.testing.assert_close(gn[[0, 2]], g[[0, 2]], rtol=0, atol=0)


def test_nan_in_topk_is_contained(device):
    x, xn = _nan_rows(device, torch.float32)
    v, i = fastlapsum.topk(x, 5, sorted=True)
    vn, i_n = fastlapsum.topk(xn, 5, sorted=True)
    assert torch.equal(i_n[[0, 2]], i[[0, 2]]) and torch.equal(vn[[0, 2]], v[[0, 2]])
    assert i_n[1, 0].item() == 7 and bool(vn[1, 0].isnan())
    assert bool(vn[3].isnan().all())
    vs, is_ = fastlapsum.topk(xn, 5, largest=False, sorted=True)
    assert not bool(vs[1].isnan().any())  # NaN is the worst score on the smallest side
    torch.testing.assert_close(vs[1], torch.topk(x[1], 5, largest=False).values, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("largest", [True, False])
def test_infinite_scores(device, dtype, largest):
    """+inf scores get p = 1 while the budget allows (an equal share when it does not);
    -inf get p = 0 unless the budget needs them (DESIGN §6). Mirrored for largest=False."""
    inf = math.inf if largest else -math.inf
    n = 12
    x = x_of("cpu", rows=6, n=n, dtype=torch.float64, seed=3)
    x[0, [2, 5]] = inf  # two top scores, budget 3.5: both 1, finite part 1.5
    x[1, [2, 5]] = inf  # budget 1 < 2: each gets 1/2, finite part 0
    x[2, [0, 1, 2]] = -inf  # three bottom scores, budget 4 < 9 finite: they get 0
    x[3, [0, 1, 2]] = -inf  # budget 10.5 > 9 finite: finite all 1, bottom share 1.5
    x[4] = inf  # all top: equal shares
    x[5] = -inf  # all bottom: equal shares
    x = x.to(dtype).to(device)
    k = torch.tensor([3.5, 1.0, 4.0, 10.5, 5.0, 3.0], device=device)
    for method in ("auto", "sort", "bracket"):
        p = fastlapsum.soft_topk(x, k, 0.5, largest=largest, method=method).double().cpu()
        assert bool(torch.isfinite(p).all())
        assert budget_error(p, k.cpu()) <= max(BUDGET_TOL[dtype], 1e-6)
        assert p[0, [2, 5]].tolist() == [1.0, 1.0]
        assert abs(p[0].sum().item() - 3.5) < 1e-2 and p[0].min() >= 0
        assert p[1, [2, 5]].tolist() == [0.5, 0.5] and bool((p[1, [0, 1, 3, 4] + list(range(6, n))] == 0).all())
        assert p[2, :3].tolist() == [0.0, 0.0, 0.0]
        assert bool((p[3, 3:] == 1).all()) and torch.allclose(p[3, :3], torch.full((3,), 0.5, dtype=torch.float64))
        torch.testing.assert_close(p[4], torch.full((n,), 5.0 / n, dtype=torch.float64), rtol=2e-3, atol=0)
        torch.testing.assert_close(p[5], torch.full((n,), 3.0 / n, dtype=torch.float64), rtol=2e-3, atol=0)
        ref = reference.soft_topk_reference(x, k, 0.5, largest=largest)
        torch.testing.assert_close(p, ref.cpu(), rtol=0, atol=max(BUDGET_TOL[dtype], 1e-5))
    # log mode agrees
    lp = fastlapsum.log_soft_topk(x, k, 0.5, largest=largest).double().cpu()
    rtol = {torch.float16: 5e-3, torch.bfloat16: 4e-2}.get(dtype, 1e-5)  # log p rounded: absolute in log space
    torch.testing.assert_close(lp.exp(), p, rtol=rtol, atol=1e-6)
    # hard mode takes the infinite top scores first
    h = fastlapsum.soft_topk(x, torch.tensor([2.0, 1.0, 4.0, 10.0, 5.0, 3.0], device=device), 0.5,
                             largest=largest, hard=True).cpu()
    assert h[0, [2, 5]].tolist() == [1.0, 1.0] and h[0].sum() == 2
    assert h[1, [2, 5]].sum() == 1 and h[1].sum() == 1
    assert h[2, :3].sum() == 0 and h[2].sum() == 4
    assert bool((h[3, 3:] == 1).all()) and h[3].sum() == 10
    assert h.sum(1).tolist() == [2.0, 1.0, 4.0, 10.0, 5.0, 3.0]


@pytest.mark.parametrize("largest", [True, False])
def test_infinite_scores_gradient_finite(device, largest):
    inf = math.inf if largest else -math.inf
    x = x_of(device, rows=4, n=12, dtype=torch.float64, seed=4)
    x[0, [2, 5]] = inf
    x[1, [2, 5]] = inf
    x[2, [0, 1, 2]] = -inf
    x[3] = inf
    x.requires_grad_()
    k = torch.tensor([3.5, 1.0, 4.0, 5.0], dtype=torch.float64, device=device, requires_grad=True)
    t = torch.full((4,), 0.5, dtype=torch.float64, device=device, requires_grad=True)
    w = torch.linspace(-1, 1, 12, dtype=torch.float64, device=device)
    p = fastlapsum.soft_topk(x, k, t, largest=largest)
    gx, gk, gt = torch.autograd.grad((p * w).sum(), (x, k, t))
    for g in (gx, gk, gt):
        assert bool(torch.isfinite(g).all()), g
    # rows whose threshold is infinite (budget met by +inf alone, or all +inf) are hard: zero gradient
    assert bool((gx[1] == 0).all()) and bool((gx[3] == 0).all())
    # the finite part of row 0 still has a gradient, the +inf scores none
    assert bool((gx[0, [2, 5]] == 0).all()) and bool((gx[0] != 0).any())
