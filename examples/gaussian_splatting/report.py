"""results.json, results.md (the README's table format), psnr_vs_retention.png, renders.png."""
import json
import os

import torch


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def table(rows, ref_psnr):
    lines = ["| method | kept | Gaussians | PSNR (dB) | vs no pruning (dB) | SSIM | render FPS | train s | "
             "selector s (share) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = None if ref_psnr is None else r["psnr"] - ref_psnr
        sel = "-" if "selector_s" not in r else f"{r['selector_s']:.2f} ({100 * r['selector_share']:.1f} %)"
        lines.append(f"| {r['name']} | {100 * r['retention']:.0f} % | {r['n']:,} | {r['psnr']:.2f} | "
                     f"{_fmt(d, '+.2f')} | {r['ssim']:.4f} | {r['fps']:.0f} | {r['train_s']:.1f} | {sel} |")
    return lines


def write_outputs(res, views, out, plots=True):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    meta, rows, sweep = res["meta"], res["rows"], res["sweep"]
    ref = next((r["psnr"] for r in rows if r["method"] == "none"), None)
    a = meta["args"]
    md = [f"Scene: {a['n_ref']:,} reference Gaussians, {a['views']} views at {a['size']} px (every 8th held "
          f"out), device {meta['device']}. ADC: {meta.get('n_init', '?'):,} -> {meta.get('n_adc', '?'):,} "
          f"Gaussians in {meta.get('adc_steps', '?')} steps. Each method: {a['score_steps']} score steps, "
          f"prune to K = {meta.get('K', '?'):,}, {a['finetune_steps']} fine-tune steps. Held-out views.", ""]
    md += table(rows, ref)
    if sweep:
        md += ["", f"Retention sweep (from the ADC snapshot; {a['sweep_score']} score + {a['sweep_finetune']} "
               "fine-tune steps, shorter than the main table; the difference column is against the main "
               "table's no-pruning run):", ""]
        md += table(sweep, ref)
    if res["errors"]:
        md += ["", "Errors:", ""] + ["    " + e.replace("\n", "\n    ") for e in res["errors"]]
    phases = ", ".join(f"{k} {v:.1f}" for k, v in res["phases"].items())
    md += ["", f"Phases (s): {phases}"]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    if not plots:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if sweep:
        fig, ax = plt.subplots(figsize=(5.5, 4))
        for m in dict.fromkeys(r["method"] for r in sweep):
            pts = sorted((r["retention"], r["psnr"]) for r in sweep if r["method"] == m)
            ax.plot(*zip(*pts), marker="o", label=next(r["name"] for r in sweep if r["method"] == m))
        if ref is not None:
            ax.axhline(ref, color="gray", ls="--", label="no pruning")
        ax.set_xlabel("kept fraction")
        ax.set_ylabel("held-out PSNR (dB)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out, "psnr_vs_retention.png"), dpi=120)
        plt.close(fig)
    if len(views) > 1:
        fig, axs = plt.subplots(1, len(views), figsize=(2.6 * len(views), 2.9))
        for ax, (name, img) in zip(axs, views.items()):
            ax.imshow(img.clamp(0, 1).float().numpy())
            ax.set_title(name, fontsize=7)
            ax.axis("off")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "renders.png"), dpi=120)
        plt.close(fig)
