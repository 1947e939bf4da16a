"""The LapSum threshold of a row sharded across ranks (docs/DISTRIBUTED.md §Soft).

b solves Ψ(b) = Σ_i F((s_i - b)/t) = k over the concatenated row. Each rank sorts its
finite scores once; Ψ's three sums at any point c (the count above c and the exponential
sums on each side, DESIGN §1.1) then cost a binary search. The solve narrows a bracket
[lo, hi] around b in rounds: every rank proposes Q of its scores strictly inside the
bracket, evenly spaced in its own order; Ψ is evaluated at all proposals (all-gathered
sums); the bracket shrinks to the two proposals around b. Each round divides every rank's
count inside the bracket by Q + 1, so it ends with no score strictly inside after
⌈log_{Q+1} max local n⌉ + 1 rounds at most; there the root is the closed form of
`reference.solve_interval` from three all-gathered sums. Every rank folds the gathered
parts in rank order: b is bit-identical on every rank.
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
Q = 256  # scores each rank proposes per row and round
Q_EXACT = 4  # the same where Ψ is summed exactly (O(n) per proposal)
MAX_ROUNDS = 16  # Q = 256: enough for 2^112 scores per rank


class _Sorted:
    """One rank's finite scores of each row, descending, and their prefix / suffix scans:
    logA[j] = log Σ_{i<=j} e^{(s_j - s_i)/t},  logB[j] = log Σ_{i>=j} e^{(s_i - s_j)/t}."""

    def __init__(self, s: torch.Tensor, t: torch.Tensor):
        R, n = s.shape
        finite = torch.isfinite(s)
        self.m = finite.sum(1)
        self.n = n
        self.t = t
        srt = torch.where(finite, s, -math.inf).sort(1, descending=True).values
        self.srt = srt
        self.neg = (-srt).contiguous()  # ascending, +inf padding after the finite scores
        if n == 0:
            return
        valid = torch.arange(n, device=s.device)[None, :] < self.m[:, None]
        top = torch.where(self.m > 0, srt[:, 0], torch.zeros_like(t))
        z = torch.where(valid, (srt - top[:, None]) / t[:, None], torch.zeros_like(srt))
        ninf = torch.full_like(z, -math.inf)
        self.logA = z + torch.logcumsumexp(torch.where(valid, -z, ninf), 1)
        self.logB = -z + torch.logcumsumexp(torch.where(valid, z, ninf).flip(1), 1).flip(1)

    def counts(self, c: torch.Tensor):
        """(#{s > c}, #{s >= c}) per point of c [R, C] (int64)."""
        if self.n == 0:
            z = torch.zeros(c.shape, dtype=torch.int64, device=c.device)
            return z, z
        v = (-c).contiguous()
        m = self.m[:, None]
        gt = torch.searchsorted(self.neg, v, side="left").clamp(max=m)
        ge = torch.searchsorted(self.neg, v, side="right").clamp(max=m)
        return gt, ge

    def stats(self, c: torch.Tensor) -> torch.Tensor:
        """[R, C, 4]: #{s > c}, #{s >= c}, A = Σ_{s>c} e^{(c-s)/t}, B = Σ_{s<=c} e^{(s-c)/t}."""
        gt, ge = self.counts(c)
        out = torch.zeros((*c.shape, 4), dtype=F64, device=c.device)
        out[..., 0] = gt
        out[..., 1] = ge
        if self.n == 0:
            return out
        t = self.t[:, None]
        ia = (gt - 1).clamp(min=0)
        ib = gt.clamp(max=self.n - 1)
        ea = self.logA.gather(1, ia) + (c - self.srt.gather(1, ia)) / t
        eb = self.logB.gather(1, ib) + (self.srt.gather(1, ib) - c) / t
        out[..., 2] = torch.where(gt > 0, torch.exp(ea), 0.0)
        out[..., 3] = torch.where(gt < self.m[:, None], torch.exp(eb), 0.0)
        return out

    def stats_exact(self, s: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """stats() summed directly over the scores s [R, n] (unsorted), one proposal at
        a time: exact to rounding whatever the scores' span."""
        out = torch.zeros((*c.shape, 4), dtype=F64, device=c.device)
        fin = torch.isfinite(s)
        t = self.t[:, None]
        zero = torch.zeros_like(s)
        for j in range(c.shape[1]):
            cj = c[:, j:j + 1]
            gt, ge = fin & (s > cj), fin & (s >= cj)
            out[:, j, 0] = gt.sum(1)
            out[:, j, 1] = ge.sum(1)
            out[:, j, 2] = torch.where(gt, torch.exp((cj - s).clamp(max=0) / t), zero).sum(1)
            out[:, j, 3] = torch.where(fin & ~gt, torch.exp((s - cj).clamp(max=0) / t), zero).sum(1)
        return out

    def proposals(self, lo, hi, active, q: int) -> torch.Tensor:
        """[R, q]: up to q of this rank's scores strictly inside (lo, hi), evenly spaced in
        its order (all of them when they are at most q); NaN fills."""
        R = lo.shape[0]
        if self.n == 0:
            return torch.full((R, q), math.nan, dtype=F64, device=lo.device)
        start = self.counts(hi[:, None])[1][:, 0]
        end = self.counts(lo[:, None])[0][:, 0]
        n_in = (end - start).clamp(min=0)[:, None]
        i = torch.arange(q, device=lo.device)[None, :]
        few = n_in <= q
        pos = start[:, None] + torch.where(few, i, ((i + 1) * n_in) // (q + 1))
        ok = active[:, None] & (i < n_in)
        got = self.srt.gather(1, pos.clamp(0, self.n - 1))
        return torch.where(ok, got, torch.full_like(got, math.nan))


def _exchange(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    dev = t.device
    return _comm.gather(t.to(_comm.comm_device(t, shard.group)), shard).to(dev)


def solve(x_rows: torch.Tensor, k: torch.Tensor, t: torch.Tensor, largest: bool, shard: Shard, what: str):
    """b (x's units, float64 [R]) and the edge mass of each row of the sharded row
    (DESIGN §8's rules over the concatenated row), identical on every rank."""
    sign = 1.0 if largest else -1.0
    s = x_rows.to(F64) * sign
    R = s.shape[0]
    # 1. non-finite counts, finite counts, k and t of every rank
    head = torch.stack([(s == math.inf).sum(1).to(F64), (s == -math.inf).sum(1).to(F64),
                        torch.isnan(s).any(1).to(F64), torch.isfinite(s).sum(1).to(F64),
                        k.detach(), t.detach()], 1)
    heads = _exchange(head, shard)
    for col, name in ((4, "k"), (5, "temperature")):
        same = (heads[:, :, col] == heads[0:1, :, col]) | (heads[:, :, col].isnan() & heads[0:1, :, col].isnan())
        if not bool(same.all()):
            raise ValueError(f"{what}: {name} differs across ranks (every rank must pass the same)")
    tot = _comm.fold_sum(heads)
    P, N, nan = tot[:, 0], tot[:, 1], tot[:, 2]
    n = float(shard.n)
    kk, tt = heads[0, :, 4], heads[0, :, 5]
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
    srt = _Sorted(s, tt)
    b_s, ok = _narrow_and_solve(srt, s, kf, tt, active, tot[:, 3], shard, what, exact=False)
    redo = active & ~ok
    if bool(redo.any()):
        b2, ok2 = _narrow_and_solve(srt, s, kf, tt, redo, tot[:, 3], shard, what, exact=True)
        b_s = torch.where(redo, b2, b_s)
    inf = torch.full_like(b_s, math.inf)
    b_s = torch.where(upper, inf, torch.where(lower, -inf, b_s))
    b_s = torch.where(bad, torch.full_like(b_s, math.nan), b_s)
    one = torch.ones_like(b_s)
    edge = torch.where(upper, torch.where(P > 0, kk / P.clamp(min=1), 0 * one), one)
    edge = torch.where(lower, torch.where(N > 0, (kk - (n - N)) / N.clamp(min=1), one), edge)
    edge = torch.where(bad, torch.full_like(edge, math.nan), edge)
    return b_s * sign, edge


def _narrow_and_solve(srt: _Sorted, s, kf, t, active, finite_count, shard: Shard, what: str, exact: bool):
    """The rounds of proposals, then the closed form. -> (b_s, the root lies in its
    bracket by the exact sums)."""
    R = s.shape[0]
    q = Q_EXACT if exact else Q
    lo = torch.full((R,), -math.inf, dtype=F64, device=s.device)
    hi = torch.full((R,), math.inf, dtype=F64, device=s.device)
    cgt_lo = finite_count.clone()  # #{s > lo}: every finite score
    cge_hi = torch.zeros_like(lo)  # #{s >= hi}
    for _ in range(MAX_ROUNDS * (4 if exact else 1)):
        if not bool((active & (cgt_lo - cge_hi > 0)).any()):
            break
        cand = _exchange(srt.proposals(lo, hi, active, q), shard).permute(1, 0, 2).reshape(R, -1)
        st = _comm.fold_sum(_exchange(srt.stats_exact(s, cand) if exact else srt.stats(cand), shard))
        psi = st[..., 0] - 0.5 * st[..., 2] + 0.5 * st[..., 3]
        valid = ~torch.isnan(cand) & active[:, None]
        le = valid & (psi <= kf[:, None])
        hi = torch.minimum(hi, torch.where(le, cand, math.inf).amin(1))
        cge_hi = torch.maximum(cge_hi, torch.where(le, st[..., 1], 0.0).amax(1))
        ge = valid & (psi >= kf[:, None]) & (cand <= hi[:, None])
        lo = torch.maximum(lo, torch.where(ge, cand, -math.inf).amax(1))
        cgt_lo = torch.minimum(cgt_lo, torch.where(ge, st[..., 0], math.inf).amin(1))
    else:
        raise RuntimeError(f"{what}: the sharded solve did not converge")
    return _closed_form(s, lo, hi, kf, t, active, shard)


def _closed_form(s, lo, hi, kf, t, active, shard: Shard) -> torch.Tensor:
    """No score lies strictly inside (lo, hi): C = #{s > lo}, A = Σ_{s>lo} e^{(hi-s)/t},
    B = Σ_{s<=lo} e^{(s-lo)/t} over the row (one pass here, all-gathered), then the
    quadratic's root."""
    fin = torch.isfinite(s)
    above = fin & (s > lo[:, None])
    below = fin & ~above
    tc = t[:, None]
    hic = torch.where(torch.isfinite(hi), hi, 0.0)[:, None]
    loc = torch.where(torch.isfinite(lo), lo, 0.0)[:, None]
    zero = torch.zeros_like(s)
    part = torch.stack([above.sum(1).to(F64),
                        torch.where(above, torch.exp((hic - s).clamp(max=0) / tc), zero).sum(1),
                        torch.where(below, torch.exp((s - loc).clamp(max=0) / tc), zero).sum(1)], 1)
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
