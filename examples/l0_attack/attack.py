"""Pixel-L0 attack benchmark: LapSumL0 (fastlapsum) against the L0 attacks of foolbox,
adv-lib and a calibrated PGD-L0, on the same images, model and budgets.

    python examples/l0_attack/attack.py --quick                    # CPU smoke run (temp folder)
    python examples/l0_attack/attack.py --device cuda --out DIR    # 224x224 resnet18 (gpu_run.sh)

Phases (each with a time cap; a failing phase is logged and the others still report):
  train      resnet18 on random crops of the skimage.data photos (data.py)
  calibrate  PGD-L0 step size per K, chosen on a calibration split (never the evaluation crops)
  ours, pgd  fixed-budget attacks at each K (LapSumL0, PGDL0 in lapsum_l0.py)
  peers      minimum-L0 attacks: foolbox L0FMNAttack, foolbox L0BrendelBethgeAttack (needs
             numba), adv-lib fmn(norm=0), adv-lib sigma_zero

Every adversarial image is re-checked after 8-bit quantisation (the model is run again on
the quantised image) and its L0 is counted in pixels (a pixel changed in any channel counts
once). Fixed-budget methods: success at K. Minimum-L0 methods: the fraction of images whose
found adversarial has pixel-L0 <= K, and the median pixel L0 (inf when under half succeed).
Writes results.json, results.md, examples.png and log.txt to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import tempfile
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
from lapsum_l0 import LapSumL0, PGDL0, pixel_l0, quantise  # noqa: E402

FIXED = ("ours", "pgd")
MINIMISERS = ("fb_fmn", "fb_bb", "al_fmn", "al_sigma0")
LABELS = {"ours": "LapSumL0 (fastlapsum, exact-budget ST mask)",
          "pgd": "PGD-L0 (step size from calibration split)",
          "fb_fmn": "foolbox L0FMNAttack", "fb_bb": "foolbox L0BrendelBethgeAttack",
          "al_fmn": "adv-lib fmn(norm=0)", "al_sigma0": "adv-lib sigma_zero"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", type=int, default=None, help="crop side in pixels (default 224; quick 32)")
    ap.add_argument("--budgets", default=None, help="comma-separated pixel budgets K")
    ap.add_argument("--images", type=int, default=None, help="evaluation images (correctly classified)")
    ap.add_argument("--calib", type=int, default=None, help="calibration images for PGD-L0's step size")
    ap.add_argument("--steps", type=int, default=None, help="steps of ours and PGD-L0 per restart")
    ap.add_argument("--restarts", type=int, default=1)
    ap.add_argument("--peer-steps", type=int, default=None, help="steps of FMN / sigma-zero / BB")
    ap.add_argument("--pgd-etas", default="0.03,0.1,0.3,1.0", help="PGD-L0 step-size grid")
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--train-steps", type=int, default=None)
    ap.add_argument("--train-batch", type=int, default=None)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run; phases get shares of it (default 110; quick 300: its caps only guard)")
    ap.add_argument("--methods", default=",".join(FIXED + MINIMISERS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 on CPU: on a small shared machine OpenMP "
                         "barriers cost more than a second thread wins for these small batches)")
    ap.add_argument("--quick", action="store_true", help="tiny CPU run (smoke test)")
    ap.add_argument("--out", default=None, help="output folder (a temp folder with --quick)")
    a = ap.parse_args(argv)
    d = dict(size=224, budgets="4,16,64,256", images=32, calib=16, steps=150, peer_steps=250,
             train_steps=600, train_batch=64, time_budget=110.0)
    if a.quick:
        d.update(size=32, budgets="4,16", images=3, calib=2, steps=12, peer_steps=8,
                 train_steps=20, train_batch=8, time_budget=300.0)
        a.pgd_etas = "0.3"
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.budgets = [int(k) for k in str(a.budgets).split(",")]
    a.pgd_etas = [float(e) for e in str(a.pgd_etas).split(",")]
    a.methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in a.methods if m not in LABELS]
    if bad:
        ap.error(f"--methods: unknown {bad}; choose from {list(LABELS)}")
    if a.out is None:
        if not a.quick:
            ap.error("--out is required (the quick run writes to a temp folder)")
        a.out = tempfile.mkdtemp(prefix="l0_attack_quick_")
    return a


class Clock:
    """Run-wide deadline: a phase's cap is its share of the budget, never past the end."""

    def __init__(self, budget):
        self.t0, self.budget = time.perf_counter(), budget

    def now(self):
        return time.perf_counter() - self.t0

    def cap(self, share):
        return max(0.0, min(share * self.budget, self.budget - self.now()))


class TimeLimit:
    """Raise TimeoutError in the main thread after `seconds` (SIGALRM): a phase that would
    overrun its cap is cut, and the phases before it keep their results."""

    def __init__(self, seconds):
        self.seconds = seconds

    @staticmethod
    def _fire(signum, frame):
        raise TimeoutError("time cap reached")

    def __enter__(self):
        if self.seconds <= 0:
            raise TimeoutError("no time left")
        self.old = signal.signal(signal.SIGALRM, self._fire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.old)
        return False


# --------------------------------------------------------------------------------------
# peers (each returns adversarial candidates for all images; the check happens later)
# --------------------------------------------------------------------------------------

def _adv_lib():
    sys.modules.setdefault("visdom", types.ModuleType("visdom"))  # adv-lib imports it, unused here
    from adv_lib.attacks import fmn, sigma_zero
    return fmn, sigma_zero


def peer_fn(name, model, steps):
    if name in ("fb_fmn", "fb_bb"):
        import foolbox as fb

        fmodel = fb.PyTorchModel(model, bounds=(0, 1))
        if name == "fb_fmn":
            atk = fb.attacks.L0FMNAttack(steps=steps)
        else:  # foolbox's documented initialisation: an init_attack that finds a starting point
            atk = fb.attacks.L0BrendelBethgeAttack(
                init_attack=fb.attacks.LinearSearchBlendedUniformNoiseAttack(), steps=steps)
        return lambda x, y: atk(fmodel, x, y, epsilons=None)[1]
    fmn, sigma_zero = _adv_lib()
    if name == "al_fmn":
        return lambda x, y: fmn(model, x, y, norm=0, steps=steps)
    return lambda x, y: sigma_zero(model, x, y, num_steps=steps)


def run_chunked(fn, x, y, chunk, cap, log):
    """fn on chunks of images until the time cap; images not reached stay clean (failures)."""
    out, t0, n = x.clone(), time.perf_counter(), 0
    for i in range(0, len(x), chunk):
        try:
            with TimeLimit(cap - (time.perf_counter() - t0)):
                adv = fn(x[i:i + chunk], y[i:i + chunk]).detach()
        except TimeoutError:
            log(f"    time cap {cap:.0f} s: attacked {n}/{len(x)} images (the rest count as failures)")
            break
        out[i:i + chunk] = adv
        n = min(i + chunk, len(x))
    return out, n


@torch.no_grad()
def check(model, x, y, adv):
    """8-bit check of candidates: (uint8 images, pixel L0, misclassified) per image."""
    u8 = torch.round(adv.clamp(0, 1) * 255).to(torch.uint8)
    xq = u8.float() / 255
    pred = torch.cat([model(xq[i:i + 32]).argmax(1) for i in range(0, len(xq), 32)])
    return u8, pixel_l0(xq, x), pred != y


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------

def calibrate_pgd(model, xc, yc, args, cap, log):
    """Per K, the eta in the grid with the highest success on the calibration split (ties:
    fewer mean steps). Never sees the evaluation images."""
    best, t0, prev = {}, time.perf_counter(), args.pgd_etas[0]
    for K in args.budgets:
        scores = []
        for eta in args.pgd_etas:
            atk = PGDL0(model, k=K, steps=args.steps, eta=eta, seed=args.seed + 1)
            try:
                with TimeLimit(cap - (time.perf_counter() - t0)):
                    atk(xc, yc)
            except TimeoutError:
                log(f"    time cap {cap:.0f} s: K={K} grid cut after {len(scores)} value(s)")
                break
            scores.append((int(atk.success.sum()), -float(atk.steps_used.float().mean()), eta))
        best[K] = prev = max(scores)[2] if scores else prev
        log(f"    K={K}: eta {best[K]} (calibration successes {[s[0] for s in scores]} "
            f"for etas {args.pgd_etas[:len(scores)]})")
    return best


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "log.txt"), "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    clock = Clock(args.time_budget)
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    if dev.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    if dev.type == "cuda":  # fp32 attacks and checks: TF32 would blur the 8-bit decisions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    res = dict(meta=dict(vars(args), device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                         torch=torch.__version__), rows=[], phases={}, errors={})

    def save():
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({k: v for k, v in res.items() if k != "adv" and not k.startswith("_")},
                      f, indent=1, default=str)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(results_md(res))

    # ---- data and model
    t = clock.now()
    photos = data.load_photos(dev)
    model, tsteps = data.train(photos, args.size, args.train_steps, args.train_batch, args.seed,
                               clock.cap(0.25), log)
    n_pool = max(4 * (args.images + args.calib), 64)
    xe, ye, boxes_e = data.make_split(photos, n_pool, args.size, args.seed + 2)
    xc, yc, boxes_c = data.make_split(photos, n_pool, args.size, args.seed + 1)
    ok_e, ok_c = data.correct(model, xe, ye), data.correct(model, xc, yc)
    acc = float(ok_e.float().mean())
    ie, ic = ok_e.nonzero()[:, 0][:args.images], ok_c.nonzero()[:, 0][:args.calib]
    x, y, xc, yc = xe[ie], ye[ie], xc[ic], yc[ic]
    res["meta"].update(train_steps_done=tsteps, clean_accuracy=acc, n_eval=len(y), n_calib=len(yc),
                       pixels=args.size * args.size)
    res["split"] = dict(eval_boxes=boxes_e[ie.cpu()].tolist(), calib_boxes=boxes_c[ic.cpu()].tolist())
    res["phases"]["train"] = clock.now() - t
    log(f"[train] {tsteps} steps, clean accuracy {acc:.3f} on {n_pool} evaluation-stream crops; "
        f"attacking {len(y)} correctly classified {args.size}x{args.size} crops "
        f"({res['phases']['train']:.1f} s)")
    res["_model"], res["_x"], res["_y"], res["_xc"], res["_yc"] = model, x, y, xc, yc
    res["adv"] = {}
    save()

    # ---- PGD-L0 calibration (own split)
    etas = {K: args.pgd_etas[0] for K in args.budgets}
    if "pgd" in args.methods:
        t = clock.now()
        log("[calibrate] PGD-L0 step size on the calibration split")
        try:
            etas = calibrate_pgd(model, xc, yc, args, clock.cap(0.13), log)
        except Exception as e:  # fail soft: keep the grid's first value
            res["errors"]["calibrate"] = repr(e)
            log(f"    failed: {e!r}")
        res["meta"]["pgd_eta"] = etas
        res["phases"]["calibrate"] = clock.now() - t

    shares = dict(ours=0.12, pgd=0.10, fb_fmn=0.08, fb_bb=0.08, al_fmn=0.08, al_sigma0=0.08)
    for name in args.methods:
        t = clock.now()
        cap = clock.cap(shares[name])
        log(f"[{name}] {LABELS[name]} (cap {cap:.0f} s)")
        try:
            if name in FIXED:
                for K in args.budgets:
                    sync(dev)
                    tk = time.perf_counter()
                    if name == "ours":
                        atk = LapSumL0(model, k=K, steps=args.steps, restarts=args.restarts,
                                       lr=args.lr, temperature=args.temperature, seed=args.seed)
                    else:
                        atk = PGDL0(model, k=K, steps=args.steps, restarts=args.restarts,
                                    eta=etas[K], seed=args.seed)
                    try:
                        with TimeLimit(cap - (clock.now() - t)):
                            adv = atk(x, y)
                            sync(dev)
                    except TimeoutError:
                        log(f"    time cap {cap:.0f} s: K={K} not finished, not reported")
                        res["errors"][f"{name}_K{K}"] = "time cap"
                        continue
                    record(res, name, K, model, x, y, adv, time.perf_counter() - tk, log,
                           steps=float(atk.steps_used.float().mean()))
            else:
                if name == "fb_bb":
                    import numba  # noqa: F401  foolbox's BB needs it; missing -> reported as skipped
                fn = peer_fn(name, model, args.peer_steps)
                sync(dev)
                tk = time.perf_counter()
                adv, n = run_chunked(fn, x, y, 16 if dev.type == "cuda" else 4, cap, log)
                sync(dev)
                record(res, name, None, model, x, y, adv, time.perf_counter() - tk, log, attacked=n)
        except Exception as e:
            res["errors"][name] = repr(e)
            log(f"    {name} failed or skipped: {e!r}")
        res["phases"][name] = clock.now() - t
        save()

    try:
        plot_examples(res, os.path.join(args.out, "examples.png"))
    except Exception as e:
        res["errors"]["plot"] = repr(e)
    res["meta"]["total_s"] = clock.now()
    save()
    log(f"[done] {clock.now():.1f} s; results in {args.out}")
    logf.close()
    return res


def record(res, name, K, model, x, y, adv, secs, log, steps=None, attacked=None):
    """Check the candidates after 8-bit quantisation and add this method's rows."""
    u8, l0, mis = check(model, x, y, adv)
    l0, mis = l0.cpu(), mis.cpu()
    n = len(y)
    if K is not None:  # fixed budget: success at this K only
        ok = mis & (l0 <= K)
        res["adv"][(name, K)] = (u8.cpu(), ok)
        res["rows"].append(dict(method=name, K=K, success=float(ok.float().mean()), n=n,
                                l0=[int(v) if o else -1 for v, o in zip(l0, ok)], seconds=secs,
                                mean_steps=steps))
        log(f"    K={K}: success {int(ok.sum())}/{n}  {secs:.1f} s  mean steps {steps:.1f}")
        return
    l0_eff = torch.where(mis, l0.float(), torch.tensor(math.inf))
    res["adv"][(name, None)] = (u8.cpu(), mis)
    med = float(l0_eff.median()) if n else math.inf
    for k in res["meta"]["budgets"]:
        res["rows"].append(dict(method=name, K=k, success=float((l0_eff <= k).float().mean()), n=n,
                                median_l0=med, seconds=secs, attacked=attacked,
                                l0=[int(v) if o else -1 for v, o in zip(l0, mis)]))
    log(f"    adversarial after quantisation {int(mis.sum())}/{n}, median pixel L0 {med:g}, "
        f"success at K {[round(float((l0_eff <= k).float().mean()), 3) for k in res['meta']['budgets']]}"
        f"  {secs:.1f} s")


def results_md(res):
    m = res["meta"]
    ks = m["budgets"]
    lines = [f"resnet18 trained from scratch, {m['size']}x{m['size']} crops of the skimage.data photos "
             f"({len(data.PHOTOS)} classes), {m.get('n_eval', '?')} correctly classified evaluation crops "
             f"(clean accuracy {m.get('clean_accuracy', float('nan')):.3f}), device {m['device_name']}; "
             f"pixel L0 after 8-bit quantisation; ours/PGD-L0 {m['steps']} steps x {m['restarts']} restart(s), "
             f"peers {m['peer_steps']} steps.", "",
             "| method | kind | " + " | ".join(f"success K={k}" for k in ks) + " | median pixel L0 | time (s) |",
             "|---|---|" + "---|" * len(ks) + "---|---|"]
    for name in list(FIXED) + list(MINIMISERS):
        rows = [r for r in res["rows"] if r["method"] == name]
        if not rows and name not in res["errors"]:
            continue
        if not rows:
            lines.append(f"| {LABELS[name]} | — | " + " | ".join("—" for _ in ks)
                         + f" | — | not run: {res['errors'][name][:60]} |")
            continue
        by_k = {r["K"]: r for r in rows}
        cells = [f"{by_k[k]['success']:.3f}" if k in by_k else "—" for k in ks]
        if name in FIXED:
            kind, med, secs = "fixed K", "—", sum(r["seconds"] for r in rows)
        else:
            kind, med, secs = "min L0", f"{rows[0]['median_l0']:g}", rows[0]["seconds"]
        lines.append(f"| {LABELS[name]} | {kind} | " + " | ".join(cells) + f" | {med} | {secs:.1f} |")
    if "pgd_eta" in m:
        lines += ["", "PGD-L0 step size per K (chosen on the calibration split): "
                  + ", ".join(f"K={k}: {v}" for k, v in m["pgd_eta"].items())]
    return "\n".join(lines) + "\n"


def plot_examples(res, path, n_show=4):
    """Clean and ours' adversarial crops at the smallest K with successes; changed pixels ringed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [k for (name, k) in res["adv"] if name == "ours" and bool(res["adv"][(name, k)][1].any())]
    if not ks:
        return
    K = min(ks)
    u8, ok = res["adv"][("ours", K)]
    idx = ok.nonzero()[:, 0][:n_show].tolist()
    x = res["_x"].cpu()
    fig, axes = plt.subplots(2, len(idx), figsize=(max(2.6 * len(idx), 6.0), 5.4), squeeze=False)
    for j, i in enumerate(idx):
        clean = x[i].permute(1, 2, 0).numpy()
        adv = u8[i].permute(1, 2, 0).float().numpy() / 255
        pts = (u8[i] != torch.round(x[i] * 255).to(torch.uint8)).any(0).nonzero()
        axes[0, j].imshow(clean)
        axes[0, j].set_title(data.PHOTOS[int(res["_y"][i])], fontsize=8)
        axes[1, j].imshow(adv)
        axes[1, j].scatter(pts[:, 1], pts[:, 0], s=30, facecolors="none", edgecolors="red", linewidths=0.6)
        axes[1, j].set_title(f"{len(pts)} pixels changed", fontsize=8)
        for a in axes[:, j]:
            a.axis("off")
    fig.suptitle(f"LapSumL0, K={K}: clean (top), adversarial (bottom, changes ringed)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
