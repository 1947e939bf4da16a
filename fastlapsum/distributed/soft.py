"""The LapSum threshold of a row sharded across ranks (docs/DISTRIBUTED.md §Soft).

b solves Ψ(b) = Σ_i F((s_i - b)/t) = k over the concatenated row. Each rank sorts its
finite scores once; its part of Ψ at any point c (the count above c and the exponential
sums on each side, DESIGN §1.1) then costs a binary search. The solve narrows a bracket
[lo, hi] around b in rounds: every rank proposes q = max(16, 256 / world) of its scores
strictly inside the bracket, evenly spaced in its own order; Ψ is evaluated at all
proposals (all-gathered parts); the bracket shrinks to the two proposals around b. Each
round divides every rank's count inside the bracket by q + 1, so after
⌈log_{q+1} max local n⌉ rounds no score lies strictly inside, and the root is the closed
form of `reference.solve_interval` from three sums over the row, each rank's summed
exactly in one pass. Every rank folds the gathered parts in rank order: b is
bit-identical on every rank.
"""
from __future__ import annotations

import math

import torch

from .._ops import MODE_HARD, MODE_LOG, ops
from ..reference import solve_interval
from . import _comm
from ._comm import Shard
from ._vjp import local_sums, mask_grads, row_sums, terms, threshold_grads
from .hard import hard_mask

F64 = torch.float64
Q_TOTAL, Q_MIN = 256, 16  # proposals per row and round: Q_TOTAL over the ranks, >= Q_MIN each
Q_EXACT = 4  # per rank, where Ψ is summed exactly (O(n) per proposal)
MAX_ROUNDS = 24  # Q_MIN = 16: enough for 2^98 scores per rank


class _Sorted:
    """One rank's finite scores of each row (selected side, float64), ascending with +inf
    padding after the m finite ones, and their scans:
    la[i] = log Σ_{j>=i} e^{(a_i - a_j)/t},  lb[i] = log Σ_{j<=i} e^{(a_j - a_i)/t}."""

    def __init__(self, x_rows: torch.Tensor, sign: float, t: torch.Tensor):
        R, n = x_rows.shape
        s = x_rows.to(F64) * sign
        fin = torch.isfinite(s)
        self.m = fin.sum(1)
        self.n, self.t = n, t
        self.asc = torch.where(fin, s, math.inf).sort(dim=1).values
        del s, fin
        if n == 0:
            return
        valid = self.valid()
        ninf = torch.tensor(-math.inf, dtype=F64, device=x_rows.device)
        tc = t[:, None]
        top = self.asc.gather(1, (self.m - 1).clamp(min=0)[:, None])
        z = torch.where(valid, (self.asc - top) / tc, 0.0)  # <= 0
        self.la = torch.where(valid, -z, ninf).flip(1).logcumsumexp(1).flip(1).add_(z)
        z = torch.where(valid, (self.asc - self.asc[:, :1]) / tc, 0.0)  # >= 0
        self.lb = torch.where(valid, z, ninf).logcumsumexp(1).sub_(z)

    def valid(self) -> torch.Tensor:
        return torch.arange(self.n, device=self.asc.device)[None, :] < self.m[:, None]

    def counts(self, c: torch.Tensor):
        """(#{s <= c}, #{s < c}) per point of c [R, C] (int64), over the finite scores."""
        if self.n == 0:
            z = torch.zeros(c.shape, dtype=torch.int64, device=c.device)
            return z, z
        c = c.contiguous()
        m = self.m[:, None]
        return (torch.searchsorted(self.asc, c, side="right").clamp(max=m),
                torch.searchsorted(self.asc, c, side="left").clamp(max=m))

    def psi(self, c: torch.Tensor) -> torch.Tensor:
        """This rank's Ψ(c) = #{s > c} - ½ Σ_{s>c} e^{(c-s)/t} + ½ Σ_{s<=c} e^{(s-c)/t}
        at each point of c [R, C], from the scans (to ~eps·(score span)/t)."""
        le = self.counts(c)[0]
        m = self.m[:, None]
        if self.n == 0:
            return (m - le).to(F64)
        t = self.t[:, None]
        ia = le.clamp(max=self.n - 1)
        ib = (le - 1).clamp(min=0)
        A = torch.exp(self.la.gather(1, ia) + (c - self.asc.gather(1, ia)) / t)
        B = torch.exp(self.lb.gather(1, ib) + (self.asc.gather(1, ib) - c) / t)
        return (m - le) - 0.5 * torch.where(le < m, A, 0.0) + 0.5 * torch.where(le > 0, B, 0.0)

    def sums(self, c: torch.Tensor, ref_above: torch.Tensor, ref_below: torch.Tensor) -> torch.Tensor:
        """Exact in one pass, per point c [R, C]: (#{s > c}, Σ_{s>c} e^{(ra-s)/t},
        Σ_{s<=c} e^{(s-rb)/t}) -> [R, C, 3], for references ra <= every score above c and
        rb >= every score at or below it."""
        R, C = c.shape
        out = torch.zeros((R, C, 3), dtype=F64, device=c.device)
        if self.n == 0:
            return out
        valid = self.valid()
        t = self.t[:, None]
        for j in range(C):
            cj, ra, rb = c[:, j:j + 1], ref_above[:, j:j + 1], ref_below[:, j:j + 1]
            above = valid & (self.asc > cj)
            below = valid & ~above
            out[:, j, 0] = above.sum(1)
            out[:, j, 1] = torch.where(above, torch.exp(((ra - self.asc) / t).clamp(max=0)), 0.0).sum(1)
            out[:, j, 2] = torch.where(below, torch.exp(((self.asc - rb) / t).clamp(max=0)), 0.0).sum(1)
        return out

    def psi_exact(self, c: torch.Tensor) -> torch.Tensor:
        """psi() summed directly: exact to rounding whatever the scores' span."""
        st = self.sums(c, c, c)
        return st[..., 0] - 0.5 * st[..., 1] + 0.5 * st[..., 2]

    def proposals(self, lo, hi, active, q: int) -> torch.Tensor:
        """[R, q + 1]: the count of this rank's scores strictly inside (lo, hi), then up
        to q of them evenly spaced in its order (all of them when they are at most q),
        NaN filling."""
        R = lo.shape[0]
        if self.n == 0:
            out = torch.full((R, q + 1), math.nan, dtype=F64, device=lo.device)
            out[:, 0] = 0
            return out
        start = self.counts(lo[:, None])[0][:, 0]
        end = self.counts(hi[:, None])[1][:, 0]
        n_in = torch.where(active, end - start, 0).clamp(min=0)[:, None]
        i = torch.arange(q, device=lo.device)[None, :]
        few = n_in <= q
        pos = start[:, None] + torch.where(few, i, ((i + 1) * n_in) // (q + 1))
        got = self.asc.gather(1, pos.clamp(0, self.n - 1))
        return torch.cat([n_in.to(F64), torch.where(i < n_in, got, torch.full_like(got, math.nan))], 1)


def _exchange(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    dev = t.device
    return _comm.gather(t.to(_comm.comm_device(t, shard.group)), shard).to(dev)


def solve(x_rows: torch.Tensor, k: torch.Tensor, t: torch.Tensor, largest: bool, shard: Shard, what: str):
    """b (x's units, float64 [R]) and the edge mass of each row of the sharded row
    (DESIGN §8's rules over the concatenated row), identical on every rank."""
    sign = 1.0 if largest else -1.0
    R = x_rows.shape[0]
    # 1. non-finite counts, k and t of every rank
    pinf, ninf = (x_rows == math.inf).sum(1).to(F64), (x_rows == -math.inf).sum(1).to(F64)
    head = torch.stack([pinf if largest else ninf, ninf if largest else pinf,
                        torch.isnan(x_rows).any(1).to(F64), k.detach(), t.detach()], 1)
    heads = _exchange(head, shard)
    for col, name in ((3, "k"), (4, "temperature")):
        same = (heads[:, :, col] == heads[0:1, :, col]) | (heads[:, :, col].isnan() & heads[0:1, :, col].isnan())
        if not bool(same.all()):
            raise ValueError(f"{what}: {name} differs across ranks (every rank must pass the same)")
    tot = _comm.fold_sum(heads)
    P, N, nan = tot[:, 0], tot[:, 1], tot[:, 2]
    n = float(shard.n)
    kk, tt = heads[0, :, 3], heads[0, :, 4]
    if R and bool((kk > n).any()):
        raise ValueError(f"{what}: k must be finite and >= 0 and <= n = {shard.n} (the concatenated row), "
                         f"got max {float(kk.max())}")
    kf = kk - P
    bad = (nan > 0) | ~(kk >= 0) | ~(kk <= n) | ~(tt > 0) | ~torch.isfinite(tt)
    upper = ~bad & (kk <= P)
    lower = ~bad & ~upper & (kk >= n - N)
    active = ~bad & ~upper & ~lower

    # 2. the bracket, narrowed until no score lies strictly inside; 3. the closed form.
    # The sorted scans evaluate Ψ to ~eps·(score span)/t; where that picked a bracket
    # without the root (scores ~1e300 apart), the exact sums of step 3 say so and those
    # rows are narrowed again with exactly summed Ψ (O(n) per proposal, few proposals).
    srt = _Sorted(x_rows, sign, tt)
    b_s, ok = _narrow_and_solve(srt, kf, tt, active, shard, what, exact=False)
    redo = active & ~ok
    if bool(redo.any()):
        b2, _ = _narrow_and_solve(srt, kf, tt, redo, shard, what, exact=True)
        b_s = torch.where(redo, b2, b_s)
    inf = torch.full_like(b_s, math.inf)
    b_s = torch.where(upper, inf, torch.where(lower, -inf, b_s))
    b_s = torch.where(bad, torch.full_like(b_s, math.nan), b_s)
    one = torch.ones_like(b_s)
    edge = torch.where(upper, torch.where(P > 0, kk / P.clamp(min=1), 0 * one), one)
    edge = torch.where(lower, torch.where(N > 0, (kk - (n - N)) / N.clamp(min=1), one), edge)
    edge = torch.where(bad, torch.full_like(edge, math.nan), edge)
    return b_s * sign, edge


def proposals_per_rank(world: int, exact: bool = False) -> int:
    """Scores each rank proposes per row and round: about 256 proposals in all."""
    return Q_EXACT if exact else max(Q_MIN, Q_TOTAL // world)


def _narrow_and_solve(srt: _Sorted, kf, t, active, shard: Shard, what: str, exact: bool):
    """The rounds of proposals, then the closed form. -> (b_s, the root lies in its
    bracket by the exact sums). A round is two all-gathers: the proposals with each
    rank's count inside the bracket (the loop ends when the row's count is 0), then Ψ
    at every proposal."""
    R = kf.shape[0]
    q = proposals_per_rank(shard.world, exact)
    lo = torch.full((R,), -math.inf, dtype=F64, device=kf.device)
    hi = torch.full((R,), math.inf, dtype=F64, device=kf.device)
    for _ in range(MAX_ROUNDS * (4 if exact else 1)):
        got = _exchange(srt.proposals(lo, hi, active, q), shard)  # [W, R, 1 + q]
        if not bool((_comm.fold_sum(got[:, :, 0]) > 0).any()):
            break
        cand = got[:, :, 1:].permute(1, 0, 2).reshape(R, -1)
        psi = _comm.fold_sum(_exchange(srt.psi_exact(cand) if exact else srt.psi(cand), shard))
        valid = ~torch.isnan(cand) & active[:, None]
        hi = torch.minimum(hi, torch.where(valid & (psi <= kf[:, None]), cand, math.inf).amin(1))
        ge = valid & (psi >= kf[:, None]) & (cand <= hi[:, None])
        lo = torch.maximum(lo, torch.where(ge, cand, -math.inf).amax(1))
    else:
        raise RuntimeError(f"{what}: the sharded solve did not converge")
    return _closed_form(srt, lo, hi, kf, t, active, shard)


def _closed_form(srt: _Sorted, lo, hi, kf, t, active, shard: Shard):
    """No score lies strictly inside (lo, hi): C = #{s > lo}, A = Σ_{s>lo} e^{(hi-s)/t},
    B = Σ_{s<=lo} e^{(s-lo)/t} over the row (one exact pass here, all-gathered), then the
    quadratic's root. -> (b_s, whether Ψ(hi) <= k <= Ψ(lo) by these sums)."""
    fin = lambda v: torch.where(torch.isfinite(v), v, 0.0)[:, None]  # noqa: E731  (no score there)
    part = srt.sums(lo[:, None], fin(hi), fin(lo))[:, 0]
    C, A, B = _comm.fold_sum(_exchange(part, shard)).unbind(1)
    with torch.no_grad():
        b = solve_interval(C, A, B, hi, lo, kf, t)
    # Ψ at the bracket's ends from the same sums: the root is inside iff Ψ(hi) <= kf <= Ψ(lo)
    gap = torch.exp(torch.where(torch.isfinite(hi - lo), (lo - hi) / t, -math.inf))
    psi_hi, psi_lo = C - 0.5 * A + 0.5 * B * gap, C - 0.5 * A * gap + 0.5 * B
    tol = 4 * torch.finfo(F64).eps * (C + A + B)
    ok = (psi_hi <= kf + tol) & (kf <= psi_lo + tol)
    b = torch.minimum(torch.maximum(b, lo), hi)
    return torch.where(active, b, torch.zeros_like(b)), ok


# ---- autograd: the forward solves once; the backward all-gathers the VJP sums --------

def _mask(x_rows, b, t, edge, largest: bool, mode: int, k, shard: Shard) -> torch.Tensor:
    if mode == MODE_HARD:
        p = hard_mask(x_rows, k, largest, shard)
        return torch.where(torch.isnan(b)[:, None], torch.full_like(p, math.nan), p)
    return ops.lapsum_mask(x_rows.contiguous(), b, t, edge, largest, mode == MODE_LOG)


class SoftFn(torch.autograd.Function):
    """(x_rows, k, t) -> this rank's slice of the mask (or log mask, or hard mask)."""

    @staticmethod
    def forward(ctx, x_rows, k, t, largest, mode, shard, what):
        b, edge = solve(x_rows, k, t, largest, shard, what)
        tt = t.detach()
        p = _mask(x_rows, b, tt, edge, largest, mode, k.detach(), shard)
        ctx.largest, ctx.log_mode, ctx.shard = largest, mode == MODE_LOG, shard
        ctx.save_for_backward(x_rows, b, tt)
        return p

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gp):
        x_rows, b, t = ctx.saved_tensors
        sign = 1.0 if ctx.largest else -1.0
        s, b_s = x_rows.to(F64) * sign, b * sign
        a, d, gw, ga = terms(s, b_s, t, gp, ctx.log_mode)
        S = row_sums(local_sums(a, d, gw, ga, t), t, ctx.shard)
        gs, gk, gt = mask_grads(S, a, d, gp, b_s, t, ctx.log_mode)
        return (gs * sign).to(x_rows.dtype), gk, gt, None, None, None, None


class ThresholdFn(torch.autograd.Function):
    """(x_rows, k, t) -> b (x's units), identical on every rank."""

    @staticmethod
    def forward(ctx, x_rows, k, t, largest, shard, what):
        b, _ = solve(x_rows, k, t, largest, shard, what)
        ctx.largest, ctx.shard = largest, shard
        ctx.save_for_backward(x_rows, b, t.detach())
        return b

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gb):
        x_rows, b, t = ctx.saved_tensors
        sign = 1.0 if ctx.largest else -1.0
        s, b_s = x_rows.to(F64) * sign, b * sign
        a, d, gw, ga = terms(s, b_s, t, None, False)
        S = row_sums(local_sums(a, d, gw, ga, t), t, ctx.shard)
        gs, gk, gt = threshold_grads(S, a, gb, b_s, t, sign)
        return (gs * sign).to(x_rows.dtype), gk, gt, None, None, None
