"""Exact hard top-k on batched long rows, small k against large: fastlapsum.topk against
torch.topk and FlashInfer's top_k, a short run for A/B comparisons of the per-row kernel.

Cases (rows x n, k; fp32 and bf16 Gaussian scores, no lengths):
  vocabulary 256 x 152064, k = 50; the k sweep on 2048 x 262144 (k = 64, 512, 2048); and
  the shapes of bench_user_shapes.py the per-row kernel also runs (sparse attention
  2048 x 131072, k = 2048; L0 batch 64 x 150528, k = 1000; expert choice 256 x 65536,
  k = 2048), to see that they keep their times.
Columns: CUDA-graph device time (ms, median over replays) of fastlapsum.topk (unsorted),
torch.topk(sorted=False) and flashinfer.top_k (the fastest of its pinned backends; null
where it is not installed), the byte floor (one read of x at the copy bandwidth measured in
this run), and the regime fastlapsum takes. Every fastlapsum output is checked: sorted
values equal torch.topk's, the unsorted values the same multiset.

    python benchmarks/bench_topk_long_rows.py --out /tmp/topk_long_rows.json
    python benchmarks/bench_topk_long_rows.py --only vocabulary,k_sweep_64 --dtypes float32
"""
from __future__ import annotations

import argparse

import torch

import fastlapsum
from bench_user_shapes import SHAPES as USER_SHAPES
from bench_user_shapes import flashinfer_ms, flashinfer_top_k
from timing import bandwidth_header, finish, graph_median_ms_or_none, require_cuda_build, run_record

_USER = {s[0]: s for s in USER_SHAPES}
SHAPES = [_USER["vocabulary"]] + [(f"k_sweep_{k}", 2048, 262144, k) for k in (64, 512, 2048)] + [
    _USER[name] for name in ("sparse_attention_rows", "l0_attack_batch", "moe_expert_choice")]  # name, rows, n, k

def run(args):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = bandwidth_header(dev)
    top_k = None if args.no_flashinfer else flashinfer_top_k()
    only = set(args.only.split(",")) if args.only else None
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rows, bad = [], []
    for name, m, n, k in SHAPES:
        if only is not None and name not in only:
            continue
        for dtype in dtypes:
            x = torch.randn(m, n, device=dev, generator=gen).to(dtype)
            hv, _ = fastlapsum.topk(x, k, sorted=True)
            uv, _ = fastlapsum.topk(x, k, sorted=False)
            ref = torch.topk(x, k, sorted=True).values
            exact = torch.equal(hv, ref) and torch.equal(uv.sort(1, descending=True).values, ref)
            if not exact:
                bad.append(f"{name} {dtype}")
            row = dict(name=name, rows=m, n=n, k=k, dtype=str(dtype).replace("torch.", ""),
                       regime=fastlapsum.topk_diagnostics(x, k),
                       ours_ms=graph_median_ms_or_none(lambda: fastlapsum.topk(x, k), reps=args.reps),
                       torch_topk_ms=graph_median_ms_or_none(lambda: torch.topk(x, k, sorted=False), reps=args.reps),
                       flashinfer_ms=flashinfer_ms(top_k, x, k, args.reps),
                       floor_ms=x.numel() * x.element_size() / (bw * 1e9) * 1e3, exact=exact)
            rows.append(row)
            f = lambda v: "   -   " if v is None else f"{v:7.3f}"  # noqa: E731
            print(f"{name:>22} {row['dtype']:>8} {m:>5}x{n:<7} k={k:<5} {row['regime']:>8} | ours {f(row['ours_ms'])}"
                  f"  floor {row['floor_ms']:.3f}  torch {f(row['torch_topk_ms'])}  flashinfer {f(row['flashinfer_ms'])}"
                  f" | {'exact' if exact else 'NOT EXACT'}", flush=True)
            del x
            torch.cuda.empty_cache()
    return run_record(dev, bandwidth_gbps=bw, rows=rows), bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--only", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated torch dtypes")
    ap.add_argument("--no-flashinfer", action="store_true", help="skip FlashInfer's columns")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args()
    require_cuda_build()
    result, bad = run(args)
    finish(result, args.out, bad)


if __name__ == "__main__":
    main()
