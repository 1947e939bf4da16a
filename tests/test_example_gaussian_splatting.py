"""examples/gaussian_splatting: the --quick run (fallback renderer, CPU) and its invariants; the
fallback renderer against a per-pixel loop written from gsplat's kernel; the alpha*T statistic;
the bisection selector against soft_topk; the strategy's prune through gsplat's remove op."""
import json
import math

import pytest
import torch

from conftest import load_example

pytest.importorskip("gsplat")
pytest.importorskip("torchmetrics")


def _load(name):
    return load_example("gaussian_splatting", name)


def test_quick_run(tmp_path):
    threads = torch.get_num_threads()
    train = _load("train")
    try:
        res = train.main(["--quick", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # main() pins CPU threads; leave the session as it was
    meta, rows, sweep = res["meta"], res["rows"], res["sweep"]
    assert not res["errors"], res["errors"]
    assert meta["n_adc"] > meta["n_init"]  # ADC densified
    K = meta["K"]
    assert K == round(0.3 * meta["n_adc"])
    by = {r["method"]: r for r in rows}
    assert list(by) == ["none", "learned", "bisection", "alphaT", "opacity"]
    assert by["none"]["n"] == meta["n_adc"]
    S = meta["args"]["score_steps"]
    for m in ("learned", "bisection", "alphaT", "opacity"):
        assert by[m]["n_after_prune"] == by[m]["n"] == K  # exactly K, nothing regrows
    for m in ("learned", "bisection"):
        assert by[m]["selector_calls"] == S
        assert by[m]["mask_sum_err"] <= 1e-4 * K  # sum(mask) == k_t at the prune
        assert 0 < by[m]["selector_share"] < 1
    # the two selectors compute the same mask, so the runs agree
    assert abs(by["learned"]["psnr"] - by["bisection"]["psnr"]) < 0.05
    for r in rows + sweep:
        assert math.isfinite(r["psnr"]) and 0 < r["ssim"] <= 1 and r["fps"] > 0
    assert sorted({round(r["retention"], 1) for r in sweep}) == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert len(sweep) == 15 and all(r["n"] == r["K"] for r in sweep)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == 5
    md = (tmp_path / "results.md").read_text()
    assert "learned (soft_topk)" in md and "hard (alpha*T blend weight)" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "psnr_vs_retention.png").stat().st_size > 0
    assert (tmp_path / "renders.png").stat().st_size > 0


def _scene64(N=14, C=2, W=9, H=7, seed=0):
    torch.manual_seed(seed)
    scene = _load("scene")
    viewmats, Ks = scene.orbit_cameras(C, W, H, radius=3.0)
    f64 = dict(dtype=torch.float64)
    return dict(means=(torch.rand(N, 3, **f64) - 0.5) * 0.8 + torch.tensor([0, 0, 0.3], **f64),
                quats=torch.randn(N, 4, **f64), scales=torch.rand(N, 3, **f64) * 0.15 + 0.02,
                opacities=torch.rand(N, **f64) * 0.98 + 0.01, colors=torch.rand(N, 3, **f64),
                viewmats=viewmats.double(), Ks=Ks.double(), W=W, H=H)


def _loop_render(s):
    """Per pixel, written from gsplat's classic kernel; the 2D covariance uses the Jacobian of
    the pinhole projection taken by autograd. Returns images [C,H,W,3] and the per-Gaussian
    sums of alpha*T, and the accumulated alpha [C,H,W]."""
    rnd = _load("renderer")
    C, N = s["viewmats"].shape[0], s["means"].shape[0]
    img = torch.zeros(C, s["H"], s["W"], 3, dtype=torch.float64)
    acc = torch.zeros(C, s["H"], s["W"], dtype=torch.float64)
    wsum = torch.zeros(N, dtype=torch.float64)
    for c in range(C):
        V, K = s["viewmats"][c], s["Ks"][c]

        def proj(p):
            q = V[:3, :3] @ p + V[:3, 3]
            return torch.stack([K[0, 0] * q[0] / q[2] + K[0, 2], K[1, 1] * q[1] / q[2] + K[1, 2]])

        g = []
        for i in range(N):
            m = s["means"][i]
            Jw = torch.autograd.functional.jacobian(proj, m)  # d(pixel)/d(world point)
            Rq = rnd.quat_to_rotmat(s["quats"][i])
            cov = Rq @ torch.diag(s["scales"][i] ** 2) @ Rq.T
            cov2 = Jw @ cov @ Jw.T + 0.3 * torch.eye(2, dtype=torch.float64)
            depth = (V[:3, :3] @ m + V[:3, 3])[2]
            g.append((depth.item(), i, proj(m), torch.linalg.inv(cov2)))
        g.sort()
        for y in range(s["H"]):
            for x in range(s["W"]):
                px = torch.tensor([x + 0.5, y + 0.5], dtype=torch.float64)
                T = 1.0
                for _, i, mu, P in g:
                    d = mu - px
                    sigma = 0.5 * d @ P @ d
                    alpha = min(0.999, (s["opacities"][i] * torch.exp(-sigma)).item())
                    if sigma < 0 or alpha < 1 / 255:
                        continue
                    if T * (1 - alpha) <= 1e-4:
                        break
                    img[c, y, x] += alpha * T * s["colors"][i]
                    wsum[i] += alpha * T
                    acc[c, y, x] += alpha * T
                    T *= 1 - alpha
    return img, acc, wsum


def test_fallback_renderer_matches_per_pixel_loop():
    rnd = _load("renderer")
    s = _scene64()
    out, alphas, info = rnd.rasterize(s["means"], s["quats"], s["scales"], s["opacities"], s["colors"],
                                      s["viewmats"], s["Ks"], s["W"], s["H"], backend="torch")
    ref, acc, wsum = _loop_render(s)
    assert ref.abs().sum() > 1  # the cameras see the Gaussians
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(alphas[..., 0], acc, rtol=1e-9, atol=1e-9)
    assert info["means2d"].shape == (2, 14, 2) and info["radii"].shape == (2, 14, 2)
    assert info["width"] == s["W"] and info["n_cameras"] == 2
    w = rnd.blend_weights(s["means"], s["quats"], s["scales"], s["opacities"], s["viewmats"], s["Ks"],
                          s["W"], s["H"], backend="torch")
    torch.testing.assert_close(w, wsum, rtol=1e-9, atol=1e-9)


def test_fallback_renderer_occlusion_and_gradients():
    rnd = _load("renderer")
    s = _scene64(N=2, C=1, W=5, H=5)
    V, K = s["viewmats"][0], s["Ks"][0]
    # two Gaussians on the optical axis, the near one opaque: it hides the far one
    axis = -V[:3, :3].T @ V[:3, 3]  # camera centre in world coordinates
    fwd = V[2, :3]
    means = torch.stack([axis + 2.0 * fwd, axis + 3.0 * fwd])
    q = torch.tensor([[1.0, 0, 0, 0]] * 2, dtype=torch.float64)
    sc = torch.full((2, 3), 0.5, dtype=torch.float64)
    op = torch.tensor([0.999, 0.9], dtype=torch.float64)
    col = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64)
    out, _, _ = rnd.rasterize(means.flip(0), q, sc, op.flip(0), col.flip(0), s["viewmats"], s["Ks"], 5, 5, "torch")
    centre = out[0, 2, 2]
    assert centre[0] > 0.99 and centre[1] < 1e-3  # depth order, not input order
    args = [t.clone().requires_grad_() for t in (s["means"], s["quats"], s["scales"], s["opacities"], s["colors"])]
    torch.autograd.gradcheck(
        lambda m, qq, ss, o, c: rnd.rasterize(m, qq, ss, o, c, s["viewmats"], s["Ks"], s["W"], s["H"], "torch")[0],
        args, atol=1e-6)


def test_bisection_selector_matches_soft_topk():
    import fastlapsum

    strat = _load("lapsum_strategy")
    torch.manual_seed(1)
    x = torch.randn(300, dtype=torch.float64) * 2
    x[:20] = 0.5  # ties
    for k, t in ((30.0, 0.05), (150.5, 1.0), (299.0, 10.0)):
        a = x.clone().requires_grad_()
        b = x.clone().requires_grad_()
        pa = strat.bisection_soft_topk(a, k, t)
        pb = fastlapsum.soft_topk(b, k, t)
        torch.testing.assert_close(pa, pb, rtol=1e-7, atol=1e-9)
        assert abs(pa.sum().item() - k) < 1e-6
        g = torch.randn(300, dtype=torch.float64)
        (ga,) = torch.autograd.grad((pa * g).sum(), a)
        (gb,) = torch.autograd.grad((pb * g).sum(), b)
        torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-8)


def test_strategy_prunes_exactly_k_through_gsplat_remove():
    strat_mod = _load("lapsum_strategy")
    torch.manual_seed(0)
    N, K = 50, 17
    params = torch.nn.ParameterDict({"means": torch.nn.Parameter(torch.randn(N, 3)),
                                     "opacities": torch.nn.Parameter(torch.randn(N))})
    opts = {k: torch.optim.Adam([v], lr=0.1) for k, v in params.items()}
    s = strat_mod.LapSumPruneStrategy(keep=K, score_start=0, prune_at=3, score_lr=0.0)
    with pytest.raises(ValueError, match="solver"):
        strat_mod.LapSumPruneStrategy(keep=K, score_start=0, prune_at=3, solver="sort")
    with pytest.raises(ValueError, match="prune_at"):
        strat_mod.LapSumPruneStrategy(keep=K, score_start=3, prune_at=3)
    init = torch.randn(N)
    state = s.initialize_state(params, init)
    target = params["means"].detach()[:, 0].clone()
    for step in range(4):
        opac = s.opacities(params, state, step)
        assert abs(state["last_mask"].sum().item() - state["last_k"]) < 1e-3
        (opac * target).sum().backward()  # rewards keeping Gaussians with a large x
        for o in opts.values():
            o.step()
            o.zero_grad()
        scores_before = state["scores"].detach().clone()  # score_lr=0: the prune ranks these
        means_before = params["means"].detach().clone()
        s.step_post_backward(params, opts, state, step)
    assert state["pruned"] and params["means"].shape == (K, 3) and params["opacities"].shape == (K,)
    kept = torch.topk(scores_before, K).indices.sort().values
    torch.testing.assert_close(state["scores"].detach(), scores_before[kept])
    torch.testing.assert_close(params["means"].detach(), means_before[kept])
    assert opts["opacities"].state[params["opacities"]]["exp_avg"].shape == (K,)  # optimiser state cut too
    assert state["calls"] == 4
    assert s.opacities(params, state, 5).shape == (K,)  # plain sigmoid after the prune
