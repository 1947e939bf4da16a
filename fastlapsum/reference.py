"""Pure-PyTorch float64 oracle for the LapSum operator (docs/DESIGN.md §1).

The tests compare the C++/CUDA kernels against these functions; benchmarks use them as
the "pure-PyTorch sort solver" baseline, and `bisection_threshold` as the original
LapSum approach. Everything works on a [rows, n] float64 tensor of scores (largest
side; pass -x for largest=False) with float64 per-row `k` and `t`, on any device,
without host synchronisation.
"""
from __future__ import annotations

import math

import torch

LOG_HALF = math.log(0.5)


def solve_interval(C, A, B, hi, lo, k, t):
    """Root of Psi(b) = k on a score-free interval [lo, hi] (DESIGN §1.1), elementwise.

    Psi(b) = C - 1/2 e^{(b-hi)/t} A + 1/2 e^{(lo-b)/t} B; the branch is picked by the sign
    of c = C - k so that no subtraction cancels.
    """
    c = C - k
    AG = torch.where((A > 0) & (B > 0), A * B * torch.exp((lo - hi) / t), torch.zeros_like(A))
    root = torch.sqrt(c * c + AG)
    b_upper = hi + t * torch.log((c + root) / A)  # c > 0: quadratic in e^{(b-hi)/t}
    b_lower = lo - t * torch.log((-c + root) / B)  # c < 0: quadratic in e^{(lo-b)/t}
    b_mid = 0.5 * (hi + lo) + 0.5 * t * torch.log(B / A)  # c == 0
    return torch.where(c > 0, b_upper, torch.where(c < 0, b_lower, b_mid))


def _psi_and_slope(s, b, t):
    """Psi(b) and sum of t*w over the finite scores of each row."""
    u = (s - b[:, None]) / t[:, None]
    finite = torch.isfinite(s)
    p = torch.where(u <= 0, 0.5 * torch.exp(u.clamp(max=0)), 1 - 0.5 * torch.exp(-u.clamp(min=0)))
    tw = 0.5 * torch.exp(-u.abs())
    zero = torch.zeros_like(p)
    return torch.where(finite, p, zero).sum(1), torch.where(finite, tw, zero).sum(1)


def lapsum_threshold_reference(s: torch.Tensor, k: torch.Tensor, t: torch.Tensor, polish: int = 2):
    """Threshold b and edge mass per row for scores s [rows, n] (largest side).

    Non-finite rules (DESIGN §6): a NaN row gives NaN; if the +inf scores use up the
    budget, b = +inf and each +inf score gets edge = k / #(+inf); if the budget needs the
    -inf scores, b = -inf and each -inf score gets edge = the leftover share.
    """
    s = s.to(torch.float64)
    k = k.to(torch.float64)
    t = t.to(torch.float64)
    rows, n = s.shape
    finite = torch.isfinite(s)
    pinf = (s == math.inf).sum(1).double()
    ninf = (s == -math.inf).sum(1).double()
    m = finite.sum(1)
    kf = k - pinf

    srt = torch.where(finite, s, -math.inf).sort(1, descending=True).values
    pos = torch.arange(n, device=s.device)
    valid = pos[None, :] < m[:, None]
    top = torch.where(m > 0, srt[:, 0], torch.zeros_like(k))
    z = torch.where(valid, (srt - top[:, None]) / t[:, None], torch.zeros_like(srt))  # <= 0
    neg_inf = torch.full_like(z, -math.inf)
    # A_j = sum_{i<=j} e^{(s_j - s_i)/t},  B_j = sum_{i>=j} e^{(s_i - s_j)/t}  (valid j)
    logA = z + torch.logcumsumexp(torch.where(valid, -z, neg_inf), 1)
    logB = -z + torch.logcumsumexp(torch.where(valid, z, neg_inf).flip(1), 1).flip(1)
    A_incl, B_incl = torch.exp(logA), torch.exp(logB)
    j1 = (pos + 1).double()[None, :]
    psi_at = j1 - 0.5 * A_incl + 0.5 * (B_incl - 1)  # Psi(s_j)
    cnt = ((psi_at < kf[:, None]) & valid).sum(1)  # number of scores above b

    def take(v, idx, fill):
        ok = (idx >= 0) & (idx < m)
        got = v.gather(1, idx.clamp(0, n - 1)[:, None])[:, 0]
        return torch.where(ok, got, torch.full_like(got, fill))

    hi = take(srt, cnt - 1, math.inf)
    lo = take(srt, cnt, -math.inf)
    A = take(A_incl, cnt - 1, 0.0)
    B = take(B_incl, cnt, 0.0)
    b = solve_interval(cnt.double(), A, B, hi, lo, kf, t)

    for _ in range(polish):  # Newton on the exact curve: makes the oracle's budget exact
        psi, slope = _psi_and_slope(s, b, t)
        step = (psi - kf) * t / slope
        b = torch.where(torch.isfinite(step) & (slope > 0), b + step, b)

    inf = torch.full_like(b, math.inf)
    one = torch.ones_like(b)
    edge = one.clone()
    upper = kf <= 0
    lower = k >= n - ninf
    b = torch.where(upper, inf, torch.where(lower, -inf, b))
    edge = torch.where(upper, torch.where(pinf > 0, k / pinf, 0 * one), edge)
    edge = torch.where(lower & ~upper, torch.where(ninf > 0, (k - (n - ninf)) / ninf, one), edge)
    bad = s.isnan().any(1) | ~(k >= 0) | ~(k <= n) | ~(t > 0) | ~torch.isfinite(t)
    nan = torch.full_like(b, math.nan)
    return torch.where(bad, nan, b), torch.where(bad, nan, edge)


def lapsum_mask_reference(s, b, t, edge, log: bool = False):
    """p_i = F((s_i - b)/t) per row (or log p), with the infinite-threshold rules."""
    b, t, edge = b[:, None], t[:, None], edge[:, None]
    u = (s - b) / t
    if log:
        p = torch.where(u <= 0, u + LOG_HALF, torch.log1p(-0.5 * torch.exp(-u.clamp(min=0))))
        at_pinf = torch.where(s == math.inf, torch.log(edge), torch.full_like(p, -math.inf))
        at_ninf = torch.where(s == -math.inf, torch.log(edge), torch.zeros_like(p))
    else:
        p = torch.where(u <= 0, 0.5 * torch.exp(u.clamp(max=0)), 1 - 0.5 * torch.exp(-u.clamp(min=0)))
        at_pinf = torch.where(s == math.inf, edge.expand_as(p), torch.zeros_like(p))
        at_ninf = torch.where(s == -math.inf, edge.expand_as(p), torch.ones_like(p))
    p = torch.where(b == math.inf, at_pinf, torch.where(b == -math.inf, at_ninf, p))
    return torch.where(b.isnan(), torch.full_like(p, math.nan), p)


def soft_topk_reference(x, k, temperature=1.0, *, dim=-1, largest=True, log=False):
    """float64 LapSum mask of x along dim; k, temperature numbers or per-row tensors."""
    xd = x.to(torch.float64).movedim(dim, -1)
    batch = xd.shape[:-1]
    s = xd.reshape(-1, xd.shape[-1]) * (1.0 if largest else -1.0)
    rows = s.shape[0]
    kk = torch.as_tensor(k, dtype=torch.float64, device=s.device).broadcast_to(batch).reshape(rows)
    tt = torch.as_tensor(temperature, dtype=torch.float64, device=s.device).broadcast_to(batch).reshape(rows)
    b, edge = lapsum_threshold_reference(s, kk, tt)
    p = lapsum_mask_reference(s, b, tt, edge, log=log)
    return p.reshape(xd.shape).movedim(-1, dim)


def lapsum_vjp_reference(s, b, t, g):
    """Closed-form VJP of DESIGN §1.3 for scores s [rows, n] (largest side).

    Returns (grad_s, grad_k, grad_t), all float64.
    """
    s, b, t, g = (v.to(torch.float64) for v in (s, b, t, g))
    d = s - b[:, None]
    ok = torch.isfinite(s) & torch.isfinite(b)[:, None]
    w = torch.where(ok, torch.exp(-d.abs() / t[:, None]) / (2 * t[:, None]), torch.zeros_like(s))
    d = torch.where(ok, d, torch.zeros_like(d))
    W = w.sum(1)
    gw = (g * w).sum(1)
    ratio = torch.where(W > 0, gw / W, torch.zeros_like(W))
    rbar_d = torch.where(W > 0, (w * d).sum(1) / W, torch.zeros_like(W))
    grad_s = w * (g - ratio[:, None])
    grad_t = -(g * w * (d - rbar_d[:, None])).sum(1) / t
    return grad_s, ratio, grad_t


def bisection_threshold(s, k, t, steps: int = 60):
    """The original LapSum solver: bisection on Psi(b) = k, re-summing all n terms each
    step (finite scores; baseline for benchmarks)."""
    s = s.to(torch.float64)
    lo = s.min(1).values - 40 * t
    hi = s.max(1).values + 40 * t
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        psi, _ = _psi_and_slope(s, mid, t)
        above = psi > k  # b too small
        lo = torch.where(above, mid, lo)
        hi = torch.where(above, hi, mid)
    return 0.5 * (lo + hi)
