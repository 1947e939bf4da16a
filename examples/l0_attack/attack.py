"""Exact-budget pixel-L0 adversarial attack with a straight-through hard top-K mask.

Untargeted white-box attack that changes at most K pixels (any channels of one pixel count
as one): per-pixel scores s (H*W) and replacement colours c (C x H x W), and

    m     = fastlapsum.soft_topk(s, K, t, hard=True)     # forward: exactly K ones
    x_adv = x + m * (c - x)                              # backward: LapSum soft-mask gradient

optimised with a Carlini-Wagner margin loss (Adam, at most --steps steps, --restarts random
score initialisations). Success is judged only after quantising x_adv to 8 bits, and the
number of changed pixels is checked exactly. Compared, with the same images, model,
budgets and step limit:

  ours       : fastlapsum.soft_topk(hard=True)
  bisection  : the same attack with the original LapSum solver — a custom autograd
               function whose forward finds the threshold by 60-step bisection
               (fastlapsum.reference.bisection_threshold) and returns the same hard top-K
               mask, whose backward is the same LapSum soft-mask VJP. Identical maths
               and initialisations: it shows equal success and the selector-time ratio.
  PGD-L0     : sparse PGD (Croce & Hein 2019): a gradient step on the perturbation, then
               projection onto the pixels with the K largest perturbations; its step size
               is tuned per budget over a grid on the evaluation images themselves
               (which favours the baseline).

    python examples/l0_attack/attack.py                         # digits 32x32, CPU, < 5 min
    python examples/l0_attack/attack.py --quick                 # smoke test (temp folder)
    python examples/l0_attack/attack.py --megapixel --steps 20  # 1024x1024, a CPU taste
    python examples/l0_attack/attack.py --device cuda --megapixel

Writes results.json / results.md, success_vs_k.png and examples.png to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

import torch

import fastlapsum
from fastlapsum import reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from classifiers import get_model, make_digits, quantise  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("ours", "bisection", "pgd")
LABELS = {"ours": "exact-budget ST (fastlapsum)", "bisection": "exact-budget ST (60-step bisection)",
          "pgd": "PGD-L0 (tuned step)"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--megapixel", action="store_true",
                    help="1024x1024 images (10^6 pixels per selection), fully convolutional MegaNet")
    ap.add_argument("--budgets", type=str, default=None,
                    help="comma-separated K values (default 2,4,8,16; megapixel 100,300,1000)")
    ap.add_argument("--images", type=int, default=None, help="images to attack (correctly classified)")
    ap.add_argument("--restarts", type=int, default=None, help="random restarts per image")
    ap.add_argument("--steps", type=int, default=None, help="step limit per restart")
    ap.add_argument("--temperature", type=float, default=1.0, help="LapSum temperature of the score mask")
    ap.add_argument("--t-end", type=float, default=None,
                    help="temperature at the last step (geometric schedule; default: constant)")
    ap.add_argument("--lr", type=float, default=0.3, help="Adam step for scores and colour logits")
    ap.add_argument("--kappa", type=float, default=2.0, help="CW margin confidence")
    ap.add_argument("--pgd-etas", type=str, default=None,
                    help="PGD-L0 step-size grid (mean |step| per coordinate); best per K is reported")
    ap.add_argument("--bisection-steps", type=int, default=60)
    ap.add_argument("--methods", type=str, default=",".join(METHODS))
    ap.add_argument("--train-steps", type=int, default=None, help="classifier training steps")
    ap.add_argument("--train-batch", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 with --device cpu: on a small shared machine "
                         "OpenMP barriers cost more than a second thread wins for these small ops; "
                         "torch's default otherwise)")
    ap.add_argument("--quick", action="store_true", help="tiny run (smoke test), temp output folder")
    ap.add_argument("--out", default=None,
                    help="results folder (default results/ here, results/megapixel_<device>/ with "
                         "--megapixel; a temp folder with --quick)")
    ap.add_argument("--cache-dir", default=None, help="classifier weights (default cache/ here)")
    args = ap.parse_args(argv)

    cuda = torch.device(args.device).type == "cuda"
    if args.megapixel:
        d = dict(budgets="1000,2000,4000,8000" if cuda else "2000,8000", images=8 if cuda else 1,
                 restarts=2 if cuda else 1, steps=500 if cuda else 10,
                 pgd_etas="0.03,0.1,0.3,1" if cuda else "0.1", train_steps=400, train_batch=64)
    else:
        d = dict(budgets="2,4,8,16", images=32, restarts=2, steps=100 if not cuda else 500,
                 pgd_etas="0.03,0.1,0.3,1", train_steps=400, train_batch=64)
    if args.quick:
        d.update(budgets="2000" if args.megapixel else "2,8", images=1 if args.megapixel else 6,
                 restarts=1 if args.megapixel else 2, steps=3 if args.megapixel else 10,
                 pgd_etas="0.1", train_steps=150, train_batch=32)
    for key, val in d.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    args.budgets = [int(k) for k in str(args.budgets).split(",")]
    args.pgd_etas = [float(e) for e in str(args.pgd_etas).split(",")]
    args.methods = [m for m in args.methods.split(",") if m]
    assert all(m in METHODS for m in args.methods), f"--methods: choose from {METHODS}"
    if args.out is None:  # a --quick run must never overwrite the measured results
        if args.quick:
            args.out = tempfile.mkdtemp(prefix="l0_attack_quick_")
        else:
            args.out = os.path.join(HERE, "results")
            if args.megapixel:
                args.out = os.path.join(args.out, f"megapixel_{torch.device(args.device).type}")
    if args.cache_dir is None:
        args.cache_dir = os.path.join(args.out, "cache") if args.quick else os.path.join(HERE, "cache")
    return args


# --------------------------------------------------------------------------------------
# progress and timing
# --------------------------------------------------------------------------------------

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # a tiny self-overwriting printer instead
    _tqdm = None


class Progress:
    def __init__(self, total: int, tag: str):
        self.total, self.tag, self.n, self.t0 = total, tag, 0, time.perf_counter()
        self.bar = _tqdm(total=total, desc=tag, leave=True, dynamic_ncols=True) if _tqdm else None
        self.info = ""

    def update(self, n: int = 1, **info):
        self.n += n
        self.info = " ".join(f"{k} {v}" for k, v in info.items())
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(self.info, refresh=False)
        elif self.n % 5 == 0 and self.n < self.total:  # close() prints the last line
            bar = "#" * int(20 * self.n / self.total)
            print(f"\r  {self.tag:<26} [{bar:<20}] {self.n:>4}/{self.total} {self.info} "
                  f"{time.perf_counter() - self.t0:6.1f} s", end="", flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        else:
            print(f"\r  {self.tag:<26} [{'#' * 20}] {self.n:>4}/{self.total} {self.info} "
                  f"{time.perf_counter() - self.t0:6.1f} s", flush=True)


class SelectorTimer:
    """Wall time of the selector alone: its forward call, and its backward (between a hook
    on the mask, fired when the mask's gradient is ready, and one on the scores, fired when
    the selector's backward has produced their gradient). Synchronises CUDA around both."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.fwd = self.bwd = 0.0
        self.calls = 0
        self._t = None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, selector, s, *args):
        self.sync()
        t0 = time.perf_counter()
        m = selector(s, *args)
        self.sync()
        self.fwd += time.perf_counter() - t0
        self.calls += 1
        if m.requires_grad:
            m.register_hook(self._start)
            s.register_hook(self._stop)
        return m

    def _start(self, g):
        self.sync()
        self._t = time.perf_counter()

    def _stop(self, g):
        self.sync()
        if self._t is not None:
            self.bwd += time.perf_counter() - self._t
            self._t = None

    @property
    def total(self):
        return self.fwd + self.bwd


# --------------------------------------------------------------------------------------
# selectors: straight-through hard top-K with the LapSum soft-mask gradient
# --------------------------------------------------------------------------------------

def lapsum_st(s: torch.Tensor, k: int, t: float) -> torch.Tensor:
    """Ours: forward exact hard top-k mask (exactly k ones per row), backward LapSum VJP."""
    return fastlapsum.soft_topk(s, k, t, hard=True)


class BisectionST(torch.autograd.Function):
    """The same operator with the original LapSum solver: the threshold b by bisection
    (fastlapsum.reference.bisection_threshold, float64, re-summing all n terms per step),
    the hard top-k mask (torch.topk), and the closed-form LapSum VJP at b in float64."""

    @staticmethod
    def forward(ctx, s, k, t, steps):
        rows = s.shape[0]
        kk = torch.full((rows,), float(k), dtype=torch.float64, device=s.device)
        tt = torch.full((rows,), float(t), dtype=torch.float64, device=s.device)
        b = reference.bisection_threshold(s, kk, tt, steps)
        idx = torch.topk(s, k, dim=1, sorted=False).indices
        m = torch.zeros_like(s).scatter_(1, idx, 1.0)
        ctx.save_for_backward(s, b, tt)
        return m

    @staticmethod
    def backward(ctx, g):
        s, b, tt = ctx.saved_tensors
        gs, _, _ = reference.lapsum_vjp_reference(s, b, tt, g)
        return gs.to(s.dtype), None, None, None


def bisection_st(s: torch.Tensor, k: int, t: float, steps: int = 60) -> torch.Tensor:
    return BisectionST.apply(s, k, t, steps)


# --------------------------------------------------------------------------------------
# attacks
# --------------------------------------------------------------------------------------

def cw_margin(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """z_y - max_{j != y} z_j (negative = misclassified)."""
    zy = logits.gather(1, y[:, None])[:, 0]
    other = logits.scatter(1, y[:, None], -math.inf).amax(1)
    return zy - other


class Adam:
    """Adam on a list of row-batched tensors whose rows can be dropped (finished restarts)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8):
        self.p = [p.detach() for p in params]
        self.m = [torch.zeros_like(p) for p in self.p]
        self.v = [torch.zeros_like(p) for p in self.p]
        self.lr, self.b1, self.b2, self.eps, self.t = lr, betas[0], betas[1], eps, 0

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


class Book:
    """Per-image outcome over all restarts: the first verified adversarial image (uint8)."""

    def __init__(self, x, n_images):
        self.found = torch.zeros(n_images, dtype=torch.bool)
        self.adv = [None] * n_images
        self.step = [None] * n_images
        self.row_steps = []  # steps each image-restart ran

    def record(self, img_ids, x_exact, step):
        u8 = (x_exact * 255).round().to(torch.uint8).cpu()
        for j, i in enumerate(img_ids.tolist()):
            if not self.found[i]:
                self.found[i] = True
                self.adv[i] = u8[j]
                self.step[i] = step


@torch.no_grad()
def _verify_rows(model, x_exact, y):
    return cw_margin(model(x_exact), y) < 0


def run_mask_attack(model, X, Y, img_ids, K, args, selector, timer, gen, tag):
    """The exact-budget attack on all image-restart rows at once; a row stops at its first
    verified success or after args.steps steps."""
    R, C, H, W = X.shape
    n = H * W
    dev = X.device
    s = torch.randn(R, n, generator=gen, device=dev)
    w = 2.0 * torch.randn(R, C, H, W, generator=gen, device=dev)  # colour logits
    opt = Adam([s, w], args.lr)
    t_end = args.temperature if args.t_end is None else args.t_end
    book = Book(X, int(img_ids.max()) + 1)
    bar = Progress(args.steps, tag)
    for step in range(1, args.steps + 1):
        s, w = (p.requires_grad_(True) for p in opt.p)
        t = args.temperature * (t_end / args.temperature) ** ((step - 1) / max(args.steps - 1, 1))
        m = timer(selector, s, K, t)  # [R, n], exactly K ones per row
        mm = m.view(-1, 1, H, W)
        col = torch.sigmoid(w)
        colq = col + (quantise(col) - col).detach()  # the forward sees 8-bit colours
        # x + m (c - x); the last term is 0 in value but gives every pixel's colour the
        # gradient it would get if selected, so unselected colours are ready when picked
        xadv = X + mm * (colq - X) + (1 - mm.detach()) * (colq - colq.detach())
        margin = cw_margin(model(xadv), Y)
        loss = margin.clamp(min=-args.kappa).sum()
        gs, gw = torch.autograd.grad(loss, [s, w])
        with torch.no_grad():
            done = torch.zeros(len(Y), dtype=torch.bool, device=dev)
            cand = margin.detach() < 0
            if cand.any():  # verify on the exact 8-bit image: where(mask, quantised colour, x)
                ci = cand.nonzero()[:, 0]
                x_exact = torch.where(mm[ci] > 0.5, quantise(col[ci]), X[ci])
                ok = _verify_rows(model, x_exact, Y[ci])
                if ok.any():
                    book.record(img_ids[ci[ok]], x_exact[ok], step)
                    done[ci[ok]] = True
            opt.step([gs, gw])
        if step == args.steps:
            done[:] = True
        if done.any():
            book.row_steps += [step] * int(done.sum())
            keep = (~done).nonzero()[:, 0]
            opt.keep(keep)
            X, Y, img_ids = X[keep], Y[keep], img_ids[keep]
        bar.update(1, rows=len(Y), succ=int(book.found.sum()))
        if len(Y) == 0:
            break
    bar.close()
    return book


def run_pgd_l0(model, X, Y, img_ids, K, eta, args, timer, gen, tag):
    """Sparse PGD-L0: delta += eta * g / mean|g|, clip x + delta to [0, 1], keep the K pixels
    with the largest ||delta_pixel||_2 (zero the rest). Random sparse start per restart."""
    R, C, H, W = X.shape
    n = H * W
    dev = X.device

    def project(delta):
        delta = (X[:len(delta)] + delta).clamp(0, 1) - X[:len(delta)]
        idx = torch.topk(delta.pow(2).sum(1).view(len(delta), n), K, dim=1, sorted=False).indices
        keep = torch.zeros(len(delta), n, device=dev, dtype=delta.dtype).scatter_(1, idx, 1.0)
        return delta * keep.view(-1, 1, H, W)

    start = torch.rand(R, n, generator=gen, device=dev).topk(K, dim=1).indices
    mask0 = torch.zeros(R, n, device=dev).scatter_(1, start, 1.0).view(R, 1, H, W)
    delta = (torch.rand(R, C, H, W, generator=gen, device=dev) - X) * mask0
    book = Book(X, int(img_ids.max()) + 1)
    bar = Progress(args.steps, tag)
    for step in range(1, args.steps + 1):
        delta.requires_grad_(True)
        margin = cw_margin(model(X + delta), Y)
        g, = torch.autograd.grad(margin.clamp(min=-args.kappa).sum(), [delta])
        with torch.no_grad():
            done = torch.zeros(len(Y), dtype=torch.bool, device=dev)
            cand = margin.detach() < 0
            if cand.any():
                ci = cand.nonzero()[:, 0]
                x_exact = quantise(X[ci] + delta[ci])  # untouched pixels stay exactly x
                ok = _verify_rows(model, x_exact, Y[ci])
                if ok.any():
                    book.record(img_ids[ci[ok]], x_exact[ok], step)
                    done[ci[ok]] = True
            g = g / g.abs().mean((1, 2, 3), keepdim=True).clamp(min=1e-20)
            delta = delta.detach() - eta * g
            delta = timer(project, delta)
        if step == args.steps:
            done[:] = True
        if done.any():
            book.row_steps += [step] * int(done.sum())
            keep = (~done).nonzero()[:, 0]
            X, Y, img_ids, delta = X[keep], Y[keep], img_ids[keep], delta[keep]
        bar.update(1, rows=len(Y), succ=int(book.found.sum()))
        if len(Y) == 0:
            break
    bar.close()
    return book


def warm_up(model, X, Y, args):
    """One untimed forward + backward of the model and of each selector (CUDA context,
    kernel loading, allocator), so the first timed method is not charged for them."""
    k = args.budgets[0]
    x = X[:2].clone().requires_grad_(True)
    cw_margin(model(x), Y[:2]).sum().backward()
    s = torch.randn(X.shape[0], X.shape[-2] * X.shape[-1], device=X.device, requires_grad=True)
    lapsum_st(s, k, args.temperature).sum().backward()
    if "bisection" in args.methods:
        bisection_st(s[:1], k, args.temperature, 2).sum().backward()
    torch.topk(s.detach(), k, dim=1)
    if X.is_cuda:
        torch.cuda.synchronize()


@torch.no_grad()
def verify(model, x_clean, y, book, K):
    """Re-check every recorded adversarial image from its stored 8-bit form: changed pixels
    (any channel) <= K, and the model misclassifies it. Returns per-image L0 (-1: none)."""
    l0 = []
    for i, adv in enumerate(book.adv):
        if adv is None:
            l0.append(-1)
            continue
        clean_u8 = (x_clean[i] * 255).round().to(torch.uint8).cpu()
        changed = int((adv != clean_u8).any(0).sum())
        pred = model(adv.to(x_clean.device, torch.float32)[None] / 255).argmax(-1).item()
        assert changed <= K, f"image {i}: {changed} pixels changed, budget {K}"
        assert pred != int(y[i]), f"image {i}: recorded adversarial example is classified correctly"
        l0.append(changed)
    return l0


@torch.no_grad()
def pick_examples(model, x, y, books, budgets, n_show=6):
    """Up to n_show of ours' adversarial images at the smallest budget where it fooled the
    model on at least min(n_show, N) images (else the largest budget)."""
    ks = [K for K in budgets if ("ours", K) in books]
    if not ks:
        return []
    K = next((K for K in ks if int(books[("ours", K)].found.sum()) >= min(n_show, len(y))), ks[-1])
    book = books[("ours", K)]
    out = []
    for i, adv in enumerate(book.adv):
        if adv is None or len(out) == n_show:
            continue
        pred = model(adv.to(x.device, torch.float32)[None] / 255).argmax(-1).item()
        out.append(dict(clean=(x[i] * 255).round().to(torch.uint8).cpu(), adv=adv, K=K,
                        label=int(y[i]), pred=pred))
    return out


# --------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------

def _plot_examples(examples, path):
    """Clean (top) and adversarial (middle) images, changed pixels marked in red. Megapixel
    images are shown box-filtered to 256x256 with a marker per changed pixel, plus a
    bottom row: a 48x48 full-resolution crop of the adversarial image around the densest
    changed spot."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    H = examples[0]["clean"].shape[-1]
    view = max(1, H // 256)
    nrow = 2 if view == 1 else 3
    ncol = len(examples)
    fig, axes = plt.subplots(nrow, ncol, figsize=(1.9 * max(ncol, 3), 2.05 * nrow + 0.3), squeeze=False)
    for j, ex in enumerate(examples):
        clean, adv = ex["clean"].float() / 255, ex["adv"].float() / 255
        changed = (ex["adv"] != ex["clean"]).any(0)
        pts = changed.nonzero().tolist()

        def show(a, im, title):
            if view > 1:
                im = torch.nn.functional.avg_pool2d(im[None], view)[0]
            a.imshow(im.permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            a.set_title(title, fontsize=8)
            a.set_xticks([])
            a.set_yticks([])

        show(axes[0, j], clean, f"clean: {ex['label']}")
        a = axes[1, j]
        show(a, adv, f"K={ex['K']}: {ex['pred']} ({len(pts)} px)")
        if view == 1:  # a ring around each changed pixel, leaving its new colour visible
            for r_, c_ in pts:
                a.add_patch(Rectangle((c_ - 1.5, r_ - 1.5), 3, 3, fill=False, ec="red", lw=1.0))
        elif pts:
            cc = torch.tensor(pts, dtype=torch.float32) / view
            a.scatter(cc[:, 1], cc[:, 0], s=0.6, c="red", marker=".", lw=0, alpha=0.6)
        if view > 1:
            c = 48
            dens = torch.nn.functional.avg_pool2d(changed[None, None].float(), c, stride=c // 2)[0, 0]
            r0, c0 = divmod(int(dens.argmax()), dens.shape[1])
            r0, c0 = r0 * c // 2, c0 * c // 2
            a = axes[2, j]
            a.imshow(adv[:, r0:r0 + c, c0:c0 + c].permute(1, 2, 0).numpy(), interpolation="nearest")
            for r_, c_ in changed[r0:r0 + c, c0:c0 + c].nonzero().tolist():
                a.add_patch(Rectangle((c_ - 0.5, r_ - 0.5), 1, 1, fill=False, ec="red", lw=0.4))
            a.set_title(f"48x48 crop at ({r0}, {c0})", fontsize=7)
            a.set_xticks([])
            a.set_yticks([])
    fig.suptitle("clean (top), adversarial (below); changed pixels marked in red", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(rows, meta, examples, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = ["| method | K | success | time / image-restart (ms) | selector share | "
             "selector ms / step | mean steps | PGD step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = f"{100 * r['selector_share']:.1f} %"
        lines.append(f"| {LABELS[r['method']]} | {r['K']} | {100 * r['success']:.1f} % "
                     f"({r['n_success']}/{r['n_images']}) | {r['ms_per_image_restart']:.1f} | {share} | "
                     f"{r['selector_ms_per_step']:.3f} | {r['mean_steps']:.1f} | "
                     f"{r.get('eta', '') if r['method'] == 'pgd' else ''} |")
    table = "\n".join(lines)
    ratio_lines = []
    for K in sorted({r["K"] for r in rows}):
        by = {r["method"]: r for r in rows if r["K"] == K}
        if "ours" in by and "bisection" in by:
            o, b = by["ours"], by["bisection"]
            same = sum(a == c for a, c in zip(o["succeeded"], b["succeeded"]))
            ratio_lines.append(
                f"| {K} | {b['selector_ms_per_step'] / max(o['selector_ms_per_step'], 1e-9):.1f}x | "
                f"{b['ms_per_image_restart'] / max(o['ms_per_image_restart'], 1e-9):.2f}x | "
                f"{same}/{len(o['succeeded'])} |")
    ratio = ""
    if ratio_lines:
        ratio = ("| K | selector speed-up (bisection / ours, per step) | end-to-end speed-up | "
                 "images with the same outcome |\n|---:|---:|---:|---:|\n" + "\n".join(ratio_lines))
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# Pixel-L0 attack ({meta['setting']}, {meta['device']})\n\n{table}\n\n{ratio}\n\n{meta['note']}\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping the PNGs")
        return table, ratio
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method, style in (("ours", "o-"), ("bisection", "x:"), ("pgd", "s--")):
        pts = sorted((r["K"], 100 * r["success"]) for r in rows if r["method"] == method)
        if pts:
            ax.plot(*zip(*pts), style, label=LABELS[method], ms=7 if method != "bisection" else 9)
    ax.set_xscale("log", base=2 if not meta["megapixel"] else 10)
    ax.set_xlabel("pixel budget K")
    ax.set_ylabel("attack success (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"{meta['setting']}, {meta['n_images']} images x {meta['restarts']} restarts", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "success_vs_k.png"), dpi=110)
    plt.close(fig)

    if examples:
        _plot_examples(examples, os.path.join(out_dir, "examples.png"))
    return table, ratio


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    args = parse_args(argv)
    dev = torch.device(args.device)
    if args.threads is not None or dev.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    t_run = time.perf_counter()
    kind = "mega" if args.megapixel else "digits"
    res = 1024 if args.megapixel else 32
    print(f"[l0_attack] {kind} {res}x{res} on {dev}, budgets {args.budgets}, {args.images} images x "
          f"{args.restarts} restarts, <= {args.steps} steps; out: {args.out}")
    model = get_model(kind, dev, args.cache_dir, args.train_steps, args.train_batch, seed=args.seed)

    # evaluation images: the first `images` correctly classified held-out ones
    n_pool = max(4 * args.images, 16)
    xs, ys = make_digits(n_pool, seed=10_000 + args.seed, res=res, device=dev)
    with torch.no_grad():
        pred = torch.cat([model(xs[i:i + 8]).argmax(-1) for i in range(0, n_pool, 8)])
    clean_acc = (pred == ys).float().mean().item()
    ok = (pred == ys).nonzero()[:, 0][:args.images]
    x, y = xs[ok], ys[ok]
    del xs, ys
    N = len(y)
    assert N > 0, "no correctly classified image to attack"
    print(f"  clean accuracy {100 * clean_acc:.1f} % on {n_pool} held-out images; attacking {N}")
    # rows = restart-major copies of the images
    X = x.repeat(args.restarts, 1, 1, 1)
    Y = y.repeat(args.restarts)
    ids = torch.arange(N, device=dev).repeat(args.restarts)

    warm_up(model, X, Y, args)
    rows, books = [], {}
    for K in args.budgets:
        for method in args.methods:
            candidates = args.pgd_etas if method == "pgd" else [None]
            best = None
            for eta in candidates:
                gen = torch.Generator(device=dev).manual_seed(args.seed * 7919 + K)  # same init for ours/bisection
                timer = SelectorTimer(dev)
                tag = f"K={K} {method}" + (f" eta={eta}" if eta is not None else "")
                timer.sync()
                t0 = time.perf_counter()
                if method == "pgd":
                    book = run_pgd_l0(model, X, Y, ids, K, eta, args, timer, gen, tag)
                else:
                    sel = lapsum_st if method == "ours" else (
                        lambda s, k, t: bisection_st(s, k, t, args.bisection_steps))
                    book = run_mask_attack(model, X, Y, ids, K, args, sel, timer, gen, tag)
                timer.sync()
                wall = time.perf_counter() - t0
                l0 = verify(model, x, y, book, K)
                steps_total = sum(book.row_steps)
                r = dict(method=method, K=K, eta=eta, n_images=N, restarts=args.restarts,
                         n_success=int(book.found.sum()), success=float(book.found.float().mean()),
                         ms_per_image_restart=1e3 * wall / (N * args.restarts),
                         selector_ms=1e3 * timer.total, selector_fwd_ms=1e3 * timer.fwd,
                         selector_bwd_ms=1e3 * timer.bwd, selector_share=timer.total / wall,
                         selector_ms_per_step=1e3 * timer.total / max(timer.calls, 1),
                         selector_calls=timer.calls, wall_s=wall,
                         mean_steps=steps_total / max(len(book.row_steps), 1),
                         l0=l0, succeeded=[a is not None for a in book.adv])
                print(f"    {tag}: success {r['n_success']}/{N}, {r['ms_per_image_restart']:.1f} ms per "
                      f"image-restart, selector {100 * r['selector_share']:.1f} % "
                      f"({r['selector_ms_per_step']:.3f} ms/step), max L0 {max(l0)}")
                if best is None or r["n_success"] > best[0]["n_success"]:
                    best = (r, book)
            r, book = best
            if method == "pgd" and len(candidates) > 1:
                r["eta_grid"] = candidates
            rows.append(r)
            books[(method, K)] = book
    examples = pick_examples(model, x, y, books, args.budgets)
    wall = time.perf_counter() - t_run
    setting = "megapixel 1024x1024 (10^6 pixels)" if args.megapixel else "digits 32x32"
    meta = dict(setting=setting, megapixel=args.megapixel, device=str(dev), torch=torch.__version__,
                threads=torch.get_num_threads(), n_images=N, restarts=args.restarts, steps=args.steps,
                budgets=args.budgets, temperature=args.temperature, lr=args.lr, kappa=args.kappa,
                pgd_etas=args.pgd_etas, bisection_steps=args.bisection_steps, clean_accuracy=clean_acc,
                train_steps=args.train_steps, seed=args.seed, wall_s=round(wall, 1), quick=args.quick,
                note=(f"{N} correctly classified images x {args.restarts} restarts, <= {args.steps} steps; a "
                      f"restart stops at its first success (verified on the 8-bit image). Success = at least "
                      f"one restart succeeded. Selector = the soft_topk calls (ours, bisection: forward + "
                      f"backward) or the top-K projection (PGD-L0). PGD-L0's step size: best of "
                      f"{args.pgd_etas} per K. Wall time of the whole run: {wall:.0f} s."))
    table, ratio = write_outputs(rows, meta, examples, args.out)
    print(table)
    print(ratio)
    print(meta["note"])
    print(f"results written to {args.out}")
    return dict(rows=rows, meta=meta, model=model, x=x, y=y, books=books)


if __name__ == "__main__":
    main()
