"""Token pruning with an exact-budget router, and an expert-choice MoE with exact capacity.

A tiny ViT is trained from scratch on procedurally generated 24x24 shape images (made in
model.py; no downloads). After block 1 a router keeps exactly K of the 36 patch tokens:

  learned : fastlapsum.SoftTopK soft mask while training (sum exactly K, temperature
            annealed), hard top-k + gather at evaluation
  hard    : hard top-k on detached router scores, training and evaluation (the router gets
            no gradient: what a plain top-k gives you today)
  none    : no pruning (the 100 % row of both tables)

Block 2's MLP is an expert-choice MoE whose experts each take exactly C tokens of the batch
(soft_topk(..., hard=True) over the token axis; asserted on every forward).

    python examples/token_pruning/train.py                 # default run (< 5 min, 2 CPU cores)
    python examples/token_pruning/train.py --quick         # a few steps, tiny data (tests)
    python examples/token_pruning/train.py --device cuda --epochs 20

Prints a table (accuracy, tokens the later blocks ran on, forward time) and writes
results.json / results.md (and accuracy_vs_kept.png when matplotlib is installed) to --out.
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
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import N_PATCHES, TinyViT, make_shapes  # noqa: E402

FRACTIONS = (1.0, 0.75, 0.5, 0.25)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--epochs", type=int, default=4, help="passes over the training set")
    ap.add_argument("--steps", type=int, default=None, help="cap on optimiser steps per run")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--train-size", type=int, default=4000)
    ap.add_argument("--test-size", type=int, default=2000)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--t-start", type=float, default=1.0, help="router temperature at step 0")
    ap.add_argument("--t-end", type=float, default=0.05, help="router temperature at the last step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny data, a few steps (smoke test)")
    ap.add_argument("--out", default=None,
                    help="results folder (default: results/ next to this file; a temp folder with --quick)")
    args = ap.parse_args(argv)
    if args.quick:
        args.train_size, args.test_size, args.batch = 64, 64, 32
        args.epochs, args.steps = 1, min(args.steps or 2, 2)
    if args.out is None:  # a --quick run must not overwrite the measured results
        args.out = (tempfile.mkdtemp(prefix="token_pruning_quick_") if args.quick
                    else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    return args


def progress(tag: str, step: int, total: int, loss: float, t: float):
    """One self-overwriting text line (no tqdm dependency)."""
    bar = "#" * int(20 * step / total)
    end = "\n" if step == total else ""
    print(f"\r  {tag:<14} [{bar:<20}] {step:>4}/{total} loss {loss:.3f} T {t:.3f}", end=end, flush=True)


def train_one(prune: str, keep: int, data, args, dev) -> TinyViT:
    torch.manual_seed(args.seed)  # same init and batch order for every variant
    model = TinyViT(keep=keep, prune=prune).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    xtr, ytr = data
    steps_per_epoch = math.ceil(len(xtr) / args.batch)
    total = args.epochs * steps_per_epoch
    if args.steps is not None:
        total = min(total, args.steps)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, args.lr, total_steps=total, pct_start=0.1)
    step, tag = 0, f"{prune}/{keep}"
    model.train()
    while step < total:
        perm = torch.randperm(len(xtr), device=dev)
        for i in range(0, len(xtr), args.batch):
            if step >= total:
                break
            # geometric annealing: soft early (gradients reach many tokens), ~hard at the end
            frac = step / max(total - 1, 1)
            model.gate.temperature = args.t_start * (args.t_end / args.t_start) ** frac
            b = perm[i:i + args.batch]
            loss = F.cross_entropy(model(xtr[b]), ytr[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if step % 10 == 0 or step == total:
                progress(tag, step, total, loss.item(), model.gate.temperature)
    return model


@torch.no_grad()
def evaluate(model: TinyViT, data, dev, batch=500):
    """Accuracy with hard top-k + gather (model.eval()), and the invariants seen on the way."""
    model.eval()
    x, y = data
    correct, seen, moe_ok = 0, set(), True
    moe = model.later[0].mlp
    for i in range(0, len(x), batch):
        logits = model(x[i:i + batch])
        assert torch.isfinite(logits).all(), "non-finite logits"
        correct += (logits.argmax(-1) == y[i:i + batch]).sum().item()
        seen.update(model.last_tokens_seen)
        moe_ok &= bool((moe.last_counts == moe.last_capacity).all())
    return correct / len(x), sorted(seen), moe_ok


@torch.no_grad()
def forward_ms(model: TinyViT, x: torch.Tensor, reps: int) -> float:
    """Median eval forward time of one batch, in ms."""
    model.eval()
    for _ in range(2):
        model(x)
    times = []
    for _ in range(reps):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def write_outputs(rows, meta, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = ["| method | kept | K | accuracy | tokens in blocks 2-3 | forward ms | speed-up |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['kept_pct']} % | {r['K']} | {100 * r['accuracy']:.1f} % | "
                     f"{r['tokens_seen']} | {r['forward_ms']:.2f} | {r['speedup']:.2f}x |")
    table = "\n".join(lines)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# Token pruning results ({meta['device']})\n\n{table}\n\n"
                f"{meta['note']}\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: skipping accuracy_vs_kept.png")
        return table
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method, style in (("learned (SoftTopK)", "o-"), ("hard (detached router)", "s--")):
        pts = sorted((r["kept_pct"], 100 * r["accuracy"]) for r in rows if r["method"] == method)
        ax.plot(*zip(*pts), style, label=method)
    ax.set_xlabel("patch tokens kept (%)")
    ax.set_ylabel("test accuracy (%)")
    ax.invert_xaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy_vs_kept.png"), dpi=120)
    return table


def main(argv=None) -> dict:
    args = parse_args(argv)
    dev = torch.device(args.device)
    t_run = time.perf_counter()
    train = [t.to(dev) for t in make_shapes(args.train_size, seed=args.seed)]
    test = [t.to(dev) for t in make_shapes(args.test_size, seed=args.seed + 10_000)]
    timing_batch = test[0][:256]
    reps = 3 if args.quick else 20

    # 100 %: one unpruned model, shared by both tables (soft_topk with k = n keeps everything)
    runs = [("none", N_PATCHES)] + [(p, round(f * N_PATCHES)) for f in FRACTIONS[1:] for p in ("learned", "hard")]
    results = {}
    for (prune, k) in runs:
        model = train_one(prune, k, train, args, dev)
        acc, seen, moe_ok = evaluate(model, test, dev)
        assert seen == [k], f"{prune}/{k}: later blocks saw {seen} patch tokens, expected exactly {k}"
        assert moe_ok, "an expert did not get exactly C tokens"
        results[(prune, k)] = dict(acc=acc, seen=seen[0], ms=forward_ms(model, timing_batch, reps),
                                   model=model)

    base = results[("none", N_PATCHES)]
    rows = []
    for method, prune in (("learned (SoftTopK)", "learned"), ("hard (detached router)", "hard")):
        for f in FRACTIONS:
            k = round(f * N_PATCHES)
            r = base if k == N_PATCHES else results[(prune, k)]
            rows.append(dict(method=method, kept_pct=int(100 * f), K=k, accuracy=r["acc"],
                             tokens_seen=r["seen"], forward_ms=r["ms"], speedup=base["ms"] / r["ms"]))
    wall = time.perf_counter() - t_run
    meta = dict(device=str(dev), torch=torch.__version__, threads=torch.get_num_threads(),
                epochs=args.epochs, steps=args.steps, batch=args.batch, train_size=args.train_size,
                test_size=args.test_size, seed=args.seed, wall_s=round(wall, 1),
                note=(f"Forward time: median of {reps} eval forwards of a {len(timing_batch)}-image batch; "
                      f"100 % is the same unpruned model in both methods. Tokens = patch tokens "
                      f"blocks 2-3 ran on (plus CLS). Wall time of the whole run: {wall:.0f} s."))
    table = write_outputs(rows, meta, args.out)
    print(table)
    print(meta["note"])
    print(f"results written to {args.out}")
    return dict(rows=rows, meta=meta, models={f"{p}/{k}": r["model"] for (p, k), r in results.items()})


if __name__ == "__main__":
    main()
