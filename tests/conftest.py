"""Shared test helpers: device parametrisation and the tolerance rule.

Tolerance rule (flash-attention's): a kernel's error against the float64 oracle may be
a small multiple of what a same-precision PyTorch computation gets against it.
"""
import importlib.util
import math
import os
import sys

import pytest
import torch

import fastlapsum
from fastlapsum import reference

# Under pytest-xdist (-n W) the W workers already share the cores: each worker's torch keeps
# cores // W intra-op threads, since W processes of one thread per core each spin against each
# other in every parallel region (two workers of two threads on two cores: the CPU topk and
# soft tests 3x slower than with one thread each).
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))

CUDA = torch.cuda.is_available() and fastlapsum.has_cuda_kernels()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and the CUDA build")
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

# budget bound |sum p - k| / max(k, 1) (DESIGN §1.2; fp16/bf16 after rounding p)
BUDGET_TOL = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# |p_cuda - p_cpu|: both hold b in fp64; the mask is rounded to x's dtype once
P_TOL = {torch.float64: 1e-11, torch.float32: 3e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# gradients, CUDA against the CPU
G_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


def gen(seed):
    return torch.Generator().manual_seed(seed)


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


def ulp_above(b):
    """The gap from each b to the next representable value: a threshold held in fp64 can be
    no closer than a few of these."""
    return (torch.nextafter(b, torch.full_like(b, math.inf)) - b).abs()


def assert_b_matches_cpu(b, bc, t):
    """A CUDA threshold b against the CPU op's bc (t: the rows' temperatures): NaN rows alike,
    infinite ones equal, the others within 1e-6 t plus a few ulps of bc."""
    b, t = b.cpu(), t.cpu()
    assert torch.equal(torch.isnan(b), torch.isnan(bc)), (b, bc)
    inf = torch.isinf(bc)
    assert torch.equal(b[inf], bc[inf]), (b, bc)
    ok = torch.isfinite(bc)
    assert ((b - bc)[ok].abs() <= 1e-6 * t[ok] + 4 * ulp_above(bc[ok])).all(), (b, bc)


def gap_precision(device, dtype):
    """How closely an outer-gap row's b is held, as a multiple of t, and how near the gap
    test's boundary (|S / 2 kf - 1|) a row may take either path: fp64 terms (the CPU; fp64
    rows on CUDA) to 1e-9; CUDA's fp32 terms for 16/32-bit rows (DESIGN §1.1.1) to 1e-6,
    each term within a few fp32 ulps."""
    fp32_terms = str(device).startswith("cuda") and dtype != torch.float64
    return 1e-6 if fp32_terms else 1e-9


def outer_gap_test(s, k, t):
    """The float64 outer-gap test of DESIGN §1.1.1 for one row s (largest side, float64):
    (holds, S / (2 kf)), S the sum over the finite scores of e^{(s - max)/t} (or the mirror's
    over e^{(min - s)/t} with nf - kf when 2 kf > nf), or None where the row settles without a
    solve (a NaN, the budget met by the infinities)."""
    if torch.isnan(s).any():
        return None
    fin = torch.isfinite(s)
    kf = k - (s == math.inf).sum().item()
    nf = fin.sum().item()
    if not (0 < kf < nf):
        return None
    f = s[fin]
    if 2 * kf <= nf:
        ratio = torch.exp((f - f.max()) / t).sum().item() / (2 * kf)
    else:
        ratio = torch.exp((f.min() - f) / t).sum().item() / (2 * (nf - kf))
    return ratio >= 1.0, ratio


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


# ---- exact top-k ---------------------------------------------------------------------

def order_key(x: torch.Tensor, largest: bool = True) -> torch.Tensor:
    """int64 key with key(a) > key(b) iff a ranks before b (ties equal, -0 == +0, NaN above
    +inf as in torch.topk; integers exactly; for largest=False the order is reversed)."""
    if x.is_floating_point():
        d = x.double() + 0.0  # -0.0 -> +0.0
        bits = d.view(torch.int64)
        key = torch.where(bits < 0, bits ^ INT64_MAX, bits)
        key = torch.where(d.isnan(), torch.full_like(key, INT64_MAX), key)
    else:
        key = x.to(torch.int64)
    return key if largest else ~key


def topk_oracle(x, k, dim=-1, largest=True, lengths=None):
    """Top-k by a stable sort of exact keys: best first, the smaller index first among ties.
    lengths (x [rows, n], dim -1): each row's valid prefix; positions past min(k, L) get
    index -1 and value -inf (+inf for largest=False), as fastlapsum.topk pads."""
    key = order_key(x, largest)
    if lengths is not None:
        invalid = torch.arange(x.shape[-1], device=x.device)[None, :] >= lengths[:, None]
        key = key.masked_fill(invalid, torch.iinfo(torch.int64).min)
    idx = key.sort(dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
    val = x.gather(dim, idx)
    if lengths is not None:
        pad = torch.arange(k, device=x.device)[None, :] >= lengths.clamp(max=x.shape[-1])[:, None]
        idx = idx.masked_fill(pad, -1)
        val = val.masked_fill(pad, -math.inf if largest else math.inf)
    return val, idx


def assert_exact_topk(x, k, values, indices, *, largest=True, lengths=None, sorted=False):
    """DESIGN §2 exactness for x [rows, n] (selection dim last): the K indices of a row are
    distinct and valid (< L_r), the smallest selected score is >= the largest unselected
    valid score (NaN ranking above +inf), values == x.gather(indices), and rows with
    L_r <= K end in -1 padding with values -inf (+inf for largest=False)."""
    rows, n = x.shape
    assert indices.dtype == torch.int64
    assert values.dtype == x.dtype
    assert tuple(indices.shape) == (rows, k) and tuple(values.shape) == (rows, k)
    assert values.device == x.device and indices.device == x.device
    x, values, indices = x.cpu(), values.cpu(), indices.cpu()
    L = torch.full((rows,), n, dtype=torch.int64) if lengths is None else lengths.cpu().to(torch.int64).reshape(rows)
    take = L.clamp(max=k)
    pos = torch.arange(k)[None, :]
    slot_valid = pos < take[:, None]  # slots that must hold a real index

    # padding: exactly the slots past min(k, L_r), index -1, value -inf (+inf if smallest)
    pad_val = -math.inf if largest else math.inf
    assert bool((indices[~slot_valid] == -1).all()), "padding slots must hold index -1"
    assert bool((values[~slot_valid].double() == pad_val).all()), f"padding values must be {pad_val}"

    # valid and distinct
    real = indices[slot_valid]
    assert bool((real >= 0).all()), "a slot before min(k, L_r) holds -1 or a negative index"
    row_of = torch.arange(rows)[:, None].expand(rows, k)[slot_valid]
    assert bool((real < L[row_of]).all()), "an index at or past the row's valid length was selected"
    cnt = torch.zeros(rows, n + 1, dtype=torch.int64)
    cnt.scatter_add_(1, torch.where(slot_valid, indices, n), torch.ones_like(indices))
    assert n == 0 or int(cnt[:, :n].max()) <= 1, "an index was selected twice"
    assert torch.equal(cnt[:, :n].sum(1), take)

    # values are the selected scores, bit for bit (NaN included)
    got = x.gather(1, indices.clamp(min=0))
    torch.testing.assert_close(values[slot_valid], got[slot_valid], rtol=0, atol=0, equal_nan=True)

    # min selected >= max unselected among the valid prefix
    key = order_key(x, largest)
    sel = cnt[:, :n] == 1
    valid = torch.arange(n)[None, :] < L[:, None]
    min_sel = torch.where(sel, key, torch.full_like(key, INT64_MAX)).min(1).values
    max_uns = torch.where(valid & ~sel, key, torch.full_like(key, INT64_MIN)).max(1).values
    bad = (min_sel < max_uns).nonzero().flatten()
    assert bad.numel() == 0, (
        f"rows {bad[:5].tolist()}: an unselected valid score ranks above a selected one "
        f"(e.g. row {int(bad[0])}: selected {values[bad[0]].tolist()[:8]}...)")

    if sorted:
        vk = order_key(values, largest)
        ok = (vk[:, 1:] <= vk[:, :-1]) | ~slot_valid[:, 1:]
        assert bool(ok.all()), "sorted=True must give values best first"


# ---- adversarial short rows and their check against the float64 oracle (the short- and
# tiny-row suites) ----

F64 = torch.float64
EPS64 = torch.finfo(F64).eps
KINDS = 9  # row_of_kind's kinds; the last is a row with a NaN
NAN_KIND = 8


def row_of_kind(kind, n, g):
    """One float64 row of n scores of an adversarial kind."""
    i = torch.arange(n, dtype=F64)
    if kind == 0:
        return torch.randn(n, generator=g, dtype=F64)
    if kind == 1:  # ties everywhere
        return torch.randint(0, 3, (n,), generator=g).double()
    if kind == 2:  # constant
        return torch.full((n,), 0.25, dtype=F64)
    if kind == 3:  # distinct, evenly spaced, ascending
        return i
    if kind == 4:  # |b| >> t
        return 1e4 + 1e-2 * torch.randn(n, generator=g, dtype=F64)
    if kind == 5:  # all within t of each other
        return 1e-3 * torch.randn(n, generator=g, dtype=F64)
    if kind == 6:  # +inf and -inf among finite scores
        r = torch.randn(n, generator=g, dtype=F64)
        r[i % 5 == 1] = math.inf
        r[i % 7 == 3] = -math.inf
        return r
    if kind == 7:  # -inf but for a few
        r = torch.randn(n, generator=g, dtype=F64)
        return torch.where(torch.rand(n, generator=g, dtype=F64) < 0.2, r, torch.tensor(-math.inf, dtype=F64))
    r = torch.randn(n, generator=g, dtype=F64)  # NAN_KIND
    r[n // 3] = math.nan
    return r


def oracle(x, k, t, largest):
    """float64 oracle b, mask, log mask and weight sum sum_i t w_i per row, for x as given."""
    s = x.double().cpu() * (1.0 if largest else -1.0)
    b, edge = reference.lapsum_threshold_reference(s, k, t)
    p = reference.lapsum_mask_reference(s, b, t, edge)
    lp = reference.lapsum_mask_reference(s, b, t, edge, log=True)
    u = (s - b[:, None]) / t[:, None]
    fin = torch.isfinite(s) & torch.isfinite(b)[:, None]
    tw = torch.where(fin, 0.5 * torch.exp(-u.abs()), torch.zeros_like(u)).sum(1)
    return b, p, lp, tw


def conditioning(b, t, k, tw):
    """What the threshold's own fp64 rounding and the fp64 budget bound (DESIGN §1.2) move
    (x - b)/t by: a few ulps of b over t, and 1e-12 max(k, 1) / W. Capped well below a 0/1
    flip, so that nearly hard masks are still compared."""
    bb = abs(b) if math.isfinite(b) else 0.0
    return min(8 * EPS64 * (1 + bb) / t + 1e-12 * max(k, 1.0) / max(tw, 1e-300), 1e-3)


def check_against_oracle(x, k, t, kinds, largest):
    """Failure messages of soft_topk / log_soft_topk / lapsum_threshold on x against the oracle."""
    dtype = x.dtype
    b_ref, p_ref, lp_ref, tw = oracle(x, k, t, largest)
    kd, td = k.to(x.device), t.to(x.device)
    p = fastlapsum.soft_topk(x, kd, td, largest=largest).cpu()
    lp = fastlapsum.log_soft_topk(x, kd, td, largest=largest).cpu()
    b = fastlapsum.lapsum_threshold(x, kd, td, largest=largest).cpu()
    assert p.dtype == lp.dtype == dtype and b.dtype == F64
    fails = []
    for r in range(x.shape[0]):
        where = f"row {r} kind {int(kinds[r])} k={k[r].item()} t={t[r].item()}"
        if kinds[r] == NAN_KIND:
            if not (p[r].isnan().all() and lp[r].isnan().all() and b[r].isnan()):
                fails.append(f"{where}: a NaN row must give NaN")
            continue
        kr, tr, br = k[r].item(), t[r].item(), b_ref[r].item()
        # an infinite threshold exactly; a finite one is checked through the budget and mask
        # (where no score lies near it, the budget pins it only loosely)
        b_user = br if largest else -br  # the op's b is in x's units
        if math.isfinite(b[r].item()) != math.isfinite(br) or (not math.isfinite(br) and b[r].item() != b_user):
            fails.append(f"{where}: b {b[r].item()} vs oracle {b_user}")
        cond = conditioning(br, tr, kr, tw[r].item())
        # budget: DESIGN §1.2's bound, plus 4 W ulp(b) / max(k, 1) where b cannot be held closer
        bound = BUDGET_TOL[dtype] + (4 * tw[r].item() / tr * math.ulp(br) / max(kr, 1.0) if math.isfinite(br) else 0)
        be = budget_error(p[r:r + 1], k[r:r + 1]).item()
        if not be <= bound:
            fails.append(f"{where}: budget error {be:.3e} > {bound:.3e}")
        tol = 4 * mask_floor(p_ref[r], dtype) + 1e-12 + 0.5 * cond
        err = (p[r].double() - p_ref[r]).abs().max().item()
        if not err <= tol:
            fails.append(f"{where}: mask error {err:.3e} > {tol:.3e}")
        # log mask: the same rule in the log domain (rounding log p to dtype), exact infinities
        lr, lg = lp_ref[r], lp[r].double()
        fin = torch.isfinite(lr)
        if not torch.equal(lg[~fin], lr[~fin]):
            fails.append(f"{where}: log mask infinities differ")
        elif fin.any():
            floor = (lr[fin].to(dtype).double() - lr[fin]).abs().max().item()
            ltol = 4 * floor + 1e-12 + cond
            lerr = (lg[fin] - lr[fin]).abs().max().item()
            if not lerr <= ltol:
                fails.append(f"{where}: log mask error {lerr:.3e} > {ltol:.3e}")
    return fails


def same_or_close(a, b, rtol, atol):
    """Elementwise: equal (infinities, NaN included) or within atol + rtol |b|."""
    return bool(((a == b) | (a.isnan() & b.isnan()) | ((a - b).abs() <= atol + rtol * b.abs())).all())


def vjp_same_precision(op, up, x, b, t, largest):
    """(grad_k, grad_t) of the closed-form backward (DESIGN §1.3) evaluated in float32 from the
    exact threshold b: what a same-precision PyTorch implementation gets. Finite rows only.
    op is "soft", "log" or "threshold"; up the upstream gradient."""
    w = torch.float32
    sign = 1.0 if largest else -1.0
    assert torch.isfinite(x).all() and torch.isfinite(b).all()
    d = (x.double() * sign - (b * sign)[:, None]).to(w)
    tw = t.to(w)
    a = (d / tw[:, None]).abs()
    e = torch.exp(a.amin(1, keepdim=True) - a)
    share = e / e.sum(1, keepdim=True)
    f = 0.5 * torch.exp(-a)
    W = f.sum(1)
    g = up.to(w)
    if op == "threshold":
        return -sign * g * tw / W, -sign * g * (share * d).sum(1) / tw
    if op == "log":
        G = g * torch.where(d <= 0, 1.0, 2 * f / (2 - 2 * f))
        SG = G.sum(1)
        return SG / W, -((G * d).sum(1) - SG * (share * d).sum(1)) / (tw * tw)
    G = g * f
    ratio = (g * share).sum(1)
    return ratio, -((G * d).sum(1) - ratio * (f * d).sum(1)) / (tw * tw)


def assert_within_same_precision(got, exact, ref, rtol, atol, factor=2.0):
    """Elementwise, |got - exact| <= atol + rtol |exact| + factor |ref - exact|: got may be off
    the exact values by what a fixed tolerance allows plus a small multiple of what the
    same-precision reference ref is off on that element (flash-attention's rule)."""
    got, exact, ref = (v.double().cpu() for v in (got, exact, ref))
    err = (got - exact).abs()
    allowed = atol + rtol * exact.abs() + factor * (ref - exact).abs()
    worst = int((err - allowed).argmax())
    assert bool((err <= allowed).all()), (
        f"element {worst}: error {err[worst]:.3e} > {allowed[worst]:.3e} allowed "
        f"(exact {exact[worst]:.6g}, same-precision reference off by {(ref - exact).abs()[worst]:.3e})")
