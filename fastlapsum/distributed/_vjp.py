"""The closed-form VJP of DESIGN §1.3 over a sharded row (docs/GRADIENTS.md).

The row VJP needs a few sums over the whole row, kept relative to the row's largest
weight (csrc/common/vjp_math.h: VjpSums). Each rank reduces its slice to the eight numbers
(m, dref, tw, G, twd, Gd, Ga, Gad), the parts are all-gathered and merged in rank order
with VjpSums::merge's rescaling, so every rank holds the same row sums; the per-element
gradient is then local. This is vjp_math.h's algebra, vectorised over rows in float64.
"""
from __future__ import annotations

import math

import torch

from . import _comm

F64 = torch.float64
_BIG = 1.7976931348623157e308


def _times_exp(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x e^y without a spurious overflow or underflow of e^y alone (vjp_math.h)."""
    direct = x * torch.exp(y)
    far = torch.copysign(torch.exp(torch.log(x.abs()) + y), x)
    out = torch.where((y.abs() < 700.0) | torch.isnan(x), direct, far)
    return torch.where(x == 0, torch.zeros_like(x), out)


def terms(s: torch.Tensor, b_s: torch.Tensor, t: torch.Tensor, g, log_mode: bool):
    """Per element (vjp_term): a = |d| (+inf: no weight), d, gw, ga. s [R, n] and b_s [R]
    on the selected side."""
    d = s - b_s[:, None]
    fin = torch.isfinite(d)
    d = torch.where(fin, d, torch.zeros_like(d))
    a = torch.where(fin, d.abs(), torch.full_like(d, math.inf))
    zero = torch.zeros_like(d)
    if g is None:
        return a, d, zero, zero
    g = g.to(F64)
    if not log_mode:
        return a, d, torch.where(fin, g, zero), zero
    above = d > 0
    p = 1.0 - 0.5 * torch.exp(-d.clamp(min=0) / t[:, None])
    gw = torch.where(fin & above, g / p, zero)
    ga = torch.where(fin & ~above, g, zero)
    return a, d, gw, ga


def local_sums(a, d, gw, ga, t) -> torch.Tensor:
    """This rank's VjpSums per row -> [R, 8] (m, dref, tw, G, twd, Gd, Ga, Gad)."""
    R, n = a.shape
    out = torch.zeros((R, 8), dtype=F64, device=a.device)
    out[:, 0] = math.inf
    if n == 0:
        return out
    m, idx = a.min(1)
    has = m < math.inf
    dref = torch.where(has, d.gather(1, idx[:, None])[:, 0], torch.zeros_like(m))
    wh = _weights(a, m, t)
    dd = d - dref[:, None]
    out[:, 0] = m
    out[:, 1] = dref
    out[:, 2] = wh.sum(1)
    out[:, 3] = (gw * wh).sum(1)
    out[:, 4] = (wh * dd).sum(1)
    out[:, 5] = (gw * wh * dd).sum(1)
    out[:, 6] = ga.sum(1)
    out[:, 7] = (ga * dd).sum(1)
    return out


def _merge(acc: torch.Tensor, o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """VjpSums::merge, per row: fold o into acc, rescaling the side with the larger m."""
    m, dref, tw, G, twd, Gd, Ga, Gad = acc.unbind(1)
    om, odref, otw, oG, otwd, oGd, oGa, oGad = o.unbind(1)
    # rebase acc to o's reference where o holds the larger weight
    re = om < m
    f = torch.exp(-(m - om) / t)
    sh = dref - odref
    twd = torch.where(re, f * (twd + sh * tw), twd)
    Gd = torch.where(re, f * (Gd + sh * G), Gd)
    Gad = torch.where(re, Gad + sh * Ga, Gad)
    tw = torch.where(re, tw * f, tw)
    G = torch.where(re, G * f, G)
    m = torch.where(re, om, m)
    dref = torch.where(re, odref, dref)
    f = torch.exp(-(om - m) / t)
    sh = odref - dref
    new = torch.stack([m, dref, tw + f * otw, G + f * oG, twd + f * (otwd + sh * otw),
                       Gd + f * (oGd + sh * oG), Ga + oGa, Gad + oGad + sh * oGa], 1)
    return torch.where((om < math.inf)[:, None], new, torch.stack([m, dref, tw, G, twd, Gd, Ga, Gad], 1))


def row_sums(part: torch.Tensor, t: torch.Tensor, shard: "_comm.Shard") -> torch.Tensor:
    """The row's VjpSums: this rank's part all-gathered, merged in rank order."""
    parts = _comm.exchange(part, shard)
    acc = parts[0]
    for r in range(1, parts.shape[0]):
        acc = _merge(acc, parts[r], t)
    return acc


def mask_grads(S, a, d, g, b_s, t, log_mode: bool):
    """mask_vjp + grad_score: (dL/ds [R, n], dL/dk [R], dL/dt [R]) from the row sums S."""
    m, dref, tw, G, twd, Gd, Ga, Gad = S.unbind(1)
    inv_t = 1.0 / t
    has = m < math.inf
    one = torch.ones_like(tw)
    tws = torch.where(has, tw, one)
    lm = torch.where(has, m, 0 * m) * inv_t
    dc, rw, ra = twd / tws, G / tws, Ga / tws
    grad_k = rw + _times_exp(ra, lm)
    grad_t = -(Gad - Ga * dc) * inv_t * inv_t - _times_exp(Gd - G * dc, -lm - 2.0 * torch.log(t))
    c = _times_exp(inv_t, -lm)
    K = ra * inv_t + rw * c
    E = torch.exp(-lm)
    wh = _weights(a, m, t)
    g = g.to(F64)
    if not log_mode:
        gs = wh * (g * c[:, None] - K[:, None])
    else:
        above = wh * (g * c[:, None] / (1.0 - wh * E[:, None]) - K[:, None])
        gs = torch.where(d <= 0, g * inv_t[:, None] - wh * K[:, None], above)
    gs = torch.where(a <= _BIG, gs, torch.zeros_like(gs))
    return _finish(gs, grad_k, grad_t, has, b_s)


def threshold_grads(S, a, gb, b_s, t, sign: float):
    """threshold_vjp + grad_score for an upstream gradient gb [R] of b (x's units)."""
    m, dref, tw, _, twd, *_ = S.unbind(1)
    inv_t = 1.0 / t
    has = m < math.inf
    tws = torch.where(has, tw, torch.ones_like(tw))
    gs_row = gb.to(F64) * sign
    grad_k = _times_exp(-gs_row * t / tws, torch.where(has, m, 0 * m) * inv_t)
    grad_t = -gs_row * (dref + twd / tws) * inv_t
    gs = _weights(a, m, t) * (gs_row / tws)[:, None]
    gs = torch.where(a <= _BIG, gs, torch.zeros_like(gs))
    return _finish(gs, grad_k, grad_t, has, b_s)


def _weights(a, m, t):
    """wh_i = e^{-(|d_i| - m)/t}/2 relative to the row's largest weight."""
    mm = torch.where(m < math.inf, m, torch.zeros_like(m))
    return torch.where(a <= _BIG, 0.5 * torch.exp(-(a - mm[:, None]) / t[:, None]), torch.zeros_like(a))


def _finish(gs, grad_k, grad_t, has, b_s):
    """Rows without weight do not move (still_row); NaN thresholds give NaN (nan_row)."""
    zero = torch.zeros_like(grad_k)
    grad_k = torch.where(has, grad_k, zero)
    grad_t = torch.where(has, grad_t, zero)
    nan = torch.isnan(b_s)
    gs = torch.where(nan[:, None], torch.full_like(gs, math.nan), gs)
    grad_k = torch.where(nan, torch.full_like(grad_k, math.nan), grad_k)
    grad_t = torch.where(nan, torch.full_like(grad_t, math.nan), grad_t)
    return gs, grad_k, grad_t
