"""Pixel-L0 attack benchmark: LapSumL0 (fastlapsum) against the L0 attacks of foolbox,
adv-lib and a calibrated PGD-L0, on the same images, model and budgets.

    python examples/l0_attack/attack.py --quick                    # CPU smoke run (temp folder)
    python examples/l0_attack/attack.py --device cuda --out DIR    # 224x224 resnet18 (gpu_run.sh)

Phases, in order (each with a time cap; a failing phase is logged and the others still report):
  train      resnet18 on random crops of the skimage.data photos (data.py), while the
             Brendel-Bethge worker processes compile numba's solver (peers.py)
  al_sigma0  adv-lib sigma_zero; its verified adversarials become BB's starting points
  calibrate  PGD-L0 step size per K: every eta of the grid at every K, on a calibration
             split (never the evaluation crops), all etas of one K in one batched run
  ours, pgd  fixed-budget attacks at each K (LapSumL0, PGDL0 in lapsum_l0.py)
  al_fmn, fb_fmn   adv-lib fmn(norm=0), foolbox L0FMNAttack (minimum L0, from the clean image)
  fb_bb      foolbox L0BrendelBethgeAttack results collected from the workers (needs numba)

Every candidate is re-checked after 8-bit quantisation (the model is run again on the
quantised image) and its L0 is counted in pixels (a pixel changed in any channel counts
once). Fixed-budget methods: success at K. Minimum-L0 methods: the fraction of images whose
adversarial has pixel-L0 <= K, and the median pixel L0. Writes results.json, results.md,
examples.png and log.txt to --out, and prints the table and a RESULTS_JSON line at the end.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import peers  # noqa: E402
from lapsum_l0 import LapSumL0, PGDL0, pixel_l0  # noqa: E402

FIXED = ("ours", "pgd")
MINIMISERS = ("al_sigma0", "al_fmn", "fb_fmn", "fb_bb")
LABELS = {"ours": "LapSumL0 (fastlapsum, exact-budget ST mask)",
          "pgd": "PGD-L0 (step size from calibration split)",
          "fb_fmn": "foolbox L0FMNAttack", "fb_bb": "foolbox L0BrendelBethgeAttack (from sigma-zero)",
          "al_fmn": "adv-lib fmn(norm=0)", "al_sigma0": "adv-lib sigma_zero"}
# phase caps as shares of --time-budget (118 s on the GPU; BB's workers run to --bb-time, 230 s, inside gpu_run.sh's 260 s; with
# ~12 s of imports); each is a guard well above the phase's estimated time
SHARES = dict(train=0.19, al_sigma0=0.135, calibrate=0.085, ours=0.145, pgd=0.145, al_fmn=0.135,
              fb_fmn=0.17)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", type=int, default=None, help="crop side in pixels (default 224; quick 32)")
    ap.add_argument("--budgets", default=None, help="comma-separated pixel budgets K")
    ap.add_argument("--images", type=int, default=None, help="evaluation images (correctly classified)")
    ap.add_argument("--calib", type=int, default=None, help="calibration images for PGD-L0's step size")
    ap.add_argument("--steps", type=int, default=None, help="steps of ours and PGD-L0 per restart")
    ap.add_argument("--calib-steps", type=int, default=None, help="PGD-L0 steps per calibration run")
    ap.add_argument("--restarts", type=int, default=1)
    ap.add_argument("--peer-steps", type=int, default=None, help="steps of FMN and sigma-zero")
    ap.add_argument("--bb-steps", type=int, default=None, help="steps of Brendel-Bethge")
    ap.add_argument("--bb-workers", type=int, default=None, help="Brendel-Bethge worker processes")
    ap.add_argument("--bb-time", type=float, default=None,
                    help="seconds from the start until the Brendel-Bethge workers stop (default: the time budget); "
                         "BB is collected last, so a longer deadline only extends the run's end")
    ap.add_argument("--pgd-etas", default="0.03,0.1,0.3,1.0", help="PGD-L0 step-size grid")
    ap.add_argument("--lr", type=float, default=0.3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--train-steps", type=int, default=None)
    ap.add_argument("--train-batch", type=int, default=None)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run; phases get shares of it (default 118; quick 300: its caps only guard)")
    ap.add_argument("--methods", default=None,
                    help="comma-separated subset of the methods (default all; --quick: all but fb_bb, "
                         "whose numba compilation alone takes longer than the smoke run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default 1 on CPU: on a small shared machine OpenMP "
                         "barriers cost more than a second thread wins for these small batches)")
    ap.add_argument("--quick", action="store_true", help="tiny CPU run (smoke test)")
    ap.add_argument("--out", default=None, help="output folder (a temp folder with --quick)")
    a = ap.parse_args(argv)
    d = dict(size=224, budgets="256,512,1024,2048", images=16, calib=8, steps=150, calib_steps=75,
             peer_steps=500, bb_steps=80, bb_workers=6, train_steps=600, train_batch=64, time_budget=118.0)
    d["methods"] = ",".join(m for m in FIXED + MINIMISERS if not (a.quick and m == "fb_bb"))
    if a.quick:
        d.update(size=32, budgets="4,16", images=3, calib=2, steps=12, calib_steps=6, peer_steps=8,
                 bb_steps=3, bb_workers=1, train_steps=20, train_batch=8, time_budget=300.0)
        a.pgd_etas = "0.3,1.0"
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
        self.t0, self.wall0, self.budget = time.perf_counter(), time.time(), budget

    def now(self):
        return time.perf_counter() - self.t0

    def cap(self, share):
        return max(0.0, min(share * self.budget, self.budget - self.now()))


class Terminated(BaseException):
    """SIGTERM (gpu_run.sh's timeout): leave the phases, still print what was measured."""


def _terminate(signum, frame):
    raise Terminated()


@torch.no_grad()
def check(model, x, y, adv):
    """8-bit check of candidates: (uint8 images, pixel L0, misclassified, float candidate
    misclassified) per image. Two roundings are tried: to the nearest 8-bit level, and away
    from the clean value in every changed channel (a minimum-norm peer's candidate sits on the
    decision boundary and nearest rounding can pull it back); the adversarial one is kept,
    nearest first. Both change no pixel the candidate did not change."""
    adv = adv.clamp(0, 1)
    x255, a255 = torch.round(x * 255), adv * 255
    near = torch.round(a255)
    away = torch.where(a255 > x255, torch.ceil(a255), torch.where(a255 < x255, torch.floor(a255), x255))

    def mis(z):
        return torch.cat([model(z[i:i + 32]).argmax(1) for i in range(0, len(z), 32)]) != y

    f_mis = mis(adv)
    m_near = mis(near / 255)
    m_away = mis(away / 255)
    q = torch.where((m_near | ~m_away).view(-1, 1, 1, 1), near, away)
    u8 = q.to(torch.uint8)
    return u8, pixel_l0(q / 255, x), m_near | m_away, f_mis


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------

def calibrate_pgd(model, xc, yc, args, cap, log):
    """Per K, the eta of the grid with the most successes on the calibration split (ties:
    fewer mean steps, then the lower mean best margin). One batched PGD-L0 run per K tries
    every eta (each calibration image once per eta). Never sees the evaluation images; a K
    the cap cuts gets no eta (its PGD-L0 row is then not run, never a silent default)."""
    best, t0 = {}, time.perf_counter()
    E, n = len(args.pgd_etas), len(yc)
    xr, yr = xc.repeat(E, 1, 1, 1), yc.repeat(E)
    etas = torch.tensor(args.pgd_etas).repeat_interleave(n)
    for K in args.budgets:
        atk = PGDL0(model, k=K, steps=args.calib_steps, eta=etas, seed=args.seed + 1)
        tk = time.perf_counter()
        try:
            with peers.TimeLimit(cap - (time.perf_counter() - t0)):
                atk(xr, yr)
        except TimeoutError:
            log(f"    time cap {cap:.0f} s: K={K} NOT calibrated (PGD-L0 will skip it)")
            continue
        succ = atk.success.view(E, n).sum(1).tolist()
        steps = atk.steps_used.float().view(E, n).mean(1).tolist()
        marg = atk.best_margin.clamp(min=-atk.kappa).view(E, n).mean(1).tolist()
        j = max(range(E), key=lambda e: (succ[e], -steps[e], -marg[e]))
        best[K] = args.pgd_etas[j]
        log(f"    K={K}: eta {best[K]}  (etas {args.pgd_etas}: successes {succ}/{n}, mean steps "
            f"{[round(v, 1) for v in steps]}, mean best margin {[round(v, 2) for v in marg]})  "
            f"{time.perf_counter() - tk:.1f} s")
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
                         torch=torch.__version__), rows=[], phases={}, errors={}, adv={})
    old_term = signal.signal(signal.SIGTERM, _terminate)
    procs = []
    try:
        run_phases(args, res, clock, dev, log, procs)
    except Terminated:
        res["errors"]["run"] = "terminated (SIGTERM)"
        log("[terminated] printing what was measured")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        for p in procs:  # BB workers this run started, if still running
            if p.poll() is None:
                p.kill()
        if "_bb_dir" in res:
            shutil.rmtree(res["_bb_dir"], ignore_errors=True)
        res["meta"]["total_s"] = clock.now()
        save(res, args.out)
        log(f"[done] {clock.now():.1f} s; results in {args.out}")
        log("")
        log(results_md(res))
        log("RESULTS_JSON " + json.dumps(compact(res), default=str, separators=(",", ":")))
        logf.close()
    return res


def save(res, out):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(compact(res), split=res.get("split")), f, indent=1, default=str)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(results_md(res))


def compact(res):
    return {k: v for k, v in res.items() if k not in ("adv", "split") and not k.startswith("_")}


def run_phases(args, res, clock, dev, log, procs):
    # ---- Brendel-Bethge workers: compile numba during training, attack once sigma-zero's
    # adversarials exist
    bb_dir = res["_bb_dir"] = tempfile.mkdtemp(prefix="l0_bb_")  # not in --out: keep it to results
    bb_deadline = clock.wall0 + max(args.bb_time or 0.0, args.time_budget) - 3
    if "fb_bb" in args.methods:
        if importlib.util.find_spec("numba") is None:
            res["errors"]["fb_bb"] = "needs numba (not installed)"
        elif "al_sigma0" not in args.methods:
            res["errors"]["fb_bb"] = "starts from al_sigma0, which is not run"
        else:
            procs += peers.bb_start(bb_dir, args.size, args, bb_deadline)
            log(f"[fb_bb] {len(procs)} worker process(es) started (numba compile; deadline "
                f"{bb_deadline - clock.wall0:.0f} s)")

    # ---- data and model
    t = clock.now()
    photos = data.load_photos(dev)
    model, tsteps = data.train(photos, args.size, args.train_steps, args.train_batch, args.seed,
                               clock.cap(SHARES["train"]), log)
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
    save(res, args.out)

    order = ["al_sigma0", "calibrate", "ours", "pgd", "al_fmn", "fb_fmn", "fb_bb"]
    etas = {}
    for name in order:
        if name not in args.methods and not (name == "calibrate" and "pgd" in args.methods):
            continue
        if name == "fb_bb" and not procs:
            continue
        t = clock.now()
        cap = clock.cap(SHARES.get(name, 1.0))
        log(f"[{name}] {LABELS.get(name, 'PGD-L0 step size on the calibration split')} (cap {cap:.0f} s)")
        try:
            if name == "calibrate":
                etas = calibrate_pgd(model, xc, yc, args, cap, log)
                res["meta"]["pgd_eta"] = etas
            elif name in FIXED:
                fixed_phase(name, args, res, model, x, y, etas, cap, clock, t, dev, log)
            elif name == "fb_bb":
                adv, n, secs = peers.bb_collect(bb_dir, procs, x, bb_deadline, log)
                record(res, name, None, model, x, y, adv, secs, log, attacked=n)
            else:
                fn = peers.peer_fn(name, model, args.peer_steps)
                sync(dev)
                tk = time.perf_counter()
                adv, n = peers.run_chunked(fn, x, y, 16 if dev.type == "cuda" else 4, cap, log)
                sync(dev)
                record(res, name, None, model, x, y, adv, time.perf_counter() - tk, log, attacked=n)
        except Exception as e:
            res["errors"][name] = repr(e)
            log(f"    {name} failed or skipped: {e!r}")
        if name == "al_sigma0" and procs:  # always, so that the workers never wait in vain
            u8, ok = res["adv"].get((name, None), (None, torch.zeros(len(y), dtype=torch.bool)))
            if u8 is not None:  # the workers run the model one image at a time, where a start on the
                ok = ok & single_image_adversarial(model, u8, y)  # boundary can flip: skip those
            starts = [u8[i].float().div(255) if ok[i] else None for i in range(len(y))]
            peers.bb_give_starts(bb_dir, model, x, y, starts)
        res["phases"][name] = clock.now() - t
        save(res, args.out)

    try:
        plot_examples(res, os.path.join(args.out, "examples.png"))
    except Exception as e:
        res["errors"]["plot"] = repr(e)


@torch.no_grad()
def single_image_adversarial(model, u8, y):
    """Per 8-bit image: misclassified when the model sees it alone (batch of one), as the BB
    workers' foolbox model does; cuDNN picks other kernels by batch size, so a start at the
    decision boundary can be adversarial in a batch and not alone (foolbox asserts on it)."""
    dev = next(model.parameters()).device
    return torch.tensor([bool(model(u8[i:i + 1].to(dev).float().div(255)).argmax(1).item() != int(y[i]))
                         for i in range(len(y))])


def fixed_phase(name, args, res, model, x, y, etas, cap, clock, t, dev, log):
    """ours or PGD-L0 at every K, one run per K; a K past the cap is logged, not reported."""
    for K in args.budgets:
        if name == "pgd" and K not in etas:
            log(f"    K={K}: no calibrated step size, not run")
            res["errors"][f"{name}_K{K}"] = "not calibrated"
            continue
        sync(dev)
        tk = time.perf_counter()
        if name == "ours":
            atk = LapSumL0(model, k=K, steps=args.steps, restarts=args.restarts,
                           lr=args.lr, temperature=args.temperature, seed=args.seed)
        else:
            atk = PGDL0(model, k=K, steps=args.steps, restarts=args.restarts, eta=etas[K], seed=args.seed)
        try:
            with peers.TimeLimit(cap - (clock.now() - t)):
                adv = atk(x, y)
                sync(dev)
        except TimeoutError:
            log(f"    time cap {cap:.0f} s: K={K} not finished, not reported")
            res["errors"][f"{name}_K{K}"] = "time cap"
            continue
        record(res, name, K, model, x, y, adv, time.perf_counter() - tk, log,
               steps=float(atk.steps_used.float().mean()))


def record(res, name, K, model, x, y, adv, secs, log, steps=None, attacked=None):
    """Check the candidates after 8-bit quantisation and add this method's rows."""
    u8, l0, mis, fmis = check(model, x, y, adv)
    l0, mis, fmis = l0.cpu(), mis.cpu(), fmis.cpu()
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
                                float_adv=int(fmis.sum()), adv_8bit=int(mis.sum()),
                                l0=[int(v) if o else -1 for v, o in zip(l0, mis)]))
    log(f"    attacked {attacked}/{n}; adversarial in float {int(fmis.sum())}/{n}, after 8-bit rounding "
        f"{int(mis.sum())}/{n}; median pixel L0 {med:g}; success at K "
        f"{[round(float((l0_eff <= k).float().mean()), 3) for k in res['meta']['budgets']]}  {secs:.1f} s")


def results_md(res):
    m = res["meta"]
    ks = m["budgets"]
    lines = [f"resnet18 trained from scratch, {m['size']}x{m['size']} crops of the skimage.data photos "
             f"({len(data.PHOTOS)} classes), {m.get('n_eval', '?')} correctly classified evaluation crops "
             f"(clean accuracy {m.get('clean_accuracy', float('nan')):.3f}), device {m['device_name']}; "
             f"pixel L0 after 8-bit rounding; ours/PGD-L0 {m['steps']} steps x {m['restarts']} restart(s) "
             f"per K, FMN/sigma-zero {m['peer_steps']} steps, BB {m['bb_steps']} steps.", "",
             "| method | kind | " + " | ".join(f"success K={k}" for k in ks)
             + " | median pixel L0 | adversarial float / 8-bit | time (s) |",
             "|---|---|" + "---|" * len(ks) + "---|---|---|"]
    for name in list(FIXED) + list(MINIMISERS):
        rows = [r for r in res["rows"] if r["method"] == name]
        if not rows and name not in res["errors"]:
            continue
        if not rows:
            lines.append(f"| {LABELS[name]} | — | " + " | ".join("—" for _ in ks)
                         + f" | — | — | not run: {res['errors'][name][:60]} |")
            continue
        by_k = {r["K"]: r for r in rows}
        cells = [f"{by_k[k]['success']:.3f}" if k in by_k else "—" for k in ks]
        if name in FIXED:
            kind, med, secs, fa = "fixed K", "—", sum(r["seconds"] for r in rows), "—"
        else:
            r0 = rows[0]
            kind, med, secs = "min L0", f"{r0['median_l0']:g}", r0["seconds"]
            fa = f"{r0['float_adv']} / {r0['adv_8bit']} of {r0['n']}"
            if r0["attacked"] is not None and r0["attacked"] < r0["n"]:
                fa += f" ({r0['attacked']} attacked)"
        lines.append(f"| {LABELS[name]} | {kind} | " + " | ".join(cells) + f" | {med} | {fa} | {secs:.1f} |")
    if "pgd_eta" in m:
        lines += ["", "PGD-L0 step size per K (chosen on the calibration split): "
                  + ", ".join(f"K={k}: {m['pgd_eta'].get(k, 'not calibrated')}" for k in ks)]
    if res["errors"]:
        lines += ["", "Errors / cuts: " + "; ".join(f"{k}: {v[:80]}" for k, v in res["errors"].items())]
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
    if len(sys.argv) == 4 and sys.argv[1] == "--bb-worker":
        peers.bb_worker(sys.argv[2], int(sys.argv[3]))
    else:
        main()
