"""Eager-mode host cost (issue 32): what one call builds besides the kernels. Python-number
k and temperature reuse cached per-row tensors (no fill per call), a dim that is already
last costs no movedim, and the backward returns gradients for k and t only when they
require grad; the results stay those of the per-row tensor path."""
import os
import sys

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import fastlapsum as fl
from fastlapsum import functional as F

from conftest import requires_cuda

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))
from timing import capture_graph  # noqa: E402  (benchmarks/timing.py)

F64 = torch.float64


def scores(device, *shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(device)


def _ops_run(fn, prefix="aten::") -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith(prefix)]


def test_scalar_k_and_t_build_nothing_per_call(device):
    """After a first call, forward + backward with Python numbers and dim last runs no
    fill, no zeros, no permute: the kernels and the autograd bookkeeping only."""
    x = scores(device, 16, 64).requires_grad_()
    g, gb = scores(device, 16, 64, seed=1), scores(device, 16, seed=2, dtype=F64)

    def step():
        for fn in (fl.soft_topk, fl.log_soft_topk):
            torch.autograd.grad(fn(x, 8, 0.5), x, g)
        torch.autograd.grad(fl.lapsum_threshold(x, 8, 0.5), x, gb)

    step()
    names = _ops_run(step)
    for bad in ("aten::full", "aten::fill_", "aten::zeros", "aten::zero_", "aten::permute", "aten::movedim",
                "aten::ones"):
        assert bad not in names, (bad, sorted(set(names)))


@pytest.mark.parametrize("shape,dim", [((5, 33), -1), ((2, 3, 33), 2), ((33,), 0), ((4, 33, 3), 1)])
def test_matches_the_per_row_tensor_path(device, shape, dim):
    """Cached rows, the dim-last fast path and the movedim path give the per-row tensors'
    values and gradients bit for bit."""
    x = scores(device, *shape, seed=2, dtype=F64)
    batch = x.movedim(dim, -1).shape[:-1]
    k, t = 7.5, 0.7
    kk, tt = torch.full(batch, k, dtype=F64, device=device), torch.full(batch, t, dtype=F64, device=device)
    for fn in (fl.soft_topk, fl.log_soft_topk, fl.lapsum_threshold):
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        a, b = fn(xa, k, t, dim=dim), fn(xb, kk, tt, dim=dim)
        assert a.shape == b.shape == (x.shape if fn is not fl.lapsum_threshold else batch)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        w = torch.linspace(-1, 1, a.numel(), dtype=F64, device=device).reshape(a.shape)
        ga, = torch.autograd.grad((a * w).sum(), xa)
        gb, = torch.autograd.grad((b * w).sum(), xb)
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)
    torch.testing.assert_close(fl.soft_topk(x, 7, t, dim=dim, hard=True),
                               fl.soft_topk(x, kk - 0.5, tt, dim=dim, hard=True), rtol=0, atol=0)


def test_cached_rows_follow_the_value_and_the_row_count(device):
    """The cache is keyed by value and rows: changing k, t or the batch between calls
    changes the answer (the budget sum(p) == k holds for each)."""
    for rows, k, t in ((3, 2.0, 1.0), (3, 5.0, 1.0), (7, 5.0, 1.0), (3, 2.0, 0.25), (3, 2.0, 1.0)):
        x = scores(device, rows, 20, seed=rows, dtype=F64)
        p = fl.soft_topk(x, k, t)
        torch.testing.assert_close(p.sum(-1), torch.full((rows,), k, dtype=F64, device=device))
        torch.testing.assert_close(p, fl.soft_topk(x, torch.tensor(k, dtype=F64), torch.tensor(t)), rtol=0, atol=0)


def test_cache_stays_bounded_and_plain():
    """A temperature schedule does not grow the cache without bound; fake tensors (a
    dispatch mode) and inference-mode calls leave only ordinary tensors in it, usable for
    autograd afterwards."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = scores("cpu", 2, 9)
    for i in range(3 * F._CONSTANT_ROWS_MAX):
        fl.soft_topk(x, 3, 0.5 + i / 100)
    assert 0 < len(F._CONSTANT_ROWS) <= F._CONSTANT_ROWS_MAX
    F._CONSTANT_ROWS.clear()
    many = scores("cpu", F._CONSTANT_ROWS_MAX_ROWS + 1, 2)
    torch.testing.assert_close(fl.soft_topk(many, 1, 0.5).sum(-1), torch.ones(many.shape[0]))
    assert not F._CONSTANT_ROWS  # too many rows to keep
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert fl.soft_topk(fake, 4, 0.9).shape == x.shape
    with torch.inference_mode():
        fl.soft_topk(x, 4, 0.9)
    cached = [v for entry in F._CONSTANT_ROWS.values() for v in entry]
    assert cached and all(type(v) is torch.Tensor and not v.is_inference() for v in cached)
    xg = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(fl.soft_topk(xg, 4, 0.9)[:, 0].sum(), xg)
    assert bool(g.abs().sum() > 0)


def test_gradients_only_for_inputs_that_require_them(device):
    """grad_k / grad_t reach k and t when they require grad (and match finite
    differences), and the backward stays the one fused kernel."""
    x = scores(device, 3, 11, seed=4, dtype=F64).requires_grad_()
    k = torch.tensor([2.0, 4.5, 6.0], dtype=F64, device=device).requires_grad_()
    t = torch.tensor(0.8, dtype=F64, device=device)
    w = torch.linspace(-1, 1, 11, dtype=F64, device=device)
    p = fl.soft_topk(x, k, t)
    out = []
    names = _ops_run(lambda: out.extend(torch.autograd.grad((p * w).sum(), (x, k))), "fastlapsum::")
    assert names == ["fastlapsum::soft_topk_backward"], names
    gx, gk = out
    eps = 1e-6
    fd = ((fl.soft_topk(x, k + eps, t) * w).sum(-1) - (fl.soft_topk(x, k - eps, t) * w).sum(-1)) / (2 * eps)
    torch.testing.assert_close(gk, fd.detach(), rtol=1e-6, atol=1e-8)
    assert t.grad is None
    tg = t.clone().requires_grad_()
    (gt,) = torch.autograd.grad((fl.soft_topk(x, k.detach(), tg) * w).sum(), tg)
    fd_t = ((fl.soft_topk(x, k, t + eps) * w).sum() - (fl.soft_topk(x, k, t - eps) * w).sum()) / (2 * eps)
    torch.testing.assert_close(gt, fd_t.detach(), rtol=1e-6, atol=1e-8)


def test_dim_last_adds_no_view_nodes(device):
    """A 2-d x with dim last gets the op's own output (its grad_fn is the Function's
    node, the C++ Function's); a 3-d x one reshape; a dim that is not last the movedim as before."""
    x = scores(device, 4, 10).requires_grad_()
    assert fl.soft_topk(x, 3).grad_fn.name().endswith("SoftTopKFunction>")
    assert fl.lapsum_threshold(x, 3).grad_fn.name().endswith("ThresholdFunction>")
    x3 = scores(device, 2, 4, 10).requires_grad_()
    node = fl.soft_topk(x3, 3).grad_fn
    assert node.name() == "ViewBackward0"
    assert node.next_functions[0][0].name().endswith("SoftTopKFunction>")
    p0 = fl.soft_topk(x3, 1, dim=0)
    torch.testing.assert_close(p0.sum(0), torch.ones(4, 10, device=device))


def test_backward_of_rows_without_scores():
    """grad_k / grad_t of an op called on [rows, 0] are zeros, not uninitialised memory."""
    x = torch.empty(3, 0)
    b, t = torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
    for gx, gk, gt in (torch.ops.fastlapsum.soft_topk_backward(x, x, b, t, True, False),
                       torch.ops.fastlapsum.lapsum_threshold_backward(b, x, b, t, True)):
        assert gx.shape == (3, 0)
        assert bool((gk == 0).all()) and bool((gt == 0).all())


@requires_cuda
def test_cuda_graph_does_not_read_the_cache():
    """A captured call fills its own k / t rows: overwriting every cached tensor after the
    capture does not change what the graph replays, nor does clearing the cache."""
    x = scores("cuda", 8, 300)
    want = fl.soft_topk(x, 5, 0.5)  # a cache entry for the current stream
    graph, out = capture_graph(lambda: fl.soft_topk(x, 5, 0.5))
    assert F._CONSTANT_ROWS
    for entry in F._CONSTANT_ROWS.values():
        for v in entry:
            v.fill_(float("nan"))
    F._CONSTANT_ROWS.clear()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(fl.soft_topk(x, 5, 0.5), want, rtol=0, atol=0)
