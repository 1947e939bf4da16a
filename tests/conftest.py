"""Shared test helpers: device parametrisation and the tolerance rule.

Tolerance rule (flash-attention's): a kernel's error against the float64 oracle may be
a small multiple of what a same-precision PyTorch computation gets against it.
"""
import pytest
import torch

import fastlapsum

CUDA = torch.cuda.is_available() and fastlapsum.has_cuda_kernels()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and the CUDA build")

# fp64 budget bound |sum p - k| / max(k, 1) and fp32 bound (DESIGN §1.2)
BUDGET_TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def budget_error(p: torch.Tensor, k, dim=-1) -> torch.Tensor:
    """max over rows of |sum p - k| / max(k, 1), summed in float64."""
    k = torch.as_tensor(k, dtype=torch.float64, device=p.device)
    s = p.double().sum(dim)
    return ((s - k).abs() / k.clamp(min=1)).max()


def same_precision_error(x: torch.Tensor, k, t, dim=-1, largest=True) -> float:
    """Max error of the oracle's mask rounded to x.dtype: the floor any kernel pays."""
    p64 = fastlapsum.reference.soft_topk_reference(x, k, t, dim=dim, largest=largest)
    return (p64.to(x.dtype).double() - p64).abs().max().item()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
