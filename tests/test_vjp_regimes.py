"""The CUDA backward's regimes (csrc/backward/): 8, 16 or 32 lanes a row (n <= 1024), a CTA a row
(n <= 8192), the streaming reduce/apply with the partials folded in the apply blocks
(<= 16 partials a row) or by the finalize kernel (more), each against the CPU op on the
same inputs, for the three ops, both directions, fp64 / fp32 / bf16, and across every
limit (n on both sides of 64, 128, 256, 512, 1024, 4096, 8192; rows = 3, so a warp of
several rows has a group past the last row)."""
import pytest
import torch

import fastlapsum as fl
from conftest import assert_within_same_precision, requires_cuda, vjp_same_precision

F64 = torch.float64
SIZES = [1, 2, 33, 64, 65, 128, 129, 256, 257, 512, 513, 1024, 1025, 4096, 4097, 8192, 8193, 40000, 700_000]
OPS = {
    "soft": lambda x, k, t, largest: fl.soft_topk(x, k, t, largest=largest),
    "log": lambda x, k, t, largest: fl.log_soft_topk(x, k, t, largest=largest),
    "threshold": lambda x, k, t, largest: fl.lapsum_threshold(x, k, t, largest=largest),
}


def _problem(n, dtype, seed, rows=None):
    g = torch.Generator().manual_seed(seed)
    rows = rows if rows is not None else 3 if n <= 40000 else 1
    x = (torch.randn(rows, n, generator=g, dtype=F64) * 2).to(dtype)
    if n > 8:
        x[0, :3] = x[0, 3]  # ties
    k = (torch.rand(rows, generator=g, dtype=F64) * (n - 0.5) + 0.25).clamp(max=n)
    t = torch.tensor([0.3, 1.0, 0.05], dtype=F64).repeat((rows + 2) // 3)[:rows]
    return x, k, t, g


def _grads(op, x, k, t, largest, up):
    xr, kr, tr = (v.clone().requires_grad_(True) for v in (x, k, t))
    out = OPS[op](xr, kr, tr, largest)
    return torch.autograd.grad(out, (xr, kr, tr), up.to(out.device, out.dtype))


@requires_cuda
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("largest", [True, False])
def test_cuda_backward_matches_cpu(n, dtype, op, largest):
    _check_against_cpu(*_problem(n, dtype, seed=n), dtype, op, largest)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(OPS))
def test_cuda_backward_many_rows_streaming(dtype, op):
    """Many long rows: the plan streams each row in few blocks, several tiles a thread (the
    last one partial), so a thread's groups fold into one accumulator before the block's."""
    _check_against_cpu(*_problem(9001, dtype, seed=9001, rows=512), dtype, op, True)


def _check_against_cpu(x, k, t, g, dtype, op, largest):
    shape = (x.shape[0],) if op == "threshold" else x.shape
    up = torch.randn(shape, generator=g, dtype=F64).to(dtype).double()  # the same on both devices
    gx, gk, gt = _grads(op, x.cuda(), k.cuda(), t.cuda(), largest, up)
    # the CPU op on the same (rounded) scores in fp64: the exact closed form
    cx, ck, ct = _grads(op, x.double(), k, t, largest, up)
    assert gx.dtype == dtype
    eps = torch.finfo(dtype).eps if dtype != torch.float64 else 1e-12
    # the scale of one element's terms w (g c - K), |g| / (2 t) at most: where they cancel
    # (a row of one score, a tied row) the exact gradient is 0 or tiny, and an fp32 kernel's
    # rounding of each term is what a same-precision implementation pays
    scale = max(cx.abs().max().item(), up.abs().max().item() / (2 * t.min().item()))
    tol = 8 * eps * scale if dtype != torch.float64 else 1e-9 * scale
    assert (gx.double().cpu() - cx).abs().max().item() <= tol + 1e-300
    g_scale = up.abs().max().item() if op != "threshold" else 1.0
    if dtype == torch.float64:
        torch.testing.assert_close(gk.cpu(), ck, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(gt.cpu(), ct, rtol=1e-9, atol=1e-12)
        return
    # dL/dk and dL/dt are ratios of row sums: a float32 evaluation of the same closed form from
    # the exact threshold is as far off as its conditioning makes it (DESIGN §1.3)
    b = fl.lapsum_threshold(x.double(), k, t, largest=largest)
    rk, rt = vjp_same_precision(op, up, x, b, t, largest)
    # (the log mask's dL/dk carries e^{m/t}-amplified ratios of fp32-weighted sums)
    rtol = 1e-5 if op == "log" else 2e-6
    assert_within_same_precision(gk, ck, rk, rtol=rtol, atol=1e-6 * g_scale)
    assert_within_same_precision(gt, ct, rt, rtol=rtol, atol=1e-6 * g_scale)
