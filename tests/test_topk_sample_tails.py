"""fastlapsum.topk where the per-row kernel's sampled threshold is tightest against its
buffer (csrc/cuda/topk/tuning.cuh: row_sample_stride, sample_admit): 16-bit rows with
K = 2048 (the 256-thread build's 5632-entry buffer), the batched L0 shape (64 rows, fewer
than the SMs), and rows whose k-th score is a block of ties that overfills the buffer, so
that the exact fallback runs with ~6000 tied keys. Checked against the float64-key oracle
and torch.topk's values."""
import pytest
import torch

import fastlapsum
from conftest import topk_oracle

def many_rows(device):
    """More rows than two an SM on CUDA (16-bit rows then take the 256-thread build), 2 on
    the CPU."""
    return 2 * torch.cuda.get_device_properties(0).multi_processor_count + 8 if device == "cuda" else 2


def randn(rows, n, seed, device):
    return torch.randn(rows, n, generator=torch.Generator(device=device).manual_seed(seed), device=device)


def check_exact(x, k):
    vo, io = topk_oracle(x, k)
    vs, is_ = fastlapsum.topk(x, k, sorted=True)
    assert torch.equal(is_, io), "sorted indices differ from the oracle"
    assert torch.equal(vs, vo)
    assert torch.equal(vs, torch.topk(x, k, sorted=True).values)
    vu, iu = fastlapsum.topk(x, k, sorted=False)
    assert torch.equal(iu.sort(1).values, io.sort(1).values), "unsorted index set differs from the oracle"
    assert torch.equal(vu, x.gather(1, iu))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_budget_2048_long_rows(device, dtype):
    """K = 2048 on 262144-score rows (k_sweep_2048): ~80-90 scores tie with the k-th of a
    16-bit row, the admitted count sits between the budget and the buffer."""
    x = randn(many_rows(device), 262144, 2048, device).to(dtype)
    if device == "cuda":
        assert fastlapsum.topk_diagnostics(x, 2048) == "row-cta"
    check_exact(x, 2048)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_l0_batch(device, dtype):
    """64 rows of 150528 scores, k = 1000 (the L0 attack's batch): fewer rows than SMs."""
    x = randn(64 if device == "cuda" else 2, 150528, 1000, device).to(dtype)
    if device == "cuda":
        assert fastlapsum.topk_diagnostics(x, 1000) == "row-cta"
    check_exact(x, 1000)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ties", [6000, 9000])
def test_tied_block_over_the_buffer(device, dtype, ties):
    """The top of each row is `ties` equal scores at random positions (more than the
    256-thread build's buffer, and for 9000 than the 512-thread build's, which rows of
    fp32 and batches of fewer rows take): the sample's
    threshold lands in that bin with nothing above it, every tie is admitted, the buffer
    overflows and the exact fallback selects the 2048 smallest indices among the ties."""
    rows, n, k = many_rows(device), 262144, 2048
    x = randn(rows, n, ties, device)
    pos = randn(rows, n, ties + 1, device).topk(ties, dim=1).indices
    x = x.scatter(1, pos, 8.0).to(dtype)
    check_exact(x, k)
    _, idx = fastlapsum.topk(x, k, sorted=True)
    assert torch.equal(idx, pos.sort(dim=1).values[:, :k])

