"""Smoke test of examples/token_pruning: the --quick run, in-process, plus its invariants.

Pruning: every pruned model's blocks after the pruning run on exactly K patch tokens at evaluation,
the soft router's training mask sums to K per image, and the routers get gradients.
MoE: expert choice gives every expert exactly C tokens; token choice never exceeds C and
counts its drops exactly. Different seeds give different models.
"""
import json

import pytest
import torch

from conftest import load_example

pytest.importorskip("timm")
pytest.importorskip("sklearn")
pytest.importorskip("skimage")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    train = load_example("token_pruning", "train")
    out = tmp_path_factory.mktemp("tp")
    return train, train.main(["--quick", "--out", str(out)]), out


def test_tables_written(quick):
    train, res, out = quick
    saved = json.loads((out / "results.json").read_text())
    assert len(saved["prune_runs"]) == len(train.PRUNE_LABELS) * 2 and len(saved["moe_runs"]) == 3 * 2
    assert not saved["errors"] and not saved["skipped"]
    assert saved["steps"] == {"prune": 3, "moe": 3}
    md = (out / "results.md").read_text()
    for label in list(train.PRUNE_LABELS.values()) + list(train.MOE_LABELS.values()):
        assert f"| {label} |" in md
    for r in res["prune_runs"] + res["moe_runs"]:
        assert r["steps"] == 3 and 0.0 <= r["accuracy"] <= 1.0


def test_exactly_k_tokens_at_eval(quick):
    train, res, _ = quick
    for r in res["prune_runs"]:
        assert r["tokens_seen"] == [r["K"]], r
        assert 0.0 <= r["ink_recall"] <= 1.0
    side = train.parse_args(["--quick"]).canvas
    x = torch.randn(6, 1, side, side, generator=torch.Generator().manual_seed(5))
    for key, model in res["models"].items():
        phase, method, keep, _ = key.split("/")
        if phase != "prune":
            continue
        model.eval()
        with torch.no_grad():
            out = model(x)
        assert out.shape == (6, 10) and torch.isfinite(out).all()
        assert model.last_tokens_seen == int(keep)
        if method == "none":
            assert model.last_kept is None
            continue
        kept = model.last_kept  # evit: K-1 kept + 1 fused token
        assert kept.shape == (6, int(keep) - (method == "evit"))
        assert all(len(set(row.tolist())) == kept.shape[1] for row in kept)  # distinct tokens


def test_soft_mask_sums_to_k_and_routers_learn(quick):
    train, res, _ = quick
    args = train.parse_args(["--quick"])
    x = torch.randn(5, 1, args.canvas, args.canvas, generator=torch.Generator().manual_seed(1))
    for method in ("soft", "gated", "evit"):
        model = train.build_pruned(args, method, 8).train()
        model.temperature = 0.7
        model(x).logsumexp(-1).sum().backward()
        if method == "soft":
            assert model.last_mask.shape == (5, 64)
            torch.testing.assert_close(model.last_mask.sum(-1), torch.full((5,), 8.0), rtol=0, atol=1e-4)
            assert model.last_tokens_seen == 64  # training: all tokens, softly masked
        else:
            assert model.last_tokens_seen == 8
        if method != "evit":
            grad = model.router[1].weight.grad
            assert grad is not None and grad.abs().sum() > 0, method


def test_moe_budgets_and_drops():
    moe = load_example("token_pruning", "moe")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 10, 16, generator=g)  # 40 tokens, 4 experts: C = 10
    for kind in ("ec_soft", "ec_hard"):
        layer = moe.MoE(16, 32, 4, kind).eval()  # eval: the budget asserts run
        y = layer(x)
        assert y.shape == x.shape and torch.isfinite(y).all()
        assert layer.stats["capacity"] == 10 and (layer.stats["counts"] == 10).all()
        assert layer.stats["dropped"] == 0 and moe.load_cv(layer.stats["counts"]) == 0.0
    layer = moe.MoE(16, 32, 4, "tc").eval()
    with torch.no_grad():  # every token prefers expert 0: 10 processed, 30 dropped
        layer.router.weight.zero_()
        layer.router.bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))
    y = layer(x)
    s = layer.stats
    assert s["counts"].tolist() == [10, 0, 0, 0] and int(s["dropped"]) == 30 and int(s["unprocessed"]) == 30
    # dropped tokens get no expert output (the block's residual carries them)
    assert (y.reshape(40, 16)[10:] == 0).all() and (y.reshape(40, 16)[:10] != 0).any()
    assert float(layer.aux_loss.detach()) > 0


def test_token_choice_matches_a_loop_and_trains_the_same():
    """The vectorised token-choice dispatch against a plain per-token loop (queue in batch
    order, capacity C), in evaluation and in training mode (no asserts, no host syncs)."""
    moe = load_example("token_pruning", "moe")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 20, 8, generator=g)  # 60 tokens, 4 experts: C = 15
    layer = moe.MoE(8, 16, 4, "tc")
    with torch.no_grad():  # skewed router: some experts overflow
        layer.router.bias.copy_(torch.tensor([1.5, 0.5, 0.0, -1.0]))
    flat = x.reshape(60, 8)
    gate = layer.router(flat).softmax(-1)
    want = torch.zeros_like(flat)
    fill = [0] * 4
    for i in range(60):
        e = int(gate[i].argmax())
        if fill[e] < 15:
            fill[e] += 1
            h = torch.nn.functional.gelu(flat[i] @ layer.w1[e] + layer.b1[e, 0]) @ layer.w2[e] + layer.b2[e, 0]
            want[i] = gate[i, e] * h
    for mode in (layer.eval, layer.train):
        mode()
        y = layer(x).reshape(60, 8)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
        assert int(layer.stats["dropped"]) == 60 - sum(fill) > 0
    y.sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0 and layer.w1.grad.abs().sum() > 0


def test_moe_runs_report_balance_and_router_gradient(quick):
    train, res, _ = quick
    by = {}
    for r in res["moe_runs"]:
        by.setdefault(r["router"], []).append(r)
        assert 0.0 <= r["dropped_frac"] <= r["unprocessed_frac"] + 1e-12 <= 1.0 + 1e-12
    for r in by["ec_soft"] + by["ec_hard"]:
        assert r["load_cv"] == 0.0 and r["dropped_frac"] == 0.0
    # the exact-budget soft router sends a gradient to every token's router logits
    for r in by["ec_soft"]:
        assert r["router_grad_frac"] == 1.0
    for r in by["ec_hard"]:
        assert r["router_grad_frac"] < 1.0


def test_seeds_differ(quick):
    train, res, _ = quick
    a = res["models"]["prune/soft/4/0"].state_dict()
    b = res["models"]["prune/soft/4/1"].state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)
    losses = {r["seed"]: r["final_loss"] for r in res["prune_runs"] if r["method"] == "soft"}
    assert losses[0] != losses[1]
