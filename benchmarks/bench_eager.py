"""Eager-mode cost of one call (issue 32): what a training loop pays per call when the host,
not the device, is the bottleneck.

Each column is the per-call wall time of `--iters` back-to-back calls with one
synchronisation at the end (the minimum over `--repeats` such runs), in µs:

  soft_fwd_us               fastlapsum.soft_topk(x, k, 1.0), x without grad
  soft_fwd_grad_us          the same with x requiring grad (autograd records the call)
  soft_fwd_bwd_us           forward + torch.autograd.grad(p, x, g)
  st_fwd_us                 soft_topk(..., hard=True) (straight-through forward), x requiring grad
  topk_us                   fastlapsum.topk(x, int(k))
  torch_topk_us             torch.topk(x, int(k), sorted=False)
  torch_sigmoid_fwd_bwd_us  torch.sigmoid(x) + autograd.grad: the cheapest comparable gate
  soft_graph_us             soft forward replayed from a CUDA graph (device time; null on CPU)
  soft_fwd_bwd_graph_us     forward + autograd.grad replayed from a CUDA graph (null on CPU)
  module_step_us            one training step of a small nn.Module gating with SoftTopK
                            (forward, loss, backward, SGD step)
  module_sigmoid_step_us    the same module with torch.sigmoid in place of SoftTopK

k and the temperature are Python scalars, as a user passes them.

    python benchmarks/bench_eager.py --device cuda   # -> benchmarks/results/eager_h200.json
    python benchmarks/bench_eager.py --device cpu --iters 20
    python benchmarks/bench_eager.py --shape 16x64:8 --profile   # host cost alone, and where it goes

--profile writes a torch.profiler table of 20 forward + autograd.grad calls at the first
shape (ops and kernel launches by self CPU time) to eager_profile_<device>.txt next to the JSON.

--host (CUDA) also writes eager_host_<device>.json: the host's own cost of one call, split,
as the enqueue time per call of `HOST_CALLS` calls issued while the device is kept busy (so
no call waits for the GPU and the launch queue never fills), µs:

  soft_fwd_host_us          soft_topk forward
  soft_fwd_bwd_host_us      forward + autograd.grad
  vjp_op_host_us            the fused VJP op called directly (torch.ops.fastlapsum.soft_topk_backward)
  soft_grad_host_us         autograd.grad over a retained soft_topk graph (the engine + our backward)
  sigmoid_grad_host_us      autograd.grad over a retained sigmoid graph: the engine's own cost
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Optional

import torch
from torch import nn

import fastlapsum
from timing import device_name, run_record, write_json

SHAPES = [(16, 4096, 256), (1, 10**6, 62500), (64, 131072, 2048)]  # (rows, n, k)
HERE = os.path.dirname(os.path.abspath(__file__))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def per_call_us(fn: Callable[[], object], dev: torch.device, iters: int, repeats: int, warmup: int = 3) -> float:
    """Wall time per call of `iters` back-to-back calls, one sync at the end; min over repeats."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(dev)
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def graph_us(fn: Callable[[], object], iters: int, repeats: int) -> Optional[float]:
    """Device time per call: fn captured once in a CUDA graph, replayed back to back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as e:  # report, don't lose the run
        print(f"  (graph capture failed: {str(e).splitlines()[0][:120]})")
        return None
    return per_call_us(graph.replay, torch.device("cuda"), iters, repeats)


class Gate(nn.Module):
    """A small gated layer: scores from a learnable per-position bias, a gate over them,
    and the gated input; `gate` is SoftTopK or sigmoid."""

    def __init__(self, rows: int, n: int, gate: nn.Module) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(rows, n))
        self.scale = nn.Parameter(torch.ones(()))
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.scale * x + self.bias)


class Sigmoid(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


def module_step(rows: int, n: int, gate: nn.Module, x: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
    model = Gate(rows, n, gate).to(x.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()

    return step


def bench_shape(rows: int, n: int, k: int, dev: torch.device, iters: int, repeats: int) -> dict:
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, n, generator=gen, device=dev)
    xg = x.clone().requires_grad_()
    g = torch.randn(rows, n, generator=gen, device=dev)
    t = 1.0

    def fwd_bwd() -> tuple:
        return torch.autograd.grad(fastlapsum.soft_topk(xg, k, t), xg, g)

    def sigmoid_fwd_bwd() -> tuple:
        return torch.autograd.grad(torch.sigmoid(xg), xg, g)

    time_it = lambda fn: per_call_us(fn, dev, iters, repeats)  # noqa: E731
    row = dict(rows=rows, n=n, k=k)
    row["soft_fwd_us"] = time_it(lambda: fastlapsum.soft_topk(x, k, t))
    row["soft_fwd_grad_us"] = time_it(lambda: fastlapsum.soft_topk(xg, k, t))
    row["soft_fwd_bwd_us"] = time_it(fwd_bwd)
    row["st_fwd_us"] = time_it(lambda: fastlapsum.soft_topk(xg, k, t, hard=True))
    row["topk_us"] = time_it(lambda: fastlapsum.topk(x, k))
    row["torch_topk_us"] = time_it(lambda: torch.topk(x, k, sorted=False))
    row["torch_sigmoid_fwd_bwd_us"] = time_it(sigmoid_fwd_bwd)
    if dev.type == "cuda":
        row["soft_graph_us"] = graph_us(lambda: fastlapsum.soft_topk(x, k, t), iters, repeats)
        row["soft_fwd_bwd_graph_us"] = graph_us(fwd_bwd, iters, repeats)
    else:
        row["soft_graph_us"] = row["soft_fwd_bwd_graph_us"] = None
    target = torch.randn(rows, n, generator=gen, device=dev)
    row["module_step_us"] = time_it(module_step(rows, n, fastlapsum.SoftTopK(k, t), x, target))
    row["module_sigmoid_step_us"] = time_it(module_step(rows, n, Sigmoid(), x, target))
    return row


def profile_table(rows: int, n: int, k: int, dev: torch.device) -> str:
    """torch.profiler of 20 forward + autograd.grad calls: where the host time goes."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(rows, n, device=dev).requires_grad_()
    g = torch.randn(rows, n, device=dev)
    step = lambda: torch.autograd.grad(fastlapsum.soft_topk(x, k, 1.0), x, g)  # noqa: E731
    for _ in range(5):
        step()
    _sync(dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(20):
            step()
        _sync(dev)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)


HOST_CALLS = 40  # enqueued per timing: ~12 launches a call stays below the launch queue's depth


def host_us(fn: Callable[[], object], repeats: int = 7) -> float:
    """Host time per call with the device busy (torch.cuda._sleep): what the host spends
    issuing one call, never waiting for the GPU. Min over repeats."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time
        t0 = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn()
        best = min(best, (time.perf_counter() - t0) / HOST_CALLS * 1e6)
    torch.cuda.synchronize()
    return best


def host_row(rows: int, n: int, k: int, dev: torch.device) -> dict:
    x = torch.randn(rows, n, device=dev)
    xg = x.clone().requires_grad_()
    g = torch.randn_like(x)
    p_graph = fastlapsum.soft_topk(xg, k, 1.0)
    s_graph = torch.sigmoid(xg)
    f64 = dict(device=dev, dtype=torch.float64)
    b = fastlapsum.lapsum_threshold(x, k, 1.0)
    t = torch.ones(rows, **f64)
    return dict(
        rows=rows, n=n, k=k,
        soft_fwd_host_us=host_us(lambda: fastlapsum.soft_topk(x, k, 1.0)),
        soft_fwd_bwd_host_us=host_us(lambda: torch.autograd.grad(fastlapsum.soft_topk(xg, k, 1.0), xg, g)),
        vjp_op_host_us=host_us(lambda: torch.ops.fastlapsum.soft_topk_backward(g, x, b, t, True, False)),
        soft_grad_host_us=host_us(lambda: torch.autograd.grad(p_graph, xg, g, retain_graph=True)),
        sigmoid_grad_host_us=host_us(lambda: torch.autograd.grad(s_graph, xg, g, retain_graph=True)),
    )


def _shape(text: str) -> tuple[int, int, int]:
    rows_n, k = text.split(":")
    rows, n = rows_n.lower().split("x")
    return int(rows), int(n), int(k)


def _fmt(v) -> str:
    return "      -" if v is None else f"{v:9.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=200, help="back-to-back calls per timing (default 200)")
    ap.add_argument("--repeats", type=int, default=3, help="timings per column; the minimum is kept")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/eager_<h200|cpu>.json)")
    ap.add_argument("--shape", type=_shape, action="append", default=None, metavar="ROWSxN:K",
                    help="shapes to run instead of the issue's three (repeatable), e.g. 16x64:8")
    ap.add_argument("--profile", action="store_true", help="also write a profiler table of the first shape")
    ap.add_argument("--host", action="store_true", help="(CUDA) also write the host cost split, eager_host_<tag>.json")
    args = ap.parse_args()
    shapes = args.shape or SHAPES
    dev = torch.device(args.device)
    name = device_name(dev)
    tag = ("h200" if "H200" in name else name.split()[-1].lower()) if dev.type == "cuda" else "cpu"
    cols = ["soft_fwd_us", "soft_fwd_grad_us", "soft_fwd_bwd_us", "st_fwd_us", "topk_us", "torch_topk_us",
            "torch_sigmoid_fwd_bwd_us", "soft_graph_us", "soft_fwd_bwd_graph_us", "module_step_us",
            "module_sigmoid_step_us"]
    print(f"{name} | torch {torch.__version__} | {args.iters} calls x {args.repeats} repeats, µs per call")
    print(f"{'rows x n, k':>22} " + " ".join(f"{c[:-3][:9]:>9}" for c in cols))
    out_rows = []
    for rows, n, k in shapes:
        row = bench_shape(rows, n, k, dev, args.iters, args.repeats)
        out_rows.append(row)
        print(f"{f'{rows} x {n}, {k}':>22} " + " ".join(_fmt(row[c]) for c in cols), flush=True)
    result = run_record(dev,
                        timing=f"per-call wall time of {args.iters} back-to-back calls, one sync at the end, "
                               f"min over {args.repeats} repeats (µs); *_graph_us: CUDA-graph replay (device time)",
                        rows=out_rows)
    path = args.out or os.path.join(HERE, "results", f"eager_{tag}.json")
    write_json(result, path)
    if args.host and dev.type == "cuda":
        host_rows = [host_row(rows, n, k, dev) for rows, n, k in shapes]
        for r in host_rows:
            print("host µs  " + "  ".join(f"{c}={v:.1f}" if isinstance(v, float) else f"{c}={v}" for c, v in r.items()))
        write_json(run_record(dev, timing=f"host enqueue time per call of {HOST_CALLS} calls with the device kept "
                                          f"busy, min over 7 repeats (µs)", rows=host_rows),
                   os.path.join(os.path.dirname(path), f"eager_host_{tag}.json"))
    if args.profile:
        prof_path = os.path.join(os.path.dirname(path), f"eager_profile_{tag}.txt")
        with open(prof_path, "w") as f:
            f.write(f"{name} | torch {torch.__version__} | 20 x (soft_topk + autograd.grad) at "
                    f"{shapes[0][0]} x {shapes[0][1]}, k = {shapes[0][2]}\n")
            f.write(profile_table(*shapes[0], dev))
        print(f"wrote {prof_path}")


if __name__ == "__main__":
    main()
