"""fastlapsum.topk against torch.topk: what torch.topk accepts (dtypes, 0-d inputs, k as a
tensor, k = 0, empty dims, non-contiguous inputs, any dim) must work and give torch's
values. The documented differences are checked too: sorted=False by default (order then
unspecified), the smaller index wins among tied scores (oracle: a stable sort), `lengths`.
Cases follow the topk tests of PyTorch's test/test_sort_and_select.py, written anew."""
import logging

import pytest
import torch

import fastlapsum
from fastlapsum import functional as F

from conftest import DTYPES as FLOATS
from conftest import gen, topk_oracle

INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def assert_same_set(x, got, want, dim):
    """Unsorted output: the same index set (ties are decided), values = x at the indices."""
    assert_same((got[0].sort(dim).values, got[1].sort(dim).values),
                (want[0].sort(dim).values, want[1].sort(dim).values))
    torch.testing.assert_close(got[0], x.gather(dim, got[1]), rtol=0, atol=0, equal_nan=True)


def random_ints(shape, dtype, seed, low=None, high=None):
    info = torch.iinfo(dtype)
    low = info.min if low is None else low
    high = info.max if high is None else high
    return torch.randint(low, high, shape, generator=gen(seed), dtype=torch.int64).to(dtype)


# ---- results ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_random_3d_every_dim_and_transposes(device, dtype):
    x = torch.randn(7, 33, 12, generator=gen(0), dtype=torch.float64).to(dtype).to(device)
    for t in (x, x.transpose(0, 2), x.transpose(1, 2), x[:, ::3]):
        for dim in range(-3, 3):
            n = t.shape[dim]
            for k in (1, n // 2, n):
                for largest in (True, False):
                    got = fastlapsum.topk(t, k, dim=dim, largest=largest, sorted=True)
                    ref = torch.topk(t, k, dim=dim, largest=largest, sorted=True)
                    torch.testing.assert_close(got.values, ref.values, rtol=0, atol=0)
                    assert_same(got, topk_oracle(t, k, dim, largest))
                    assert_same_set(t, fastlapsum.topk(t, k, dim=dim, largest=largest),
                                    topk_oracle(t, k, dim, largest), dim)


@pytest.mark.parametrize("dtype", INTS)
def test_integral_full_range(device, dtype):
    """torch's test_topk_integral: values over the whole dtype range, the extremes included."""
    info = torch.iinfo(dtype)
    x = random_ints((6, 300), dtype, 1)
    x[0, :4] = torch.tensor([info.min, info.max, info.min, info.max], dtype=dtype)
    x = x.to(device)
    for largest in (True, False):
        for k in (0, 1, 5, 299, 300):
            got = fastlapsum.topk(x, k, largest=largest, sorted=True)
            torch.testing.assert_close(got.values, torch.topk(x, k, largest=largest).values, rtol=0, atol=0)
            assert got.values.dtype == dtype and got.indices.dtype == torch.int64
            assert_same(got, topk_oracle(x, k, largest=largest))
            assert_same_set(x, fastlapsum.topk(x, k, largest=largest), topk_oracle(x, k, largest=largest), -1)


@pytest.mark.parametrize("dtype", INTS + [torch.bool])
def test_integral_ties_smaller_index_wins(device, dtype):
    """Few distinct values (many ties at the boundary): the selected set is decided."""
    high = 2 if dtype == torch.bool else 3
    x = random_ints((5, 2049), torch.int64, 2, 0, high).to(dtype).to(device)
    for largest in (True, False):
        for k in (1, 700, 1500):
            assert_same(fastlapsum.topk(x, k, largest=largest, sorted=True), topk_oracle(x, k, largest=largest))
            assert_same_set(x, fastlapsum.topk(x, k, largest=largest), topk_oracle(x, k, largest=largest), -1)


def test_int64_beyond_float64_precision(device):
    """Scores 1 apart near 2^62 round to the same double: the int64 path stays exact."""
    base = 2**62
    x = torch.tensor([base + 1, base, base + 3, base + 2, -base, base + 3], dtype=torch.int64, device=device)
    got = fastlapsum.topk(x, 4, sorted=True)
    assert got.indices.tolist() == [2, 5, 3, 0]
    assert got.values.tolist() == [base + 3, base + 3, base + 2, base + 1]
    assert fastlapsum.topk(x, 2, largest=False, sorted=True).indices.tolist() == [4, 1]


def test_bool(device):
    """torch.topk refuses bool; ours takes it (True above False, smaller index first)."""
    x = torch.tensor([[False, True, False, True, True], [False] * 5], device=device)
    got = fastlapsum.topk(x, 2, sorted=True)
    assert got.values.dtype == torch.bool
    assert got.indices.tolist() == [[1, 3], [0, 1]]
    assert got.values.tolist() == [[True, True], [False, False]]
    assert fastlapsum.topk(x, 3, largest=False, sorted=True).indices.tolist() == [[0, 2, 1], [0, 1, 2]]


@pytest.mark.parametrize("dtype", FLOATS)
def test_nonfinite_order(device, dtype):
    """torch's test_topk_nonfinite: NaN above +inf for largest, NaN last for smallest."""
    x = torch.tensor([float("nan"), float("inf"), 1e4, 0, -1e4, -float("inf")], dtype=dtype, device=device)
    got = fastlapsum.topk(x, 4, sorted=True)
    torch.testing.assert_close(got.values, x[:4], rtol=0, atol=0, equal_nan=True)
    assert got.indices.tolist() == [0, 1, 2, 3]
    got = fastlapsum.topk(x, 4, largest=False, sorted=True)
    torch.testing.assert_close(got.values, x[[5, 4, 3, 2]], rtol=0, atol=0)
    assert got.indices.tolist() == [5, 4, 3, 2]
    ref = torch.topk(x, 6)
    torch.testing.assert_close(fastlapsum.topk(x, 6, sorted=True).values, ref.values, rtol=0, atol=0, equal_nan=True)


def test_4d_ties_along_dim1(device):
    """torch's test_topk_4d, with the tie rule deciding the third pick (index 0)."""
    x = torch.ones(2, 3072, 2, 2, device=device)
    x[:, 1] *= 2.0
    x[:, 10] *= 1.5
    got = fastlapsum.topk(x, 3, dim=1, sorted=True)
    assert got.values.shape == (2, 3, 2, 2)
    assert bool((got.indices[:, 0] == 1).all() and (got.indices[:, 1] == 10).all()
                and (got.indices[:, 2] == 0).all())
    assert bool((got.values[:, 0] == 2).all() and (got.values[:, 1] == 1.5).all() and (got.values[:, 2] == 1).all())


def test_noncontiguous_equals_contiguous(device):
    """torch's test_topk_noncontiguous_gpu, on every device and dtype family."""
    for x in (torch.randn(20, generator=gen(3)), random_ints((20,), torch.int32, 3)):
        t = x.to(device)[::2]
        assert not t.is_contiguous()
        for sorted_ in (True, False):
            assert_same(fastlapsum.topk(t, 5, sorted=sorted_), fastlapsum.topk(t.contiguous(), 5, sorted=sorted_))


@pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool])
def test_k_zero(device, dtype):
    """torch's test_topk_zero: k = 0 gives empty results of the right shape and dtypes."""
    x = torch.ones(2, 2, device=device).to(dtype)
    for dim in (0, 1):
        got = fastlapsum.topk(x, 0, dim=dim, largest=False)
        assert got.values.shape == got.indices.shape == ((0, 2) if dim == 0 else (2, 0))
        assert got.values.dtype == dtype and got.indices.dtype == torch.int64


@pytest.mark.parametrize("shape,k,dim", [((0,), 0, 0), ((3, 0), 0, -1), ((3, 0), 0, 0), ((0, 5), 2, -1),
                                         ((2, 0, 4), 1, -1), ((2, 0, 4), 0, 1)])
def test_empty_tensors(device, shape, k, dim):
    """Empty inputs torch.topk takes, including an empty selection dim with k = 0."""
    x = torch.empty(shape, device=device)
    got, ref = fastlapsum.topk(x, k, dim=dim), torch.topk(x, k, dim=dim)
    assert got.values.shape == ref.values.shape and got.indices.shape == ref.indices.shape
    assert got.indices.dtype == torch.int64


def test_empty_dim_with_k_one_is_an_error(device):
    with pytest.raises(ValueError, match=r"\bk\b"):
        fastlapsum.topk(torch.empty(3, 0, device=device), 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.int64, torch.bool])
def test_zero_dim_input(device, dtype):
    """A 0-d x, as in torch.topk: k in {0, 1}, dim in {0, -1}, 0-d results (the element)."""
    x = torch.tensor(3, device=device).to(dtype)
    for k in (0, 1):
        for dim in (0, -1):
            got = fastlapsum.topk(x, k, dim=dim)
            assert got.values.shape == () and got.indices.shape == ()
            assert got.values.item() == x.item() and got.indices.item() == 0
            # torch.topk on a 0-d CUDA tensor with k = 0 returns uninitialised memory
            if dtype != torch.bool and (k == 1 or device == "cpu"):
                assert_same(got, torch.topk(x, k, dim=dim))
    with pytest.raises(ValueError, match=r"\bk\b"):
        fastlapsum.topk(x, 2)
    with pytest.raises(IndexError, match="dim"):
        fastlapsum.topk(x, 1, dim=1)


def test_zero_dim_input_with_lengths(device):
    x = torch.tensor(3.0, device=device)
    got = fastlapsum.topk(x, 1, lengths=torch.tensor(0, device=device))
    assert got.values.item() == float("-inf") and got.indices.item() == -1
    assert fastlapsum.topk(x, 1, lengths=torch.tensor(1, device=device)).values.item() == 3.0


# ---- arguments -------------------------------------------------------------------------

def test_return_type(device):
    x = torch.randn(3, 10, generator=gen(4)).to(device)
    res = fastlapsum.topk(x, 3, sorted=True)
    assert isinstance(res, torch.return_types.topk) and isinstance(res, tuple) and len(res) == 2
    values, indices = res
    assert res.values is values and res.indices is indices
    assert_same(res, torch.topk(x, 3))


@pytest.mark.parametrize("k", [torch.tensor(2), torch.tensor([2]), torch.tensor([[2]], dtype=torch.uint8),
                               torch.tensor(2, dtype=torch.int32)])
def test_k_as_integer_tensor(device, k):
    """torch.topk takes a one-element integer tensor for k (it has __index__)."""
    x = torch.randn(4, 9, generator=gen(5)).to(device)
    assert_same(fastlapsum.topk(x, k, sorted=True), torch.topk(x, k))


@pytest.mark.parametrize("k", [torch.tensor(2.0), torch.tensor(True), torch.tensor([1, 2]), 2.0, True, "2", None])
def test_k_not_an_int(k):
    """What torch.topk refuses for k (a float or bool, or a tensor of either)."""
    with pytest.raises(TypeError, match=r"\bk\b"):
        fastlapsum.topk(torch.randn(4, 9), k)


@pytest.mark.parametrize("dim", [True, False, 1.0, 0.0, torch.tensor(1.0), torch.tensor(True), None, "1"])
def test_dim_not_an_int_every_op(dim):
    """torch's test_topk_arguments: dim=True is not read as dim 1. Every public op."""
    x = torch.randn(3, 2, 10, generator=gen(6))
    calls = [lambda: fastlapsum.topk(x, 1, dim=dim), lambda: fastlapsum.soft_topk(x, 1, dim=dim),
             lambda: fastlapsum.soft_topk(x, 1, dim=dim, hard=True),
             lambda: fastlapsum.log_soft_topk(x, 1, dim=dim), lambda: fastlapsum.lapsum_threshold(x, 1, dim=dim),
             lambda: fastlapsum.lapsum_diagnostics(x, 1, dim=dim), lambda: fastlapsum.SoftTopK(1, dim=dim)]
    for call in calls:
        with pytest.raises(TypeError, match=r"\bdim\b"):
            call()


def test_dim_integer_like_is_fine():
    np = pytest.importorskip("numpy")
    x = torch.randn(3, 2, 10, generator=gen(7))
    for dim in (np.int64(1), torch.tensor(1)):
        assert_same(fastlapsum.topk(x, 1, dim=dim), fastlapsum.topk(x, 1, dim=1))
        torch.testing.assert_close(fastlapsum.soft_topk(x, 1, dim=dim), fastlapsum.soft_topk(x, 1, dim=1),
                                   rtol=0, atol=0)
        assert fastlapsum.SoftTopK(1, dim=dim).dim == 1


@pytest.mark.parametrize("name", ["largest", "sorted"])
@pytest.mark.parametrize("value", [1, 0, None, "True"])
def test_flags_must_be_bool(name, value):
    with pytest.raises(TypeError, match=name):
        fastlapsum.topk(torch.randn(4, 9), 2, **{name: value})


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.uint32, torch.uint64])
def test_unsupported_dtypes(dtype):
    """torch.topk refuses these as well."""
    x = torch.zeros(3, 4, dtype=dtype)
    with pytest.raises(TypeError, match=r"\bx\b.*" + str(dtype).replace("torch.", "")):
        fastlapsum.topk(x, 2)


def test_sorted_default_is_false():
    """Ours defaults to sorted=False (torch.topk to True): the set is the same, the order
    unspecified; sorted=True gives torch's order."""
    import inspect
    assert inspect.signature(fastlapsum.topk).parameters["sorted"].default is False
    x = torch.randn(5, 200, generator=gen(8))
    assert_same_set(x, fastlapsum.topk(x, 50), torch.topk(x, 50), -1)


# ---- integer rows with lengths, and the CUDA routes (run here on the CPU) ---------------

@pytest.mark.parametrize("dtype", INTS + [torch.bool])
def test_integer_lengths_padding(device, dtype):
    """Past a row's length: index -1, value the dtype's worst (lowest for largest)."""
    high = 2 if dtype == torch.bool else 50
    x = random_ints((4, 12), torch.int64, 9, 0, high).to(dtype).to(device)
    lengths = torch.tensor([0, 3, 5, 12], device=device)
    lo, hi = (False, True) if dtype == torch.bool else (torch.iinfo(dtype).min, torch.iinfo(dtype).max)
    for largest, pad in ((True, lo), (False, hi)):
        got = fastlapsum.topk(x, 5, largest=largest, sorted=True, lengths=lengths)
        for r, n in enumerate(lengths.tolist()):
            take = min(n, 5)
            v, i = topk_oracle(x[r, :n], take, largest=largest)
            assert got.indices[r].tolist() == i.tolist() + [-1] * (5 - take)
            assert got.values[r].tolist() == v.tolist() + [pad] * (5 - take)


@pytest.mark.parametrize("dtype", INTS + [torch.bool])
def test_cuda_integer_routes_agree(dtype):
    """The two routes integer rows take on CUDA (narrow ints through the float32 selector,
    wide ints a stable sort), run on the CPU: both equal the native integer kernel."""
    high = 2 if dtype == torch.bool else None
    x = random_ints((6, 257), torch.int64 if high else dtype, 10, 0 if high else None, high).to(dtype)
    x[1] = x[1, 0]  # a constant row
    lengths = torch.tensor([0, 1, 40, 256, 257, 100])
    for largest in (True, False):
        for len_rows in (None, lengths):
            want = F.ops.topk(x, 64, largest, True, len_rows)
            by_sort = F._topk_indices_by_sort(x, 64, largest, len_rows)
            assert_same((F._gather_padded(x, by_sort, largest), by_sort), want)
            if dtype in F._EXACT_IN_FP32:
                via_float = F.ops.topk(x.float(), 64, largest, True, len_rows)[1]
                assert_same((F._gather_padded(x, via_float, largest), via_float), want)


def test_values_gradient_matches_torch(device):
    x = torch.randn(3, 17, generator=gen(11), dtype=torch.float64).to(device).requires_grad_()
    w = torch.randn(3, 5, generator=gen(12), dtype=torch.float64).to(device)
    (g,) = torch.autograd.grad((fastlapsum.topk(x, 5, sorted=True).values * w).sum(), x)
    (gt,) = torch.autograd.grad((torch.topk(x, 5).values * w).sum(), x)
    torch.testing.assert_close(g, gt, rtol=0, atol=0)
    x0 = torch.tensor(2.0, dtype=torch.float64, device=device, requires_grad=True)
    (g0,) = torch.autograd.grad(fastlapsum.topk(x0, 1).values * 3, x0)
    assert g0.item() == 3.0


@pytest.fixture
def _quiet_compile_trace():
    trace = logging.getLogger("torch.__trace")
    old = trace.disabled
    trace.disabled = True
    yield
    trace.disabled = old


def test_compile_fullgraph_return_type(device, _quiet_compile_trace):
    """fullgraph compile of code that uses .values/.indices and returns the result itself."""
    def f(x, xi):
        r = fastlapsum.topk(x, 3, sorted=True)
        ri = fastlapsum.topk(xi, 2, dim=0, largest=False)
        return r, r.values * 2, r.indices + 1, ri.values, ri.indices

    x = torch.randn(4, 9, generator=gen(13)).to(device)
    xi = random_ints((5, 3), torch.int32, 14, -100, 100).to(device)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")(x, xi)
    want = f(x, xi)
    assert isinstance(got[0], torch.return_types.topk)
    assert_same(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.bool])
def test_opcheck_integer_rows(dtype):
    """The op's schema, fake kernel and autograd registration hold for integer rows too."""
    x = random_ints((5, 40), torch.int64, 15, 0, 7).to(dtype)
    res = torch.library.opcheck(F.ops.topk, (x, 6, True, True, torch.tensor([0, 3, 6, 39, 40])))
    assert all(v == "SUCCESS" for v in res.values()), res
