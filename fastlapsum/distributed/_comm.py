"""Collectives of the sharded ops (docs/DISTRIBUTED.md): every exchange is an all-gather
of a small per-rank tensor, and every rank folds the gathered parts in rank order, so
every rank computes the same bits from the same inputs whatever the backend's reduction
order."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist


# newer torch names it all_gather_single, older releases all_gather_into_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Shard(NamedTuple):
    """Where this rank's slice sits in the concatenated row."""

    group: Optional[dist.ProcessGroup]
    world: int
    rank: int
    offset: int  # global index of the local slice's first element
    n: int  # length of the concatenated row
    sizes: tuple  # local length on every rank, in rank order


def gather(t: torch.Tensor, shard_or_group) -> torch.Tensor:
    """all_gather of a tensor of the same shape on every rank -> [world, *t.shape]."""
    group = shard_or_group.group if isinstance(shard_or_group, Shard) else shard_or_group
    world = dist.get_world_size(group)
    t = t.contiguous()
    out = torch.empty(world * t.numel(), dtype=t.dtype, device=t.device)
    _all_gather_single(out, t.reshape(-1), group=group)
    return out.view(world, *t.shape)


def fold_sum(parts: torch.Tensor) -> torch.Tensor:
    """Sum over the leading (rank) dim in rank order: the same bits on every rank."""
    acc = parts[0].clone()
    for r in range(1, parts.shape[0]):
        acc += parts[r]
    return acc


def exchange(t: torch.Tensor, shard: "Shard") -> torch.Tensor:
    """gather() through the backend's device, the result back on t's device."""
    return gather(t.to(comm_device(t, shard.group)), shard).to(t.device)


def comm_device(x: torch.Tensor, group) -> torch.device:
    """Where the exchanged tensors live: NCCL moves CUDA tensors only, gloo CPU ones."""
    backend = dist.get_backend(group)
    if backend == "nccl" or (x.is_cuda and backend != "gloo"):
        return torch.device("cuda", torch.cuda.current_device()) if not x.is_cuda else x.device
    return torch.device("cpu")


def describe(x, dim: int, group, what: str, flags: int = 0, err: Optional[BaseException] = None) -> Shard:
    """One all-gather of (ndim, dim, rows, local length, dtype, flags, error): checks that
    the ranks agree on everything but the local length, and returns this rank's place in
    the row. A rank that rejected its own arguments (err) re-raises its error and every
    other rank raises a ValueError naming it, so no rank waits in a later collective."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialised (init_process_group first)")
    ok = err is None
    rows = 1
    if ok:
        for i, s in enumerate(x.shape):
            if i != dim:
                rows *= s
        meta = [x.dim(), dim, rows, x.shape[dim], _DTYPE_CODES.get(x.dtype, -1), flags, 0]
        dev = comm_device(x, group)
    else:
        meta = [0, 0, 0, 0, 0, 0, 1]
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
            else torch.device("cpu")
    allm = gather(torch.tensor(meta, dtype=torch.int64, device=dev), group).cpu()
    world, rank = allm.shape[0], dist.get_rank(group)
    failed = [r for r in range(world) if int(allm[r, 6])]
    if failed:
        if not ok:
            raise err
        raise ValueError(f"{what}: rank(s) {failed} of the group rejected their arguments")
    for col, name in ((0, "x.dim()"), (1, "dim"), (2, "the size of x without dim"), (4, "x.dtype"),
                      (5, "the flags (largest, hard, k of topk)")):
        if not bool((allm[:, col] == allm[0, col]).all()):
            raise ValueError(f"{what}: {name} differs across ranks: {allm[:, col].tolist()}")
    sizes = tuple(int(v) for v in allm[:, 3])
    return Shard(group, world, rank, sum(sizes[:rank]), sum(sizes), sizes)


_DTYPE_CODES = {dt: i for i, dt in enumerate((
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool))}
