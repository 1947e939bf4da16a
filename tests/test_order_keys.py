"""The order keys of csrc/common/order_keys.h, seen through fastlapsum.topk (docs/DESIGN.md,
"Order keys"): rows of signed zeros, infinities, NaNs of every sign and payload, subnormals,
extremes and ties, in every dtype the op takes, against a sort by a Python total-order key
(value order, -0 == +0, every NaN above +inf, ties by the smaller index). The keys
themselves are checked exhaustively by tools/check_order_keys.cpp (not run here: it walks
all 2^32 fp32 patterns)."""
import math

import pytest
import torch

import fastlapsum

from conftest import DEVICES, gen

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}


def signed(u, width):
    """The unsigned bit pattern u as the signed integer of that width (for tensor views)."""
    return u - (1 << width) if u >> (width - 1) else u


def float_row(dtype, seed):
    """A shuffled row of the special values (each twice, so they tie) and random ones."""
    fi = torch.finfo(dtype)
    width = fi.bits
    exp_bits = {16: 5 if dtype == torch.float16 else 8, 32: 8, 64: 11}[width]
    man = width - 1 - exp_bits
    inf_bits = ((1 << exp_bits) - 1) << man
    sign = 1 << (width - 1)
    patterns = [
        0, sign,                      # +0, -0
        1, sign | 1,                  # the smallest subnormals
        (1 << man) - 1, sign | ((1 << man) - 1),  # the largest subnormals
        1 << man, sign | (1 << man),  # the smallest normals
        inf_bits - 1, sign | (inf_bits - 1),      # +-max
        inf_bits, sign | inf_bits,    # +-inf
        inf_bits | 1, sign | inf_bits | 1,        # NaNs: smallest payload, both signs
        inf_bits | (1 << (man - 1)), sign | inf_bits | (1 << (man - 1)),  # quiet NaNs
        sign - 1, (1 << width) - 1,   # all-ones NaNs
    ]
    bits = torch.tensor([signed(p, width) for p in patterns] * 2, dtype=BITS[dtype])
    special = bits.view(dtype)
    rnd = torch.randn(40, generator=gen(seed), dtype=torch.float64).to(dtype)
    tiny = (torch.randint(-(1 << man), 1 << man, (12,), generator=gen(seed + 1))).to(BITS[dtype]).view(dtype)
    x = torch.cat([special, rnd, rnd[:8], tiny])  # rnd[:8]: more ties
    return x[torch.randperm(x.numel(), generator=gen(seed + 2))]


def int_row(dtype, seed):
    ii = torch.iinfo(dtype)
    edge = [ii.min, ii.min + 1, -1 if ii.min < 0 else 1, 0, 1, ii.max - 1, ii.max] * 2
    rnd = torch.randint(ii.min, ii.max, (40,), generator=gen(seed), dtype=torch.int64)
    x = torch.cat([torch.tensor(edge, dtype=torch.int64), rnd, rnd[:8]]).to(dtype)
    return x[torch.randperm(x.numel(), generator=gen(seed + 2))]


def python_order(x, largest):
    """Indices best first by a Python key: (is NaN, value); -0.0 == 0.0 in Python, and
    sorted is stable, so ties keep the smaller index first."""
    vals = x.double().tolist() if x.is_floating_point() else x.tolist()
    def key(i):
        v = vals[i]
        nan = isinstance(v, float) and math.isnan(v)
        r = (1, 0.0) if nan else (0, v)
        return r if largest else (-r[0], -r[1])
    # best first: the largest key first; stable for ties (reverse=True keeps ties' order)
    return sorted(range(len(vals)), key=key, reverse=True)


def same_bits(a, b):
    if a.dtype == torch.bool or not a.is_floating_point():
        return torch.equal(a, b)
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def check_row(x, largest, device):
    n = x.numel()
    want = python_order(x, largest)
    xd = x.to(device)
    for k in sorted({0, 1, 2, 5, n // 3, n // 2, n - 1, n}):
        values, indices = fastlapsum.topk(xd, k, largest=largest, sorted=True)
        assert indices.tolist() == want[:k], (k, x.dtype, largest)
        expect = x[torch.tensor(want[:k], dtype=torch.int64)]
        if device == "cpu":  # values are x's elements, bit for bit (NaN payloads, -0)
            assert same_bits(values.cpu(), expect), (k, x.dtype)
        else:
            assert torch.equal(values.cpu().isnan(), expect.isnan())
            assert torch.equal(values.cpu().nan_to_num(), expect.nan_to_num())
        # unsorted: the same set
        _, idx_u = fastlapsum.topk(xd, k, largest=largest, sorted=False)
        assert sorted(idx_u.tolist()) == sorted(want[:k])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_float_rows_total_order(device, dtype, largest, seed):
    check_row(float_row(dtype, seed), largest, device)


@pytest.mark.parametrize("dtype", INTS + [torch.bool])
@pytest.mark.parametrize("largest", [True, False])
def test_integer_rows_total_order(dtype, largest):
    x = torch.tensor([True, False] * 7 + [False, True, True]) if dtype == torch.bool else int_row(dtype, 3)
    check_row(x, largest, "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_signed_zeros_tie_by_index(device, dtype):
    """-0 and +0 are one value: the smaller index wins whichever its sign."""
    x = torch.tensor([0.0, -0.0, 0.0, -0.0, -1.0, 1.0], dtype=dtype)
    for largest, want in [(True, [5, 0, 1, 2]), (False, [4, 0, 1, 2])]:
        _, idx = fastlapsum.topk(x.to(device), 4, largest=largest, sorted=True)
        assert idx.tolist() == want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_payloads_tie_above_inf(device, dtype):
    """NaNs of either sign and any payload rank together above +inf (largest) or last
    (smallest), ties by index."""
    x = float_row(dtype, 5)
    nan = x.isnan().nonzero().flatten().tolist()
    _, idx = fastlapsum.topk(x.to(device), len(nan) + 1, largest=True, sorted=True)
    assert idx.tolist()[:len(nan)] == sorted(nan)
    assert x[idx[len(nan)].item()].item() == math.inf
    _, idx = fastlapsum.topk(x.to(device), x.numel(), largest=False, sorted=True)
    assert idx.tolist()[-len(nan):] == sorted(nan)
