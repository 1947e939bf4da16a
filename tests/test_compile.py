"""torch.compile with Python-number k / temperature that change between calls (a
temperature schedule): no graph break, and no recompilation beyond dynamo's one
automatic-dynamic recompile at the first change (none with dynamic=True). On the CPU the
aot_eager backend (the same tracing and AOT autograd; inductor's C++ build costs minutes
on 2 cores), inductor on CUDA."""
import logging

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import fastlapsum as fl

F64 = torch.float64
SCHEDULE = [(3.0, 1.0), (3.5, 0.8), (2.25, 0.6), (4.0, 0.45), (1.5, 0.3)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test counts its own compiles; pytest's log capture of torch's structured
    trace would make every compile several times slower."""
    trace = logging.getLogger("torch.__trace")
    old = trace.disabled
    trace.disabled = True
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    trace.disabled = old


def _backend(device):
    return CompileCounterWithBackend("aot_eager" if device == "cpu" else "inductor")


def _loss(x, k, t):
    w = torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype, device=x.device)
    return ((fl.soft_topk(x, k, t) * w).sum() + (fl.log_soft_topk(x, k, t, largest=False).exp() * w).sum()
            + fl.lapsum_threshold(x, k, t).sum() + (fl.soft_topk(x, 2, t, hard=True) * w).sum()
            + fl.soft_topk(x, k / 2, t, dim=0).pow(2).sum())


def _run_schedule(compiled, x):
    """Forward and backward of the compiled loss along SCHEDULE, against eager;
    -> the compile count after each step."""
    counts = []
    for k, t in SCHEDULE:
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = compiled(xc, k, t), _loss(xe, k, t)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        gc, ge = torch.autograd.grad(got, xc)[0], torch.autograd.grad(want, xe)[0]
        assert bool((ge != 0).any())
        torch.testing.assert_close(gc, ge, rtol=1e-10, atol=1e-12)
        counts.append(compiled_count(compiled))
    return counts


def compiled_count(compiled) -> int:
    return compiled._backend_counter.frame_count


def _compile(device, **kw):
    cnt = _backend(device)
    compiled = torch.compile(_loss, backend=cnt, **kw)
    compiled._backend_counter = cnt
    return compiled


def test_changing_floats_fullgraph(device):
    """fullgraph=True: the floats stay graph inputs (no Python check, no torch.full fill
    value on them), so one recompile at the first change makes them dynamic, then none."""
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(0), dtype=F64).to(device)
    counts = _run_schedule(_compile(device, fullgraph=True), x)
    assert counts == [1, 2, 2, 2, 2], counts


def test_changing_floats_dynamic_compiles_once(device):
    x = torch.randn(4, 10, generator=torch.Generator().manual_seed(1), dtype=F64).to(device)
    counts = _run_schedule(_compile(device, fullgraph=True, dynamic=True), x)
    assert counts == [1] * len(SCHEDULE), counts


def test_no_graph_break_without_fullgraph(device):
    x = torch.randn(3, 12, generator=torch.Generator().manual_seed(2), dtype=F64).to(device)
    counts = _run_schedule(_compile(device), x)
    assert counts[-1] <= 2, counts
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def test_module_temperature_schedule(device):
    """SoftTopK with .temperature / .k changed between steps (the README's schedule)."""
    gate = fl.SoftTopK(4.0, 1.0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 16), gate).to(device=device, dtype=F64)
    cnt = _backend(device)
    compiled = torch.compile(net, backend=cnt, fullgraph=True)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(3), dtype=F64).to(device)
    for step, (k, t) in enumerate(SCHEDULE):
        gate.k, gate.temperature = k, t
        out = compiled(x)
        torch.testing.assert_close(out, net(x), rtol=1e-12, atol=1e-12)
        out.sum().backward()
        assert cnt.frame_count == min(step + 1, 2), (step, cnt.frame_count)


def test_invalid_numbers_still_checked_in_eager():
    """The checks skipped while compiling still run in eager."""
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match="temperature"):
        fl.soft_topk(x, 2.0, -1.0)
    with pytest.raises(ValueError, match="k must be"):
        fl.soft_topk(x, 6.0, 1.0)
