"""A/B timing of one tree: python tools/ab/ab_shapes.py TAG OUT.json (PYTHONPATH selects the tree).
Graph device times (ms) of soft (t = 1: the outer gap; t = 0.05: the sort), fwd+bwd, straight-through
and topk on the tiny-row shapes, fp32 and bf16."""
import json, sys, torch
sys.path.insert(0, "benchmarks")
from timing import graph_median_ms
import fastlapsum
SHAPES = [(65536, 256, 8), (16384, 64, 2), (65536, 128, 4), (32768, 512, 8), (8192, 1024, 8), (16384, 256, 32),
          (4096, 2048, 16)]
tag, out = sys.argv[1], sys.argv[2]
res = {}
g = torch.Generator(device="cuda").manual_seed(0)
for m, n, k in SHAPES:
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(m, n, device="cuda", generator=g).to(dt)
        xg = x.clone().requires_grad_(True)
        gr = torch.randn_like(x)
        fns = {"soft": lambda: fastlapsum.soft_topk(x, k, 1.0),
               "soft_t0.05": lambda: fastlapsum.soft_topk(x, k, 0.05),
               "fwdbwd": lambda: torch.autograd.grad(fastlapsum.soft_topk(xg, k, 1.0), xg, gr),
               "st": lambda: fastlapsum.soft_topk(x, k, 1.0, hard=True),
               "topk": lambda: fastlapsum.topk(x, k),
               "topk_sorted": lambda: fastlapsum.topk(x, k, sorted=True)}
        for name, fn in fns.items():
            key = f"{m}x{n} k={k} {str(dt)[6:]} {name}"
            res[key] = graph_median_ms(fn, reps=30)
        del x, xg, gr
        torch.cuda.empty_cache()
json.dump(res, open(out, "w"), indent=1)
print(tag, "done", len(res))
