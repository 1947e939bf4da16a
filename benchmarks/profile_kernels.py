"""Per-kernel device times of one fastlapsum op on CUDA, from torch.profiler: where the
time of one call goes. Prints one table per size.

    python benchmarks/profile_kernels.py --sizes 1e6 1e8                 # soft_topk fwd+bwd
    python benchmarks/profile_kernels.py --op topk --sizes 1e8            # topk, k = n/16
    python benchmarks/profile_kernels.py --op topk --rows 2048 --sizes 131072 --k 2048
    python benchmarks/profile_kernels.py --sizes 1e6 --forward --timeline   # each launch of one call, in order
    ncu -k regex:scan_kernel python benchmarks/profile_kernels.py --sizes 1e6 --warmup 0 --calls 1 --bare

Run it with FASTLAPSUM_DEPENDENT_LAUNCH=0 (gpu_check.sh does): with dependent launches a
kernel starts before its predecessor ends, and its measured time includes that wait.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import fastlapsum


def make_call(op, rows, n, k, method, forward, describe):
    x = torch.randn(rows, n, device="cuda")
    if op == "topk":
        return lambda: fastlapsum.topk(x, int(k))
    kt = torch.full((rows,), k, dtype=torch.float64, device="cuda")
    t = torch.ones(rows, dtype=torch.float64, device="cuda")
    if describe:  # the solver path the timed calls take (not under --bare: an external profiler would count it)
        info = fastlapsum.lapsum_diagnostics(x, kt, t, method=method)
        print(f"# paths {info.path.tolist()[:4]} middle {info.middle_size.tolist()[:4]} attempts {info.attempts.tolist()[:4]}")
    if forward:
        return lambda: fastlapsum.soft_topk(x, kt, t, method=method)
    x.requires_grad_()
    g = torch.randn_like(x)
    # autograd.grad: no accumulation into x.grad in the timings
    return lambda: torch.autograd.grad(fastlapsum.soft_topk(x, kt, t, method=method), x, g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--op", choices=["soft", "topk"], default="soft", help="soft: soft_topk forward+backward")
    ap.add_argument("--sizes", nargs="*", type=float, default=[1e6, 1e8])
    ap.add_argument("--rows", type=int, default=1, help="batch of rows, each of the given size")
    ap.add_argument("--k", type=float, default=None, help="budget (default n/16)")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--bare", action="store_true", help="just run the calls (under an external profiler)")
    ap.add_argument("--forward", action="store_true", help="soft: the forward only")
    ap.add_argument("--timeline", action="store_true", help="each kernel of the last call: start and duration")
    args = ap.parse_args()
    for nf in args.sizes:
        n = int(nf)
        k = args.k if args.k is not None else n / 16
        call = make_call(args.op, args.rows, n, k, args.method, args.forward, args.timeline)
        for _ in range(args.warmup):
            call()
        torch.cuda.synchronize()
        if args.bare:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
            continue
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
        print(f"==== {args.op}: {args.rows} x n = {n:,}, k = {k:,.0f} ({args.method}), {args.calls} calls")
        if args.timeline:
            print_timeline(prof, args.calls)
        else:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


def print_timeline(prof, calls):
    """The kernels of the last call in launch order: start (us after the call's first), duration."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_call = len(kernels) // calls
    last = kernels[-per_call:]
    t0 = last[0].time_range.start
    for e in last:
        name = e.name.replace("void ", "").replace("fastlapsum::(anonymous namespace)::", "")[:48]
        print(f"  {e.time_range.start - t0:8.1f} {e.time_range.elapsed_us():7.1f}  {name}")
    print(f"  span {last[-1].time_range.end - t0:.1f} us, {per_call} kernels")


if __name__ == "__main__":
    main()
