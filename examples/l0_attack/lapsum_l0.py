"""Pixel-L0 attacks as attack objects: `LapSumL0` (exact-budget straight-through top-K mask,
fastlapsum) and `PGDL0` (sparse PGD, Croce & Hein 2019), both with the torchattacks.Attack
interface, plus `LapSumL0Foolbox` for foolbox-style callers.

    atk = LapSumL0(model, k=100, steps=200)
    x_adv = atk(x, y)            # x in [0, 1], [N, C, H, W]; at most k pixels changed
    atk.success                  # bool [N]: misclassified after 8-bit quantisation

A pixel is one spatial position; changing any of its channels counts once. The returned
images are 8-bit (k / 255) exactly, so `x_adv` is what a saved PNG would hold.

The attack: per-pixel scores s (H*W) and replacement colours c = sigmoid(w) (C x H x W),

    m     = fastlapsum.soft_topk(s, K, t, hard=True)   # forward: exactly K ones per row
    x_adv = x + m * (c - x)                            # backward: the LapSum soft-mask VJP

optimised with Adam on a Carlini-Wagner margin loss; an image stops at its first step whose
8-bit image is misclassified (re-checked by a separate forward pass).
"""
from __future__ import annotations

import math

import torch

import fastlapsum

try:  # the torchattacks interface when it is installed, a minimal compatible base otherwise
    from torchattacks.attack import Attack
except ImportError:  # pragma: no cover - exercised only without torchattacks
    class Attack:
        def __init__(self, name, model):
            self.attack, self.model = name, model
            self.targeted = False
            self.supported_mode = ["default"]
            try:
                self.device = next(model.parameters()).device
            except (StopIteration, AttributeError):
                self.device = None

        def get_logits(self, inputs):
            return self.model(inputs)

        def get_target_label(self, inputs, labels):
            raise ValueError("targeted mode needs torchattacks")

        def __call__(self, inputs, labels=None):
            training = self.model.training
            self.model.eval()
            try:
                return self.forward(inputs, labels)
            finally:
                self.model.train(training)


def quantise(x: torch.Tensor) -> torch.Tensor:
    """Round to 8-bit values (k / 255)."""
    return torch.round(x.clamp(0, 1) * 255) / 255


def margin_loss(logits: torch.Tensor, y: torch.Tensor, targeted: bool = False) -> torch.Tensor:
    """Untargeted: z_y - max_{j != y} z_j; targeted (y = target): max_{j != y} z_j - z_y.
    Negative means the attack goal is met."""
    zy = logits.gather(1, y[:, None])[:, 0]
    other = logits.scatter(1, y[:, None], -math.inf).amax(1)
    return other - zy if targeted else zy - other


def pixel_l0(x_adv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Changed pixels per image at 8-bit precision; a pixel changed in any channel counts once."""
    a = torch.round(x_adv.clamp(0, 1) * 255)
    b = torch.round(x.clamp(0, 1) * 255)
    return (a != b).any(1).flatten(1).sum(1)


class _Adam:
    """Adam over row-batched tensors whose rows can be dropped (finished images)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8):
        self.p = [p.detach() for p in params]
        self.m = [torch.zeros_like(p) for p in self.p]
        self.v = [torch.zeros_like(p) for p in self.p]
        self.lr, self.b1, self.b2, self.eps, self.t = lr, betas[0], betas[1], eps, 0

    @torch.no_grad()
    def step(self, grads):
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for p, m, v, g in zip(self.p, self.m, self.v, grads):
            m.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            p.addcdiv_(m, (v / c2).sqrt_().add_(self.eps), value=-self.lr / c1)

    def keep(self, rows):
        self.p = [p[rows] for p in self.p]
        self.m = [m[rows] for m in self.m]
        self.v = [v[rows] for v in self.v]


class _L0Base(Attack):
    """Shared driver: restarts over the images not yet fooled; `success` and `steps_used`
    describe the last call."""

    def __init__(self, name, model, k, steps, restarts, kappa, seed):
        super().__init__(name, model)
        if int(k) < 1:
            raise ValueError(f"k must be a positive pixel count, got {k}")
        if int(steps) < 1 or int(restarts) < 1:
            raise ValueError(f"steps and restarts must be >= 1, got {steps}, {restarts}")
        self.k, self.steps, self.restarts = int(k), int(steps), int(restarts)
        self.kappa, self.seed = float(kappa), int(seed)
        self.supported_mode = ["default", "targeted"]

    def _goal(self, logits, y):
        return margin_loss(logits, y, self.targeted)

    def forward(self, images, labels):
        x = quantise(images.clone().detach().to(self.device))  # attacks start from 8-bit images
        y = labels.clone().detach().to(self.device)
        if x.dim() != 4:
            raise ValueError(f"images must be [N, C, H, W], got shape {tuple(x.shape)}")
        if self.k > x.shape[-1] * x.shape[-2]:
            raise ValueError(f"k={self.k} exceeds the {x.shape[-1] * x.shape[-2]} pixels of an image")
        if self.targeted:
            y = self.get_target_label(x, y)
        gen = torch.Generator(device=x.device).manual_seed(self.seed)
        out = x.clone()
        self.success = torch.zeros(len(x), dtype=torch.bool, device=x.device)
        self.steps_used = torch.zeros(len(x), dtype=torch.long, device=x.device)
        for _ in range(self.restarts):
            todo = (~self.success).nonzero()[:, 0]
            if len(todo) == 0:
                break
            self._rows = todo
            adv, ok, used = self._run(x[todo], y[todo], gen)
            self.steps_used[todo] += used
            out[todo] = adv  # an unsuccessful restart still returns a K-pixel image
            self.success[todo] = ok
        return out

    @torch.no_grad()
    def _check(self, x_exact, y):
        return self._goal(self.get_logits(x_exact), y) < 0


class LapSumL0(_L0Base):
    r"""Exact-budget pixel-L0 attack with fastlapsum's straight-through top-K mask.

    Arguments:
        model (nn.Module): classifier on inputs in [0, 1].
        k (int): pixel budget (k pixels are selected; at most k change).
        steps (int): Adam steps per restart. restarts (int): random score restarts.
        lr (float): Adam step on scores and colour logits.
        temperature (float): LapSum temperature of the mask's gradient.
        kappa (float): CW margin confidence (the loss is clamped below -kappa).
    """

    def __init__(self, model, k=10, steps=100, restarts=1, lr=0.3, temperature=1.0, kappa=2.0, seed=0):
        super().__init__("LapSumL0", model, k, steps, restarts, kappa, seed)
        self.lr, self.temperature = float(lr), float(temperature)

    def _run(self, X, Y, gen):
        R, C, H, W = X.shape
        dev = X.device
        s = torch.randn(R, H * W, generator=gen, device=dev)
        w = 2.0 * torch.randn(R, C, H, W, generator=gen, device=dev)  # colour logits
        opt = _Adam([s, w], self.lr)
        adv, ok = X.clone(), torch.zeros(R, dtype=torch.bool, device=dev)
        used = torch.full((R,), self.steps, dtype=torch.long, device=dev)
        ids = torch.arange(R, device=dev)  # rows still attacked -> their image index
        for step in range(1, self.steps + 1):
            s, w = (p.requires_grad_(True) for p in opt.p)
            m = fastlapsum.soft_topk(s, self.k, self.temperature, hard=True).view(-1, 1, H, W)
            col = torch.sigmoid(w)
            colq = col + (quantise(col) - col).detach()  # the forward sees 8-bit colours
            # the last term is 0 in value; it gives every pixel's colour the gradient it would
            # get if selected, so a colour is ready when its pixel enters the mask
            xadv = X + m * (colq - X) + (1 - m.detach()) * (colq - colq.detach())
            margin = self._goal(self.get_logits(xadv), Y)
            gs, gw = torch.autograd.grad(margin.clamp(min=-self.kappa).sum(), [s, w])
            with torch.no_grad():
                x_exact = torch.where(m > 0.5, quantise(col), X)  # exactly the K chosen pixels
                adv[ids] = x_exact
                hit = margin.detach() < 0
                if hit.any():
                    hit &= self._check(x_exact, Y)
            opt.step([gs, gw])
            if hit.any():
                ok[ids[hit]] = True
                used[ids[hit]] = step
                keep = (~hit).nonzero()[:, 0]
                opt.keep(keep)
                X, Y, ids = X[keep], Y[keep], ids[keep]
                if len(ids) == 0:
                    break
        return adv, ok, used


class PGDL0(_L0Base):
    r"""Sparse PGD-L0 (Croce & Hein 2019): delta -= eta * g / mean|g|, clip x + delta to
    [0, 1], keep the k pixels with the largest ||delta_pixel||_2 (zero the rest); random
    sparse start. Same interface and 8-bit check as LapSumL0; eta should be chosen on
    images other than the evaluated ones. `eta` may be one value per image (a tensor of
    length N), so one batched run can try several step sizes; `best_margin` holds each
    image's lowest margin of the last call (a tie-break when no image is fooled)."""

    def __init__(self, model, k=10, steps=100, restarts=1, eta=0.1, kappa=2.0, seed=0):
        super().__init__("PGDL0", model, k, steps, restarts, kappa, seed)
        self.eta = torch.as_tensor(eta, dtype=torch.float32)
        if self.eta.dim() > 1 or not bool((self.eta > 0).all()):
            raise ValueError(f"eta must be a positive number or a 1-D tensor of them, got {eta}")

    def forward(self, images, labels):
        eta = self.eta.to(self.device if self.device is not None else images.device)
        if eta.dim() == 1 and len(eta) != len(images):
            raise ValueError(f"eta has {len(eta)} values for {len(images)} images")
        self._eta_all = eta.expand(len(images)).clone()
        self.best_margin = torch.full((len(images),), math.inf, device=eta.device)
        return super().forward(images, labels)

    def _project(self, X, delta):
        R, C, H, W = delta.shape
        delta = (X + delta).clamp(0, 1) - X
        idx = torch.topk(delta.pow(2).sum(1).view(R, H * W), self.k, dim=1, sorted=False).indices
        keep = torch.zeros(R, H * W, device=delta.device, dtype=delta.dtype).scatter_(1, idx, 1.0)
        return delta * keep.view(R, 1, H, W)

    def _run(self, X, Y, gen):
        R, C, H, W = X.shape
        dev = X.device
        start = torch.rand(R, H * W, generator=gen, device=dev).topk(self.k, dim=1).indices
        mask0 = torch.zeros(R, H * W, device=dev).scatter_(1, start, 1.0).view(R, 1, H, W)
        delta = (torch.rand(R, C, H, W, generator=gen, device=dev) - X) * mask0
        adv, ok = X.clone(), torch.zeros(R, dtype=torch.bool, device=dev)
        used = torch.full((R,), self.steps, dtype=torch.long, device=dev)
        ids = torch.arange(R, device=dev)
        rows = self._rows  # row -> image index of the whole call (per-image eta, best margin)
        eta = self._eta_all[rows].view(R, 1, 1, 1)
        for step in range(1, self.steps + 1):
            delta.requires_grad_(True)
            margin = self._goal(self.get_logits(X + delta), Y)
            g, = torch.autograd.grad(margin.clamp(min=-self.kappa).sum(), [delta])
            with torch.no_grad():
                r = rows[ids]
                self.best_margin[r] = torch.minimum(self.best_margin[r], margin.detach())
                # rounding can move a clipped pixel's channels only within their own pixel,
                # and untouched pixels stay exactly x, so the pixel count stays <= k
                x_exact = quantise(X + delta)
                adv[ids] = x_exact
                hit = margin.detach() < 0
                if hit.any():
                    hit &= self._check(x_exact, Y)
                g = g / g.abs().mean((1, 2, 3), keepdim=True).clamp(min=1e-20)
                delta = self._project(X, delta.detach() - eta * g)
            if hit.any():
                ok[ids[hit]] = True
                used[ids[hit]] = step
                keep = (~hit).nonzero()[:, 0]
                X, Y, ids, delta, eta = X[keep], Y[keep], ids[keep], delta[keep], eta[keep]
                if len(ids) == 0:
                    break
        return adv, ok, used


class LapSumL0Foolbox:
    """LapSumL0 for foolbox-style callers: `raw, clipped, success = attack(fmodel, x, criterion,
    epsilons=[K1, K2, ...])`, epsilons being pixel budgets. `fmodel` is a foolbox PyTorchModel
    (or any torch module); `criterion` a foolbox Misclassification or the labels."""

    def __init__(self, steps=100, restarts=1, lr=0.3, temperature=1.0, kappa=2.0, seed=0):
        self.kw = dict(steps=steps, restarts=restarts, lr=lr, temperature=temperature, kappa=kappa, seed=seed)

    def __call__(self, model, inputs, criterion, *, epsilons):
        labels = getattr(criterion, "labels", criterion)
        labels = getattr(labels, "raw", labels)
        module = _TorchView(model) if not isinstance(model, torch.nn.Module) else model
        raws, succ = [], []
        for k in epsilons:
            atk = LapSumL0(module, k=int(k), **self.kw)
            raws.append(atk(inputs, labels))
            succ.append(atk.success)
        return raws, list(raws), torch.stack(succ)


class _TorchView(torch.nn.Module):
    """A foolbox model (callable on torch tensors, differentiable) as an nn.Module."""

    def __init__(self, fmodel):
        super().__init__()
        self.fmodel = fmodel
        self.anchor = torch.nn.Parameter(torch.zeros(0, device=getattr(fmodel, "device", "cpu")))

    def forward(self, x):
        return self.fmodel(x)
