"""The peers of the pixel-L0 benchmark (attack.py): foolbox L0FMNAttack and
L0BrendelBethgeAttack, adv-lib fmn(norm=0) and sigma_zero, plus the run-time helpers
(time limits, chunked runs) and the Brendel-Bethge worker processes.

Brendel-Bethge's L0 step is a numba solver run per image on the CPU (~0.1-0.2 s per step at
224x224x3) and numba compiles it on first use (tens of seconds). So BB runs in worker
processes started before training: each compiles the solver (on a random-init model),
waits for the trained model and its starting points (sigma-zero's verified adversarials,
written by the main process), and attacks its
share of the images one at a time until a wall-clock deadline, while the main process runs
the other attacks on the GPU. The workers run the model on the CPU (one thread each), so
they never share the GPU with the attacks whose times are measured there.

    python attack.py --bb-worker DIR RANK   (started by attack.py, not by hand)
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
import types

import torch


class TimeLimit:
    """Raise TimeoutError in the main thread after `seconds` (SIGALRM): a phase that would
    overrun its cap is cut, and the phases before it keep their results."""

    def __init__(self, seconds):
        self.seconds = seconds

    @staticmethod
    def _fire(signum, frame):
        raise TimeoutError("time cap reached")

    def __enter__(self):
        if self.seconds <= 0:
            raise TimeoutError("no time left")
        self.old = signal.signal(signal.SIGALRM, self._fire)
        signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.old)
        return False


def _adv_lib():
    sys.modules.setdefault("visdom", types.ModuleType("visdom"))  # adv-lib imports it, unused here
    from adv_lib.attacks import fmn, sigma_zero
    return fmn, sigma_zero


def _l0fmn_class(fb):
    """foolbox 3.3.4's L0FMNAttack with its projection's index kept in range. Its `project`
    reads position `epsilon` of each row's sorted |delta| (d features), out of range once the
    L0 ball has grown to the whole image (epsilon == d: an IndexError on the CPU, a device
    assert on CUDA that ends the process's CUDA context). Clamped to d - 1 that position keeps
    every feature, which is what epsilon == d asks for; below d nothing changes."""

    class L0FMN(fb.attacks.L0FMNAttack):
        def project(self, x, x0, epsilon):
            d = math.prod(x0.shape[1:])
            return super().project(x, x0, epsilon.minimum(d - 1))

    return L0FMN


def peer_fn(name, model, steps):
    """fn(x, y) -> adversarial candidates, every peer started from the clean images."""
    if name == "fb_fmn":
        import foolbox as fb

        fmodel = fb.PyTorchModel(model, bounds=(0, 1), device=next(model.parameters()).device)
        atk = _l0fmn_class(fb)(steps=steps)
        return lambda x, y: atk(fmodel, x, y, epsilons=None)[1]
    fmn, sigma_zero = _adv_lib()
    if name == "al_fmn":
        return lambda x, y: fmn(model, x, y, norm=0, steps=steps)
    if name == "al_sigma0":
        return lambda x, y: sigma_zero(model, x, y, num_steps=steps)
    raise ValueError(f"unknown peer {name!r}")


def run_chunked(fn, x, y, chunk, cap, log):
    """fn on chunks of images until the time cap; images not reached stay clean (failures)."""
    out, t0, n = x.clone(), time.perf_counter(), 0
    for i in range(0, len(x), chunk):
        try:
            with TimeLimit(cap - (time.perf_counter() - t0)):
                adv = fn(x[i:i + chunk], y[i:i + chunk]).detach()
        except TimeoutError:
            log(f"    time cap {cap:.0f} s: attacked {n}/{len(x)} images (the rest count as failures)")
            break
        out[i:i + chunk] = adv
        n = min(i + chunk, len(x))
    return out, n


# --------------------------------------------------------------------------------------
# Brendel-Bethge in worker processes
# --------------------------------------------------------------------------------------

def bb_start(wdir, size, args, deadline):
    """Start args.bb_workers processes; returns the Popen objects."""
    os.makedirs(wdir, exist_ok=True)
    # the workers' model on the attack's device: BB's step is the model's gradient (a resnet18
    # at 224x224 takes ~0.5 s on one CPU thread) plus numba's L0 solver on the CPU
    torch.save(dict(size=size, steps=args.bb_steps, workers=args.bb_workers, deadline=deadline,
                    device=args.device), os.path.join(wdir, "cfg.pt"))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attack.py")
    return [subprocess.Popen([sys.executable, script, "--bb-worker", wdir, str(r)])
            for r in range(args.bb_workers)]


def bb_give_starts(wdir, model, x, y, starts):
    """Hand the workers the model, images, labels and starting points (None: no start)."""
    tmp = os.path.join(wdir, "starts.tmp")
    torch.save(dict(state={k: v.cpu() for k, v in model.state_dict().items()}, x=x.cpu(), y=y.cpu(),
                    starts=[None if s is None else s.cpu() for s in starts]), tmp)
    os.replace(tmp, os.path.join(wdir, "starts.pt"))  # atomic: a worker never reads half a file


def bb_collect(wdir, procs, x, deadline, log):
    """Wait for the workers until the deadline (then stop them), merge their adversarials.
    Images without a result stay clean (failures). Returns (adv, attacked, attack seconds)."""
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()  # a worker started by this run, past the deadline
            p.wait()
    adv, n, secs = x.clone(), 0, 0.0
    for r in range(len(procs)):
        f = os.path.join(wdir, f"out_{r}.pt")
        if not os.path.exists(f):
            log(f"    worker {r}: no results (exit code {procs[r].returncode})")
            continue
        out = torch.load(f)
        for i, a in out["adv"].items():
            adv[i] = a.to(x.device)
        n += len(out["adv"])
        secs += out["seconds"]
        log(f"    worker {r}: {len(out['adv'])} image(s), compile {out['compile_s']:.1f} s, "
            f"attack {out['seconds']:.1f} s{', ' + out['note'] if out['note'] else ''}")
    return adv, n, secs


def bb_worker(wdir, rank):
    """One BB worker (a child process): compile numba's solver on a dummy problem, wait for
    the model and starting points, attack images rank, rank + workers, ... one at a time
    until the deadline, saving after each image."""
    import foolbox as fb

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import data

    cfg = torch.load(os.path.join(wdir, "cfg.pt"))
    dev = torch.device(cfg.get("device", "cpu"))
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    model = data.make_model().eval()  # random init for the compile run; trained weights later
    for p in model.parameters():
        p.requires_grad_(False)
    # device: foolbox's default is cuda:0 when there is one, and it moves the model there
    fmodel = fb.PyTorchModel(model, bounds=(0, 1), device=dev)
    out = dict(adv={}, seconds=0.0, compile_s=0.0, note="")
    path = os.path.join(wdir, f"out_{rank}.pt")

    def save():
        torch.save(out, path + ".tmp")
        os.replace(path + ".tmp", path)

    # numba compiles on first call; a 2-step run on random images against a label neither
    # predicts (both count as "adversarial") compiles the same solver the real run uses
    t = time.time()
    g = torch.Generator().manual_seed(rank)
    xw = torch.rand(2, 3, cfg["size"], cfg["size"], generator=g).to(dev)
    with torch.no_grad():
        pw = model(xw).argmax(1).tolist()
    fake = torch.tensor([next(c for c in range(len(data.PHOTOS)) if c not in pw)], device=dev)
    fb.attacks.L0BrendelBethgeAttack(steps=2)(fmodel, xw[:1], fake, epsilons=None, starting_points=xw[1:])
    out["compile_s"] = time.time() - t
    save()

    starts_file = os.path.join(wdir, "starts.pt")
    while not os.path.exists(starts_file):
        if time.time() > cfg["deadline"]:
            out["note"] = "no starting points before the deadline"
            save()
            return
        time.sleep(0.2)
    s = torch.load(starts_file)
    model.load_state_dict(s["state"])
    atk = fb.attacks.L0BrendelBethgeAttack(steps=cfg["steps"])
    for i in range(rank, len(s["x"]), cfg["workers"]):
        if s["starts"][i] is None:
            continue
        x, y, x0 = (t_[None].to(dev) for t_ in (s["x"][i], s["y"][i], s["starts"][i]))
        t = time.time()
        try:
            with TimeLimit(cfg["deadline"] - t):
                adv = atk(fmodel, x, y, epsilons=None, starting_points=x0)[1]
        except TimeoutError:
            out["note"] = f"deadline reached during image {i}"
            break
        except AssertionError:  # foolbox's check that the start is adversarial (for this model run)
            out["note"] += f"image {i}: start not adversarial here; "
            continue
        except Exception as e:
            out["note"] += f"image {i} failed: {e!r}; "
            continue
        out["seconds"] += time.time() - t
        out["adv"][i] = adv[0].cpu()
        save()
    save()
