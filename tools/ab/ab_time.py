"""A/B timing of whichever fastlapsum is importable: graph device ms per (shape, dtype, op),
and a per-kernel profile of chosen shapes. Run once per tree, alternately; compare with ab_cmp.py."""
import json, statistics, sys
import torch
import fastlapsum

SHAPES = [
    ("moe256", 65536, 256, 8), ("moe64", 16384, 64, 2), ("expert", 256, 65536, 2048),
    ("l0", 64, 150528, 1000), ("sparse", 2048, 131072, 2048), ("vocab", 256, 152064, 50),
    ("gs5e6", 1, 5_000_000, 1_500_000), ("b16x4096", 16, 4096, 256), ("r1e6", 1, 10**6, 62500),
    ("r1e7", 1, 10**7, 625000), ("r1e8", 1, 10**8, 6250000),
    ("w262k_k8", 2048, 262144, 8), ("w262k_k512", 2048, 262144, 512), ("w262k_k8192", 2048, 262144, 8192),
]
PROFILE = sys.argv[3].split(",") if len(sys.argv) > 3 else []


def graph_ms(fn, reps=25):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    del g
    return statistics.median(ts)


def kernels(fn):
    from torch.profiler import profile, ProfilerActivity
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn(); torch.cuda.synchronize()
    out = []
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name[:90], round(e.device_time * 1e-3, 4) if hasattr(e, "device_time") else round(e.cuda_time * 1e-3, 4)))
    return out


def main():
    tag, path = sys.argv[1], sys.argv[2]
    gen = torch.Generator(device="cuda").manual_seed(0)
    res, prof = {}, {}
    for name, m, n, k in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
            xg = x.clone().requires_grad_(True)
            g = torch.randn_like(x)
            ops = {
                "soft": lambda: fastlapsum.soft_topk(x, k, 1.0),
                "fwdbwd": lambda: torch.autograd.grad(fastlapsum.soft_topk(xg, k, 1.0), xg, g),
                "hard": lambda: fastlapsum.topk(x, k),
            }
            for op, fn in ops.items():
                key = f"{name}/{str(dtype)[6:]}/{op}"
                try:
                    res[key] = graph_ms(fn)
                except Exception as e:  # noqa
                    print(key, "failed", e); res[key] = None
                if f"{name}/{op}" in PROFILE and dtype == torch.float32:
                    prof[key] = kernels(fn)
            print(tag, name, str(dtype)[6:], {o: res[f"{name}/{str(dtype)[6:]}/{o}"] for o in ops}, flush=True)
            del x, xg, g
            torch.cuda.empty_cache()
    json.dump(dict(tag=tag, res=res, prof=prof), open(path, "w"), indent=1)


main()
