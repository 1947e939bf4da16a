"""The shapes users run, soft and hard, against the memory floor and the peers, one run.

Workloads (rows x n, k): MoE token-choice routers (65536 x 256, k = 8; 16384 x 64, k = 2),
MoE expert choice (256 x 65536, k = 2048), an L0-attack batch (64 x 150528, k = 1000),
sparse-attention rows (2048 x 131072, k = 2048), a vocabulary (256 x 152064, k = 50) and
3DGS pruning (1 x 5e6, k = 1.5e6); fp32 and bf16 scores.

Columns (CUDA-graph device time, ms, median over replays):
  soft_ms         soft_topk forward (t = 1)          soft_floor_ms      read x + write p
  fwd_bwd_ms      forward + backward (autograd.grad of <p, g>)
  fwd_bwd_floor_ms  the forward's floor + 4 more passes of x's bytes (read x, g twice, write dx)
  st_ms           straight-through forward (soft_topk(hard=True))
  kth_sigmoid_ms  the budget-less relaxation users write today: torch.topk's k-th value v,
                  then sigmoid((x - v) / t)
  hard_ms         fastlapsum.topk (unsorted)          hard_floor_ms      read x
  torch_topk_ms   torch.topk(sorted=False)
  flashinfer_ms   flashinfer.top_k, the fastest of its pinned backends (null where it is not
                  installed or cannot run the shape)
The floors use the copy bandwidth measured in the same run.

    python benchmarks/bench_user_shapes.py --out benchmarks/results/user_shapes_h200.json
"""
from __future__ import annotations

import argparse
import os

import torch

import fastlapsum
from timing import bandwidth_header, graph_median_ms_or_none, require_cuda_build, run_record, write_json

SHAPES = [  # name, rows, n, k
    ("moe_token_choice_256", 65536, 256, 8),
    ("moe_token_choice_64", 16384, 64, 2),
    ("moe_expert_choice", 256, 65536, 2048),
    ("l0_attack_batch", 64, 150528, 1000),
    ("sparse_attention_rows", 2048, 131072, 2048),
    ("vocabulary", 256, 152064, 50),
    ("gaussian_pruning", 1, 5_000_000, 1_500_000),
]
# FlashInfer's multi-CTA radix kernel needs all of a row's CTAs resident: keep to rows it can run
FLASHINFER_MAX_N = 4_000_000


def flashinfer_top_k():
    """flashinfer.top_k, or None where it is not installed. On a machine without network the
    wheels travel in .whl/ and benchmarks/gpu_check.sh installs them (docs/PERFORMANCE.md)."""
    os.environ.setdefault("FLASHINFER_DISABLE_JIT", "1")
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    try:
        import flashinfer
        return flashinfer.top_k
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        print(f"flashinfer unavailable: {type(e).__name__}: {e}")
        return None


def flashinfer_ms(top_k, x, k, reps):
    if top_k is None or x.size(1) > FLASHINFER_MAX_N:
        return None
    best = None
    for algo in ("default", "filtered", "cub"):
        os.environ["FLASHINFER_TOPK_ALGO"] = algo
        try:
            v, _ = top_k(x, k, sorted=False)
            ref = torch.topk(x, k, sorted=False).values
            if not torch.equal(v.sort(1).values, ref.sort(1).values):
                print(f"    flashinfer {algo}: not the top-k, ignored")
                continue
            ms = graph_median_ms_or_none(lambda: top_k(x, k, sorted=False), reps=reps)
        except Exception as e:  # noqa: BLE001 - a backend that cannot run this shape
            print(f"    flashinfer {algo}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if ms is not None and (best is None or ms < best):
            best = ms
    os.environ.pop("FLASHINFER_TOPK_ALGO", None)
    return best


def run(args):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = bandwidth_header(dev)
    top_k = flashinfer_top_k()
    reps = args.reps
    rows = []
    for name, m, n, k in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, n, device=dev, generator=gen).to(dtype)
            nbytes = x.numel() * x.element_size()

            def floor(passes):
                return passes * nbytes / (bw * 1e9) * 1e3

            t = 1.0
            p = fastlapsum.soft_topk(x, k, t)
            budget = ((p.double().sum(1) - k).abs() / max(k, 1)).max().item()
            xg = x.detach().clone().requires_grad_(True)
            g = torch.randn_like(x)

            def fwd_bwd():
                return torch.autograd.grad(fastlapsum.soft_topk(xg, k, t), xg, g)

            def kth_sigmoid():
                v = torch.topk(x, k, dim=1, sorted=False).values.amin(1, keepdim=True)
                return torch.sigmoid((x - v) / t)

            hv, _ = fastlapsum.topk(x, k, sorted=True)
            exact = torch.equal(hv, torch.topk(x, k, sorted=True).values)
            def dev_ms(fn):
                return graph_median_ms_or_none(fn, reps=reps)

            row = dict(name=name, rows=m, n=n, k=k, dtype=str(dtype).replace("torch.", ""),
                       soft_ms=dev_ms(lambda: fastlapsum.soft_topk(x, k, t)), soft_floor_ms=floor(2),
                       fwd_bwd_ms=dev_ms(fwd_bwd), fwd_bwd_floor_ms=floor(6),
                       st_ms=dev_ms(lambda: fastlapsum.soft_topk(x, k, t, hard=True)),
                       kth_sigmoid_ms=dev_ms(kth_sigmoid),
                       hard_ms=dev_ms(lambda: fastlapsum.topk(x, k)), hard_floor_ms=floor(1),
                       torch_topk_ms=dev_ms(lambda: torch.topk(x, k, sorted=False)),
                       flashinfer_ms=flashinfer_ms(top_k, x, k, reps),
                       budget_error=budget, hard_exact=exact)
            rows.append(row)
            f = lambda v: "   -   " if v is None else f"{v:7.3f}"  # noqa: E731
            print(f"{name:>22} {row['dtype']:>8} {m:>6}x{n:<9} k={k:<8} soft {f(row['soft_ms'])} "
                  f"(floor {row['soft_floor_ms']:.3f})  fwd+bwd {f(row['fwd_bwd_ms'])} (floor {row['fwd_bwd_floor_ms']:.3f})"
                  f"  st {f(row['st_ms'])}  kth+sigmoid {f(row['kth_sigmoid_ms'])} | hard {f(row['hard_ms'])} "
                  f"(floor {row['hard_floor_ms']:.3f})  torch {f(row['torch_topk_ms'])}  flashinfer "
                  f"{f(row['flashinfer_ms'])} | budget {budget:.1e} {'exact' if exact else 'NOT EXACT'}", flush=True)
            del x, xg, g, p
            torch.cuda.empty_cache()
    return run_record(dev, bandwidth_gbps=bw, rows=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args()
    require_cuda_build()
    result = run(args)
    if args.out:
        write_json(result, args.out)
    if any(not r["hard_exact"] for r in result["rows"]):
        raise SystemExit("fastlapsum.topk NOT EXACT on a shape")


if __name__ == "__main__":
    main()
