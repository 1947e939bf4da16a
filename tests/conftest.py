"""Shared test helpers: device parametrisation and the tolerance rule.

Tolerance rule (flash-attention's): a kernel's error against the float64 oracle may be
a small multiple of what a same-precision PyTorch computation gets against it.
"""
import importlib.util
import os
import sys

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


def mask_floor(p64: torch.Tensor, dtype) -> float:
    """Max error against the float64 oracle mask p64 of a same-precision PyTorch
    implementation (the yardstick of the tolerance rule): the oracle rounded to dtype and,
    below float64, the mask with its exponential taken in float32 on the exact argument
    u = (s - b)/t rounded to float32 (what torch.exp in float32 gives a careful kernel
    that forms u in float64). u is recovered from p64 itself."""
    p64 = p64.double()
    floor = (p64.to(dtype).double() - p64).abs().max().item()
    if dtype != torch.float64:
        u = torch.where(p64 <= 0.5, torch.log(2 * p64), -torch.log(2 * (1 - p64)))
        p32 = torch.where(u <= 0, 0.5 * torch.exp(u.float()), 1 - 0.5 * torch.exp(-u.float()))
        floor = max(floor, (p32.double() - p64).abs().nan_to_num(0.0).max().item())
        # a float32 exp may be 2 ulp off (CUDA's documented bound; the CPU's is tighter)
        floor = max(floor, 2 * torch.finfo(torch.float32).eps * p64.nan_to_num(0.0).abs().max().item())
    return floor


def same_precision_error(x: torch.Tensor, k, t, dim=-1, largest=True) -> float:
    """mask_floor of the oracle's mask for x: the error a same-precision implementation pays."""
    p64 = fastlapsum.reference.soft_topk_reference(x, k, t, dim=dim, largest=largest)
    return mask_floor(p64, x.dtype)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


def load_example(example: str, name: str):
    """Import examples/<example>/<name>.py under a unique module name. Its folder is on
    sys.path while it loads (scripts import their sibling modules), and the siblings it
    imported are dropped from sys.modules afterwards, so that two examples' modules of the
    same name (model.py, say) cannot shadow each other within one pytest run."""
    folder = os.path.join(EXAMPLES, example)
    spec = importlib.util.spec_from_file_location(f"{example}_{name}", os.path.join(folder, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(folder)
        for key in set(sys.modules) - before:
            origin = getattr(sys.modules[key], "__file__", None) or ""
            if os.path.dirname(os.path.abspath(origin)) == os.path.abspath(folder):
                del sys.modules[key]
    return mod
