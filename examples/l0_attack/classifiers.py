"""Data and classifiers for the pixel-L0 attack example (see README.md next to this file).

No downloads: the images are procedural.

* `make_digits(n, seed, res)`: colour images [n, 3, res, res] of the ten digits, drawn as
  anti-aliased strokes (polylines and arcs of fixed templates) under a random affine
  transform (rotation, scale, shear, shift) and stroke width, in a random foreground colour
  on a random background colour, plus noise, quantised to 8 bits. A hand-drawn-digit
  stand-in for scikit-learn's `digits` (not installed in this venv; this needs nothing).
  With `res > 128` the digit is rendered at 128x128 and upsampled bilinearly, and the
  noise is added at full resolution (so a 1024x1024 image has 10^6 distinct pixels).
* `DigitNet`: a small fully convolutional CNN for 32x32 inputs (per-image standardisation,
  4 strided conv layers, global average pooling, a linear head).
* `MegaNet`: the megapixel classifier for 1024x1024 inputs — the trained DigitNet behind
  a fixed 32x32 average-pool stem (so it is fully convolutional and needs no training of
  its own; applied to digits rendered at 128x128 and upsampled to 1024x1024).
* `get_model(kind, dev, cache_dir, ...)`: trains DigitNet (under a minute on a CPU) or
  loads it from `cache_dir` (`cache/` next to this file, git-ignored). The cache
  file name carries the training settings, so a `--quick` model never stands in for the
  real one.
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

N_CLASSES = 10


# --------------------------------------------------------------------------------------
# Procedural digits
# --------------------------------------------------------------------------------------

def _arc(cx, cy, r, a0, a1, n=10, ry=None):
    """Polyline of an arc (angles in degrees; y points down, 90 deg = downwards)."""
    ry = r if ry is None else ry
    return [(cx + r * math.cos(math.radians(a0 + (a1 - a0) * i / n)),
             cy + ry * math.sin(math.radians(a0 + (a1 - a0) * i / n))) for i in range(n + 1)]


# Each digit: a list of strokes (polylines) in the unit square, x right, y down.
_TEMPLATES = {
    0: [_arc(0.5, 0.5, 0.27, 0, 360, 16, ry=0.38)],
    1: [[(0.36, 0.25), (0.52, 0.12), (0.52, 0.88)]],
    2: [_arc(0.5, 0.33, 0.24, 190, 360, 8) + [(0.24, 0.86), (0.78, 0.86)]],
    3: [_arc(0.5, 0.31, 0.19, 200, 450, 10), _arc(0.5, 0.67, 0.21, 270, 520, 10)],
    4: [[(0.64, 0.88), (0.64, 0.12), (0.22, 0.64), (0.82, 0.64)]],
    5: [[(0.74, 0.13), (0.34, 0.13), (0.3, 0.46)] + _arc(0.5, 0.64, 0.23, 230, 500, 10)[1:]],
    6: [[(0.68, 0.13), (0.42, 0.3), (0.29, 0.62)], _arc(0.5, 0.66, 0.21, 0, 360, 14)],
    7: [[(0.22, 0.13), (0.78, 0.13), (0.42, 0.88)]],
    8: [_arc(0.5, 0.31, 0.18, 0, 360, 12), _arc(0.5, 0.68, 0.21, 0, 360, 14)],
    9: [_arc(0.5, 0.34, 0.21, 0, 360, 14), [(0.71, 0.36), (0.6, 0.87)]],
}


def _segments() -> torch.Tensor:
    """[10, S, 4] segment endpoints (x0, y0, x1, y1); short digits padded far away."""
    segs = []
    for d in range(10):
        s = [(*p, *q) for stroke in _TEMPLATES[d] for p, q in zip(stroke[:-1], stroke[1:])]
        segs.append(s)
    S = max(len(s) for s in segs)
    out = torch.full((10, S, 4), -10.0)
    for d, s in enumerate(segs):
        out[d, :len(s)] = torch.tensor(s)
    return out


_SEGS = _segments()


def _render(y: torch.Tensor, g: torch.Generator, res: int, device="cpu") -> torch.Tensor:
    """Stroke coverage [n, res, res] in [0, 1] of digits y under random affine transforms
    (random parameters drawn on the CPU from g, distances computed on `device`)."""
    n = len(y)
    seg = _SEGS[y]  # [n, S, 4]
    p0, p1 = seg[..., :2] - 0.5, seg[..., 2:] - 0.5
    ang = (torch.rand(n, generator=g) - 0.5) * math.radians(24)
    sx = 0.78 + 0.25 * torch.rand(n, generator=g)
    sy = 0.78 + 0.25 * torch.rand(n, generator=g)
    sh = (torch.rand(n, generator=g) - 0.5) * 0.4
    c, s = torch.cos(ang), torch.sin(ang)
    # A = R(ang) @ [[sx, sh], [0, sy]]
    A = torch.stack([torch.stack([c * sx, c * sh - s * sy], -1),
                     torch.stack([s * sx, s * sh + c * sy], -1)], -2)  # [n, 2, 2]
    shift = (torch.rand(n, 2, generator=g) - 0.5) * 0.16 + 0.5
    far = seg[..., :1] < -5  # padding stays far away
    p0 = torch.where(far, torch.full_like(p0, -10.0), torch.einsum("nij,nsj->nsi", A, p0) + shift[:, None])
    p1 = torch.where(far, torch.full_like(p1, -10.0), torch.einsum("nij,nsj->nsi", A, p1) + shift[:, None])
    half = 0.045 + 0.04 * torch.rand(n, generator=g)  # stroke half-width (unit square)
    p0, p1, half = p0.to(device), p1.to(device), half.to(device)
    coords = (torch.arange(res, dtype=torch.float32, device=device) + 0.5) / res
    py, px = torch.meshgrid(coords, coords, indexing="ij")
    pix = torch.stack([px.reshape(-1), py.reshape(-1)], -1)  # [P, 2]
    out = torch.empty(n, res * res, device=device)
    chunk = max(1, (1 << 22) // (res * res * seg.shape[1]))
    for i in range(0, n, chunk):
        a, b = p0[i:i + chunk, :, None], p1[i:i + chunk, :, None]  # [c, S, 1, 2]
        ab = b - a
        ap = pix[None, None] - a  # [c, S, P, 2]
        tt = ((ap * ab).sum(-1) / (ab * ab).sum(-1).clamp(min=1e-12)).clamp(0, 1)
        d = (ap - tt[..., None] * ab).norm(dim=-1).min(1).values  # [c, P]
        out[i:i + chunk] = ((half[i:i + chunk, None] - d) * res + 0.5).clamp(0, 1)
    return out.reshape(n, res, res)


def make_digits(n: int, seed: int, res: int = 32, noise: float = 0.03,
                device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """n colour digit images [n, 3, res, res] (8-bit values in [0, 1]) and labels [n];
    deterministic in `seed` for a given device (random parameters from a CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(10, (n,), generator=g)
    base = min(res, 128)
    cov = _render(y, g, base, device)[:, None]  # [n, 1, base, base]
    bg = torch.rand(n, 3, 1, 1, generator=g)
    fg = torch.rand(n, 3, 1, 1, generator=g)
    weak = (fg - bg).abs().amax(1, keepdim=True) < 0.45  # too little contrast: invert bg
    fg = torch.where(weak, (1 - bg + 0.3 * (torch.rand(n, 3, 1, 1, generator=g) - 0.5)).clamp(0, 1), fg)
    seeds = torch.randint(2 ** 62, (1,), generator=g).item()
    bg, fg = bg.to(device), fg.to(device)
    if res != base:
        cov = F.interpolate(cov, size=(res, res), mode="bilinear", align_corners=False)
    gd = torch.Generator(device=device).manual_seed(seeds)
    img = bg + cov * (fg - bg) + noise * torch.randn(n, 3, res, res, generator=gd, device=device)
    return quantise(img.clamp(0, 1)), y.to(device)


def quantise(x: torch.Tensor) -> torch.Tensor:
    """Round to 8-bit colour values (k / 255)."""
    return torch.round(x * 255) / 255


# --------------------------------------------------------------------------------------
# Classifiers
# --------------------------------------------------------------------------------------

class ImageNorm(nn.Module):
    """Per-image standardisation (part of the model, so attacks differentiate through it):
    subtract each channel's mean, divide by the image's RMS contrast. Makes the random
    foreground/background colours easy to ignore."""

    def forward(self, x):
        x = x - x.mean((2, 3), keepdim=True)
        return x / (x.pow(2).mean((1, 2, 3), keepdim=True).sqrt() + 0.05)


def _body(c_in: int) -> list[nn.Module]:
    """32x32 feature map -> logits: strided 3x3/5x5 convs, global average pooling, linear."""
    return [nn.Conv2d(c_in, 32, 5, stride=2, padding=2), nn.ReLU(),
            nn.Conv2d(32, 48, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(48, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, N_CLASSES)]


class DigitNet(nn.Sequential):
    """32x32 colour digits -> 10 logits; fully convolutional + global average pooling."""
    RES = 32

    def __init__(self):
        super().__init__(ImageNorm(), *_body(3))


class MegaNet(nn.Sequential):
    """1024x1024 colour digits -> 10 logits: DigitNet made to take megapixel inputs behind
    a fixed 32x32 average-pool stem (a stride-32 convolution with constant weights). Fully
    convolutional; the attack differentiates through all 10^6 pixels, and a changed pixel
    moves its pooled pixel by 1/1024 of its colour change."""
    RES = 1024

    def __init__(self, digits: DigitNet):
        super().__init__(nn.AvgPool2d(self.RES // DigitNet.RES), *digits)


def _train(model: nn.Module, res: int, steps: int, batch: int, dev, seed: int, tag: str) -> None:
    """Adam on a fixed pool of procedural digits."""
    pool = min(4000, steps * batch // 2)
    X, Y = make_digits(pool, seed=seed + 7, res=res, device=dev)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    g = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.perf_counter()
    for step in range(steps):
        i = torch.randint(pool, (batch,), generator=g)
        x, y = X[i.to(dev)], Y[i.to(dev)]
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 10 == 0 or step + 1 == steps:
            bar = "#" * int(20 * (step + 1) / steps)
            print(f"\r  train {tag:<7} [{bar:<20}] {step + 1:>4}/{steps} loss {loss.item():.3f} "
                  f"{time.perf_counter() - t0:5.0f} s", end="\n" if step + 1 == steps else "", flush=True)
    model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 256) -> float:
    correct = sum((model(x[i:i + batch]).argmax(-1) == y[i:i + batch]).sum().item()
                  for i in range(0, len(x), batch))
    return correct / len(x)


def get_model(kind: str, dev, cache_dir: str, steps: int, batch: int, seed: int = 0) -> nn.Module:
    """The trained classifier, frozen: 'digits' (DigitNet) or 'mega' (the same DigitNet
    behind MegaNet's pooling stem). DigitNet is trained once and kept in cache_dir (the
    file name carries the training settings; weights stored on the CPU, loaded to dev)."""
    path = os.path.join(cache_dir, f"digits_s{steps}_b{batch}_seed{seed}.pt")
    torch.manual_seed(seed)
    model = DigitNet().to(dev)
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location=dev))
        print(f"  loaded the digits classifier from {path}")
    else:
        _train(model, DigitNet.RES, steps, batch, dev, seed, "digits")
        os.makedirs(cache_dir, exist_ok=True)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, path + ".tmp")
        os.replace(path + ".tmp", path)
    if kind == "mega":
        model = MegaNet(model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
