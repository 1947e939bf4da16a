"""Timing helpers of the benchmarks, the demo and the CUDA-graph tests: median wall time of a
callable (CUDA events on the GPU), CUDA-graph capture and replay, and the device's copy
bandwidth for byte floors. Times are meaningful only as ratios within one run.

Not part of the installed package: scripts in benchmarks/ import it as `timing` (their
folder is on sys.path); examples/demo.py and the CUDA tests put benchmarks/ on sys.path."""
from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: str | torch.device = "cpu", *, warmup: int = 2,
              reps: int = 5) -> float:
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def capture_graph(fn: Callable[[], object], *, warmup: int = 2):
    """Warm fn up on a side stream, then capture one call in a CUDA graph.
    Returns (graph, outputs of the captured call); graph.replay() reruns it in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_median_ms(fn: Callable[[], object], *, reps: int = 20) -> float:
    """Device time of fn on CUDA: captured once in a CUDA graph, then the median over
    replays. Leaves out the host's launch overhead, which dominates eager timings of
    small inputs (eager and graph times are both worth reporting)."""
    graph, _ = capture_graph(fn)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def copy_bandwidth_gbps(device: str | torch.device, nbytes: int = 1 << 30) -> float:
    """Device read+write bandwidth from a large copy, in GB/s (for the byte floor)."""
    n = nbytes // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), device, warmup=2, reps=5)
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def bandwidth_header(device: str | torch.device) -> float:
    """The copy bandwidth of this run in GB/s (the floors' denominator), printed with the
    device's name and torch's version as a benchmark log's first line."""
    device = torch.device(device)
    bw = copy_bandwidth_gbps(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"{name} | copy bandwidth {bw:.0f} GB/s | torch {torch.__version__}")
    return bw


def graph_median_ms_or_none(fn: Callable[[], object], *, reps: int = 20) -> float | None:
    """graph_median_ms, or None (reported) where fn cannot be captured: one failed column
    must not lose a benchmark run."""
    try:
        return graph_median_ms(fn, reps=reps)
    except RuntimeError as e:
        print(f"    graph capture failed: {str(e).splitlines()[0][:160]}")
        return None


def device_name(device: str | torch.device) -> str:
    """The GPU's name, or the CPU's with its thread count: a result file's "gpu" field."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_record(device: str | torch.device, **fields) -> dict:
    """A benchmark's result: where and when it ran (gpu, torch, date), then its own fields."""
    return dict(gpu=device_name(device), torch=torch.__version__, date=datetime.date.today().isoformat(), **fields)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


def finish(result: dict, path: str | None, not_exact: list[str]) -> None:
    """Write the result (when a path is given), then fail the run if any case was not exact:
    a timing of a wrong answer must not pass as a measurement."""
    if path:
        write_json(result, path)
    if not_exact:
        raise SystemExit(f"NOT EXACT: {', '.join(not_exact)}")


def require_cuda_build() -> None:
    """Exit unless a CUDA device and fastlapsum's CUDA kernels are both here."""
    import fastlapsum
    if not (torch.cuda.is_available() and fastlapsum.has_cuda_kernels()):
        raise SystemExit("needs a CUDA device and the CUDA build of fastlapsum")
