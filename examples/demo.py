"""fastlapsum demo: an exact-budget soft top-k on millions of scores.

For each size: the budget error |sum p - k| / k, the solver path the row took, and
the time of fastlapsum.soft_topk next to the PyTorch baselines (torch.topk, the
pure-PyTorch float64 sort solver, the 60-step bisection of the original LapSum). Then one
gradient step through the mask, with gradients for the scores, k and the temperature.

    python examples/demo.py                 # 1e6 and 1e7 scores (CPU), 1e6..1e8 on a GPU
    python examples/demo.py --sizes 1e6 3e8 --device cuda
"""
import argparse
import math
import os
import sys

import torch

import fastlapsum
from fastlapsum import reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks"))
from timing import median_ms  # noqa: E402  (benchmarks/timing.py)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpu = torch.cuda.is_available() and fastlapsum.has_cuda_kernels()
    ap.add_argument("--device", default="cuda" if gpu else "cpu")
    ap.add_argument("--sizes", nargs="*", type=float, default=[1e6, 1e7, 1e8] if gpu else [1e5, 1e6, 1e7])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--baseline-max-n", type=float, default=1e8 if gpu else 1e7,
                    help="largest n for the slow pure-PyTorch baselines")
    args = ap.parse_args()
    dev = torch.device(args.device)
    t = args.temperature
    print(f"fastlapsum {fastlapsum.__version__} | torch {torch.__version__} | device {dev}"
          f"{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else ''}"
          f" | threads {torch.get_num_threads()}")
    print(f"soft top-k of Gaussian fp32 scores, k = n/16, temperature = {t}\n")
    head = f"{'n':>11} {'budget err':>10} {'path':>14} {'middle':>9} {'ours ms':>9} {'topk ms':>9} {'sort-ref ms':>11} {'bisect ms':>10}"
    print(head)
    print("-" * len(head))
    gen = torch.Generator(device=dev).manual_seed(0)
    for nf in args.sizes:
        n = int(nf)
        k = n / 16
        x = torch.randn(n, generator=gen, device=dev)
        p = fastlapsum.soft_topk(x, k, t)
        err = abs(p.double().sum().item() - k) / k
        info = fastlapsum.lapsum_diagnostics(x, k, t)
        reps = 3 if n >= 1e7 else 5
        ours = median_ms(lambda: fastlapsum.soft_topk(x, k, t), dev, reps=reps)
        topk = median_ms(lambda: torch.topk(x, int(k), sorted=False), dev, reps=reps)
        s, kk, tt = x[None].double(), torch.tensor([k], device=dev, dtype=torch.float64), torch.tensor([t], device=dev, dtype=torch.float64)
        ref = bis = math.nan
        if n <= args.baseline_max_n:
            ref = median_ms(lambda: reference.lapsum_threshold_reference(s, kk, tt, polish=0), dev, warmup=1, reps=1)
            if n <= args.baseline_max_n / (10 if gpu else 100):
                bis = median_ms(lambda: reference.bisection_threshold(s, kk, tt), dev, warmup=0, reps=1)
        print(f"{n:>11,} {err:>10.2e} {fastlapsum.PATH_NAMES[int(info.path)]:>14} {int(info.middle_size):>9,} "
              f"{ours:>9.3f} {topk:>9.3f} {ref:>11.2f} {bis:>10.1f}")
        del x, p, s

    # One gradient step: learn scores so that the mask covers the "good" items.
    n = int(min(args.sizes))
    k = torch.tensor(n / 16, dtype=torch.float64, device=dev, requires_grad=True)
    temp = torch.tensor(t, device=dev, requires_grad=True)
    scores = torch.randn(n, generator=gen, device=dev).requires_grad_()
    target = (torch.rand(n, generator=gen, device=dev) < 1 / 16).float()
    opt = torch.optim.Adam([scores], lr=0.5)
    losses = []
    for step in range(10):
        p = fastlapsum.soft_topk(scores, k, temp)
        loss = -(p * target).sum() / target.sum()  # share of the good items the mask covers
        opt.zero_grad()
        k.grad = temp.grad = None
        loss.backward()
        opt.step()
        losses.append(loss.item())
    p = fastlapsum.soft_topk(scores.detach(), k.detach(), temp.detach())
    print(f"\n10 Adam steps on n = {n:,}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
          f"sum(p) = {p.double().sum().item():.6f} (k = {k.item():.1f})")
    print(f"|grad scores| = {scores.grad.norm().item():.3e}, dL/dk = {k.grad.item():.3e}, "
          f"dL/dtemperature = {temp.grad.item():.3e}")


if __name__ == "__main__":
    main()
