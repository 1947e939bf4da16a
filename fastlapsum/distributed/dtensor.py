"""DTensor inputs of the sharded ops (docs/DISTRIBUTED.md §DTensor).

A DTensor whose selection dim is sharded (Shard(dim)) on one mesh dimension runs the
op on its local shard over that mesh dimension's process group; other mesh dimensions
may replicate x or shard other dims (their rows are independent). Outputs are DTensors:
the mask keeps x's placements; b and topk's (values, indices) are replicated on the
sharding mesh dimension. to_local / from_local carry the gradients.
"""
from __future__ import annotations

from typing import Callable

import torch


def _dtensor_types():
    try:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    except ImportError:  # torch built without distributed
        return None
    return DTensor, Partial, Replicate, Shard


def is_dtensor(x) -> bool:
    t = _dtensor_types()
    return t is not None and isinstance(x, t[0])


def local_arg(v, name: str, what: str):
    """k or temperature: a DTensor must be replicated; its local tensor is the value."""
    if not is_dtensor(v):
        return v
    _, _, Replicate, _ = _dtensor_types()
    if not all(isinstance(p, Replicate) for p in v.placements):
        raise ValueError(f"{what}: a DTensor {name} must be replicated on every mesh dimension, "
                         f"got {v.placements}")
    return v.to_local()


def _contiguous_stride(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def call_sharded(x, dim, what: str, fn: Callable, kind: str):
    """Run fn(local x, dim, group) for a DTensor x sharded on dim and wrap its result.
    kind: "slice" (same shape and placements as x), "reduced" (x without dim),
    "topk" ((values, indices) with dim of size k)."""
    DTensor, Partial, Replicate, Shard = _dtensor_types()
    nd = x.dim()
    if not isinstance(dim, int) or isinstance(dim, bool) or not -max(nd, 1) <= dim < max(nd, 1):
        raise IndexError(f"{what}: dim {dim} out of range for a {nd}-d DTensor")
    d = dim % max(nd, 1)
    mesh, placements = x.device_mesh, tuple(x.placements)
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"{what}: x has a Partial placement; redistribute it first")
    on_dim = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d]
    if len(on_dim) != 1:
        raise ValueError(f"{what}: a DTensor x must be sharded on dim {d} (Shard({d})) on exactly one mesh "
                         f"dimension, got placements {placements}; call fastlapsum.{what} on a replicated row")
    mdim = on_dim[0]
    group = mesh.get_group(mdim)
    if mesh.get_local_rank(mdim) != torch.distributed.get_rank(group):
        raise NotImplementedError(f"{what}: the mesh orders the ranks of mesh dim {mdim} differently from "
                                  "its process group")
    out = fn(x.to_local(), d, group)
    shape = tuple(x.shape)
    if kind == "slice":
        return DTensor.from_local(out, mesh, placements, run_check=False, shape=shape,
                                  stride=_contiguous_stride(shape))
    if kind == "reduced":
        new_shape = shape[:d] + shape[d + 1:]
        new_pl = tuple(Replicate() if i == mdim else
                       (Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > d else p)
                       for i, p in enumerate(placements))
        return DTensor.from_local(out, mesh, new_pl, run_check=False, shape=new_shape,
                                  stride=_contiguous_stride(new_shape))
    k = out.values.shape[d] if out.values.dim() else 0
    new_shape = shape[:d] + (k,) + shape[d + 1:]
    new_pl = tuple(Replicate() if i == mdim else p for i, p in enumerate(placements))
    wrap = [DTensor.from_local(v, mesh, new_pl, run_check=False, shape=new_shape,
                               stride=_contiguous_stride(new_shape)) for v in out]
    return torch.return_types.topk((wrap[0], wrap[1]))

