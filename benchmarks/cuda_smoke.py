"""Quick CUDA-vs-CPU agreement check (seconds; the full suite is tests/test_cuda.py)."""
import torch

import fastlapsum

torch.manual_seed(0)
for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
    x = torch.randn(8, 5000, dtype=dtype)
    x[1, 7] = float("inf")
    x[2, 3] = float("nan")
    k = torch.rand(8, dtype=torch.float64) * 5000
    for hard in (False, True):
        kk = k.round() if hard else k
        pc = fastlapsum.soft_topk(x, kk, 0.5, hard=hard)
        pg = fastlapsum.soft_topk(x.cuda(), kk.cuda(), 0.5, hard=hard).cpu()
        d = (pc.double() - pg.double()).abs().nan_to_num(0).max().item()
        same_nan = bool((pc.isnan() == pg.isnan()).all())
        print(f"{str(dtype):>15} hard={hard!s:5} max|cpu-cuda| {d:.2e} nan-pattern-equal {same_nan}")
    xg = x.double().cuda().requires_grad_()
    xc = x.double().requires_grad_()
    g = torch.randn(8, 5000, dtype=torch.float64)
    fastlapsum.soft_topk(xc, k, 0.5).backward(g)
    fastlapsum.soft_topk(xg, k.cuda(), 0.5).backward(g.cuda())
    print("   grad max|cpu-cuda|", (xc.grad - xg.grad.cpu()).abs().nan_to_num(0).max().item())
v1, i1 = fastlapsum.topk(x.float(), 10, sorted=True)
v2, i2 = fastlapsum.topk(x.float().cuda(), 10, sorted=True)
print("topk values equal (NaN == NaN)", torch.equal(v1.nan_to_num(), v2.cpu().nan_to_num()), "indices equal", torch.equal(i1, i2.cpu()))
