"""Smoke test of examples/gaussian_splatting: the --quick run, in-process, plus its invariants.

Checks that the run finishes and writes its table, that after the prune at T2 exactly K
Gaussians remain for both pruning methods at every retention (and nothing regrows), that
the soft mask's sum was K, and that the splatter's hand-written backward matches autograd
through a dense reference renderer.
"""
import json
import math

import torch

from conftest import load_example



def _load(name):
    return load_example("gaussian_splatting", name)


def test_quick_run_exact_budget(tmp_path):
    threads = torch.get_num_threads()
    train = _load("train")
    try:
        res = train.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # main() pins CPU threads; leave the session as it was
    meta, rows = res["meta"], res["rows"]
    n_adc = meta["n_adc"]
    assert n_adc > meta["n_init"]  # ADC densified
    assert rows[0]["method"].startswith("reference") and rows[0]["n_final"] == n_adc
    kept = sorted({r["retention"] for r in rows[1:]})
    assert kept == [0.1, 0.3, 0.5, 0.7, 0.9]
    for r in rows[1:]:
        K = round(r["retention"] * n_adc)
        assert r["K"] == K
        assert r["n_after_prune"] == K, r  # exactly K right after the hard prune at T2
        assert r["n_final"] == K, r        # and still K at T3 (no densification after T1)
        assert r["size_bytes"] == K * 36
        assert math.isfinite(r["psnr"]) and 0 < r["ssim"] <= 1
        assert r["renders_per_s"] > 0
        if r["method"].startswith("learned"):
            assert r["mask_sum_err"] <= 1e-6 * max(K, 1) + 1e-4  # soft_topk kept sum(p) = K
            assert r["selector_calls"] == meta["args"]["t2"] - meta["args"]["t1"] + 1
    for key, out in res["results"].items():
        assert out["g"].n == (n_adc if key == "reference" else out["K"])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == len(rows) == 11
    md = (tmp_path / "results.md").read_text()
    assert "learned (soft_topk)" in md and "hard (footprint x opacity)" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "psnr_vs_retention.png").stat().st_size > 0
    assert (tmp_path / "renders.png").stat().st_size > 0


def test_splatter_backward_matches_dense_autograd():
    splat = _load("splat")
    torch.manual_seed(0)
    N, H, W = 25, 14, 17
    f64 = dict(dtype=torch.float64)
    m = (torch.rand(N, 2, **f64) * torch.tensor([W + 4.0, H + 4.0], **f64) - 2).requires_grad_()
    s = (torch.rand(N, 2, **f64) * 2 + 0.4).requires_grad_()
    th = (torch.rand(N, **f64) * 3).requires_grad_()
    col = torch.rand(N, 3, **f64).requires_grad_()
    w = torch.rand(N, **f64).requires_grad_()
    for blend in ("normalized", "additive"):
        out, contrib = splat.render(m, s, th, col, w, H, W, blend=blend, max_pairs=150, return_contrib=True)
        ref = splat.render_reference(m, s, th, col, w, H, W, blend=blend)
        torch.testing.assert_close(out, ref)
        G = torch.randn_like(out)
        g1 = torch.autograd.grad((out * G).sum(), [m, s, th, col, w])
        g2 = torch.autograd.grad((ref * G).sum(), [m, s, th, col, w])
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b)
    assert contrib.shape == (N,) and (contrib >= 0).all()
