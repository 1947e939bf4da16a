"""A differentiable, tile-free, pure-PyTorch 2D Gaussian splatter, SSIM, images, and ADC.

Renderer (`render`): each Gaussian i has a mean mu_i (pixels), scales s_i (pixels), an angle
theta_i, an RGB colour c_i and an opacity o_i = sigmoid(logit_i) (times a mask m_i while
scores are learned). Weights w_i(x) = o_i m_i exp(-0.5 (x - mu_i)^T Sigma_i^-1 (x - mu_i)).
The image is the normalised weighted blend

    C(x) = sum_i w_i(x) c_i / (sum_i w_i(x) + eps)

(black where nothing covers x), or, with blend="additive", sum_i w_i(x) c_i.

Every Gaussian is cut off at its 3-sigma radius, like 3DGS does: it is splatted into a
square patch of (2R+1)^2 pixels around its centre pixel, R the smallest bucket radius >= 3
max(s_i). Gaussians are grouped by bucket (one patch shape per bucket), each group is
evaluated in chunks of at most `max_pairs` (Gaussian, pixel) pairs and scattered into the
image with index_add. The cost is the sum of the footprints, not pixels x Gaussians, so a
megapixel image with ~10^6 Gaussians fits on a GPU; no CPU-only ops, no host sync besides one
per call (the bucket sizes).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# patch radii (pixels); a Gaussian uses the smallest >= its 3-sigma radius
BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 96, 128, 192, 256)

_offsets_cache: dict = {}


def _offsets(r: int, device) -> torch.Tensor:
    key = (r, str(device))
    if key not in _offsets_cache:
        _offsets_cache[key] = torch.arange(-r, r + 1, device=device)
    return _offsets_cache[key]


def conic(scales: torch.Tensor, theta: torch.Tensor):
    """Entries (a, b, c) of Sigma^-1 = R diag(1/s^2) R^T."""
    cs, sn = torch.cos(theta), torch.sin(theta)
    ix, iy = scales[:, 0].pow(-2), scales[:, 1].pow(-2)
    a = cs * cs * ix + sn * sn * iy
    b = cs * sn * (ix - iy)
    c = sn * sn * ix + cs * cs * iy
    return a, b, c


class _SplatChunk(torch.autograd.Function):
    """Scatter one chunk of M Gaussians with the same patch radius R into the image
    accumulator [4, H*W] (rgb * w, w); also returns each Gaussian's sum of w g.

    The patch is separable: per-axis offsets dx [M, S], dy [M, S] (S = 2R + 1), so only the
    cross term b dx dy, the exp and the scatter run over the M x S x S pairs. Out-of-image
    rows/columns get -1e4 added to their exponent (weight 0). Hand-written backward: saves
    only g per pair."""

    @staticmethod
    def forward(ctx, mx, my, a, b, c, w, col1, off, H, W):
        cx, cy = mx.detach().floor().long(), my.detach().floor().long()
        X = cx[:, None] + off[None]                                   # [M, S] pixel columns
        Y = cy[:, None] + off[None]                                   # [M, S] pixel rows
        dx = X.to(mx.dtype) + 0.5 - mx[:, None]
        dy = Y.to(mx.dtype) + 0.5 - my[:, None]
        tx = (-0.5 * a[:, None]) * dx * dx
        tx = tx.masked_fill((X < 0) | (X >= W), -1e4)
        ty = (-0.5 * c[:, None]) * dy * dy
        ty = ty.masked_fill((Y < 0) | (Y >= H), -1e4)
        power = torch.baddbmm(ty[:, :, None] + tx[:, None, :], (-b[:, None] * dy)[:, :, None], dx[:, None, :])
        g = power.clamp_(max=0.0).exp_()                              # [M, S, S]
        M, S = dx.shape
        g = g.view(M, S * S)
        wg = g * w[:, None]
        flat = ((Y.clamp(0, H - 1) * W)[:, :, None] + X.clamp(0, W - 1)[:, None, :]).view(-1)
        src = col1.T.contiguous()[:, :, None] * wg[None]                        # [4, M, P], channel-major
        out = mx.new_zeros(4, H * W).index_add_(1, flat, src.view(4, -1))
        ctx.save_for_backward(dx, dy, g, a, b, c, w, col1, flat)
        return out, wg.sum(1)

    @staticmethod
    def backward(ctx, gout, _gcontrib):
        dx, dy, g, a, b, c, w, col1, flat = ctx.saved_tensors
        M, S = dx.shape
        go = gout.index_select(1, flat).view(4, M, S * S)
        wg = g * w[:, None]
        g_col1 = (go * wg[None]).sum(2).T                                   # [M, 4]
        t = (go * col1.T.contiguous()[:, :, None]).sum(0)                              # dL/d(w g) [M, P]
        t *= g                                                              # dL/dw per pair
        g_w = t.sum(1)
        q = (t * w[:, None]).view(M, S, S)                                  # dL/d(power)
        qx = q.sum(1)                                                       # [M, S] over rows
        qy = q.sum(2)                                                       # [M, S] over columns
        qdx = torch.bmm(q, dx[:, :, None])[:, :, 0]                         # sum_x q[y, x] dx[x]
        g_a = -0.5 * (qx * dx * dx).sum(1)
        g_c = -0.5 * (qy * dy * dy).sum(1)
        g_b = -(qdx * dy).sum(1)
        sx, sy = (qx * dx).sum(1), (qy * dy).sum(1)
        g_mx = a * sx + b * sy
        g_my = b * sx + c * sy
        return g_mx, g_my, g_a, g_b, g_c, g_w, g_col1, None, None, None


def render(means, scales, theta, colours, weights, H: int, W: int, *, blend="normalized", eps=1e-2,
           max_pairs=1 << 24, return_contrib=False, max_radius=None):
    """Image [H, W, 3] of N Gaussians; means/scales in pixels [N, 2], theta [N], colours [N, 3],
    weights [N] (opacity x mask). With return_contrib also sum_x w_i(x) per Gaussian [N]
    (its opacity-weighted footprint inside the image)."""
    dev, N = means.device, means.shape[0]
    buckets = [r for r in BUCKETS if max_radius is None or r <= max_radius] or [1]
    bt = torch.tensor(buckets, device=dev, dtype=torch.float32)
    with torch.no_grad():
        rad = (3.0 * scales.max(dim=1).values).clamp(min=1.0)
        bucket = torch.searchsorted(bt, rad.contiguous()).clamp(max=len(buckets) - 1)
        order = torch.argsort(bucket)
        counts = torch.bincount(bucket, minlength=len(buckets)).tolist()  # the one host sync
    a, b, c = conic(scales, theta)
    col1 = torch.cat([colours, torch.ones_like(colours[:, :1])], 1)  # rgb + weight channel
    acc = means.new_zeros(4, H * W)
    contrib = means.new_zeros(N) if return_contrib else None
    start = 0
    for r, cnt in zip(buckets, counts):
        if cnt == 0:
            continue
        off = _offsets(r, dev)
        step = max(1, max_pairs // off.numel() ** 2)
        for s0 in range(start, start + cnt, step):
            idx = order[s0:min(s0 + step, start + cnt)]
            part, csum = _SplatChunk.apply(means[idx, 0], means[idx, 1], a[idx], b[idx], c[idx],
                                           weights[idx], col1[idx], off, H, W)
            acc = acc + part
            if return_contrib:
                contrib = contrib.index_add(0, idx, csum.detach())
        start += cnt
    if blend == "normalized":
        img = acc[:3] / (acc[3:] + eps)
    elif blend == "additive":
        img = acc[:3]
    else:
        raise ValueError(f"blend must be 'normalized' or 'additive', got {blend!r}")
    img = img.reshape(3, H, W).permute(1, 2, 0)
    return (img, contrib) if return_contrib else img


def render_reference(means, scales, theta, colours, weights, H, W, *, blend="normalized", eps=1e-2):
    """Dense autograd version (every Gaussian on every pixel, 3-sigma-square cut like render):
    for tests of the hand-written backward on tiny inputs."""
    a, b, c = conic(scales, theta)
    ys, xs = torch.meshgrid(torch.arange(H, device=means.device), torch.arange(W, device=means.device),
                            indexing="ij")
    bt = torch.tensor(BUCKETS, device=means.device, dtype=torch.float32)
    rad = bt[torch.searchsorted(bt, (3.0 * scales.max(1).values).clamp(min=1.0).detach()).clamp(max=len(BUCKETS) - 1)]
    cx, cy = means[:, 0].detach().floor(), means[:, 1].detach().floor()
    within = ((xs.reshape(1, -1) - cx[:, None]).abs() <= rad[:, None]) & ((ys.reshape(1, -1) - cy[:, None]).abs() <= rad[:, None])
    dx = xs.reshape(1, -1) + 0.5 - means[:, :1]
    dy = ys.reshape(1, -1) + 0.5 - means[:, 1:]
    power = -0.5 * (a[:, None] * dx * dx + 2 * b[:, None] * dx * dy + c[:, None] * dy * dy)
    wg = weights[:, None] * torch.exp(power.clamp(max=0)) * within
    num = wg.T @ colours
    den = wg.sum(0)[:, None]
    img = num / (den + eps) if blend == "normalized" else num
    return img.reshape(H, W, 3)


# ----------------------------------------------------------------------------- metrics

def _gauss1d(size=11, sigma=1.5, device=None, dtype=torch.float32):
    x = torch.arange(size, device=device, dtype=dtype) - size // 2
    g = torch.exp(-x * x / (2 * sigma * sigma))
    return g / g.sum()


def _band(n, g):
    """[n, n] matrix of the zero-padded 1D convolution with the odd kernel g."""
    r = g.numel() // 2
    i = torch.arange(n, device=g.device)
    d = i[None, :] - i[:, None] + r
    return torch.where((d >= 0) & (d < g.numel()), g[d.clamp(0, g.numel() - 1)], 0.0)


def ssim(img: torch.Tensor, ref: torch.Tensor, window=11, sigma=1.5) -> torch.Tensor:
    """Mean SSIM of two [H, W, 3] images in [0, 1] (Gaussian window 11, sigma 1.5, zero padding
    like 3DGS's training loss; C1 = 0.01^2, C2 = 0.03^2)."""
    x = img.permute(2, 0, 1)[None]
    y = ref.permute(2, 0, 1)[None]
    g = _gauss1d(window, sigma, img.device, img.dtype)
    z = torch.cat([x, y, x * x, y * y, x * y], 1)  # one separable blur for all five maps
    if z.is_cuda:
        kx = g.view(1, 1, 1, -1).expand(15, 1, 1, window)
        ky = g.view(1, 1, -1, 1).expand(15, 1, window, 1)
        z = F.conv2d(z, kx, padding=(0, window // 2), groups=15)
        z = F.conv2d(z, ky, padding=(window // 2, 0), groups=15)
    else:  # CPU: two banded matmuls beat the depthwise convolution by ~10x at these sizes
        H, W = z.shape[-2:]
        z = _band(H, g) @ z @ _band(W, g).T
    mx, my, exx, eyy, exy = z.split(3, 1)
    sxx = exx - mx * mx
    syy = eyy - my * my
    sxy = exy - mx * my
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return s.mean()


def psnr(img: torch.Tensor, ref: torch.Tensor) -> float:
    mse = (img.clamp(0, 1) - ref).pow(2).mean().item()
    return 10 * math.log10(1.0 / max(mse, 1e-12))


# ----------------------------------------------------------------------------- images

def load_image(size_hw: tuple[int, int], source: str = "auto") -> tuple[torch.Tensor, str]:
    """Target image [H, W, 3] in [0, 1], no download: matplotlib's bundled grace_hopper.jpg
    (512x600 photo) resized, or a procedural image when that is unavailable or
    source == 'procedural'."""
    H, W = size_hw
    if source in ("auto", "photo"):
        try:
            import matplotlib.cbook as cbook
            import matplotlib.image as mimage
            with cbook.get_sample_data("grace_hopper.jpg") as f:
                arr = mimage.imread(f, format="jpg")
            img = torch.as_tensor(arr.copy()).float().div(255.0)[..., :3]  # [600, 512, 3]
            h0, w0 = img.shape[:2]
            # crop to the target aspect ratio around the centre, then resize (antialiased)
            ar = W / H
            if w0 / h0 > ar:
                cw = int(round(h0 * ar)); x0 = (w0 - cw) // 2
                img = img[:, x0:x0 + cw]
            else:
                ch = int(round(w0 / ar)); y0 = (h0 - ch) // 2
                img = img[y0:y0 + ch]
            img = F.interpolate(img.permute(2, 0, 1)[None], size=(H, W), mode="bilinear",
                                antialias=True, align_corners=False)[0].permute(1, 2, 0)
            return img.clamp(0, 1).contiguous(), "grace_hopper.jpg (matplotlib sample data)"
        except Exception as e:  # pragma: no cover - depends on the matplotlib install
            if source == "photo":
                raise
            print(f"  (no bundled photo: {e}; using the procedural image)")
    return procedural_image(H, W), "procedural"


def procedural_image(H: int, W: int, seed: int = 0) -> torch.Tensor:
    """Smooth gradients, discs, rings, stripes, a checker patch and value noise: edges and
    texture at several scales."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, H), torch.linspace(0, 1, W), indexing="ij")
    img = torch.stack([0.2 + 0.6 * xx, 0.3 + 0.4 * yy, 0.5 + 0.3 * torch.sin(3 * xx + 2 * yy)], -1)
    for _ in range(10):
        cx, cy, r = torch.rand(3, generator=g).tolist()
        r = 0.05 + 0.18 * r
        col = torch.rand(3, generator=g)
        d = ((xx - cx) ** 2 + (yy - cy) ** 2).sqrt()
        if torch.rand(1, generator=g).item() < 0.5:
            m = torch.sigmoid((r - d) * 300)
        else:
            m = torch.sigmoid((0.02 - (d - r).abs()) * 300)
        img = img * (1 - m[..., None]) + col * m[..., None]
    stripes = (torch.sin(60 * (xx + 0.5 * yy)) > 0).float()
    box = ((xx > 0.6) & (xx < 0.9) & (yy > 0.65) & (yy < 0.9)).float()
    img = img * (1 - 0.5 * box[..., None] * stripes[..., None])
    check = (((xx * 16).floor() + (yy * 16).floor()) % 2).float()
    box2 = ((xx > 0.08) & (xx < 0.3) & (yy > 0.7) & (yy < 0.92)).float()
    img = img * (1 - box2[..., None]) + box2[..., None] * check[..., None]
    # multi-octave value noise: texture down to ~4-pixel features at 1024 px, so a large image
    # needs many Gaussians
    for cells, amp in ((8, 0.08), (32, 0.06), (128, 0.05), (256, 0.04)):
        cells = min(cells, max(2, min(H, W) // 4))
        noise = torch.rand(1, 3, cells, cells, generator=g) - 0.5
        img = img + amp * F.interpolate(noise, size=(H, W), mode="bicubic", align_corners=False)[0].permute(1, 2, 0)
    return img.clamp(0, 1)


# ----------------------------------------------------------------------------- model + ADC

PARAMS = ("means", "log_scales", "theta", "colours", "opacity_logit")
BYTES_PER_GAUSSIAN = 4 * (2 + 2 + 1 + 3 + 1)  # fp32: mean, scales, angle, rgb, opacity


class Gaussians:
    """The parameters of N Gaussians and their Adam optimizer (one param group per tensor),
    with the in-place edits ADC and pruning need: append, keep a subset (state included)."""

    def __init__(self, params: dict, lrs: dict):
        self.p = {k: torch.nn.Parameter(v.detach().clone()) for k, v in params.items()}
        self.opt = torch.optim.Adam([{"params": [self.p[k]], "lr": lrs[k], "name": k} for k in PARAMS],
                                    eps=1e-15)

    @classmethod
    def init_random(cls, n, target: torch.Tensor, lrs: dict, gen: torch.Generator):
        H, W, _ = target.shape
        dev = target.device
        xy = torch.rand(n, 2, generator=gen).to(dev) * torch.tensor([W, H], device=dev, dtype=torch.float32)
        ix = xy[:, 0].long().clamp(0, W - 1)
        iy = xy[:, 1].long().clamp(0, H - 1)
        spacing = math.sqrt(H * W / n)
        params = dict(
            means=xy,
            log_scales=torch.full((n, 2), math.log(0.5 * spacing), device=dev),
            theta=(torch.rand(n, generator=gen) * math.pi).to(dev),
            colours=target[iy, ix].clone(),
            opacity_logit=torch.full((n,), math.log(0.5 / 0.5), device=dev),  # o = 0.5
        )
        return cls(params, lrs)

    @property
    def n(self) -> int:
        return self.p["means"].shape[0]

    def scales(self):
        return self.p["log_scales"].exp()

    def opacity(self):
        return torch.sigmoid(self.p["opacity_logit"])

    def render(self, H, W, mask=None, **kw):
        w = self.opacity() if mask is None else self.opacity() * mask
        return render(self.p["means"], self.scales(), self.p["theta"], self.p["colours"], w, H, W, **kw)

    def state_dict(self):
        return {"params": {k: v.detach().clone() for k, v in self.p.items()},
                "opt": _clone(self.opt.state_dict())}

    @classmethod
    def from_state(cls, sd, lrs):
        g = cls(sd["params"], lrs)
        g.opt.load_state_dict(_clone(sd["opt"]))
        return g

    def _replace(self, make):
        """Rebuild every parameter (and its Adam moments) with make(name, tensor, is_state)."""
        for grp in self.opt.param_groups:
            name, old = grp["name"], grp["params"][0]
            new = torch.nn.Parameter(make(name, old.detach(), False))
            st = self.opt.state.pop(old, None)
            if st:
                st["exp_avg"] = make(name, st["exp_avg"], True)
                st["exp_avg_sq"] = make(name, st["exp_avg_sq"], True)
                self.opt.state[new] = st
            grp["params"][0] = new
            self.p[name] = new

    def keep(self, idx: torch.Tensor):
        """Keep Gaussians idx (a long index or bool mask), with their optimizer state."""
        self._replace(lambda name, t, is_state: t[idx].clone())

    def append(self, new: dict):
        """Append Gaussians; their Adam moments start at zero."""
        self._replace(lambda name, t, is_state: torch.cat(
            [t, torch.zeros_like(new[name]) if is_state else new[name].to(t.dtype)]))


def _clone(sd):
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    if isinstance(sd, dict):
        return {k: _clone(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_clone(v) for v in sd]
    return sd


@torch.no_grad()
def densify_and_prune(g: Gaussians, grad_avg: torch.Tensor, *, grad_thresh: float, clone_scale: float,
                      min_opacity: float, max_gaussians: int | None):
    """3DGS adaptive density control on 2D Gaussians. grad_avg: the mean positional-gradient
    norm per Gaussian since the last call. Gaussians with grad_avg >= grad_thresh are cloned
    (max scale <= clone_scale pixels: an identical copy) or split (2 samples from the Gaussian,
    scales / 1.6, the original removed); then Gaussians with opacity < min_opacity are
    pruned. max_gaussians caps the count (the largest gradients densify first)."""
    n0 = g.n
    sel = grad_avg >= grad_thresh
    if max_gaussians is not None:
        room = max(0, max_gaussians - n0)  # clone and split each add one Gaussian
        if int(sel.sum()) > room:
            top = torch.topk(torch.where(sel, grad_avg, -1.0), room).indices
            sel = torch.zeros_like(sel)
            sel[top] = True
    smax = g.scales().max(1).values
    clone = sel & (smax <= clone_scale)
    split = sel & (smax > clone_scale)
    new = {k: g.p[k][clone] for k in PARAMS}
    if split.any():
        s = g.scales()[split]
        th = g.p["theta"][split]
        rep = lambda t: t.repeat(2, *([1] * (t.dim() - 1)))  # noqa: E731
        z = torch.randn(2 * s.shape[0], 2, device=s.device) * rep(s)
        cs, sn = torch.cos(rep(th)), torch.sin(rep(th))
        off = torch.stack([cs * z[:, 0] - sn * z[:, 1], sn * z[:, 0] + cs * z[:, 1]], 1)
        sp = dict(means=rep(g.p["means"][split]) + off,
                  log_scales=rep(g.p["log_scales"][split]) - math.log(1.6),
                  theta=rep(th), colours=rep(g.p["colours"][split]),
                  opacity_logit=rep(g.p["opacity_logit"][split]))
        new = {k: torch.cat([new[k], sp[k]]) for k in PARAMS}
    g.append(new)
    keep = torch.ones(g.n, dtype=torch.bool, device=grad_avg.device)
    keep[:n0] &= ~split  # split originals go
    keep &= g.opacity() >= min_opacity
    if not bool(keep.all()):
        g.keep(keep)
    return dict(cloned=int(clone.sum()), split=int(split.sum()), n=g.n)
