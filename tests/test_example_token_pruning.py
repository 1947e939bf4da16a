"""Smoke test of examples/token_pruning: the --quick run, in-process, plus its invariants.

Checks that every expert of the expert-choice MoE gets exactly C tokens, that the pruned
model's later blocks run on exactly K patch tokens, and that outputs are finite.
"""
import json
import math

import torch

from conftest import load_example



def _load(name):
    return load_example("token_pruning", name)


def test_quick_run_invariants(tmp_path):
    train = _load("train")
    res = train.main(["--quick", "--out", str(tmp_path)])

    # table: both methods over 100/75/50/25 %, later blocks saw exactly K tokens, all finite
    rows = res["rows"]
    assert sorted({r["kept_pct"] for r in rows}) == [25, 50, 75, 100]
    assert {r["method"] for r in rows} == {"learned (SoftTopK)", "hard (detached router)"}
    for r in rows:
        assert r["tokens_seen"] == r["K"] == round(r["kept_pct"] * 36 / 100)
        assert 0.0 <= r["accuracy"] <= 1.0
        assert math.isfinite(r["forward_ms"]) and r["forward_ms"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == len(rows)
    assert (tmp_path / "results.md").exists()

    # the trained models themselves, in both modes
    x, _ = train.make_shapes(16, seed=123)
    for name, model in res["models"].items():
        prune, k = name.split("/")
        k = int(k)
        moe = model.later[0].mlp
        model.eval()
        with torch.no_grad():
            out = model(x)
        assert torch.isfinite(out).all(), name
        # hard top-k + gather at evaluation: blocks 2 and 3 really ran on K (+ CLS) tokens
        assert model.last_tokens_seen == [k, k], name
        n_tokens = 16 * (k + 1)
        assert moe.last_capacity == moe.capacity(n_tokens)
        assert (moe.last_counts == moe.last_capacity).all(), name
        # training mode: the learned router's soft mask keeps all tokens, scaled; the MoE
        # capacity is then set by the effective B*(K+1) tokens; gradients are finite
        model.train()
        out = model(x)
        assert torch.isfinite(out).all(), name
        assert (moe.last_counts == moe.last_capacity).all(), name
        if prune == "learned" and k < 36:
            assert model.last_tokens_seen == [36, 36]
            assert moe.last_capacity == moe.capacity(n_tokens)
            m = model.gate(model.router(model.router_norm(torch.randn(16, 36, 64))).squeeze(-1))
            torch.testing.assert_close(m.sum(-1), torch.full((16,), float(k)))
        out.sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), name
        if prune == "learned" and k < 36:
            assert model.router.weight.grad.abs().sum() > 0  # the exact-budget gate trains the router
        if prune == "hard":
            assert model.router.weight.grad is None  # the baseline's router gets nothing
