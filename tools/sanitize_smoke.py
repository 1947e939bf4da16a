"""Every CUDA kernel of fastlapsum on small awkward shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python tools/sanitize_smoke.py
    compute-sanitizer --tool racecheck python tools/sanitize_smoke.py --quick

Row lengths straddle each regime's limits (warp rows, on-chip rows, long rows), rows are
offset by one element (unaligned starts), and ragged `lengths` include 0 and more than n.
It checks nothing itself beyond finiteness of the budget; the sanitizer reports.
"""
from __future__ import annotations

import argparse

import torch

import fastlapsum


def shapes(quick: bool):
    # 20_000: the per-row top-k kernel's sampled path (rows longer than its 8192-entry buffer)
    ns = [1, 2, 31, 33, 64, 65, 255, 257, 1000, 1025, 4097, 20_000] + ([] if quick else [70_000, 300_000])
    for n in ns:
        for rows in ([1, 37] if n < 10_000 else [1, 3]):
            yield rows, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    for rows, n in shapes(args.quick):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            base = torch.randn(rows, n + 1, device="cuda", dtype=dtype)
            x = base[:, 1:]  # unaligned rows with a pitch of n + 1
            if n > 4:
                x[0, :3] = float("inf")
                x[-1, 1] = float("nan")
            for largest in (True, False):
                k = max(1, n // 8)
                xg = x.detach().clone().requires_grad_(True)
                p = fastlapsum.soft_topk(xg, float(k) - 0.5 if k > 1 else 0.5, 0.1, largest=largest)
                p.backward(torch.randn_like(p))
                # t = 10: the root above every score (the short-row kernels' outer-gap path)
                p = fastlapsum.soft_topk(xg, k, 10.0, largest=largest)
                p.backward(torch.randn_like(p))
                lp = fastlapsum.log_soft_topk(xg, k, 0.1, largest=largest)
                lp.exp().sum().backward()
                b = fastlapsum.lapsum_threshold(xg, k, 0.1, largest=largest)
                b.sum().backward()
                st = fastlapsum.soft_topk(xg, k, 0.1, largest=largest, hard=True)
                st.sum().backward()
                for kk in {0, 1, min(n, 8), min(n, 16), k, n}:  # 1-16: the warp rows' filter
                    for srt in (False, True):
                        fastlapsum.topk(x, kk, largest=largest, sorted=srt)
                lengths = torch.randint(0, n + 3, (rows,), device="cuda")
                fastlapsum.topk(x, k, largest=largest, sorted=True, lengths=lengths)
            torch.cuda.synchronize()
        print(f"rows={rows} n={n} ok", flush=True)
    # rows of no scores (the op; the Python API refuses them): the short-row kernels run them
    # and must not load
    kt = [torch.full((3,), v, device="cuda", dtype=torch.float64) for v in (0.0, 0.1)]
    for dtype in (torch.float32, torch.float64):
        for method in (0, 1):
            torch.ops.fastlapsum.lapsum_threshold(torch.empty(3, 0, device="cuda", dtype=dtype), *kt, True, method)
    torch.cuda.synchronize()
    print("rows=3 n=0 ok", flush=True)


if __name__ == "__main__":
    main()
