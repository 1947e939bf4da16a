"""Graph time of one soft forward (fp32, t = 1, Gaussian rows, and three other rows of 10^6) at
the sizes and budgets around the 10^6 target, with the middle-set size, the budget error and the
solver's path; each round in a fresh process (run-to-run spread is a few microseconds here).

    python benchmarks/soft_forward_sizes.py        (ROUNDS=3 by default)
"""
import json

# (rows, n, k / n): short rows (one CTA each), the bracket's sorted middle set (k = n/16 up to
# 2^21), the binning chain after it (4e6, 1e7, and k = n/2, whose middle sets exceed one CTA).
CASES = [(16, 4096, 1 / 16), (256, 1000, 1 / 16),
         (1, 100_000, 1 / 16), (1, 262_144, 1 / 16), (1, 500_000, 1 / 16), (1, 1_000_000, 1 / 16),
         (1, 1 << 20, 1 / 16), (1, 2_000_000, 1 / 16), (1, 1 << 21, 1 / 16), (1, 4_000_000, 1 / 16),
         (1, 10_000_000, 1 / 16), (1, 1_000_000, 1 / 2), (1, 2_000_000, 1 / 2)]
# Rows of 1e6 unlike the Gaussian ones (labelled by kind): "t30", a Gaussian row at t = 30 (b
# lies above every score: an empty middle set, the tails only); "uni", a uniform row at its
# median with t = 0.01 (~27K middle scores: more than the sorted middle kernel takes, so the
# binning levels after it run); "const", a constant row at k = n/2 (the radix fallback over the
# whole row). The last two time the chain after the sorted kernel.
CHAIN_CASES = [("t30", 1_000_000, 1 / 16, 30.0), ("uni", 1_000_000, 1 / 2, 0.01), ("const", 1_000_000, 1 / 2, 1.0)]


def scores(kind, rows, n, gen):
    import torch
    if kind == "uni":
        return torch.rand(rows, n, generator=gen, device="cuda")
    if kind == "const":
        return torch.full((rows, n), 0.25, device="cuda")
    return torch.randn(rows, n, generator=gen, device="cuda")  # Gaussian (CASES, "t30")


def measure():
    import torch

    import fastlapsum
    from fastlapsum.timing import graph_median_ms

    gen = torch.Generator(device="cuda").manual_seed(0)
    out = []
    cases = [(f"{rows}x{n}" if rows > 1 else n, rows, n, frac, 1.0, None) for rows, n, frac in CASES]
    cases += [(f"{n}{kind}", 1, n, frac, temp, kind) for kind, n, frac, temp in CHAIN_CASES]
    for label, rows, n, frac, temp, kind in cases:
        x = scores(kind, rows, n, gen)
        k = torch.full((rows,), n * frac, dtype=torch.float64, device="cuda")
        t = torch.full((rows,), temp, dtype=torch.float64, device="cuda")
        ms = graph_median_ms(lambda: fastlapsum.soft_topk(x, k, t))
        err = (fastlapsum.soft_topk(x, k, t).double().sum(-1) - n * frac).abs().max().item() / (n * frac)
        info = fastlapsum.lapsum_diagnostics(x, n * frac, temp)
        middle, path = int(info.middle_size.flatten()[0]), fastlapsum.PATH_NAMES[int(info.path.flatten()[0])]
        out.append((label, frac, round(ms * 1e3, 1), middle, f"{err:.0e}", path))
    print(json.dumps(out))


if __name__ == "__main__":
    from fresh_rounds import main
    main(__file__, "cases: (n, k/n, us graph, middle set, budget error, solver path)", measure)
