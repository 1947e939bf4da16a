"""Learned exact-budget pruning of a multi-view 3D Gaussian-splatting fit, against baselines.

Pipeline (one scene, every method from the same densified snapshot, the same K and schedule):
  scene      reference Gaussians on textured surfaces rendered from cameras on a sphere;
             every 8th view is held out
  ADC        train from a subsampled point cloud with gsplat's DefaultStrategy (the grow
             threshold is set each refine to a gradient quantile so the size reaches --target)
  score      S steps; learned: opacities x fastlapsum.soft_topk(scores, k_t, t_t), k_t: N -> K
             (lapsum_strategy.py), then a hard prune to exactly K through gsplat's remove op;
             hard baselines: plain training, then a prune to the top K by their statistic
  fine-tune  F steps, no densification
Methods: no pruning; hard by alpha*T blending weight summed over the training views; hard by
opacity; learned (soft_topk); learned with a 60-step bisection selector (selector cost).
Metrics on the held-out views: PSNR, SSIM, Gaussians, render FPS, training time, selector
share. A retention sweep reuses the ADC snapshot with shorter S and F (--sweep-score,
--sweep-finetune). CUDA uses gsplat's rasterizer; the CPU uses renderer.py's dense fallback.
"""
import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
from torchmetrics.functional.image import structural_similarity_index_measure as ssim_fn

from lapsum_strategy import LapSumPruneStrategy
from renderer import blend_weights, rasterize
from report import write_outputs
from scene import make_scene

PRESETS = {
    "quick": dict(device="cpu", size=16, views=16, n_ref=400, n_init=80, target=200, t1=30,
                  score_steps=16, finetune_steps=16, sweep_score=8, sweep_finetune=8, batch=2,
                  refine_every=8, budget_s=600.0, render_reps=1, threads=1),
    "gpu": dict(device="cuda", size=192, views=128, n_ref=400_000, n_init=120_000, target=1_000_000,
                t1=800, score_steps=300, finetune_steps=500, sweep_score=100, sweep_finetune=150,
                batch=4, refine_every=100, budget_s=200.0, render_reps=10, threads=0),
}
METHODS = [("none", "no pruning"), ("learned", "learned (soft_topk)"),
           ("bisection", "learned (60-step bisection)"), ("alphaT", "hard (alpha*T blend weight)"),
           ("opacity", "hard (opacity)")]
NAMES = dict(METHODS)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny CPU scene, the smoke test (= --preset quick)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--out", default=None, help="output folder (default: results/ beside this file)")
    ap.add_argument("--backend", choices=["auto", "gsplat", "torch"], default="auto",
                    help="auto: gsplat on CUDA, the dense PyTorch fallback on the CPU")
    for key, val in PRESETS["quick"].items():
        ap.add_argument("--" + key.replace("_", "-"), type=type(val), default=None)
    ap.add_argument("--retention", type=float, default=0.3, help="kept fraction of the main table")
    ap.add_argument("--retentions", default="0.1,0.3,0.5,0.7,0.9", help="sweep; empty to skip")
    ap.add_argument("--t-start", type=float, default=1.0)
    ap.add_argument("--t-end", type=float, default=0.05)
    ap.add_argument("--budget-power", type=float, default=2.0)
    ap.add_argument("--score-lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset or ("quick" if args.quick else "gpu")]
    for key, val in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    if not 0 < args.retention < 1:
        ap.error(f"--retention must be in (0, 1), got {args.retention}")
    args.sweep = [float(r) for r in args.retentions.split(",") if r.strip()]
    if any(not 0 < r < 1 for r in args.sweep):
        ap.error(f"--retentions must lie in (0, 1), got {args.retentions}")
    return args


class Clock:
    """Wall budget shared by the phases: a phase of n planned steps gets the remaining time
    times n over the remaining planned steps, so an overrun early shrinks what follows."""

    def __init__(self, budget_s, planned_steps, dev, reserve=0.12):
        self.t0, self.budget, self.left_steps, self.dev = time.perf_counter(), budget_s, planned_steps, dev
        self.reserve = reserve

    def now(self):
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        return time.perf_counter()

    def elapsed(self):
        return time.perf_counter() - self.t0

    def cap(self, steps, weight=1.0):
        left = max(self.budget * (1 - self.reserve) - self.elapsed(), 0.0)
        share = min(left, left * weight * steps / max(self.left_steps, 1))
        self.left_steps = max(self.left_steps - steps, 0)
        return share


def log(msg, clock=None):
    stamp = f"[{clock.elapsed():7.1f}s] " if clock else ""
    print(stamp + msg, flush=True)


def make_params(src, dev):
    params = torch.nn.ParameterDict({k: torch.nn.Parameter(v.detach().clone().to(dev)) for k, v in src.items()})
    return params


def make_optimizers(params, spacing):
    lrs = dict(means=0.1 * spacing, quats=1e-3, scales=5e-3, opacities=5e-2, colors=1e-2)
    return {k: torch.optim.Adam([params[k]], lr=lr, eps=1e-15) for k, lr in lrs.items()}


def init_params(scene, n_init, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    ref = scene["ref"]
    n_ref = ref["means"].shape[0]
    idx = torch.randperm(n_ref, generator=gen)[:n_init].to(ref["means"].device)
    spacing = math.sqrt(12.0 / n_init)
    means = ref["means"][idx] + 0.3 * spacing * torch.randn(n_init, 3, generator=gen).to(ref["means"].device)
    dev = means.device
    return dict(means=means, quats=torch.randn(n_init, 4, generator=gen).to(dev),
                scales=torch.full((n_init, 3), math.log(0.7 * spacing), device=dev),
                opacities=torch.full((n_init,), math.log(0.3 / 0.7), device=dev),
                colors=torch.zeros(n_init, 3, device=dev)), spacing


def render(params, opac, viewmats, Ks, scene, backend):
    return rasterize(params["means"], params["quats"], torch.exp(params["scales"]), opac,
                     torch.sigmoid(params["colors"]), viewmats, Ks, scene["width"], scene["height"], backend)


def train(params, opts, scene, args, steps, step0, gen, clock, tag, *, strategy=None, sstate=None,
          adc=None, adc_state=None):
    """steps of training from step0; stops early at its share of the wall budget. ADC and the
    score phases may take twice their share: ADC's size is what every method starts from, and
    the bisection selector's score steps cost more than the others' (every method must get
    the same steps)."""
    cap = clock.cap(steps, 2.0 if adc is not None or strategy is not None else 1.0)
    t0 = clock.now()
    ids = scene["train"]
    done, loss = 0, torch.tensor(float("nan"))
    for it in range(step0, step0 + steps):
        if time.perf_counter() - t0 > cap:
            log(f"{tag}: time cap {cap:.1f}s reached after {done}/{steps} steps", clock)
            break
        cams = ids[torch.randint(len(ids), (args.batch,), generator=gen).to(ids.device)]
        opac = strategy.opacities(params, sstate, it) if strategy else torch.sigmoid(params["opacities"])
        img, _, info = render(params, opac, scene["viewmats"][cams], scene["Ks"][cams], scene, args.backend)
        if adc is not None:
            adc.step_pre_backward(params, opts, adc_state, it, info)
        gt = scene["images"][cams].permute(0, 3, 1, 2)
        pred = img.permute(0, 3, 1, 2)
        loss = 0.8 * (pred - gt).abs().mean() + 0.2 * (1 - ssim_fn(pred, gt, data_range=1.0))
        loss.backward()
        for o in opts.values():
            o.step()
            o.zero_grad(set_to_none=True)
        if adc is not None:
            _adc_step(adc, adc_state, params, opts, it, info, args)
        if strategy is not None:
            strategy.step_post_backward(params, opts, sstate, it, info)
        done += 1
    secs = clock.now() - t0
    log(f"{tag}: {done} steps in {secs:.1f}s, {params['means'].shape[0]} Gaussians, loss {loss.item():.4f}", clock)
    return dict(steps=done, seconds=secs)


def _adc_step(adc, state, params, opts, it, info, args):
    n = params["means"].shape[0]
    if n >= args.target:
        adc.refine_stop_iter = min(adc.refine_stop_iter, it)
    if it >= adc.refine_stop_iter:
        return
    if it > adc.refine_start_iter and it % adc.refine_every == 0 and state["count"] is not None:
        # grow the Gaussians with the largest mean screen-space gradient (ADC's criterion), at
        # most 80 % of them per refine, the threshold picked so the size lands just past --target
        g = (state["grad2d"] / state["count"].clamp_min(1))[state["count"] > 0]
        if g.numel():
            frac = min(max(args.target * 1.05 / n - 1, 0.05), 0.8)  # aim just past the target
            q = max(1, int((1 - frac) * g.numel()))
            adc.grow_grad2d = float(torch.kthvalue(g.float().cpu(), q).values)
    adc.step_post_backward(params, opts, state, it, info, packed=False)
    if it > adc.refine_start_iter and it % adc.refine_every == 0:
        log(f"ADC step {it}: {n} -> {params['means'].shape[0]} Gaussians")


@torch.no_grad()
def evaluate(params, scene, args, reps):
    ids = scene["test"]
    opac = torch.sigmoid(params["opacities"])
    preds = torch.cat([render(params, opac, scene["viewmats"][ids[i:i + 8]], scene["Ks"][ids[i:i + 8]], scene,
                              args.backend)[0].clamp(0, 1) for i in range(0, len(ids), 8)])
    gt = scene["images"][ids]
    mse = ((preds - gt) ** 2).flatten(1).mean(1)
    psnr = (-10 * torch.log10(mse.clamp_min(1e-12))).mean().item()
    ssim = ssim_fn(preds.permute(0, 3, 1, 2), gt.permute(0, 3, 1, 2), data_range=1.0).item()
    dev = preds.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    render(params, opac, scene["viewmats"][ids[:1]], scene["Ks"][ids[:1]], scene, args.backend)  # warm-up
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        for i in ids:
            render(params, opac, scene["viewmats"][i:i + 1], scene["Ks"][i:i + 1], scene, args.backend)
    sync()
    fps = reps * len(ids) / (time.perf_counter() - t0)
    return dict(psnr=psnr, ssim=ssim, fps=fps, n=params["means"].shape[0]), preds[0].cpu()


def hard_prune(params, opts, keep_scores, K):
    from gsplat.strategy import ops

    drop = torch.ones(keep_scores.shape[0], dtype=torch.bool, device=keep_scores.device)
    drop[torch.topk(keep_scores, K, sorted=False).indices] = False
    ops.remove(params, opts, {}, drop)


def blend_importance(params, scene, args, clock, cache_key):
    """(alpha*T summed over the training views, the seconds that pass took), computed once per
    snapshot (cache_key) and charged to every run that uses it."""
    cache = scene.setdefault("importance", {})  # snapshots live as long as the scene
    if cache_key not in cache:
        ids = scene["train"]
        t0 = clock.now()
        w = blend_weights(params["means"], params["quats"], torch.exp(params["scales"]),
                          torch.sigmoid(params["opacities"]), scene["viewmats"][ids], scene["Ks"][ids],
                          scene["width"], scene["height"], args.backend)
        cache[cache_key] = (w, clock.now() - t0)
    return cache[cache_key]


def run_method(method, K, S, F, snap, pre, scene, args, spacing, clock, step0, pre_seconds=0.0):
    """One method from the ADC snapshot (learned) or the post-S snapshot (hard / none)."""
    dev = scene["images"].device
    gen = torch.Generator().manual_seed(args.seed + 7)
    tag = f"{method}@{K}"
    if method in ("learned", "bisection"):
        params = make_params(snap, dev)
        opts = make_optimizers(params, spacing)
        w, init_s = blend_importance(params, scene, args, clock, id(snap))
        init = torch.log(w + 1e-6)
        strat = LapSumPruneStrategy(keep=K, score_start=step0, prune_at=step0 + S - 1, t_start=args.t_start,
                                    t_end=args.t_end, budget_power=args.budget_power, score_lr=args.score_lr,
                                    solver="lapsum" if method == "learned" else "bisection")
        sstate = strat.initialize_state(params, init)
        r1 = train(params, opts, scene, args, S, step0, gen, clock, tag + " score", strategy=strat, sstate=sstate)
        if not sstate["pruned"]:  # the phase was cut short by its time cap
            strat.prune(params, opts, sstate)
        mask = sstate["last_mask"]
        extra = dict(selector_s=strat.selector_seconds(sstate), selector_calls=sstate["calls"],
                     mask_sum_err=abs(mask.double().sum().item() - sstate["last_k"]) if mask is not None else None,
                     n_after_prune=sstate["n_after_prune"])
        train_s = init_s + r1["seconds"]
        steps_done = r1["steps"]
    else:
        params = make_params(pre, dev)
        opts = make_optimizers(params, spacing)
        train_s, steps_done, extra = pre_seconds, S, {}
        if method != "none":
            if method == "alphaT":
                stat, secs = blend_importance(params, scene, args, clock, id(pre))
                train_s += secs
            else:
                stat = params["opacities"].detach()
            hard_prune(params, opts, stat, K)
            extra["n_after_prune"] = params["means"].shape[0]
    r2 = train(params, opts, scene, args, F, step0 + S, gen, clock, tag + " fine-tune")
    train_s += r2["seconds"]
    metrics, view = evaluate(params, scene, args, args.render_reps)
    row = dict(method=method, name=NAMES[method], K=K, steps=steps_done + r2["steps"], train_s=train_s, **metrics,
               **extra)
    if "selector_s" in row:
        row["selector_share"] = row["selector_s"] / max(train_s, 1e-9)
    sel = f" selector {row['selector_s']:.2f}s ({100 * row['selector_share']:.1f} %)" if "selector_s" in row else ""
    log(f"{tag}: PSNR {metrics['psnr']:.2f} SSIM {metrics['ssim']:.4f} N {metrics['n']} "
        f"FPS {metrics['fps']:.0f} train {train_s:.1f}s{sel}", clock)
    return row, view


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available (use --quick or --device cpu)")
    dev = torch.device(args.device)
    if args.threads > 0:  # tiny CPU tensors: more threads only add contention
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    S, F, Ss, Fs = args.score_steps, args.finetune_steps, args.sweep_score, args.sweep_finetune
    planned = args.t1 + S + 3 * F + 2 * (S + F) + Ss + len(args.sweep) * (2 * Ss + 3 * Fs)
    clock = Clock(args.budget_s, planned, dev)
    res = dict(meta=dict(args=vars(args), device=str(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else "cpu"),
               rows=[], sweep=[], phases={}, errors=[])
    views = {}

    def save(plots=False):
        write_outputs(res, views, out, plots)

    try:
        t0 = clock.now()
        scene = make_scene(args.n_ref, args.views, args.size, args.size, dev, args.backend, seed=args.seed)
        res["phases"]["scene_s"] = clock.now() - t0
        views["ground truth"] = scene["images"][scene["test"][0]].cpu()
        log(f"scene: {args.n_ref} reference Gaussians, {len(scene['train'])} train / {len(scene['test'])} "
            f"held-out views at {args.size}px ({res['phases']['scene_s']:.1f}s)", clock)

        from gsplat.strategy import DefaultStrategy

        init, spacing = init_params(scene, args.n_init, args.seed)
        params = make_params(init, dev)
        opts = make_optimizers(params, spacing)
        adc = DefaultStrategy(refine_start_iter=args.refine_every // 2, refine_every=args.refine_every,
                              refine_stop_iter=args.t1, reset_every=10 ** 9, prune_opa=0.005)
        adc_state = adc.initialize_state(scene_scale=1.5)
        gen = torch.Generator().manual_seed(args.seed + 3)
        r = train(params, opts, scene, args, args.t1, 0, gen, clock, "ADC", adc=adc, adc_state=adc_state)
        res["phases"]["adc_s"] = r["seconds"]
        snap = {k: v.detach().clone() for k, v in params.items()}
        n_adc = snap["means"].shape[0]
        res["meta"].update(n_init=args.n_init, n_adc=n_adc, adc_steps=r["steps"])
        del params, opts, adc_state
        K = round(args.retention * n_adc)
        res["meta"]["K"] = K
        # the hard baselines and "no pruning" share the S plain steps after the snapshot
        params = make_params(snap, dev)
        opts = make_optimizers(params, spacing)
        r = train(params, opts, scene, args, S, args.t1, torch.Generator().manual_seed(args.seed + 7), clock, "plain")
        pre, pre_s = {k: v.detach().clone() for k, v in params.items()}, r["seconds"]
        res["phases"]["plain_s"] = pre_s
        del params, opts
    except KeyboardInterrupt:
        res["errors"].append("interrupted during scene/ADC")
        save()
        return res
    save()

    def attempt(target, method, K, S_, F_, pre_, pre_s_, label):
        try:
            row, view = run_method(method, K, S_, F_, snap, pre_, scene, args, spacing, clock, args.t1, pre_s_)
            row["retention"] = K / n_adc
            target.append(row)
            if label:
                views[label] = view
        except KeyboardInterrupt:
            raise
        except Exception:
            res["errors"].append(f"{method}@{K}: {traceback.format_exc()}")
            log(res["errors"][-1], clock)
        save()

    try:
        for method, name in METHODS:
            attempt(res["rows"], method, K, S, F, pre, pre_s, name)
        save(plots=True)
        if args.sweep:
            params = make_params(snap, dev)
            opts = make_optimizers(params, spacing)
            r = train(params, opts, scene, args, Ss, args.t1, torch.Generator().manual_seed(args.seed + 7), clock,
                      "sweep plain")
            pre_sw = {k: v.detach().clone() for k, v in params.items()}
            del params, opts
            for ret in args.sweep:
                for method in ("learned", "alphaT", "opacity"):
                    attempt(res["sweep"], method, round(ret * n_adc), Ss, Fs, pre_sw, r["seconds"], None)
    except KeyboardInterrupt:
        res["errors"].append("interrupted")
    res["phases"]["total_s"] = clock.elapsed()
    save(plots=True)
    # the log alone carries the table (a GPU machine may return the log without the other files)
    with open(os.path.join(out, "results.md")) as f:
        print(f.read(), flush=True)
    log(f"done in {clock.elapsed():.1f}s; outputs in {out}", clock)
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
