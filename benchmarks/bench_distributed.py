"""Sharded ops over NCCL (fastlapsum.distributed, docs/DISTRIBUTED.md): one process per GPU.

    torchrun --nproc-per-node=2 benchmarks/bench_distributed.py --out benchmarks/results/distributed_h200_x2.json
    python benchmarks/bench_distributed.py --nproc 2 --out ...      # the same, spawned here
    python benchmarks/bench_distributed.py --nproc 1 --quick        # world size 1 on one GPU

Cases (fp32 Gaussian scores; the row split evenly over the ranks, along the last dim):
  single   one row of n scores (--single, default 1e9 and 4e9), k = n/16, t = 1
  experts  expert choice: 256 experts x 2^18 tokens per rank, capacity k = 2048, t = 1
  vocab    vocabulary-parallel logits: 256 x 152064 split over the ranks, k = 50
Per case and op (soft = distributed.soft_topk forward; soft_fwd_bwd = with its backward;
topk = distributed.topk): `sharded_ms`, the op on the shards; `gather_op_ms`, the usual
workaround: all-gather the row onto every rank, then the single-GPU op on the whole row;
`single_ms`, the single-GPU op alone on the whole row (one GPU, where it fits). Times are
medians of eager CUDA-event times, the maximum over ranks. The all-gathers one call makes
and the bytes each rank sends are counted. Checked outside the timed region: the budget
summed over the ranks, b against the single-GPU op on the gathered row (in units of t), and
the hard selection (indices) equal to fastlapsum.topk on the gathered row. A measurement
that runs out of memory is recorded as "oom".
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

# NVLink multicast stays off (the device machines' rule; KINDS.md)
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v


DEV = "cuda"  # "cpu" with --cpu: gloo, a smoke run of this script without GPUs


def _once_ms(fn) -> float:
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _timed(fn, reps: int, warmup: int = 1) -> float:
    """Median of eager times over reps (after a barrier each), max over ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        times.append(_once_ms(fn))
    t = torch.tensor([statistics.median(times)], device=DEV)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed_local(fn, reps: int) -> float:
    fn()
    return statistics.median(_once_ms(fn) for _ in range(reps))


def _empty_cache() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()


def _oom_safe(fn):
    """fn() or "oom" on every rank if any rank ran out of memory."""
    try:
        out, bad = fn(), 0
    except torch.OutOfMemoryError:
        out, bad = "oom", 1
    _empty_cache()
    flag = torch.tensor([bad], device=DEV)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return "oom" if int(flag) else out


class _Counter:
    """Counts fastlapsum.distributed's all-gathers and the bytes this rank sends."""

    def __init__(self):
        from fastlapsum.distributed import _comm

        self.comm, self.real, self.calls, self.bytes = _comm, _comm._all_gather_single, 0, 0

    def __enter__(self):
        def counted(out, inp, *a, **kw):
            self.calls += 1
            self.bytes += inp.numel() * inp.element_size()
            return self.real(out, inp, *a, **kw)

        self.comm._all_gather_single = counted
        return self

    def __exit__(self, *exc):
        self.comm._all_gather_single = self.real


def _gather_rows(x_local: torch.Tensor) -> torch.Tensor:
    """The whole rows on every rank: all-gather the equal shards, concatenate along the last dim."""
    world = dist.get_world_size()
    from fastlapsum.distributed._comm import gather

    out = gather(x_local, None)  # [world, *x_local.shape]
    return out.movedim(0, -2).reshape(*x_local.shape[:-1], world * x_local.shape[-1])


def run_case(name: str, rows: int, n_local: int, k: int, ops, reps: int, single: bool) -> list:
    import fastlapsum
    import fastlapsum.distributed as fd

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device=DEV).manual_seed(1234 + rank)  # a different shard per rank
    x = torch.randn(rows, n_local, device=DEV, generator=g)
    n = n_local * world
    t = 1.0
    out = []
    for op in ops:
        rec = {"case": name, "op": op, "rows": rows, "n": n, "n_local": n_local, "k": k, "world": world}
        if op == "topk":
            sharded = lambda: fd.topk(x, k)  # noqa: E731
            whole = lambda xg: fastlapsum.topk(xg, k)  # noqa: E731
        elif op == "soft":
            sharded = lambda: fd.soft_topk(x, k, t)  # noqa: E731
            whole = lambda xg: fastlapsum.soft_topk(xg, k, t)  # noqa: E731
        else:  # soft_fwd_bwd
            xr = x.detach().requires_grad_(True)
            sharded = lambda: fd.soft_topk(xr, k, t).sum().backward()  # noqa: E731

            def whole(xg):
                xg = xg.detach().requires_grad_(True)
                fastlapsum.soft_topk(xg, k, t).sum().backward()
        with _Counter() as c:
            res = _oom_safe(sharded)
        rec["all_gathers"], rec["bytes_sent_per_rank"] = c.calls, c.bytes
        rec["sharded_ms"] = _oom_safe(lambda: _timed(sharded, reps))
        rec["gather_op_ms"] = _oom_safe(lambda: _timed(lambda: whole(_gather_rows(x)), reps))
        if single and rank == 0:
            xg = _oom_safe_local(lambda: torch.randn(rows, n, device=DEV))
            rec["single_ms"] = "oom" if xg is None else _oom_local(lambda: _timed_local(lambda: whole(xg), reps))
            del xg
            _empty_cache()
        if res != "oom" and op != "soft_fwd_bwd":
            chk = _oom_safe(lambda: _check(x, k, t, op, res))
            rec.update(chk if isinstance(chk, dict) else {"check": chk})
        dist.barrier()
        out.append(rec)
        if rank == 0:
            print(json.dumps(rec), flush=True)
    del x
    _empty_cache()
    return out


def _oom_safe_local(fn):
    try:
        return fn()
    except torch.OutOfMemoryError:
        return None


def _oom_local(fn):
    try:
        return fn()
    except torch.OutOfMemoryError:
        _empty_cache()
        return "oom"


def _check(x, k, t, op, res) -> dict:
    """Against the single-GPU op on the gathered row (on every rank)."""
    import fastlapsum
    import fastlapsum.distributed as fd

    xg = _gather_rows(x)
    if op == "topk":
        ref = fastlapsum.topk(xg, k, sorted=True)
        same = torch.equal(res.indices, ref.indices) and torch.equal(res.values, ref.values)
        flag = torch.tensor([int(same)], device=DEV)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return {"hard_equal": bool(int(flag))}
    total = res.double().sum(-1)
    dist.all_reduce(total)
    budget = float(((total - k).abs() / max(k, 1)).max())
    b = fd.lapsum_threshold(x, k, t)
    bg = fastlapsum.lapsum_threshold(xg, k, t)
    return {"budget_err": budget, "b_err_over_t": float(((b - bg).abs() / t).max())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="JSON results (written by rank 0)")
    ap.add_argument("--nproc", type=int, default=None, help="spawn this many processes (without torchrun)")
    ap.add_argument("--cases", default="single,experts,vocab")
    ap.add_argument("--single", default="1e9,4e9", help="row lengths of the single-row case")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small shapes: a smoke run of the NCCL path")
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU: a smoke run of this script")
    args = ap.parse_args(argv)
    if "RANK" in os.environ:
        _worker(int(os.environ["LOCAL_RANK"]), None, args)
        return
    import torch.multiprocessing as mp

    nproc = args.nproc or (2 if args.cpu else torch.cuda.device_count())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    mp.start_processes(_worker, args=(nproc, args), nprocs=nproc, start_method="spawn", join=True)


def _worker(local_rank: int, world, args) -> None:
    global DEV
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    kw = {} if world is None else {"rank": local_rank, "world_size": world}
    if args.cpu:
        DEV = "cpu"
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600), **kw)
    else:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600),
                                device_id=torch.device("cuda", local_rank), **kw)
    world = dist.get_world_size()
    cases = args.cases.split(",")
    results = []
    reps = 2 if args.quick else args.reps
    if "single" in cases:
        sizes = [2**16 if args.cpu else 2**24] if args.quick else [int(float(s)) for s in args.single.split(",")]
        for n in sizes:
            n -= n % world
            results += run_case("single", 1, n // world, n // 16, ["soft", "topk"], min(reps, 3), single=True)
    if "experts" in cases:
        rows, per_rank = (16, 2**12 if args.cpu else 2**14) if args.quick else (256, 2**18)
        results += run_case("experts", rows, per_rank, 2048, ["soft", "soft_fwd_bwd", "topk"], reps, single=True)
    if "vocab" in cases:
        rows = (2 if args.cpu else 16) if args.quick else 256
        results += run_case("vocab", rows, 152064 // world, 50, ["topk", "soft"], reps, single=True)
    if dist.get_rank() == 0 and args.out:
        meta = {"world": world, "device": "cpu (gloo)" if args.cpu else torch.cuda.get_device_name(),
                "torch": torch.__version__, "quick": args.quick,
                "nccl": None if args.cpu else ".".join(map(str, torch.cuda.nccl.version())),
                "time_unit": "ms (eager, median over reps, max over ranks)"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
