"""Graph time of fastlapsum.topk on the shapes around issue 4's one miss (N = 128K, M = 2048,
K = 2048, ragged causal rows: 1.35x the one-scan floor), and a few others that share its
per-row kernel; each output is checked against torch.topk. For same-run A/B
(benchmarks/ab_sizes.sh with SCRIPT=benchmarks/topk_shapes.py); each round a fresh process.

    python benchmarks/topk_shapes.py        (ROUNDS=3 by default; DTYPES=f16,bf16: those cases only)
    SHAPES=64x1048576x2048,65x131072x2048:f16 python benchmarks/topk_shapes.py   (other cases: M x N x K
    [:dtype], ragged causal rows with lengths passed)
"""
import json

KB = 1024
# (M, N, K, pass lengths, dtype)
CASES = [(2048, 128 * KB, 2048, True, "f32"), (2048, 128 * KB, 2048, False, "f32"),
         (4096, 128 * KB, 2048, True, "f32"), (8192, 128 * KB, 2048, True, "f32"),
         (512, 128 * KB, 2048, True, "f32"), (2048, 256 * KB, 2048, True, "f32"),
         (1024, 512 * KB, 2048, True, "f32"), (2048, 256 * KB, 512, True, "f32"),
         (2048, 256 * KB, 8192, True, "f32"), (2048, 128 * KB, 2048, True, "f16"),
         (64, 4096, 512, True, "f32"),
         # 16-bit scores (the row kernel's 256-thread build where 2.5 K <= 5632)
         (2048, 128 * KB, 2048, False, "f16"), (2048, 128 * KB, 2048, True, "bf16"),
         (4096, 128 * KB, 2048, True, "f16"), (512, 128 * KB, 2048, True, "f16"),
         (2048, 256 * KB, 2048, True, "f16"), (1024, 512 * KB, 2048, True, "f16"),
         (2048, 256 * KB, 512, True, "f16"), (2048, 256 * KB, 4096, True, "f16"), (64, 4096, 512, True, "f16")]


def measure():
    import os

    import torch

    import fastlapsum
    from fastlapsum.timing import copy_bandwidth_gbps, graph_median_ms
    from bench_hard_topk import causal_fill

    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth_gbps(torch.device("cuda"))
    out = []
    dtypes = os.environ.get("DTYPES")
    cases = CASES
    if os.environ.get("SHAPES"):
        cases = []
        for item in os.environ["SHAPES"].split(","):
            shape, _, dt = item.partition(":")
            M, N, K = (int(v) for v in shape.split("x"))
            cases.append((M, N, K, True, dt or "f32"))
    for M, N, K, pass_len, dt in cases:
        if dtypes and dt not in dtypes.split(","):
            continue
        x = torch.empty(M, N, device="cuda")
        lengths = causal_fill(x, gen)
        if dt != "f32":
            x = x.to({"f16": torch.float16, "bf16": torch.bfloat16}[dt])
        ln = lengths if pass_len else None
        ms = graph_median_ms(lambda: fastlapsum.topk(x, K, lengths=ln))
        v = fastlapsum.topk(x, K, sorted=True, lengths=ln)[0]
        exact = bool(torch.equal(v, torch.topk(x, K, sorted=True).values))
        floor_ms = int(lengths.sum()) * x.element_size() / (bw * 1e9) * 1e3
        label = f"{M}x{N // KB}K" + ("" if K == 2048 else f"/K{K}") + ("+len" if pass_len else "") + \
            ("" if dt == "f32" else f"/{dt}")
        out.append((label, None, round(ms * 1e3, 1), round(ms / floor_ms, 3), "exact" if exact else "NOT EXACT"))
        del x
    print(json.dumps(out))


if __name__ == "__main__":
    from fresh_rounds import main
    main(__file__, "cases: (shape, -, us graph, x one-scan floor, exactness)", measure)
