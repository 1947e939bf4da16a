"""Smoke test of examples/l0_attack: the --quick run, in-process, plus its invariants.

Checks that every adversarial example, re-read from its stored 8-bit form, changes at most
K pixels (any channel counts) and is misclassified; that the outputs are written; and that
the bisection baseline is the same operator as fastlapsum's straight-through mask (same
hard forward, same gradient).
"""
import json

import torch

import fastlapsum
from conftest import load_example


def _load(name):
    return load_example("l0_attack", name)


def test_bisection_selector_is_the_same_operator():
    attack = _load("attack")
    torch.manual_seed(0)
    s = torch.randn(3, 500, dtype=torch.float64)
    g = torch.randn(3, 500, dtype=torch.float64)
    for k, t in ((1, 0.3), (7, 1.0), (40, 0.05)):
        s1 = s.clone().requires_grad_(True)
        s2 = s.clone().requires_grad_(True)
        m1 = attack.lapsum_st(s1, k, t)
        m2 = attack.bisection_st(s2, k, t)
        assert torch.equal(m1, m2)
        assert (m1.sum(1) == k).all()
        m1.backward(g)
        m2.backward(g)
        torch.testing.assert_close(s2.grad, s1.grad, rtol=1e-7, atol=1e-9)
        # and it is the soft mask's gradient
        s3 = s.clone().requires_grad_(True)
        fastlapsum.soft_topk(s3, k, t).backward(g)
        torch.testing.assert_close(s1.grad, s3.grad)


def test_quick_run_budgets_hold(tmp_path):
    attack = _load("attack")
    res = attack.main(["--quick", "--out", str(tmp_path)])
    meta, rows, books = res["meta"], res["rows"], res["books"]
    model, x, y = res["model"], res["x"], res["y"]
    assert meta["quick"] and len(y) > 0
    assert {r["method"] for r in rows} == {"ours", "bisection", "pgd"}
    assert sorted({r["K"] for r in rows}) == sorted(meta["budgets"])

    clean_u8 = (x * 255).round().to(torch.uint8)
    assert torch.equal(clean_u8.float() / 255, x)  # the clean images are 8-bit already
    n_adv = 0
    for r in rows:
        K = r["K"]
        book = books[(r["method"], K)]
        assert r["n_success"] == sum(a is not None for a in book.adv)
        assert 0.0 <= r["success"] <= 1.0 and r["ms_per_image_restart"] > 0
        for i, adv in enumerate(book.adv):
            if adv is None:
                assert r["l0"][i] == -1
                continue
            n_adv += 1
            assert adv.dtype == torch.uint8 and adv.shape == clean_u8[i].shape
            changed = int((adv != clean_u8[i]).any(0).sum())  # pixels, any channel
            assert changed <= K, (r["method"], K, changed)
            assert changed == r["l0"][i]
            with torch.no_grad():
                assert model(adv.float()[None] / 255).argmax(-1).item() != int(y[i])
    assert n_adv > 0, "the quick run found no adversarial example at all"

    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["rows"]) == len(rows)
    assert (tmp_path / "results.md").exists()
    assert (tmp_path / "success_vs_k.png").exists()
