"""Cluttered digits: real handwritten digits pasted onto real photographs (no downloads).

* Digits: scikit-learn's `load_digits` (1797 handwritten digits, 8x8, 17 grey levels; the
  file ships inside the scikit-learn wheel). A fixed split: 1300 train, 497 test digits.
* Backgrounds: greyscale crops of photographs shipped inside the scikit-image wheel
  (camera, grass, gravel, brick, moon, coins, astronaut, coffee, chelsea, rocket). Training
  crops come from the top 60 % of each photo, test crops from the bottom 40 %.
* A sample (the defaults of train.py): a 64x64 photo crop (contrast scaled to [0, 0.4]) with
  one digit at its native 8x8 size pasted in white into a random cell of the 8x8 grid. With
  8x8 patches the digit is exactly one of the 64 patch tokens; the other 63 are photo
  clutter, so a router that finds the digit can drop almost everything.
  (`sizes`/`align=0` give scaled digits at free positions instead: a ViT trained from
  scratch needs far more steps to find those.)

Training batches are generated on the device, fresh every step (random digit, crop, size,
position); the test set is fixed (one generator seed) and built from held-out digits and
held-out photo regions.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

PHOTOS = ("camera", "grass", "gravel", "brick", "moon", "coins", "astronaut", "coffee",
          "chelsea", "rocket")
N_TRAIN_DIGITS = 1300


def _photos(factor: int) -> list[np.ndarray]:
    from skimage import data
    from skimage.color import rgb2gray
    out = []
    for name in PHOTOS:
        im = getattr(data, name)()
        im = rgb2gray(im[..., :3]) if im.ndim == 3 else im / 255.0
        im = np.asarray(im, dtype=np.float32)
        f = factor  # downscale: more texture per small crop
        h, w = im.shape[0] // f * f, im.shape[1] // f * f
        out.append(im[:h, :w].reshape(h // f, f, w // f, f).mean((1, 3)))
    return out


def _crops(photos, n: int, train: bool, rng: np.random.Generator, contrast: float,
           size: int) -> np.ndarray:
    """n size x size crops (of the photo downscaled 2x), from the top 60 % (train) or bottom 40 % (test) of a photo."""
    out = np.empty((n, size, size), np.float32)
    which = rng.integers(len(photos), size=n)
    for i, p in enumerate(which):
        im = photos[p]
        cut = int(0.6 * im.shape[0])
        lo, hi = (0, cut - size) if train else (cut, im.shape[0] - size)
        r = rng.integers(lo, hi + 1)
        c = rng.integers(0, im.shape[1] - size + 1)
        crop = im[r:r + size, c:c + size]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        out[i] = crop
    lo, hi = out.min((1, 2), keepdims=True), out.max((1, 2), keepdims=True)
    return contrast * (out - lo) / np.maximum(hi - lo, 1e-6)


class ClutteredDigits:
    """Holds the digit and background banks on `device`; `batch` makes training samples,
    `test_set` the fixed test set."""

    def __init__(self, device, n_backgrounds: int = 2048, n_test: int = 4096, seed: int = 0,
                 contrast: float = 0.4, canvas: int = 32, sizes: tuple[int, int] = (12, 16),
                 align: int = 0):
        from sklearn.datasets import load_digits
        d = load_digits()
        rng = np.random.default_rng(seed)
        perm = rng.permutation(len(d.target))
        imgs = torch.tensor(d.images[perm] / 16.0, dtype=torch.float32).unsqueeze(1)
        labels = torch.tensor(d.target[perm], dtype=torch.long)
        photos = _photos(2 if canvas <= 32 else 1)
        self.sizes, self.canvas, self.align = sizes, canvas, align
        self.device = torch.device(device)
        self.train_digits = imgs[:N_TRAIN_DIGITS].to(self.device)
        self.train_labels = labels[:N_TRAIN_DIGITS].to(self.device)
        self.train_bg = torch.from_numpy(_crops(photos, n_backgrounds, True, rng, contrast, canvas)).to(self.device)
        test_digits, test_labels = imgs[N_TRAIN_DIGITS:].to(self.device), labels[N_TRAIN_DIGITS:].to(self.device)
        test_bg = torch.from_numpy(_crops(photos, max(n_test // 4, 1), False, rng, contrast, canvas)).to(self.device)
        g = torch.Generator(device=self.device).manual_seed(seed + 12345)
        self.test_x, self.test_y = self._compose(test_digits, test_labels, test_bg, n_test, g, sizes, canvas, align)

    @staticmethod
    def _compose(digits, labels, bgs, n: int, g: torch.Generator, sizes, canvas, align=0):
        dev = digits.device
        di = torch.randint(len(digits), (n,), generator=g, device=dev)
        bi = torch.randint(len(bgs), (n,), generator=g, device=dev)
        size = torch.randint(sizes[0], sizes[1] + 1, (n,), generator=g, device=dev).float()  # digit size in px
        half = size / canvas                     # digit half-extent, normalised canvas units
        cx = (torch.rand(n, generator=g, device=dev) * 2 - 1) * (1 - half)
        cy = (torch.rand(n, generator=g, device=dev) * 2 - 1) * (1 - half)
        if align:  # centre snapped to a cell of the align-px grid (cells of size align)
            cells = canvas // align
            cx = (2 * torch.randint(cells, (n,), generator=g, device=dev) + 1) / cells - 1
            cy = (2 * torch.randint(cells, (n,), generator=g, device=dev) + 1) / cells - 1
        theta = torch.zeros(n, 2, 3, device=dev)
        theta[:, 0, 0] = theta[:, 1, 1] = 1 / half
        theta[:, 0, 2], theta[:, 1, 2] = -cx / half, -cy / half
        grid = F.affine_grid(theta, (n, 1, canvas, canvas), align_corners=False)
        alpha = F.grid_sample(digits[di], grid, mode="bilinear", padding_mode="zeros",
                              align_corners=False)
        x = bgs[bi].unsqueeze(1) * (1 - alpha) + alpha  # white digit over the photo
        return (x - 0.3) / 0.3, labels[di]

    def batch(self, n: int, g: torch.Generator):
        """n fresh training samples from the training digits and training crops."""
        return self._compose(self.train_digits, self.train_labels, self.train_bg, n, g, self.sizes, self.canvas, self.align)

    @staticmethod
    def digit_patches(x: torch.Tensor, patch: int) -> torch.Tensor:
        """[B, N] bool: patches holding digit ink (a pixel above 0.8; backgrounds stay <= 0.6,
        so only a pixel at least half covered by the digit gets there)."""
        white = (x * 0.3 + 0.3) > 0.8
        return F.max_pool2d(white.float(), patch).flatten(1) > 0
