"""The radix bracket of DESIGN §1.2 over a sharded row: the LapSum root from all-gathered
histograms (docs/DISTRIBUTED.md §Soft).

Scores are keyed by their order-preserving integer image (32 bits for fp16/bf16/fp32
scores, 64 for fp64). A round splits the key range still in play into 256 bins by the next
8 bits; each rank histograms its scores in that range: per bin the count and the two
exponential sums against the bin's ends (α against its lower end, β against its upper
end, every exponent <= 0). The parts are all-gathered and folded in rank order. With the
tails (the scores above and below the range, kept as a count and sums against the range's
ends) Ψ at every bin edge follows without cancellation; the root lies in one bin. An empty
bin, or a bin of one key after the last digit, leaves no score strictly inside the root's
interval, and the closed form of `reference.solve_interval` gives b from the same sums.
So a row takes at most 4 rounds (fp32 scores) or 8 (fp64), one all-gather of R·256·3
float64 per rank each, and one pass over the local scores per round.
"""
from __future__ import annotations

import math

import torch

from ..reference import solve_interval
from . import _comm
from ._comm import Shard

F64 = torch.float64
BITS, BINS = 8, 256
_MAX = {64: torch.finfo(torch.float64).max, 32: float(torch.finfo(torch.float32).max)}


def _keys(s: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Order-preserving signed keys (int64) of the scores s (selected side) and their width."""
    if s.dtype == torch.float64:
        bits = s.view(torch.int64)
        return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF), 64
    bits = s.float().view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64), 32


def _values(key: torch.Tensor, width: int) -> torch.Tensor:
    """float64 value of each key (the key map is an involution); keys past the finite range
    (±inf, NaN patterns) give ±max, which no finite score exceeds."""
    if width == 64:
        v = (key ^ ((key >> 63) & 0x7FFFFFFFFFFFFFFF)).view(torch.float64)
    else:
        k32 = key.to(torch.int32)
        v = (k32 ^ ((k32 >> 31) & 0x7FFFFFFF)).view(torch.float32).to(F64)
    big = torch.full_like(v, _MAX[width])
    big = torch.where(key >= 0, big, -big)
    return torch.where(torch.isfinite(v), v, big)


CHUNK = 1 << 26  # scores per pass piece: bounds the histogram's temporaries


def _histogram(s, key, todo, prefix, r: int, shift: int, t, R: int) -> torch.Tensor:
    """This rank's [R, BINS, 5]: count, min, max, α = Σ e^{(min - s)/t}, β = Σ e^{(s - max)/t}
    of its scores in the range in play (the row's key prefix above `shift + BITS` bits),
    binned by the key's next BITS bits (min +inf, max -inf where a bin holds none). Two
    passes over column pieces of at most CHUNK scores: min / max first, then the sums
    against them."""
    dev = s.device
    size = R * BINS + 1  # the last bin takes the scores outside the range
    n = s.shape[1]
    step = max(1, CHUNK // max(R, 1))
    rows = torch.arange(R, device=dev)[:, None] * BINS
    pieces = [(i, min(n, i + step)) for i in range(0, n, step)]

    def piece(i, j):  # the flat bin of each score of columns [i, j) (the spare one outside)
        kk = key[:, i:j]
        ins = torch.isfinite(s[:, i:j]) & todo[:, None]
        if r > 0:
            ins &= (kk >> (shift + BITS)) == prefix[:, None]
        g = ((kk >> shift) & (BINS - 1)) ^ (BINS // 2 if r == 0 else 0)
        return torch.where(ins, rows + g, R * BINS).reshape(-1), ins

    mn = torch.full((size,), math.inf, dtype=F64, device=dev)
    mx = torch.full((size,), -math.inf, dtype=F64, device=dev)
    cnt, alpha, beta = (torch.zeros(size, dtype=F64, device=dev) for _ in range(3))
    for i, j in pieces:
        f, v = piece(i, j)[0], s[:, i:j].reshape(-1)
        mn.scatter_reduce_(0, f, v, "amin")
        mx.scatter_reduce_(0, f, v, "amax")
        cnt += torch.bincount(f, minlength=size)
    tc = t[:, None]
    for i, j in pieces:
        (f, ins), v = piece(i, j), s[:, i:j]
        ea = torch.where(ins, torch.exp(((mn[f].view(R, -1) - v) / tc).clamp(max=0)), 0.0)
        alpha += torch.bincount(f, weights=ea.reshape(-1), minlength=size)
        eb = torch.where(ins, torch.exp(((v - mx[f].view(R, -1)) / tc).clamp(max=0)), 0.0)
        beta += torch.bincount(f, weights=eb.reshape(-1), minlength=size)
    out = torch.stack([cnt, mn, mx, alpha, beta], 1)
    return out[: R * BINS].reshape(R, BINS, 5)


def _fold(H: torch.Tensor, t: torch.Tensor):
    """The ranks' histograms [W, R, BINS, 5] folded in rank order: counts add, min / max
    are the row's, α and β are rescaled to them."""
    cnt = _comm.fold_sum(H[..., 0])
    mn, mx = H[..., 1].amin(0), H[..., 2].amax(0)
    tc = t[:, None]
    has = H[..., 0] > 0
    fa = torch.where(has, torch.exp(((mn - H[..., 1]) / tc).clamp(max=0)), 0.0)
    fb = torch.where(has, torch.exp(((H[..., 2] - mx) / tc).clamp(max=0)), 0.0)
    return cnt, mn, mx, _comm.fold_sum(fa * H[..., 3]), _comm.fold_sum(fb * H[..., 4])


def _ex(d: torch.Tensor, t: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """e^{d/t} where ok (d <= 0 there), else 0; t [R] broadcasts over d's trailing dims."""
    tt = t.reshape(-1, *([1] * (d.dim() - 1)))
    return torch.where(ok, torch.exp((torch.where(ok, d, 0.0) / tt).clamp(max=0)), 0.0)


def solve_finite(x_rows: torch.Tensor, sign: float, kf: torch.Tensor, t: torch.Tensor, active: torch.Tensor,
                 shard: Shard) -> torch.Tensor:
    """b_s (selected side) of the active rows: the root of Σ_finite F((s_i - b)/t) = kf over
    the concatenated row (0 < kf < #finite). Identical on every rank.

    Atoms: the non-empty bins of the range in play, each with its count, its min and max
    score and α (against its min), β (against its max); the tails: the scores above the
    range (count T_cnt, T_A = Σ e^{(H - s)/t}, H their min) and below it (T_B = Σ e^{(s - L)/t},
    L their max). Ψ is evaluated at every atom's min and max; the root lies in a gap
    between atoms (closed form) or inside one atom (the next digit refines it)."""
    R, n = x_rows.shape
    dev = x_rows.device
    s = (x_rows.to(F64) * sign) if x_rows.dtype == F64 else (x_rows * sign)
    key, width = _keys(s)
    s = s.to(F64)
    prefix = torch.zeros(R, dtype=torch.int64, device=dev)
    H = torch.full((R,), math.inf, dtype=F64, device=dev)
    L = -H
    T_cnt, T_A, T_B = (torch.zeros(R, dtype=F64, device=dev) for _ in range(3))
    todo = active.clone()
    b = torch.zeros(R, dtype=F64, device=dev)
    rounds = width // BITS
    for r in range(rounds):
        shift = width - BITS * (r + 1)
        hist = _histogram(s, key, todo, prefix, r, shift, t, R)
        cnt, mn, mx, alpha, beta = _fold(_comm.exchange(hist, shard), t)
        # the non-empty bins first, in order: m atoms per row (padding after them)
        m = max(1, int((cnt > 0).sum(1).max()))
        binid = torch.sort((cnt == 0).to(torch.int8), dim=1, stable=True).indices[:, :m]
        cnt, mn, mx, alpha, beta = (v.gather(1, binid) for v in (cnt, mn, mx, alpha, beta))
        idx = torch.arange(m, device=dev)
        ge = idx[:, None] <= idx[None, :]  # [j, g]: g >= j
        has = cnt > 0
        mn0, mx0 = torch.where(has, mn, 0.0), torch.where(has, mx, 0.0)
        pair = has[:, :, None] & has[:, None, :]  # [R, j, g], both atoms non-empty
        tail_a = _ex(mn0 - H[:, None], t, has & (T_cnt[:, None] > 0)) * T_A[:, None]
        # at c = min_j: above = atoms g >= j; below = g < j.  at c = max_j: above g > j; below g <= j
        A_min = (_ex(mn0[:, :, None] - mn0[:, None, :], t, pair & ge) @ alpha[:, :, None])[..., 0] + tail_a
        B_min = (_ex(mx0[:, None, :] - mn0[:, :, None], t, pair & ~ge) @ beta[:, :, None])[..., 0]
        A_max = (_ex(mx0[:, :, None] - mn0[:, None, :], t, pair & ~ge.T) @ alpha[:, :, None])[..., 0] + \
            _ex(mx0 - H[:, None], t, has & (T_cnt[:, None] > 0)) * T_A[:, None]
        B_max = (_ex(mx0[:, None, :] - mx0[:, :, None], t, pair & ge.T) @ beta[:, :, None])[..., 0]
        B_min = B_min + _ex(L[:, None] - mn0, t, has & (L[:, None] > -math.inf)) * T_B[:, None]
        B_max = B_max + _ex(L[:, None] - mx0, t, has & (L[:, None] > -math.inf)) * T_B[:, None]
        c_max = T_cnt[:, None] + cnt.flip(1).cumsum(1).flip(1) - cnt  # #{s > max_j}
        c_min = c_max + cnt  # #{s >= min_j}
        psi = torch.stack([c_min - 0.5 * A_min + 0.5 * B_min, c_max - 0.5 * A_max + 0.5 * B_max], 2)
        hit = (has[:, :, None] & (psi <= kf[:, None, None])).reshape(R, 2 * m)
        p = torch.where(hit.any(1), hit.int().argmax(1), 2 * m)  # first point with Ψ <= kf
        gj = (p // 2).clamp(max=m - 1)
        # the last non-empty atom before gj (-1: none) and the first after it (m: none)
        n_atoms = has.sum(1)
        prev = torch.where(p == 2 * m, n_atoms - 1, gj - 1)
        nxt = torch.where(gj + 1 < n_atoms, gj + 1, m)
        at = lambda v, i: v.gather(1, i.clamp(0, m - 1)[:, None])[:, 0]  # noqa: E731
        lo = torch.where(prev >= 0, at(mx, prev), L)
        B_lo = torch.where(prev >= 0, at(B_max, prev), T_B)
        inside_atom = (p % 2 == 1) & (p < 2 * m)
        point = inside_atom & ((at(mn, gj) == at(mx, gj)) | (r == rounds - 1))  # the root at one value
        gap = ~inside_atom
        above_all = p == 2 * m
        # gap before atom gj (or above every atom): lo = the previous atom's max (or L), hi = min_gj (or H)
        hi = torch.where(above_all, H, at(mn, gj))
        C = torch.where(above_all, T_cnt, at(c_min, gj))
        A = torch.where(above_all, torch.where(T_cnt > 0, T_A, 0.0), at(A_min, gj))
        # one value v: the closed form on [v, v]
        v = at(mx, gj)
        lo = torch.where(point, v, lo)
        hi = torch.where(point, v, hi)
        C = torch.where(point, at(c_max, gj), C)
        A = torch.where(point, at(A_max, gj), A)
        B_lo = torch.where(point, at(B_max, gj), B_lo)
        done = todo & (gap | point)
        with torch.no_grad():
            bj = solve_interval(C, A, B_lo, hi, lo, kf, t)
        b = torch.where(done, torch.minimum(torch.maximum(bj, lo), hi), b)
        todo = todo & ~done
        if not bool(todo.any()):
            break
        # descend into atom gj: the atoms above and below it join the tails
        base = torch.full_like(prefix, -(BINS // 2)) if r == 0 else prefix * BINS
        H2 = torch.where(nxt < m, at(mn, nxt), H)
        above = idx[None, :] > gj[:, None]
        T_A2 = (_ex(H2[:, None] - mn0, t, has & above) * alpha).sum(1) + \
            torch.where(T_cnt > 0, _ex(H2 - H, t, T_cnt > 0) * T_A, 0.0)
        prefix = torch.where(todo, base + at(binid, gj), prefix)
        T_A = torch.where(todo, T_A2, T_A)
        T_B = torch.where(todo, B_lo, T_B)
        T_cnt = torch.where(todo, at(c_max, gj), T_cnt)
        H = torch.where(todo, H2, H)
        L = torch.where(todo, lo, L)
    return b
