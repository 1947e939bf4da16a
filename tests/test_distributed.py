"""fastlapsum.distributed on the CPU: gloo, WORLD spawned processes (docs/DISTRIBUTED.md).

The processes are spawned once for the module; each runs every check below on its
slice of rows that every rank builds from the same seed, and records pass or the
error per check. A check compares the sharded ops with the single-process ops on the
concatenated row: soft ops to the float tolerance, the hard top-k exactly. The process
group has a timeout, so a rank stuck in a collective raises instead of hanging.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

import fastlapsum

from conftest import BUDGET_TOL, gen

WORLD = 3
TIMEOUT_S = 30
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


# ---- helpers (run inside the workers) -------------------------------------------------

def _rank():
    return dist.get_rank()


def _sizes(n: int, how: str, world: int = WORLD) -> list:
    """Ragged local lengths summing to n: 'ragged' (one empty rank), 'one' (all on the
    middle rank), 'even'."""
    if how == "one":
        return [0] * (world // 2) + [n] + [0] * (world - world // 2 - 1)
    if how == "even":
        return [n // world + (r < n % world) for r in range(world)]
    cut = [0, n // 5, n // 5, n][: world + 1] if world == 3 else None
    if cut is None:
        return _sizes(n, "even", world)
    return [cut[r + 1] - cut[r] for r in range(world)]  # [n/5, 0, n - n/5]


def _local(xg: torch.Tensor, sizes: list, dim: int = -1, rank=None) -> torch.Tensor:
    r = _rank() if rank is None else rank
    return xg.narrow(dim, sum(sizes[:r]), sizes[r])


def _rows(R: int, n: int, seed: int, dtype=torch.float64, kind="normal") -> torch.Tensor:
    g = gen(seed)
    x = torch.randn(R, n, generator=g, dtype=torch.float64)
    if kind == "ties":
        x = torch.round(x * 2)
    return x.to(dtype)


def _close(a, b, atol, rtol=0.0, what=""):
    a, b = a.double(), b.double()
    same_nan = torch.isnan(a) == torch.isnan(b)
    assert bool(same_nan.all()), f"{what}: NaN pattern differs"
    a, b = a.nan_to_num(0.0, posinf=1e308, neginf=-1e308), b.nan_to_num(0.0, posinf=1e308, neginf=-1e308)
    err = (a - b).abs() - rtol * b.abs()
    assert float(err.max()) <= atol if err.numel() else True, f"{what}: max error {float(err.max())} > {atol}"


def _all_equal_across_ranks(v: torch.Tensor, what: str):
    out = [torch.empty_like(v) for _ in range(dist.get_world_size())]
    dist.all_gather(out, v.contiguous())
    for o in out:
        assert torch.equal(o.view(torch.uint8) if o.is_floating_point() else o,
                           v.view(torch.uint8) if v.is_floating_point() else v), f"{what}: differs across ranks"


def _total(v: torch.Tensor) -> torch.Tensor:
    v = v.double().clone()
    dist.all_reduce(v)
    return v


# ---- checks ---------------------------------------------------------------------------

def _soft_case(xg, k, t, sizes, *, dtype, largest=True, log=False, tol=None, group=None, dim=-1, budget=True):
    """The sharded soft mask, threshold and budget against the single-process ops."""
    import fastlapsum.distributed as fd

    x = _local(xg, sizes, dim)
    fn, ref = (fd.log_soft_topk, fastlapsum.log_soft_topk) if log else (fd.soft_topk, fastlapsum.soft_topk)
    p = fn(x, k, t, dim=dim, largest=largest, group=group)
    pg = ref(xg, k, t, dim=dim, largest=largest)
    tol = tol if tol is not None else (1e-11 if dtype == torch.float64 else 3e-6)
    _close(p, _local(pg, sizes, dim), tol, rtol=1e-9 if log else 0.0, what="mask")
    b = fd.lapsum_threshold(x, k, t, dim=dim, largest=largest, group=group)
    bg = fastlapsum.lapsum_threshold(xg, k, t, dim=dim, largest=largest)
    tt = torch.as_tensor(t, dtype=torch.float64)
    ulps = 8 * torch.finfo(torch.float64).eps * bg.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0) / tt
    err = ((b - bg).where(torch.isfinite(bg), 0.0) / tt).abs() - ulps  # b is held to a few ulps of itself
    _close(err.clamp(min=0), torch.zeros_like(b), 1e-6 if dtype != torch.float64 else 1e-9,
           what="threshold (units of t)")
    assert bool((torch.isinf(b) == torch.isinf(bg)).all()), "threshold: infinities differ"
    _all_equal_across_ranks(b, "threshold")
    if budget and not log:
        s = _total(p.double().sum(dim)) if group is None else None
        if s is not None:
            kk = torch.as_tensor(k, dtype=torch.float64).broadcast_to(s.shape)
            ok = ~torch.isnan(s)
            bound = BUDGET_TOL[dtype]
            err = torch.where(ok, (s - kk).abs() / kk.clamp(min=1), 0.0)
            assert float(err.max()) <= bound, f"budget error {float(err.max())}"


def check_soft_fp64():
    xg = _rows(4, 37, 1)
    k = torch.tensor([1.0, 5.5, 18.0, 36.25])
    for t in (1.0, 0.05, 30.0):
        for how in ("ragged", "one", "even"):
            _soft_case(xg, k, t, _sizes(37, how), dtype=torch.float64)
    _soft_case(xg, k, 0.3, _sizes(37, "ragged"), dtype=torch.float64, largest=False)
    _soft_case(xg, 3.0, 0.3, _sizes(37, "ragged"), dtype=torch.float64, log=True)


def check_soft_fp32_and_dim():
    xg = _rows(3, 41, 2, dtype=torch.float32)
    _soft_case(xg, torch.tensor([2.0, 7.5, 40.0]), 0.5, _sizes(41, "ragged"), dtype=torch.float32)
    x3 = _rows(2, 3 * 23, 3).reshape(2, 23, 3).float()  # the row along dim 1
    _soft_case(x3, 4.0, 0.7, _sizes(23, "ragged"), dtype=torch.float32, dim=1)


def check_soft_long_rows():
    """Local rows longer than the proposals per round: several narrowing rounds."""
    xg = _rows(2, 3000, 4)
    _soft_case(xg, torch.tensor([17.0, 2500.5]), 0.01, _sizes(3000, "ragged"), dtype=torch.float64)
    from fastlapsum.distributed import radix

    chunk, radix.CHUNK = radix.CHUNK, 256  # the histogram in several pieces
    try:
        xt = _rows(2, 3000, 5, kind="ties")
        _soft_case(xt, torch.tensor([100.0, 1499.0]), 0.2, _sizes(3000, "even"), dtype=torch.float64)
    finally:
        radix.CHUNK = chunk
    # scores that share their leading key digits: every radix round descends. |b| >> t: the
    # budget holds only to W·ulp(b) (DESIGN §1.2), for the single-process op as well
    xc = 1.0 + 1e-12 * _rows(2, 300, 20)
    for t in (1e-13, 1e-10):
        _soft_case(xc, torch.tensor([7.0, 150.5]), t, _sizes(300, "ragged"), dtype=torch.float64, budget=False)


def check_soft_adversarial():
    inf, nan = math.inf, math.nan
    rows = torch.tensor([
        [0.5] * 12,  # constant row
        [inf, inf, 1.0, 2.0, -inf, 3.0, 0.0, -inf, 5.0, 1.0, 2.0, 2.0],
        [inf, inf, 1.0, 2.0, -inf, 3.0, 0.0, -inf, 5.0, 1.0, 2.0, 2.0],
        [inf, inf, 1.0, 2.0, -inf, 3.0, 0.0, -inf, 5.0, 1.0, 2.0, 2.0],
        [1.0, nan, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0],  # NaN row
        [1e300, -1e300, 0.0, 1.0, 2.0, 1e-300, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],  # huge spread
        [-inf] * 12,
        [3.0, 3.0, 3.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0],
    ], dtype=torch.float64)
    k = torch.tensor([4.0, 1.5, 7.0, 11.0, 3.0, 6.0, 5.0, 4.5])  # +inf use up / solve / need -inf
    for how in ("ragged", "one", "even"):
        for t in (1.0, 1e-3, 1e4):
            _soft_case(rows, k, t, _sizes(12, how), dtype=torch.float64)
    for kk in (0.0, 12.0):
        _soft_case(rows, kk, 0.5, _sizes(12, "ragged"), dtype=torch.float64)
    _soft_case(rows.float(), k, 0.5, _sizes(12, "ragged"), dtype=torch.float32)


def check_soft_low_precision():
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
        xg = _rows(2, 33, 18).to(dtype)
        _soft_case(xg, torch.tensor([3.0, 20.5]), 0.5, _sizes(33, "ragged"), dtype=dtype, tol=tol)


def check_collectives_bounded():
    """A fixed number of all-gathers per call, whatever n: describe, head and one per radix
    round (at most 4 for fp32 scores, 8 for fp64) in the forward; one in the backward;
    describe and two for topk."""
    import fastlapsum.distributed as fd
    from fastlapsum.distributed import _comm

    calls = []
    real = _comm._all_gather_single
    _comm._all_gather_single = lambda *a, **kw: (calls.append(1), real(*a, **kw))[1]
    try:
        for n in (30, 3000, 30000):
            for dtype, rounds in ((torch.float32, 4), (torch.float64, 8)):
                x = _local(_rows(2, n, 19, dtype=dtype), _sizes(n, "ragged")).requires_grad_(True)
                calls.clear()
                p = fd.soft_topk(x, 7.0, 0.1)
                assert len(calls) <= 2 + rounds, f"n={n}: {len(calls)} all-gathers in the forward"
                calls.clear()
                p.sum().backward()
                assert len(calls) == 1, f"{len(calls)} all-gathers in the backward"
                calls.clear()
                fd.topk(x.detach(), 5)
                assert len(calls) == 3, f"{len(calls)} all-gathers in topk"
    finally:
        _comm._all_gather_single = real


def check_soft_hard():
    import fastlapsum.distributed as fd

    xg = _rows(3, 29, 6, kind="ties")
    xg[1, 3] = math.nan
    k = torch.tensor([3.0, 5.0, 29.0])
    for how in ("ragged", "one"):
        sizes = _sizes(29, how)
        p = fd.soft_topk(_local(xg, sizes), k, 0.5, hard=True)
        pg = fastlapsum.soft_topk(xg, k, 0.5, hard=True)
        _close(p, _local(pg, sizes), 0.0, what="hard mask")


def _grad_case(xg, k, t, sizes, *, largest, mode):
    import fastlapsum.distributed as fd

    g = torch.randn(xg.shape, generator=gen(7), dtype=torch.float64)
    gb = torch.randn(xg.shape[:-1], generator=gen(8), dtype=torch.float64)
    outs = []
    for sharded in (True, False):
        x = (_local(xg, sizes) if sharded else xg).clone().requires_grad_(True)
        kk = k.clone().requires_grad_(True)
        tt = torch.tensor(t, dtype=torch.float64, requires_grad=True)
        ops = fd if sharded else fastlapsum
        if mode == "threshold":
            loss = (ops.lapsum_threshold(x, kk, tt, largest=largest) * gb).sum()
        else:
            kw = {"hard": True} if mode == "hard" else {}
            fn = ops.log_soft_topk if mode == "log" else ops.soft_topk
            y = fn(x, kk, tt, largest=largest, **kw)
            loss = (y * (_local(g, sizes) if sharded else g)).nan_to_num(0.0).sum()
        loss.backward()
        outs.append((x.grad, kk.grad, tt.grad))
    (gx, gk, gt), (rx, rk, rt) = outs
    _close(gx, _local(rx, sizes), 1e-9, rtol=1e-8, what=f"{mode} dx")
    _close(gk, rk, 1e-9, rtol=1e-8, what=f"{mode} dk")
    _close(gt, rt, 1e-9, rtol=1e-8, what=f"{mode} dt")


def check_gradients():
    xg = _rows(3, 31, 9)
    xg[2, 4] = math.inf
    k = torch.tensor([2.0, 10.5, 20.0], dtype=torch.float64)
    for mode in ("soft", "log", "threshold"):
        for how, largest in (("ragged", True), ("one", False), ("even", True)):
            _grad_case(xg, k, 0.4, _sizes(31, how), largest=largest, mode=mode)
    _grad_case(xg, torch.tensor([2.0, 10.0, 20.0], dtype=torch.float64), 0.4, _sizes(31, "ragged"),
               largest=True, mode="hard")  # straight-through: the soft mask's gradient
    sat = _rows(2, 31, 10) * 1e4  # saturated: every weight underflows relative to t
    _grad_case(sat, torch.tensor([3.0, 7.0], dtype=torch.float64), 1e-2, _sizes(31, "ragged"),
               largest=True, mode="soft")
    _grad_case(sat, torch.tensor([3.0, 7.0], dtype=torch.float64), 1e-2, _sizes(31, "ragged"),
               largest=True, mode="threshold")


def _topk_case(xg, k, sizes, *, largest, group=None):
    import fastlapsum.distributed as fd

    v, i = fd.topk(_local(xg, sizes), k, largest=largest, group=group)
    rv, ri = fastlapsum.topk(xg, k, largest=largest, sorted=True)
    assert torch.equal(i, ri), f"topk indices differ: {i.tolist()} vs {ri.tolist()}"
    assert torch.equal(v.isnan(), rv.isnan()) and torch.equal(v[~v.isnan()], rv[~rv.isnan()]), "topk values"


def check_topk():
    inf, nan = math.inf, math.nan
    xg = _rows(4, 40, 11, kind="ties")
    xg[0, [3, 17, 30]] = nan
    xg[1, [0, 5, 39]] = inf
    xg[2, [2, 9]] = -inf
    xg[3, [1, 6, 8, 20]] = torch.tensor([-0.0, 0.0, -0.0, 0.0], dtype=torch.float64)
    for how in ("ragged", "one", "even"):
        for largest in (True, False):
            for k in (0, 1, 7, 20, 39, 40):
                _topk_case(xg, k, _sizes(40, how), largest=largest)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        _topk_case(xg.to(dtype), 9, _sizes(40, "ragged"), largest=True)
    ints = (xg.nan_to_num(0.0, posinf=50, neginf=-50) * 3).to(torch.int64)
    for dtype in (torch.int64, torch.int32, torch.int8, torch.uint8):
        _topk_case(ints.clamp(0, 127).to(dtype) if dtype == torch.uint8 else ints.to(dtype), 11,
                   _sizes(40, "ragged"), largest=False)
    _topk_case(xg > 0, 5, _sizes(40, "ragged"), largest=True)


def check_topk_gradient():
    import fastlapsum.distributed as fd

    xg = _rows(2, 30, 12)
    sizes = _sizes(30, "ragged")
    x = _local(xg, sizes).clone().requires_grad_(True)
    w = torch.randn(2, 6, generator=gen(13), dtype=torch.float64)
    (fd.topk(x, 6).values * w).sum().backward()
    xr = xg.clone().requires_grad_(True)
    (fastlapsum.topk(xr, 6, sorted=True).values * w).sum().backward()
    _close(x.grad, _local(xr.grad, sizes), 0.0, what="topk grad")


def check_bad_input():
    import fastlapsum.distributed as fd

    xg = _rows(2, 10, 14)
    x = _local(xg, _sizes(10, "ragged"))
    for call in (lambda: fd.soft_topk(x, 10.5, 1.0), lambda: fd.topk(x, 11),
                 lambda: fd.soft_topk(x, 1.0 + _rank(), 1.0),  # k differs across ranks
                 lambda: fd.soft_topk(x, 2.0, 1.0 if _rank() != 1 else -1.0),  # rejected on rank 1 only
                 lambda: fd.topk(x, 2 if _rank() else "2"),
                 lambda: fd.soft_topk(x if _rank() else x.float(), 2.0)):  # dtype differs
        with pytest.raises((ValueError, TypeError)):
            call()
    with pytest.raises(TypeError):
        fd.soft_topk(x.long(), 2.0)  # the same on every rank: no collective is needed to agree


def check_groups():
    """A group of 1 (the whole row on one rank) and a group of 2 ranks out of WORLD."""
    singles = [dist.new_group([r]) for r in range(WORLD)]
    pair = dist.new_group([0, 2])
    xg = _rows(2, 25, 15)
    k = torch.tensor([3.0, 12.5])
    me = singles[_rank()]
    import fastlapsum.distributed as fd

    p = fd.soft_topk(xg, k, 0.5, group=me)
    _close(p, fastlapsum.soft_topk(xg, k, 0.5), 1e-11, what="group of 1")
    v, i = fd.topk(xg, 6, group=me)
    assert torch.equal(i, fastlapsum.topk(xg, 6, sorted=True).indices)
    if _rank() in (0, 2):
        sizes = [9, 16]
        x = _local(xg, sizes, rank=[0, 2].index(_rank()))
        p = fd.soft_topk(x, k, 0.5, group=pair)
        _close(p, _local(fastlapsum.soft_topk(xg, k, 0.5), sizes, rank=[0, 2].index(_rank())), 1e-11,
               what="group of 2")
        v, i = fd.topk(x, 6, group=pair)
        assert torch.equal(i, fastlapsum.topk(xg, 6, sorted=True).indices)


def check_dtensor():
    import fastlapsum.distributed as fd
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    xg = _rows(3, 20, 16)  # 20 over 3 ranks: uneven shards (7, 7, 6)
    k = torch.tensor([2.0, 9.5, 15.0], dtype=torch.float64)
    xd = distribute_tensor(xg, mesh, [Shard(1)]).detach().requires_grad_(True)
    p = fd.soft_topk(xd, k, 0.5)
    assert p.placements == (Shard(1),)
    _close(p.full_tensor(), fastlapsum.soft_topk(xg, k, 0.5), 1e-11, what="dtensor mask")
    g = torch.randn(3, 20, generator=gen(17), dtype=torch.float64)
    (p * distribute_tensor(g, mesh, [Shard(1)])).sum().backward()
    xr = xg.clone().requires_grad_(True)
    (fastlapsum.soft_topk(xr, k, 0.5) * g).sum().backward()
    _close(xd.grad.full_tensor(), xr.grad, 1e-9, rtol=1e-8, what="dtensor grad")
    b = fd.lapsum_threshold(distribute_tensor(xg, mesh, [Shard(1)]), k, 0.5)
    assert b.placements == (Replicate(),)
    _close(b.to_local(), fastlapsum.lapsum_threshold(xg, k, 0.5), 1e-9, what="dtensor threshold")
    v, i = fd.topk(distribute_tensor(xg.t().contiguous(), mesh, [Shard(0)]), 4, dim=0)
    assert torch.equal(i.to_local(), fastlapsum.topk(xg.t(), 4, dim=0, sorted=True).indices)


CHECKS = {name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}


# ---- the workers and the tests --------------------------------------------------------

def _worker(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    results = {}
    try:
        for name, fn in CHECKS.items():
            try:
                fn()
                results[name] = "ok"
            except Exception:  # recorded; the tests report it
                results[name] = traceback.format_exc()
            ok = torch.tensor([results[name] == "ok"], dtype=torch.int64)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # keeps the ranks in step
    finally:
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(WORLD, tmp), nprocs=WORLD, start_method="spawn", join=True)
        out = []
        for r in range(WORLD):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
    return out


@pytest.mark.parametrize("name", list(CHECKS))
def test_distributed(results, name):
    failures = [f"rank {r}:\n{res.get(name, 'not run')}" for r, res in enumerate(results) if res.get(name) != "ok"]
    assert not failures, "\n".join(failures)


def test_needs_init():
    import fastlapsum.distributed as fd

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.soft_topk(torch.randn(2, 5), 1.0)
