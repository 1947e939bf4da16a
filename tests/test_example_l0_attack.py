"""Smoke test of examples/l0_attack: the attack objects on a tiny model, and the --quick
benchmark run (resnet18 on 32x32 photo crops, every method) with its invariants:
every recorded adversarial image, re-read from its 8-bit form, is misclassified and its
pixel L0 (any channel counts once) is what the row says and, for the fixed-budget
attacks, at most K; PGD-L0's calibration crops are not evaluation crops."""
import json

import pytest
import torch
from torch import nn

from conftest import load_example

pytest.importorskip("torchvision")
pytest.importorskip("skimage")


def _load(name):
    return load_example("l0_attack", name)


@pytest.fixture(autouse=True)
def _one_thread():
    # on a small shared CPU, OpenMP barriers of a second thread cost more than it wins here
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny_model():
    """A linear classifier on 12x12 or 10x10 RGB images: a few pixels can flip it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(4)).eval()


def test_pixel_l0_counts_pixels_not_channels():
    lib = _load("lapsum_l0")
    x = torch.full((2, 3, 5, 5), 0.5)
    a = x.clone()
    a[0, :, 1, 1] = 0.0          # one pixel, three channels -> 1
    a[0, 2, 3, 4] = 1.0          # one pixel, one channel -> 1
    a[1, 0, 0, 0] = 0.5 + 0.4 / 255  # below half a grey level: rounds back, not a change
    assert lib.pixel_l0(a, x).tolist() == [2, 0]


@pytest.mark.parametrize("cls", ["LapSumL0", "PGDL0"])
def test_attack_object_interface_and_budget(cls):
    lib = _load("lapsum_l0")
    model = _tiny_model()
    torch.manual_seed(1)
    x = torch.round(torch.rand(6, 3, 12, 12) * 255) / 255
    y = model(x).argmax(1)
    atk = getattr(lib, cls)(model, k=5, steps=40)
    try:
        import torchattacks
        assert isinstance(atk, torchattacks.attack.Attack)
    except ImportError:
        pass
    x_adv = atk(x, y)
    assert x_adv.shape == x.shape and x_adv.min() >= 0 and x_adv.max() <= 1
    assert torch.equal(torch.round(x_adv * 255) / 255, x_adv)  # 8-bit exactly
    assert (lib.pixel_l0(x_adv, x) <= 5).all()
    assert atk.success.any(), "no adversarial example on a tiny random model"
    with torch.no_grad():
        pred = model(x_adv).argmax(1)
    assert (pred[atk.success] != y[atk.success]).all()
    with pytest.raises(ValueError, match="k"):
        getattr(lib, cls)(model, k=0)
    with pytest.raises(ValueError, match="k=200"):
        getattr(lib, cls)(model, k=200, steps=2)(x, y)


def test_foolbox_style_call():
    fb = pytest.importorskip("foolbox")
    lib = _load("lapsum_l0")
    model = _tiny_model()
    x = torch.round(torch.rand(4, 3, 10, 10, generator=torch.Generator().manual_seed(2)) * 255) / 255
    y = model(x).argmax(1)
    fmodel = fb.PyTorchModel(model, bounds=(0, 1))
    raw, clipped, success = lib.LapSumL0Foolbox(steps=30)(fmodel, x, fb.criteria.Misclassification(y),
                                                          epsilons=[3, 10])
    assert success.shape == (2, 4) and len(raw) == 2
    for k, adv, ok in zip((3, 10), clipped, success):
        assert (lib.pixel_l0(adv, x) <= k).all()
        assert (model(adv).argmax(1)[ok] != y[ok]).all()


class _Threshold(nn.Module):
    """Class 1 iff channel 0 of pixel (0, 0) exceeds t; a decision boundary between two
    8-bit levels."""

    def __init__(self, t):
        super().__init__()
        self.t = t

    def forward(self, x):
        z = (x[:, 0, 0, 0] - self.t) * 1e4
        return torch.stack([torch.zeros_like(z), z], 1)


def test_check_rounds_away_from_clean_when_nearest_undoes_the_attack():
    attack = _load("attack")
    c = 128 / 255
    model = _Threshold(c + 0.3 / 255)
    x = torch.full((3, 3, 4, 4), c)
    y = torch.zeros(3, dtype=torch.long)
    adv = x.clone()
    adv[0, 0, 0, 0] = c + 0.4 / 255   # float adversarial; nearest rounds back to clean
    adv[1, 0, 0, 0] = c + 0.7 / 255   # nearest rounding (c + 1/255) stays adversarial
    adv[1, 1, 2, 2] = c + 0.2 / 255   # ... and drops this sub-level change
    adv[2, 1, 3, 3] = c + 0.4 / 255   # not adversarial in float nor in either rounding
    u8, l0, mis, fmis = attack.check(model, x, y, adv)
    assert fmis.tolist() == [True, True, False]
    assert mis.tolist() == [True, True, False]
    assert l0.tolist() == [1, 1, 0]
    assert u8[0, 0, 0, 0] == 129 and u8[1, 0, 0, 0] == 129 and u8[1, 1, 2, 2] == 128
    assert (model(u8.float() / 255).argmax(1) == torch.tensor([1, 1, 0])).all()


def test_foolbox_l0fmn_projection_in_range():
    """foolbox 3.3.4's L0FMNAttack.project indexes past the row at epsilon == d (the whole
    image); the benchmark's subclass keeps every feature there and matches it below d."""
    fb = pytest.importorskip("foolbox")
    ep = pytest.importorskip("eagerpy")
    cls = _load("peers")._l0fmn_class(fb)
    torch.manual_seed(0)
    x0, x = ep.astensor(torch.zeros(2, 3, 4, 4)), ep.astensor(torch.rand(2, 3, 4, 4))
    whole = ep.astensor(torch.tensor([48.0, 5.0]))
    with pytest.raises(IndexError):
        fb.attacks.L0FMNAttack(steps=1).project(x, x0, whole)
    kept = (cls(steps=1).project(x, x0, whole).raw != 0).flatten(1).sum(1)
    assert kept.tolist() == [48, 6]  # foolbox keeps epsilon + 1 features below d
    below = ep.astensor(torch.tensor([47.0, 0.0]))
    assert torch.equal(cls(steps=1).project(x, x0, below).raw, fb.attacks.L0FMNAttack(steps=1).project(x, x0, below).raw)


def test_pgd_per_image_eta():
    lib = _load("lapsum_l0")
    model = _tiny_model()
    x = torch.round(torch.rand(4, 3, 10, 10, generator=torch.Generator().manual_seed(3)) * 255) / 255
    y = model(x).argmax(1)
    atk = lib.PGDL0(model, k=4, steps=5, eta=torch.tensor([0.03, 0.1, 0.3, 1.0]))
    atk(x, y)
    assert atk.best_margin.shape == (4,) and torch.isfinite(atk.best_margin).all()
    with pytest.raises(ValueError, match="eta has 4 values for 2 images"):
        atk(x[:2], y[:2])
    with pytest.raises(ValueError, match="eta"):
        lib.PGDL0(model, k=4, eta=-1.0)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("l0_quick")
    return _load("attack").main(["--quick", "--out", str(out)]), out


def test_quick_run_invariants(quick):
    res, out = quick
    attack = _load("attack")
    model, x, y, xc = res["_model"], res["_x"], res["_y"], res["_xc"]
    ks = res["meta"]["budgets"]
    assert len(y) > 0 and len(xc) > 0
    clean_u8 = torch.round(x * 255).to(torch.uint8)

    # the calibration split is not the evaluation split
    eval_boxes = {tuple(b) for b in res["split"]["eval_boxes"]}
    assert not eval_boxes & {tuple(b) for b in res["split"]["calib_boxes"]}
    assert not any(torch.equal(a, b) for a in x for b in xc)
    assert set(res["meta"]["pgd_eta"]) == set(ks)

    methods = {r["method"] for r in res["rows"]}
    assert {"ours", "pgd", "fb_fmn", "al_fmn", "al_sigma0"} <= methods, (methods, res["errors"])
    n_adv = 0
    for r in res["rows"]:
        fixed = r["method"] in attack.FIXED
        u8, ok = res["adv"][(r["method"], r["K"] if fixed else None)]
        pix = (u8 != clean_u8).any(1).flatten(1).sum(1)  # pixels, any channel
        with torch.no_grad():
            mis = model(u8.float() / 255).argmax(1) != y
        for i, l0 in enumerate(r["l0"]):
            if l0 < 0:
                continue
            n_adv += 1
            assert mis[i] and ok[i], (r["method"], i)
            assert l0 == int(pix[i]), (r["method"], i, l0, int(pix[i]))
            if fixed:
                assert l0 <= r["K"]
        # success at K = fraction with a verified adversarial of pixel-L0 <= K
        expect = sum(0 <= l0 <= r["K"] for l0 in r["l0"]) / len(y)
        assert r["success"] == pytest.approx(expect)
    assert n_adv > 0, "the quick run found no adversarial example at all"

    saved = json.loads((out / "results.json").read_text())
    assert len(saved["rows"]) == len(res["rows"])
    md = (out / "results.md").read_text()
    assert "| method |" in md and "LapSumL0" in md and "adv-lib sigma_zero" in md
    # the log alone carries the results: the table and one parseable JSON line at the end
    log = (out / "log.txt").read_text()
    assert md.strip() in log
    line = [ln for ln in log.splitlines() if ln.startswith("RESULTS_JSON ")]
    assert len(line) == 1 and len(json.loads(line[0][len("RESULTS_JSON "):])["rows"]) == len(res["rows"])
