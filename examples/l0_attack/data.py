"""Data and classifier of the pixel-L0 attack example (see README.md next to this file).

No downloads. The images are the colour photographs that scikit-image ships inside its
wheel (`skimage.data`, loaded without pooch or network). The task: which photograph is a
random crop from. A crop is a random square (side 30-75 % of the photo's short side) at a
random place, resized to SxS (bilinear, torchvision roi_align), randomly flipped, quantised
to 8 bits. Training crops also get brightness/contrast jitter.

Splits come from disjoint random streams: training crops are drawn online from `seed`,
the calibration crops (PGD-L0's step size) from `seed + 1`, the evaluation crops from
`seed + 2`; `crop_boxes` returns the boxes, so a test can check that no evaluation crop is
a calibration crop. Evaluation crops overlap the training photos' content (there are only
seven photos): the model is attacked, not tested for generalisation.

The classifier is torchvision's resnet18 as it is (random init, trained here; ImageNet stem,
so at 224x224 its learned first convolution sees the full-resolution input), with
per-channel standardisation as its first layer. The CPU smoke run uses the same network
on 32x32 crops.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

PHOTOS = ("astronaut", "chelsea", "coffee", "hubble_deep_field", "immunohistochemistry",
          "retina", "rocket")


def load_photos(device) -> list[torch.Tensor]:
    """The seven RGB photos of skimage.data as float [3, h, w] tensors in [0, 1]."""
    import skimage.data

    out = []
    for name in PHOTOS:
        a = np.asarray(getattr(skimage.data, name)())[..., :3]
        out.append(torch.from_numpy(a.copy()).permute(2, 0, 1).float().div(255).to(device))
    return out


def crop_boxes(photos, n: int, gen: torch.Generator, lo=0.3, hi=0.75):
    """n (class, box) pairs; box = (x0, y0, x1, y1) in pixels of that class's photo."""
    cls = torch.randint(len(photos), (n,), generator=gen)
    u = torch.rand(n, 3, generator=gen)
    hw = torch.tensor([p.shape[1:] for p in photos], dtype=torch.float32)[cls]  # [n, (h, w)]
    side = (lo + (hi - lo) * u[:, 0]) * hw.min(1).values
    x0 = u[:, 1] * (hw[:, 1] - side)
    y0 = u[:, 2] * (hw[:, 0] - side)
    return cls, torch.stack([x0, y0, x0 + side, y0 + side], 1)


def render(photos, cls, boxes, size: int, gen: torch.Generator, jitter: bool = False):
    """Crops -> [n, 3, size, size] 8-bit images in [0, 1] (flips drawn from gen)."""
    from torchvision.ops import roi_align

    dev = photos[0].device
    x = torch.empty(len(cls), 3, size, size, device=dev)
    for c in cls.unique().tolist():
        rows = (cls == c).nonzero()[:, 0]
        b = torch.cat([torch.zeros(len(rows), 1), boxes[rows]], 1).to(dev)
        x[rows.to(dev)] = roi_align(photos[c][None], b, (size, size), spatial_scale=1.0,
                                    sampling_ratio=2, aligned=True)
    flip = torch.rand(len(cls), generator=gen) < 0.5
    x[flip.to(dev)] = x[flip.to(dev)].flip(-1)
    if jitter:
        a = 0.75 + 0.5 * torch.rand(len(cls), 1, 1, 1, generator=gen)  # contrast
        b = 0.1 * (torch.rand(len(cls), 1, 1, 1, generator=gen) - 0.5)  # brightness
        mean = x.mean((1, 2, 3), keepdim=True)
        x = (x - mean) * a.to(dev) + mean + b.to(dev)
    return torch.round(x.clamp(0, 1) * 255) / 255


def make_split(photos, n: int, size: int, seed: int):
    """A fixed split: (x, y, boxes), 8-bit images."""
    gen = torch.Generator().manual_seed(seed)
    cls, boxes = crop_boxes(photos, n, gen)
    x = render(photos, cls, boxes, size, gen)
    return x, cls.to(x.device), boxes


class Standardise(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1))

    def forward(self, x):
        return (x - self.mean) / self.std


def make_model() -> nn.Module:
    import torchvision

    net = torchvision.models.resnet18(weights=None, num_classes=len(PHOTOS))
    return nn.Sequential(Standardise(), net)


def train(photos, size: int, steps: int, batch: int, seed: int, time_cap: float, log=print):
    """Train resnet18 on online crops (AdamW, warm-up then cosine decay; bf16 autocast on
    CUDA) for `steps` steps or `time_cap` seconds, whichever comes first. Returns the
    eval-mode model and the steps done."""
    dev = photos[0].device
    torch.manual_seed(seed)
    model = make_model().to(dev)
    cuda = dev.type == "cuda"
    if cuda:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    t0 = time.perf_counter()
    done = 0
    while True:
        # progress by steps or by time, whichever is further: a time cap still ends the
        # schedule at a small learning rate
        prog = max(done / steps, (time.perf_counter() - t0) / time_cap)
        if prog >= 1:
            break
        lr = 2e-3 * (prog / 0.15 if prog < 0.15 else 0.5 * (1 + math.cos(math.pi * (prog - 0.15) / 0.85)))
        for g in opt.param_groups:
            g["lr"] = lr
        cls, boxes = crop_boxes(photos, batch, gen)
        x = render(photos, cls, boxes, size, gen, jitter=True)
        y = cls.to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(model(x), y, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if done % 50 == 0:
            log(f"  train step {done:4d} loss {loss.item():.3f} lr {lr:.1e} {time.perf_counter() - t0:6.1f} s")
        done += 1
    log(f"  train: {done} steps in {time.perf_counter() - t0:.1f} s (cap {time_cap:.0f} s)")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.float(), done


@torch.no_grad()
def correct(model, x, y, batch: int = 64) -> torch.Tensor:
    """Per image: does the model classify it correctly."""
    return torch.cat([model(x[i:i + batch]).argmax(1) for i in range(0, len(x), batch)]) == y
