"""Graph time of one soft forward (fp32, t = 1, Gaussian rows) at the sizes and budgets around
the 10^6 target, with the middle-set size and the budget error; each round in a fresh
process (run-to-run spread is a few microseconds at these sizes).

    python benchmarks/soft_forward_sizes.py        (ROUNDS=3 by default)
"""
import json
import os
import subprocess
import sys

# (rows, n, k / n): short rows (one CTA each), the bracket's sorted middle set (k = n/16 up to
# 2^21), the binning chain after it (4e6, 1e7, and k = n/2, whose middle sets exceed one CTA).
CASES = [(16, 4096, 1 / 16), (256, 1000, 1 / 16),
         (1, 100_000, 1 / 16), (1, 262_144, 1 / 16), (1, 500_000, 1 / 16), (1, 1_000_000, 1 / 16),
         (1, 1 << 20, 1 / 16), (1, 2_000_000, 1 / 16), (1, 1 << 21, 1 / 16), (1, 4_000_000, 1 / 16),
         (1, 10_000_000, 1 / 16), (1, 1_000_000, 1 / 2), (1, 2_000_000, 1 / 2)]


def measure():
    import torch

    import fastlapsum
    from fastlapsum.timing import graph_median_ms

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for rows, n, frac in CASES:
        x = torch.randn(rows, n, generator=gen, device="cuda")
        k = torch.full((rows,), n * frac, dtype=torch.float64, device="cuda")
        t = torch.ones(rows, dtype=torch.float64, device="cuda")
        ms = graph_median_ms(lambda: fastlapsum.soft_topk(x, k, t))
        err = (fastlapsum.soft_topk(x, k, t).double().sum(-1) - n * frac).abs().max().item() / (n * frac)
        middle = int(fastlapsum.lapsum_diagnostics(x, n * frac, 1.0).middle_size.flatten()[0])
        out.append((f"{rows}x{n}" if rows > 1 else n, frac, round(ms * 1e3, 1), middle, f"{err:.0e}"))
    print(json.dumps(out))


def main():
    print("cases: (n, k/n, us graph, middle set, budget error)")
    for rnd in range(int(os.environ.get("ROUNDS", "3"))):
        r = subprocess.run([sys.executable, __file__, "measure"], capture_output=True, text=True)
        print(f"r{rnd}: " + (r.stdout.strip().splitlines()[-1] if r.returncode == 0 else r.stderr[-600:]), flush=True)


if __name__ == "__main__":
    measure() if sys.argv[1:2] == ["measure"] else main()
