"""The CUDA top-k's launch plan (csrc/cuda/topk/plan_topk.h), checked on any build through
the _topk_cuda_plan op (the plan's host arithmetic for given device numbers): every field the
launchers of topk_cuda.cu use, on shapes that reach each regime and each branch of its
geometry (the thread-row and warp-row instances, the sorting choice, the row kernel's
candidate buffer and its 256-thread build, the grid path's CTAs a row, buffer and workspace).
The numbers encode csrc/cuda/topk/tuning.cuh: a retuned constant fails here first. On CUDA
the plan's regime for the device is the one topk_diagnostics reports."""
import pytest
import torch

import fastlapsum as fl

from conftest import requires_cuda

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
FIELDS = ("regime", "launch", "sort_in_kernel", "sort_after", "instance", "threads", "blocks", "cap", "smem",
          "ws_bytes")
SMS, GRID_CTAS_PER_SM = 132, 3  # an H200: 132 SMs, three 64 KiB grid-collect CTAs each

# ((rows, n, k, dtype, hard_mask, sorted), plan): k of the mask is its bound k_max (-1: none)
PLANS = [
    ((1000, 8, 3, F32, False, True), (0, 1, 1, 0, 8, 128, 8, 0, 0, 0)),
    ((5, 17, 17, F16, False, False), (0, 1, 0, 0, 32, 128, 1, 0, 0, 0)),
    ((3, 32, 2, BF16, True, False), (0, 1, 0, 0, 32, 128, 1, 0, 0, 0)),
    ((64, 300, 10, F32, False, True), (1, 1, 1, 0, 4, 128, 16, 0, 0, 0)),
    ((64, 300, 65, F32, False, True), (1, 1, 0, 1, 4, 128, 16, 0, 0, 0)),
    ((7, 1025, 5, F32, False, False), (1, 1, 0, 0, 16, 128, 2, 0, 0, 0)),
    ((7, 2048, 5, F32, False, False), (1, 1, 0, 0, 16, 128, 2, 0, 0, 0)),
    ((9, 2048, 5, F16, False, False), (1, 1, 0, 0, 8, 128, 3, 0, 0, 0)),
    ((9, 600, 50, BF16, True, False), (1, 1, 0, 0, 4, 128, 3, 0, 0, 0)),
    ((128, 65536, 2048, F32, False, True), (2, 1, 0, 1, 512, 512, 128, 8192, 65536, 0)),
    ((300, 65536, 2048, F16, False, False), (2, 1, 0, 0, 256, 256, 300, 5632, 45056, 0)),
    ((264, 65536, 2048, F16, False, False), (2, 1, 0, 0, 512, 512, 264, 8192, 65536, 0)),
    ((128, 65536, 2253, F16, False, False), (2, 1, 0, 0, 512, 512, 128, 9216, 73728, 0)),
    ((128, 65536, 6000, F32, False, False), (2, 1, 0, 0, 512, 512, 128, 24064, 192512, 0)),
    ((128, 65536, 7000, BF16, False, False), (2, 1, 0, 0, 512, 512, 128, 24576, 196608, 0)),
    ((100, 65536, -1, F16, True, False), (2, 1, 0, 0, 512, 512, 100, 8192, 65536, 0)),
    ((100, 65536, 1000, F16, True, False), (2, 1, 0, 0, 512, 512, 100, 8192, 65536, 0)),
    ((4, 4096, 1, F32, False, True), (2, 1, 0, 0, 512, 512, 4, 8192, 65536, 0)),
    ((1, 1048576, 2048, F32, False, True), (3, 1, 0, 1, 0, 512, 256, 67840, 65536, 551168)),
    ((64, 1048576, 2048, F16, False, False), (3, 1, 0, 0, 0, 512, 6, 67840, 65536, 35265024)),
    ((2, 65536, -1, F32, True, False), (3, 1, 0, 0, 0, 512, 16, 65536, 65536, 1065216)),
    ((2, 65536, 12000, F32, True, False), (3, 1, 0, 0, 0, 512, 16, 65536, 65536, 1065216)),
    ((16, 131072, 100, F32, False, False), (2, 1, 0, 0, 512, 512, 16, 8192, 65536, 0)),
    ((16, 131072, 100, F16, False, False), (3, 1, 0, 0, 0, 512, 16, 65648, 65536, 8535808)),
    ((1, 100000000, 10000, BF16, False, True), (3, 1, 0, 1, 0, 512, 396, 76786, 65536, 622736)),
    ((0, 65536, 10, F32, False, False), (2, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ((4, 300, 0, F32, False, True), (1, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ((4, 0, -1, F32, True, False), (0, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
    ((4, 300, 10, F64, False, True), (4, 0, 0, 0, 0, 0, 0, 0, 0, 0)),
]


def plan(rows, n, k, dtype, hard, sorted, sms=SMS, per_sm=GRID_CTAS_PER_SM):
    return dict(zip(FIELDS, torch.ops.fastlapsum._topk_cuda_plan(rows, n, k, dtype, hard, sorted, sms, per_sm)))


@pytest.mark.parametrize("call, want", PLANS, ids=lambda v: "-".join(map(str, v)) if len(v) == 6 else "")
def test_topk_cuda_plan(call, want):
    got = plan(*call)
    assert got == dict(zip(FIELDS, want))
    assert fl.TOPK_REGIME_NAMES[got["regime"]] in ("thread-rows", "warp-rows", "row-cta", "grid", "sort")


def test_plans_cover_every_cuda_regime():
    regimes = {fl.TOPK_REGIME_NAMES[want[0]] for _, want in PLANS}
    assert regimes == set(fl.TOPK_REGIME_NAMES) - {"cpu"}


def test_grid_wave_is_shared_by_the_rows():
    """The grid path gives each row its share of one wave of resident CTAs (at least one, at
    most a tile of 1024 vectors each); the per-row kernel's plan depends on the device only
    through the 16-bit build choice (the 256-thread build for more than two rows an SM)."""
    for per_sm, want in ((1, 132), (3, 396), (4, 528)):
        assert plan(1, 100_000_000, 1000, F32, False, False, per_sm=per_sm)["blocks"] == want
    assert plan(16, 1 << 20, 100, F32, True, False, sms=2, per_sm=1)["blocks"] == 1
    assert plan(1, 1 << 16, 20000, F32, False, False, sms=1000)["blocks"] == 16  # 2^16 / 4 / 1024
    row = plan(128, 1 << 16, 100, F32, False, False)
    assert row == plan(128, 1 << 16, 100, F32, False, False, sms=1, per_sm=1)
    assert plan(128, 1 << 16, 2048, F16, False, False, sms=64)["threads"] == 512  # 128 rows: two an SM
    assert plan(128, 1 << 16, 2048, F16, False, False, sms=63)["threads"] == 256


def test_hard_mask_bound_beyond_the_row_bounds_nothing():
    assert plan(2, 1 << 16, (1 << 16) + 1, F32, True, False) == plan(2, 1 << 16, -1, F32, True, False)
    assert plan(2, 1 << 16, -5, F32, True, False) == plan(2, 1 << 16, -1, F32, True, False)


def test_topk_cuda_plan_arguments():
    ops = torch.ops.fastlapsum
    with pytest.raises(RuntimeError, match="k must be in"):
        ops._topk_cuda_plan(2, 10, 11, F32, False, False, SMS, 1)
    with pytest.raises(RuntimeError, match="floating-point"):
        ops._topk_cuda_plan(2, 10, 1, torch.int32, False, False, SMS, 1)
    with pytest.raises(RuntimeError, match="sm_count"):
        ops._topk_cuda_plan(2, 10, 1, F32, False, False, 0, 1)


@requires_cuda
@pytest.mark.parametrize("call, want", PLANS, ids=lambda v: "-".join(map(str, v)) if len(v) == 6 else "")
def test_plan_regime_is_the_dispatch(call, want):
    """On this GPU, the plan's regime is the one topk / hard_mask dispatch to (topk_regime)."""
    rows, n, k, dtype, hard, sorted = call
    if rows * n > 1 << 27:
        pytest.skip("too large to allocate for a diagnostic")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.empty(rows, n, dtype=dtype, device="cuda")
    got = torch.ops.fastlapsum.topk_regime(x, k, hard)
    assert got == plan(rows, n, k, dtype, hard, sorted, sms=sms)["regime"]
