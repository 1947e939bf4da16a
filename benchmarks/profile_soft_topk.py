"""Per-kernel device times of fastlapsum.soft_topk (forward and backward) on CUDA, from
torch.profiler: where the time of one call goes. Prints one table per size.

    python benchmarks/profile_soft_topk.py --sizes 1e6 1e8
    ncu -k regex:scan_kernel python benchmarks/profile_soft_topk.py --sizes 1e6 --warmup 0 --calls 1 --bare

Run it with FASTLAPSUM_DEPENDENT_LAUNCH=0 (gpu_check.sh does): with dependent launches a
kernel starts before its predecessor ends, and its measured time includes that wait.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import fastlapsum


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="*", type=float, default=[1e6, 1e8])
    ap.add_argument("--rows", type=int, default=1, help="batch of rows, each of the given size")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--bare", action="store_true", help="just run the calls (under an external profiler)")
    args = ap.parse_args()
    for nf in args.sizes:
        n = int(nf)
        x = torch.randn(args.rows, n, device="cuda").requires_grad_()
        g = torch.randn_like(x)
        k = torch.full((args.rows,), n / 16, dtype=torch.float64, device="cuda")
        t = torch.ones(args.rows, dtype=torch.float64, device="cuda")

        def call():  # autograd.grad: no accumulation into x.grad in the timings
            torch.autograd.grad(fastlapsum.soft_topk(x, k, t, method=args.method), x, g)

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
        print(f"==== {args.rows} x n = {n:,} ({args.method}), {args.calls} forward+backward calls")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
