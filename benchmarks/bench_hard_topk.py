"""Exact hard top-k benchmark: fastlapsum.topk (native CUDA) against torch.topk(sorted=False)
and the one-scan byte floor (valid bytes over the copy bandwidth measured in this run).

Cases (fp32 Gaussian scores):
  matrix   M in {512, 1024, 2048, 4096, 8192} x N in {128K, 256K, 512K, 1M}, K = 2048,
           ragged causal rows (row r valid length N - M + 1 + r, invalid suffix -inf),
           fastlapsum with and without `lengths` (torch.topk sees the -inf suffix);
  trace    a framework-like sequence of calls whose M shrinks as N grows (with lengths);
  single   one row of n = 1e6 ... 1e9 scores, k = n / 16 (up to --max-n);
  k-sweep  K in {512, 2048, 8192} on M = 2048, N = 256K causal rows;
  router   many short rows with a small k (MoE routers: 65536 x 256, k = 8; 16384 x 64, k = 2;
           65536 x 1024, k = 32; 4096 x 2048, k = 64: the warp-row kernel's regime).
ours_ms is the median over CUDA-graph replays (device time); ours_eager_ms and
torch_topk_ms are eager CUDA-event medians. Every output is checked outside the timed region: sorted values must equal
torch.topk's exactly, the unsorted result must hold the same value multiset, and the
values must be x at the returned indices.

    python benchmarks/bench_hard_topk.py --out benchmarks/results/hard_topk_h200.json
    python benchmarks/bench_hard_topk.py --quick            # a few shapes, < 1 min
"""
from __future__ import annotations

import argparse
import math

import torch

import fastlapsum
from timing import bandwidth_header, finish, graph_median_ms, median_ms, require_cuda_build, run_record

KB = 1024
MATRIX_M = [512, 1024, 2048, 4096, 8192]
MATRIX_N = [128 * KB, 256 * KB, 512 * KB, 1024 * KB]
TRACE = [(8192, 128 * KB), (4096, 256 * KB), (2048, 512 * KB), (1024, 1024 * KB), (512, 1024 * KB)]
ROUTER = [(65536, 256, 8), (16384, 64, 2), (65536, 1024, 32), (4096, 2048, 64)]  # (M, N, K)


class Failure(AssertionError):
    pass


def check(x, k, lengths, largest=True):
    """Exactness vs torch.topk (values only: torch's tie-break among equal scores may differ)."""
    vs, _ = fastlapsum.topk(x, k, sorted=True, lengths=lengths)
    vt = torch.topk(x, k, sorted=True).values
    if not torch.equal(vs, vt):
        raise Failure("sorted values differ from torch.topk")
    vu, iu = fastlapsum.topk(x, k, sorted=False, lengths=lengths)
    if not torch.equal(vu.sort(1, descending=True).values, vt):
        raise Failure("unsorted values are not the top-k multiset")
    if not torch.equal(x.gather(1, iu.clamp(min=0)), vu):
        raise Failure("values are not x at the returned indices")
    if lengths is not None and not bool((iu < lengths[:, None]).all()):
        raise Failure("an index past the valid length was returned")
    if not bool((iu.sort(1).values.diff(dim=1) > 0).all()):
        raise Failure("duplicate indices")


def causal_fill(x, gen):
    """Gaussian scores, row r valid for N - M + 1 + r columns, -inf after; -> lengths."""
    M, N = x.shape
    x.normal_(generator=gen)
    lengths = N - M + 1 + torch.arange(M, device=x.device)
    col = torch.arange(N, device=x.device)
    for r0 in range(0, M, 256):  # chunked: a full [M, N] mask would double the memory
        xs = x[r0:r0 + 256]
        xs.masked_fill_(col[None, :] >= lengths[r0:r0 + 256, None], -math.inf)
    return lengths


def run(args):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = bandwidth_header(dev)
    rows = []
    reps = 3 if args.quick else 5

    def floor_ms(nbytes):
        return nbytes / (bw * 1e9) * 1e3

    def record(case, x, k, lengths, *, pass_lengths=True):
        M, N = x.shape
        ln = lengths if pass_lengths else None
        ok, err = True, None
        try:
            check(x, k, ln)
        except Failure as e:
            ok, err = False, str(e)
        ours_eager = median_ms(lambda: fastlapsum.topk(x, k, lengths=ln), dev, reps=reps)
        tt = median_ms(lambda: torch.topk(x, k, sorted=False), dev, reps=reps)
        try:  # device time without the host's launch overhead (the op is graph-capturable)
            ours = graph_median_ms(lambda: fastlapsum.topk(x, k, lengths=ln), reps=reps * 2)
        except RuntimeError as e:  # report, keep the eager time
            print(f"  graph capture failed: {e}")
            ours = ours_eager
        valid = int(lengths.sum()) if lengths is not None else M * N
        fl = floor_ms(valid * x.element_size())
        row = dict(case=case, M=M, N=N, K=k, lengths=bool(pass_lengths and lengths is not None), ours_ms=ours,
                   ours_eager_ms=ours_eager,
                   floor_ms=fl, floor_full_ms=floor_ms(M * N * x.element_size()), torch_topk_ms=tt,
                   vs_floor=ours / fl, speedup_vs_torch=tt / ours, exact=ok, error=err)
        rows.append(row)
        print(f"{case:>8} M={M:>5} N={N:>9,} K={k:>7,} len={str(row['lengths']):>5}  ours {ours:9.3f} ms  "
              f"floor {fl:8.3f} ms ({ours / fl:5.2f}x)  torch.topk {tt:9.3f} ms ({tt / ours:5.1f}x)  "
              f"{'exact' if ok else 'NOT EXACT: ' + err}")
        return row

    # ---- matrix (one buffer, reused through views) ----
    ms_list = [512, 2048] if args.quick else MATRIX_M
    ns_list = [128 * KB, 1024 * KB] if args.quick else MATRIX_N
    cap = max(m * n for m in ms_list for n in ns_list)
    buf = torch.empty(cap, device=dev)
    for N in ns_list:
        for M in ms_list:
            x = buf[:M * N].view(M, N)
            lengths = causal_fill(x, gen)
            record("matrix", x, 2048, lengths, pass_lengths=True)
            record("matrix", x, 2048, lengths, pass_lengths=False)

    # ---- framework-like trace ----
    trace = TRACE[:2] if args.quick else TRACE
    tot = dict(ours=0.0, floor=0.0, torch=0.0)
    for M, N in trace:
        x = buf[:M * N].view(M, N)
        lengths = causal_fill(x, gen)
        r = record("trace", x, 2048, lengths)
        tot["ours"] += r["ours_ms"]
        tot["floor"] += r["floor_ms"]
        tot["torch"] += r["torch_topk_ms"]
    print(f"   trace total: ours {tot['ours']:.3f} ms  floor {tot['floor']:.3f} ms  torch.topk {tot['torch']:.3f} ms")
    rows.append(dict(case="trace_total", M=None, N=None, K=2048, lengths=True, ours_ms=tot["ours"],
                     floor_ms=tot["floor"], torch_topk_ms=tot["torch"]))

    # ---- K sweep ----
    M, N = (512, 256 * KB) if args.quick else (2048, 256 * KB)
    x = buf[:M * N].view(M, N)
    lengths = causal_fill(x, gen)
    for k in (512, 2048, 8192):
        record("k-sweep", x, k, lengths)
    del buf, x
    torch.cuda.empty_cache()

    # ---- many short rows, small k ----
    for M, N, k in ROUTER:
        record("router", torch.randn(M, N, device=dev, generator=gen), k, None)

    # ---- single huge rows, k = n / 16 ----
    n = int(1e6)
    while n <= args.max_n:
        need = n * 4 * 1.6 + 2e9  # x, candidate buffer, outputs, torch.topk workspace
        if need > torch.cuda.mem_get_info(dev)[0]:
            print(f"  single n={n:,}: skipped (memory)")
            break
        x = torch.randn(1, n, device=dev, generator=gen)
        record("single", x, n // 16, None)
        del x
        torch.cuda.empty_cache()
        n *= 10

    return run_record(dev, bandwidth_gbps=bw, rows=rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--max-n", type=float, default=1e9, help="largest single row")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args()
    require_cuda_build()
    result = run(args)
    bad = [f"{r['case']} {r['M']}x{r['N']} K={r['K']}" for r in result["rows"] if r.get("exact") is False]
    finish(result, args.out, bad)


if __name__ == "__main__":
    main()
