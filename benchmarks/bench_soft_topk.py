"""Soft top-k benchmark: fastlapsum against the PyTorch baselines in the same run.

Rows: forward and forward+backward of fastlapsum.soft_topk (fp32, k = n/16, t = 1,
Gaussian scores, batch 1 for n = 1e3..1e9 and a 16 x 4096 batch; on CUDA also many short
rows with a small k, as in MoE routers: 65536 x 256, k = 8 and 16384 x 64, k = 2) next to (a) the
pure-PyTorch float64 sort solver (fastlapsum.reference), (b) the 60-step bisection of the
original LapSum, (c) torch.topk at the same k, (d) the byte floor: bytes that must move
(forward: two reads and one write of the row; backward: three reads and one write more)
over the copy bandwidth measured in this run. Then the solver-path statistics on the
adversarial rows of the tests.

    python benchmarks/bench_soft_topk.py --out benchmarks/results/soft_topk_cpu.json
"""
from __future__ import annotations

import argparse
import math

import torch

import fastlapsum
from fastlapsum import reference
from timing import bandwidth_header, graph_median_ms, graph_median_ms_or_none, median_ms, run_record, write_json

FWD_PASSES, BWD_PASSES = 3, 4
ROUTER = [(65536, 256, 8), (16384, 64, 2)]  # (rows, n, k): MoE-router shapes


def adversarial_rows(n: int, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    g = torch.randn(n, generator=gen, device=device)
    ar = torch.arange(n, device=device, dtype=torch.float32)
    stride = max(1, n // min(max(int(4 * n ** (2 / 3)), 1024), 1 << 16))  # bracket_rule.h's sample stride
    return {
        "gaussian": g,
        "cauchy": torch.tan(math.pi * (torch.rand(n, generator=gen, device=device) - 0.5)),
        "constant": torch.zeros(n, device=device),
        "16-level ties": torch.randint(0, 16, (n,), generator=gen, device=device).float(),
        "0/1": (torch.rand(n, generator=gen, device=device) < 0.5).float(),
        "sorted": ar / n,
        "period = stride": torch.where(ar % stride == 0, torch.full_like(g, 1e3), g),
        "blocks": (ar // max(1, n // 64)).float(),
    }


def run(args):
    dev = torch.device(args.device)
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = bandwidth_header(dev)
    rows = []

    def bench(n: int, batch: int, k: float | None = None):
        x = torch.randn(batch, n, generator=gen, device=dev)
        k, t = (n / 16 if k is None else k), 1.0
        kk = torch.full((batch,), k, dtype=torch.float64, device=dev)
        tt = torch.full((batch,), t, dtype=torch.float64, device=dev)
        reps = 3 if n * batch >= 1e8 else 10
        floor_fwd = FWD_PASSES * x.numel() * x.element_size() / (bw * 1e9) * 1e3
        fwd = median_ms(lambda: fastlapsum.soft_topk(x, k, t), dev, reps=reps)
        # device time without the host's launch overhead (what small inputs are bound by)
        fwd_graph = graph_median_ms(lambda: fastlapsum.soft_topk(x, kk, tt)) if dev.type == "cuda" else None
        xg = x.clone().requires_grad_()
        g = torch.randn_like(x)

        def fwd_bwd():
            xg.grad = None  # time our backward, not autograd accumulating into .grad
            fastlapsum.soft_topk(xg, k, t).backward(g)

        fb = median_ms(fwd_bwd, dev, reps=reps)
        fb_graph = None
        if dev.type == "cuda":  # forward + backward as one graph: device time of both
            fb_graph = graph_median_ms_or_none(lambda: torch.autograd.grad(fastlapsum.soft_topk(xg, kk, tt), xg, g))
        topk = median_ms(lambda: torch.topk(x, int(k), sorted=False), dev, reps=reps)
        ref = bis = None
        if n * batch <= args.baseline_max_n:
            s = x.double()
            ref = median_ms(lambda: reference.lapsum_threshold_reference(s, kk, tt, polish=0), dev, warmup=1, reps=3)
            if n * batch <= args.baseline_max_n / 10:
                bis = median_ms(lambda: reference.bisection_threshold(s, kk, tt), dev, warmup=1, reps=3)
        p = fastlapsum.soft_topk(x, k, t)
        err = ((p.double().sum(-1) - k).abs() / k).max().item()
        info = fastlapsum.lapsum_diagnostics(x, k, t)
        path = fastlapsum.PATH_NAMES[int(info.path.flatten()[0])]
        middle = int(info.middle_size.flatten()[0])
        for op, ours, floor in (("forward", fwd, floor_fwd),
                                ("forward_backward", fb, floor_fwd * (FWD_PASSES + BWD_PASSES) / FWD_PASSES)):
            rows.append(dict(op=op, n=n, batch=batch, k=k, ours_ms=ours, floor_ms=floor, reference_sort_ms=ref,
                             bisection_ms=bis, torch_topk_ms=topk, budget_error=err,
                             ours_graph_ms=fwd_graph if op == "forward" else fb_graph, path=path,
                             middle_size=middle))
        graph = "" if fwd_graph is None else f" (graph {fwd_graph:7.3f})"
        fb_graph_s = "" if fb_graph is None else f" (graph {fb_graph:7.3f})"
        print(f"n={n:>11,} batch={batch:>5} k={k:>10,g} fwd {fwd:9.3f} ms{graph}  fwd+bwd {fb:9.3f} ms{fb_graph_s}  floor {floor_fwd:8.4f} ms  "
              f"topk {topk:8.3f} ms  sort-ref {ref if ref is None else round(ref, 3)}  "
              f"bisect {bis if bis is None else round(bis, 2)}  budget err {err:.1e}  {path} middle {middle:,}")

    for nf in args.sizes:
        bench(int(nf), 1)
    bench(4096, 16)
    if dev.type == "cuda":
        for batch, n, k in ROUTER:
            bench(n, batch, k)

    paths = []
    n = int(args.adversarial_n)
    for name, x in adversarial_rows(n, gen, dev).items():
        for method in ("auto", "bracket"):
            info = fastlapsum.lapsum_diagnostics(x, n / 16, 1.0, method=method)
            p = fastlapsum.soft_topk(x, n / 16, 1.0, method=method)
            err = abs(p.double().sum().item() - n / 16) / (n / 16)
            ms = median_ms(lambda: fastlapsum.soft_topk(x, n / 16, 1.0, method=method), dev, reps=5)
            paths.append(dict(case=name, method=method, n=n, path=fastlapsum.PATH_NAMES[int(info.path)],
                              attempts=int(info.attempts), middle_size=int(info.middle_size),
                              ours_ms=ms, budget_error=err))
            print(f"{name:>16} {method:>8}: {paths[-1]['path']:>14} attempts {paths[-1]['attempts']} "
                  f"middle {paths[-1]['middle_size']:>9,}  {ms:8.3f} ms  budget err {err:.1e}")

    return run_record(
        dev,
        bandwidth_gbps=bw,
        cuda_threshold_solver="on-chip sort for rows <= 4096; certified sample bracket (sample 4 n^(2/3); rows <= 2^21: its middle set sorted on chip when it fits one CTA), radix fallback",
        timing="ours_ms: eager, CUDA events around one call (host launch overhead included); "
               "ours_graph_ms: the same forward (or forward + backward, as torch.autograd.grad) "
               "replayed from a CUDA graph (device time)",
        rows=rows,
        paths=paths,
    )


def main():
    gpu = torch.cuda.is_available() and fastlapsum.has_cuda_kernels()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if gpu else "cpu")
    ap.add_argument("--sizes", nargs="*", type=float,
                    default=[1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9] if gpu else [1e3, 1e4, 1e5, 1e6])
    ap.add_argument("--baseline-max-n", type=float, default=1e8 if gpu else 1e6)
    ap.add_argument("--adversarial-n", type=float, default=1e7 if gpu else 1e5)
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args()
    result = run(args)
    if args.out:
        write_json(result, args.out)


if __name__ == "__main__":
    main()
