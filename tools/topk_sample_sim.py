"""The CUDA per-row top-k kernel's sampled path, replayed with torch ops (any device): per row,
the sample (groups of 8 every 8 s scores at the row's offset), the 22-bit threshold at sample
rank r*, the tie skip, the admitted count C and the kernel's verdict: candidates (take <= C <=
cap) or the exact fallback (C > cap: overflow, C < take: underfill), which streams the row once
per radix digit (six where the k-th score has more ties than the budget still needs, as on 16-bit
rows) plus an output pass. Constants and formulas: csrc/cuda/topk/tuning.cuh, row_pass.cuh,
row_select.cuh, topk_cuda.cu (row_cap, the 256-thread "quarter" build's kQuarterCap).

    python tools/topk_sample_sim.py                       # the bench's shapes, fresh randn rows
    python tools/topk_sample_sim.py --bench-data          # on CUDA: the very tensors that
        # benchmarks/bench_topk_long_rows.py times (same generator, seed and order)
    python tools/topk_sample_sim.py --shapes 2048x262144x2048 --dtypes bfloat16 --max-rows 256
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

# tuning.cuh
kSampleTakePerStride, kSampleCapPerStride, kSampleMaxStride = 27, 118, 64
kSampleRank, kSampleTailSigmas, kSampleTieSkip = 47.25, 6.0, 1.5
RULE = "centre"  # "centre": tuning.cuh's rule; "1.75": 1.75 x take at s = max(take/27, cap/118)
kQuarterCap = 5632
kRowCapPerK, kRowCapRound, kRowCapMin, kRowCapMax = 4, 256, 8192, 24576
M32 = 0xFFFFFFFF

BENCH_SHAPES = [("vocabulary", 256, 152064, 50), ("k_sweep_64", 2048, 262144, 64), ("k_sweep_512", 2048, 262144, 512),
                ("k_sweep_2048", 2048, 262144, 2048), ("sparse_attention_rows", 2048, 131072, 2048),
                ("l0_attack_batch", 64, 150528, 1000), ("moe_expert_choice", 256, 65536, 2048)]


def row_cap(K: int) -> int:
    cap = ((kRowCapPerK * K + kRowCapRound - 1) // kRowCapRound) * kRowCapRound
    return max(kRowCapMin, min(cap, kRowCapMax))


def sample_fits(take: float, cap: float) -> bool:
    return 2.5 * take <= cap


def row_sample_stride(take: int, cap: int) -> int:
    s = max(take // kSampleTakePerStride, cap // kSampleCapPerStride)
    s = max(1, min(s, kSampleMaxStride))
    centre = math.sqrt(take * cap)
    if RULE == "centre" and take > 0 and cap > take and kSampleRank * s < centre:
        m = 0.5 * math.log(cap / take)
        s = min(s, max(1, int(centre / (kSampleTailSigmas / m) ** 2)))
    return s


def sample_admit(take: int, cap: int, s: int) -> float:
    return max(math.sqrt(take * cap) if RULE == "centre" else 1.75 * take, kSampleRank * s)


def mix32(x: torch.Tensor) -> torch.Tensor:  # int64 holding uint32 values
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def sample_offset(r: torch.Tensor, s: int) -> torch.Tensor:
    return (mix32((r * 0x9E3779B9 + 0x7F4A7C15) & M32) % s) * 8


def float_key(xf: torch.Tensor) -> torch.Tensor:
    """lapsum_math.h float_key of fp32 scores, as int64 in [0, 2^32)."""
    u = xf.contiguous().view(torch.int32).to(torch.int64) & M32
    u = torch.where(u == 0x80000000, torch.zeros_like(u), u)
    k = torch.where((u & 0x80000000) != 0, (~u) & M32, u | 0x80000000)
    return torch.where(torch.isnan(xf), torch.full_like(k, M32), k)


def key_bound(key: torch.Tensor) -> torch.Tensor:
    """row_pass.cuh key_bound: the fp32 score of a threshold key (NaN decodes bound at +-inf)."""
    u = torch.where((key & 0x80000000) != 0, key & 0x7FFFFFFF, (~key) & M32)
    f = (u - ((u & 0x80000000) << 1)).to(torch.int32).view(torch.float32)  # uint32 bits -> fp32
    inf = torch.full_like(f, math.inf)
    return torch.where(torch.isnan(f), torch.where(key >= 0x80000000, inf, -inf), f)


def simulate(x: torch.Tensor, K: int, cap: int, row0: int = 0) -> dict:
    """Per-row verdicts of the sampled path for rows x (no lengths, largest=True)."""
    R, L = x.shape
    take = min(K, L)
    xf = x.float()
    out = dict(C=torch.zeros(R, dtype=torch.int64, device=x.device))
    if L <= cap or take in (0, L):
        out.update(path="whole row in the buffer" if L <= cap else "direct", ok=torch.ones(R, dtype=torch.bool))
        return out
    if not sample_fits(take, cap):
        out.update(path="fallback (budget too large for the buffer)", ok=torch.zeros(R, dtype=torch.bool))
        return out
    s = row_sample_stride(take, cap)
    G = 8 * s
    rows = torch.arange(row0, row0 + R, device=x.device, dtype=torch.int64)
    off = sample_offset(rows, s)
    S = ((L - off - 8) // G + 1) * 8
    j = torch.arange(int(S.max()), device=x.device)
    valid = j[None, :] < S[:, None]
    pos = (off[:, None] + (j[None, :] >> 3) * G + (j[None, :] & 7)).clamp(max=L - 1)
    k22 = torch.where(valid, float_key(xf.gather(1, pos)) >> 10, torch.full_like(pos, -1))
    rs = torch.ceil(sample_admit(take, cap, s) * S.double() / L).clamp(min=1).minimum(S.double()).long()
    t22 = k22.sort(dim=1, descending=True).values.gather(1, (rs - 1)[:, None])
    above = (k22 > t22).sum(1)
    count = (k22 == t22).sum(1)
    thr = t22[:, 0] << 10
    per = L / S.double()
    skip = ((above + count).double() * per > kSampleTieSkip * cap) & (above.double() * per >= take) & (thr < 0xFFFFFC00)
    thr = torch.where(skip, thr + 1024, thr)
    lo = key_bound(thr)
    C = (~(xf < lo[:, None])).sum(1)
    kth = xf.topk(take, dim=1).values[:, -1:]
    ties_kth = (xf == kth).sum(1)
    ok = (C >= take) & (C <= cap)
    out.update(path="sampled", s=s, S=int(S.max()), rstar=int(rs.max()), C=C, ok=ok, over=C > cap, under=C < take,
               skip=skip, ties_kth=ties_kth)
    return out


def builds(dtype: torch.dtype, K: int) -> list[tuple[str, int]]:
    """The per-row kernel's builds for this dtype: the 512-thread one (buffer row_cap(K)) and,
    for 16-bit rows, the 256-thread one (at most kQuarterCap), the one topk_cuda.cu takes
    first; fp32 rows run the 512-thread build only."""
    full = ("512-thread", row_cap(K))
    if torch.empty((), dtype=dtype).element_size() == 2:
        return [("256-thread", min(row_cap(K), kQuarterCap)), full]
    return [full]


def report(name: str, x_of, rows: int, n: int, K: int, dtype: torch.dtype, chunk: int) -> None:
    for build, cap in builds(dtype, K):
        acc, info = {}, None
        for r0 in range(0, rows, chunk):
            res = simulate(x_of(r0, min(chunk, rows - r0)), K, cap, row0=r0)
            info = res
            for key in ("C", "ok", "over", "under", "skip", "ties_kth"):
                if key in res and isinstance(res[key], torch.Tensor):
                    acc.setdefault(key, []).append(res[key].cpu())
        a = {k: torch.cat(v) for k, v in acc.items()}
        head = f"{name:>22} {str(dtype).replace('torch.', ''):>8} {rows}x{n} k={K:<5} {build:>10} cap={cap:<5}"
        if info["path"] != "sampled":
            print(f"{head} {info['path']}", flush=True)
            continue
        C = a["C"].double()
        bad = (~a["ok"]).nonzero().flatten()
        ties = a["ties_kth"][bad].tolist()[:8]
        print(f"{head} s={info['s']} S={info['S']} r*={info['rstar']} C mean {C.mean():.0f} sd {C.std():.0f} "
              f"min {int(C.min())} max {int(C.max())} | fallback rows {len(bad)}/{rows} (over {int(a['over'].sum())}, "
              f"under {int(a['under'].sum())}), tie skips {int(a['skip'].sum())}"
              + (f" | fallback rows {bad.tolist()[:8]}, k-th value's ties {ties}" if len(bad) else ""), flush=True)


def shapes_of(spec):
    return [(s, *map(int, s.split("x"))) for s in spec.split(",")] if spec else BENCH_SHAPES


def tails(name: str, rows: int, n: int, K: int, dtype: torch.dtype) -> None:
    """The admitted count's tails a row, from its order statistics (C / A ~ Gamma(r) / r at
    sample rank r = A / s; the ties of 16-bit rows shift it up by up to a tie bin, ignored):
    P(C < take), P(C > cap), and the chance that some row of the batch falls back."""
    from scipy.stats import gamma
    for build, cap in builds(dtype, K):
        take = min(K, n)
        if n <= cap or not sample_fits(take, cap):
            continue
        s = row_sample_stride(take, cap)
        A = sample_admit(take, cap, s)
        r = A / s
        lo, hi = gamma.cdf(r * take / A, r), gamma.sf(r * cap / A, r)
        batch = -math.expm1(rows * math.log1p(-(lo + hi)))
        print(f"{name:>22} {str(dtype).replace('torch.', ''):>8} {rows}x{n} k={K:<5} {build:>10} cap={cap:<5} "
              f"s={s} A={A:.0f} rank={r:.1f} | P(under)={lo:.1e} P(over)={hi:.1e} a row, "
              f"P(some row of {rows} falls back)={batch:.1e}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-data", action="store_true",
                    help="regenerate bench_topk_long_rows.py's tensors (CUDA; its full default run's order)")
    ap.add_argument("--shapes", default=None, help="RxNxK,... (default: the bench's shapes)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-rows", type=int, default=None, help="at most this many rows a shape")
    ap.add_argument("--chunk", type=int, default=256, help="rows simulated at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tails", action="store_true", help="only the analytic tail probabilities (scipy)")
    ap.add_argument("--rule", choices=["centre", "1.75"], default="centre",
                    help="the sample's admission rule: tuning.cuh's (geometric centre of [take, cap], rank "
                         "floor) or 1.75 x take at s = max(take/27, cap/118)")
    args = ap.parse_args()
    global RULE
    RULE = args.rule
    if args.tails:
        for name, m, n, K in (shapes_of(args.shapes)):
            for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
                tails(name, m, n, K, dtype)
        return
    dev = torch.device(args.device)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    shapes = shapes_of(args.shapes)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    for name, m, n, K in shapes:
        for dtype in dtypes:
            rows = m if args.max_rows is None else min(m, args.max_rows)
            if args.bench_data:
                # bench_topk_long_rows.py: x = torch.randn(m, n, generator=gen).to(dtype), every
                # shape and dtype in turn from one generator seeded 0
                x = torch.randn(m, n, device=dev, generator=gen).to(dtype)
                report(name, lambda r0, c: x[r0:r0 + c], rows, n, K, dtype, args.chunk)
                del x
            else:
                report(name, lambda r0, c: torch.randn(c, n, device=dev, generator=gen).to(dtype), rows, n, K, dtype,
                       args.chunk)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    main()
