"""Token pruning and MoE routing in a timm VisionTransformer, trained from scratch on
cluttered digits (data.py: real handwritten digits on real photographs, no downloads).

Phase "prune" (pruning.py): before block --at (default 0: on the patch embeddings) a router
  keeps K of the 64 patch tokens: soft (fastlapsum.soft_topk, sum exactly K), gated hard
  top-K (Mixture-of-Depths style), EViT-style CLS-attention top-K with fusion, and the
  unpruned model; every K of --keep, every seed.
Phase "moe" (moe.py): MoE MLPs in blocks --moe-blocks with three routers: expert choice
  through the exact-budget soft router, hard expert choice (torch.topk), token choice with
  a capacity limit; every seed.

Every run of a phase takes exactly the same number of optimiser steps (--prune-steps,
--moe-steps), on every seed. Runs go seed by seed (all of both phases for seed 0, then
seed 1, ...), so a safety --deadline (no new run after it) drops whole seeds, not a method;
skipped runs are listed in the results. Results are written after every run (results.json,
results.md) and printed at the end.

    python examples/token_pruning/train.py --quick                      # smoke test (CPU)
    python examples/token_pruning/train.py --device cuda --out /tmp/tp
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from data import ClutteredDigits  # noqa: E402
from moe import MoE, load_cv  # noqa: E402
from pruning import PrunedViT, make_vit  # noqa: E402

PRUNE_LABELS = {"none": "unpruned", "soft": "soft top-K (fastlapsum, exact budget)",
                "st": "straight-through top-K (fastlapsum, hard=True)",
                "gated": "gated hard top-K (MoD-style)", "evit": "EViT CLS-attention top-K + fuse"}
MOE_LABELS = {"ec_soft": "expert choice, exact-budget soft router",
              "ec_hard": "expert choice, hard torch.topk", "tc": "token choice top-1, capacity"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="results folder (default: a temp folder)")
    ap.add_argument("--phases", default="prune,moe")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--keep", default="2,8", help="K values (patch tokens kept, of 64)")
    ap.add_argument("--dim", type=int, default=192)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--patch", type=int, default=8, help="patch side; the digit fills one patch")
    ap.add_argument("--canvas", type=int, default=64, help="image side in px (64 patch tokens at patch 8)")
    ap.add_argument("--contrast", type=float, default=0.4, help="background photo contrast (digit is 1.0)")
    ap.add_argument("--at", type=int, default=0,
                    help="prune after this many blocks (0: the patch embeddings, before any block)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--prune-steps", type=int, default=160, help="optimiser steps of every pruning run")
    ap.add_argument("--moe-steps", type=int, default=120, help="optimiser steps of every MoE run")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from start after which no new run starts (a safety net)")
    ap.add_argument("--t-start", type=float, default=1.0, help="soft router temperature, first step")
    ap.add_argument("--t-end", type=float, default=0.05, help="soft router temperature, last step")
    ap.add_argument("--methods", default="soft,st,gated,evit,none", help="pruning methods to run")
    ap.add_argument("--routers", default="ec_soft,ec_hard,tc", help="MoE routers to run")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--moe-blocks", default="0,1",
                    help="blocks whose MLP is the MoE: the first ones, where the digit's own token is processed")
    ap.add_argument("--n-test", type=int, default=4096)
    ap.add_argument("--quick", action="store_true", help="tiny model, a few steps (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.dim, args.depth, args.heads, args.batch = 32, 3, 2, 16
        args.prune_steps = args.moe_steps = 3
        args.n_test, args.seeds, args.keep, args.moe_blocks = 64, "0,1", "4", "0"
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.keep = [int(k) for k in args.keep.split(",")]
    args.moe_blocks = [int(b) for b in args.moe_blocks.split(",")]
    args.phases = args.phases.split(",")
    args.methods, args.routers = args.methods.split(","), args.routers.split(",")
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="token_pruning_")
    return args


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_pruned(args, method, keep):
    vit = make_vit(args.dim, args.depth, args.heads, args.patch, args.canvas)
    return PrunedViT(vit, method, keep, args.at)


def build_moe(args, router):
    vit = make_vit(args.dim, args.depth, args.heads, args.patch, args.canvas)
    for i in args.moe_blocks:
        vit.blocks[i].mlp = MoE(args.dim, 4 * args.dim, args.experts, router)
    return vit


def moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model):
    return sum((m.aux_loss for m in moe_layers(model)), torch.zeros(()))


def train_run(model, data, args, seed, steps, dev):
    """AdamW, warm-up + cosine; soft router temperature annealed geometrically."""
    model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    g = torch.Generator(device=dev).manual_seed(1000 + seed)
    t0 = time.perf_counter()
    loss = float("nan")
    for step in range(steps):
        if isinstance(model, PrunedViT):
            model.temperature = args.t_start * (args.t_end / args.t_start) ** (step / max(steps - 1, 1))
        x, y = data.batch(args.batch, g)
        out = model(x)
        loss_t = F.cross_entropy(out, y) + aux_loss(model).to(out.device)
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    loss = float(loss_t.detach())  # syncs
    return {"steps": steps, "train_s": time.perf_counter() - t0, "final_loss": loss}


@torch.no_grad()
def eval_pruned(model, data, args, dev, chunk=512, timing_reps=12):
    model.eval()
    correct, ink_kept, ink_total, seen = 0, 0, 0, set()
    for i in range(0, len(data.test_y), chunk):
        x, y = data.test_x[i:i + chunk], data.test_y[i:i + chunk]
        correct += int((model(x).argmax(-1) == y).sum())
        seen.add(model.last_tokens_seen)
        ink = data.digit_patches(x, args.patch)
        ink_total += int(ink.sum())
        if model.last_kept is not None:
            ink_kept += int(ink.gather(1, model.last_kept).sum())
        else:
            ink_kept += int(ink.sum())
    x = data.test_x[:chunk]
    times = []
    for _ in range(timing_reps):
        sync(dev)
        t = time.perf_counter()
        model(x)
        sync(dev)
        times.append(time.perf_counter() - t)
    return {"accuracy": correct / len(data.test_y), "tokens_seen": sorted(seen),
            "ink_recall": ink_kept / max(ink_total, 1), "forward_ms": 1e3 * statistics.median(times[2:])}


@torch.no_grad()
def eval_moe(model, data, dev, chunk=512):
    model.eval()
    correct, cv, cv_wanted, unproc, dropped, tokens = 0, [], [], 0, 0, 0
    for i in range(0, len(data.test_y), chunk):
        x, y = data.test_x[i:i + chunk], data.test_y[i:i + chunk]
        correct += int((model(x).argmax(-1) == y).sum())
        for m in moe_layers(model):
            s = m.stats
            cv.append(load_cv(s["counts"]))
            cv_wanted.append(load_cv(s["wanted"]))
            unproc += int(s["unprocessed"])
            dropped += int(s["dropped"])
            tokens += s["tokens"]
    return {"accuracy": correct / len(data.test_y), "load_cv": statistics.mean(cv),
            "wanted_cv": statistics.mean(cv_wanted), "dropped_frac": dropped / tokens,
            "unprocessed_frac": unproc / tokens}


def router_grad_probe(model, data, args, dev):
    """One training batch: the fraction of (token, expert) router logits that receive a
    nonzero gradient, averaged over the MoE layers."""
    model.train()
    g = torch.Generator(device=dev).manual_seed(99)
    x, y = data.batch(args.batch, g)
    layers = moe_layers(model)
    model.zero_grad(set_to_none=True)
    out = model(x)
    for m in layers:
        m.logits.retain_grad()
    F.cross_entropy(out, y).backward()
    fr = [float((m.logits.grad != 0).float().mean()) for m in layers]
    model.zero_grad(set_to_none=True)
    return statistics.mean(fr)


def mean_std(v):
    return (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0)


def pm(v, scale=100.0, digits=1):
    m, s = mean_std([scale * a for a in v])
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def table(title, seeds, runs, key, header, cells):
    """Markdown table, one row per key(run) in first-seen order, cells(runs) -> row cells."""
    if not runs:
        return []
    steps = sorted({r["steps"] for r in runs})  # one value: every run of a phase takes the same steps
    lines = [f"{title} (seeds {seeds}, mean ± std over the seeds run; optimiser steps per run: "
             f"{', '.join(map(str, steps))})", "",
             "| " + " | ".join(header) + " | seeds |", "|---" + "|---:" * len(header) + "|"]
    for k in dict.fromkeys(key(r) for r in runs):
        rs = [r for r in runs if key(r) == k]
        lines.append("| " + " | ".join(cells(rs)) + f" | {len(rs)} |")
    return lines + [""]


def write_results(res, out):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({k: v for k, v in res.items() if k != "models"}, f, indent=1, default=str)
    lines = [f"Config: {res['config']}", ""]
    lines += table(
        "Token pruning", res["seeds"], res["prune_runs"], lambda r: (r["method"], r["K"]),
        ["method", "K (of 64 patch tokens)", "patch tokens the blocks ran on", "test accuracy %",
         "digit patches kept %", "forward ms (512 imgs)"],
        lambda rs: [PRUNE_LABELS[rs[0]["method"]], str(rs[0]["K"]), str(rs[0]["tokens_seen"][0]),
                    pm([r["accuracy"] for r in rs]), pm([r["ink_recall"] for r in rs]),
                    f"{statistics.median(r['forward_ms'] for r in rs):.2f}"])
    lines += table(
        "MoE routing", res["seeds"], res["moe_runs"], lambda r: r["router"],
        ["router", "test accuracy %", "load CV (processed)", "load CV (wanted)", "tokens dropped %",
         "tokens no expert ran %", "router logits with gradient %"],
        lambda rs: [MOE_LABELS[rs[0]["router"]], pm([r["accuracy"] for r in rs]),
                    pm([r["load_cv"] for r in rs], 1, 3), pm([r["wanted_cv"] for r in rs], 1, 3),
                    pm([r["dropped_frac"] for r in rs]), pm([r["unprocessed_frac"] for r in rs]),
                    pm([r["router_grad_frac"] for r in rs])])
    if res["skipped"]:
        lines += ["Skipped by the safety deadline (not run; rows above have fewer seeds):", ""]
        lines += [f"- {t}" for t in res["skipped"]] + [""]
    if res["errors"]:
        lines += ["Errors:", ""] + [f"- {e}" for e in res["errors"]] + [""]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines))


def main(argv=None):
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.quick:  # a tiny model on a shared CPU: one thread is faster than several
        torch.set_num_threads(1)
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _main(args):
    start = time.perf_counter()
    dev = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    os.makedirs(args.out, exist_ok=True)
    data = ClutteredDigits(dev, n_backgrounds=64 if args.quick else 2048, n_test=args.n_test,
                           contrast=args.contrast, canvas=args.canvas,
                           sizes=(args.patch, args.patch), align=args.patch)
    print(f"data ready in {time.perf_counter() - start:.1f}s", flush=True)
    import timm
    res = {"config": (f"timm {timm.__version__} VisionTransformer dim {args.dim}, depth {args.depth}, "
                      f"heads {args.heads}, patch {args.patch}, {args.canvas}x{args.canvas} input "
                      f"({(args.canvas // args.patch) ** 2} patch tokens), pruning after "
                      f"{args.at} blocks, MoE in blocks {args.moe_blocks}, batch {args.batch}, lr {args.lr}, device {dev}, torch {torch.__version__}"),
           "seeds": args.seeds, "prune_runs": [], "moe_runs": [], "errors": [], "skipped": [],
           "phase_s": {}, "models": {}}

    n_patches = (args.canvas // args.patch) ** 2
    pruned = [m for m in args.methods if m != "none"]
    jobs = {"prune": [(m, k) for k in args.keep for m in pruned] + [("none", n_patches)] * ("none" in args.methods),
            "moe": [(r, None) for r in args.routers]}
    steps = {"prune": args.prune_steps, "moe": args.moe_steps}
    res["steps"] = {p: steps[p] for p in args.phases}
    for p in args.phases:
        res["phase_s"][p] = 0.0
        print(f"[{p}] {len(jobs[p])} runs x {len(args.seeds)} seeds, {steps[p]} steps each", flush=True)
    for seed in args.seeds:  # seed-major: a deadline drops whole seeds, never one method
        for phase in args.phases:
            for name, keep in jobs[phase]:
                tag = f"{phase} {name} K={keep} seed {seed}"
                if args.deadline is not None and time.perf_counter() - start > args.deadline:
                    res["skipped"].append(tag)
                    continue
                t_run = time.perf_counter()
                try:  # one run failing must not lose the others' results
                    torch.manual_seed(seed)
                    model = build_pruned(args, name, keep) if phase == "prune" else build_moe(args, name)
                    info = train_run(model, data, args, seed, steps[phase], dev)
                    if phase == "prune":
                        row = {"method": name, "K": keep, "seed": seed, **info,
                               **eval_pruned(model, data, args, dev, timing_reps=4 if args.quick else 12)}
                        res["prune_runs"].append(row)
                        msg = f"acc {row['accuracy']:.3f} ink {row['ink_recall']:.2f}"
                    else:
                        row = {"router": name, "seed": seed, **info, **eval_moe(model, data, dev),
                               "router_grad_frac": router_grad_probe(model, data, args, dev)}
                        res["moe_runs"].append(row)
                        msg = (f"acc {row['accuracy']:.3f} cv {row['load_cv']:.3f} drop {row['dropped_frac']:.3f} "
                               f"grad {row['router_grad_frac']:.2f}")
                    res["models"][f"{phase}/{name}/{keep}/{seed}"] = model
                    print(f"[{phase}] {name:8s} K={keep} seed {seed}: {info['steps']} steps "
                          f"{info['train_s']:.1f}s ({1e3 * info['train_s'] / info['steps']:.1f} ms/step) "
                          f"loss {info['final_loss']:.3f} {msg} (t={time.perf_counter() - start:.0f}s)", flush=True)
                except Exception as e:
                    traceback.print_exc()
                    res["errors"].append(f"{tag}: {type(e).__name__}: {e}")
                res["phase_s"][phase] += time.perf_counter() - t_run
                write_results(res, args.out)
    for p in args.phases:
        print(f"[{p}] phase total {res['phase_s'][p]:.1f}s", flush=True)
    if res["skipped"]:
        print(f"deadline ({args.deadline:.0f}s) reached: {len(res['skipped'])} runs skipped", flush=True)
    res["wall_s"] = time.perf_counter() - start
    write_results(res, args.out)
    for name in ("results.md", "results.json"):  # into the log: the log is what surely comes back
        print(f"===== {name} =====")
        print(open(os.path.join(args.out, name)).read())
    print(f"total {res['wall_s']:.1f}s; results in {args.out}", flush=True)
    return res


if __name__ == "__main__":
    main()
