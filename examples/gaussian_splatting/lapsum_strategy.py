"""Exact-budget learned pruning as a gsplat-style strategy (drop-in for a gsplat trainer).

    strategy = LapSumPruneStrategy(keep=K, score_start=T1, prune_at=T2)
    state = strategy.initialize_state(params, init_scores)        # at T1, after densification
    for step in range(T1, T3):
        opac = strategy.opacities(params, state, step)            # sigmoid(logit) * mask
        colors, alphas, info = gsplat.rasterization(..., opacities=opac, ...)
        loss.backward()
        for opt in optimizers.values(): opt.step(); opt.zero_grad()
        strategy.step_post_backward(params, optimizers, state, step, info)

From score_start to prune_at every opacity is multiplied by the mask
p = fastlapsum.soft_topk(scores, k_t, t_t): sum(p) == k_t exactly, k_t falls from N to K
and t_t from t_start to t_end. At prune_at the mask is baked into the opacities, the top-K
scores are kept and the rest go through gsplat.strategy.ops.remove (which also cuts the
optimisers' state); afterwards opacities are plain sigmoid(logit) and training fine-tunes.

solver="bisection" swaps soft_topk for a 60-step bisection on the threshold (same mask,
implicit-function gradient), the baseline for the selector's cost.
"""
import math
import time
from dataclasses import dataclass

import torch

import fastlapsum


class BisectionSoftTopK(torch.autograd.Function):
    """p_i = F((s_i - b)/t) with F the Laplace CDF and b found by `steps` bisection steps so
    that sum(p) == k; the backward is the implicit-function gradient of that mask."""

    @staticmethod
    def forward(ctx, s, k, t, steps):
        s64 = s.detach().double()
        lo = s64.min() - 50 * t
        hi = s64.max() + 50 * t
        for _ in range(steps):
            mid = 0.5 * (lo + hi)
            u = (s64 - mid) / t
            psi = torch.where(u <= 0, 0.5 * torch.exp(u.clamp(max=0)), 1 - 0.5 * torch.exp(-u.clamp(min=0))).sum()
            # psi falls as b grows: too many kept -> move the threshold up
            big = psi > k
            lo = torch.where(big, mid, lo)
            hi = torch.where(big, hi, mid)
        u = (s64 - 0.5 * (lo + hi)) / t
        p = torch.where(u <= 0, 0.5 * torch.exp(u.clamp(max=0)), 1 - 0.5 * torch.exp(-u.clamp(min=0)))
        ctx.save_for_backward((0.5 * torch.exp(-u.abs()) / t).to(s.dtype))
        return p.to(s.dtype)

    @staticmethod
    def backward(ctx, g):
        (f,) = ctx.saved_tensors
        return f * (g - (g * f).sum() / f.sum().clamp_min(1e-30)), None, None, None


def bisection_soft_topk(scores, k, t, steps=60):
    return BisectionSoftTopK.apply(scores, float(k), float(t), steps)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class LapSumPruneStrategy:
    keep: int                 # K, the Gaussians left after the prune
    score_start: int          # first step of the score phase
    prune_at: int             # step of the hard prune (end of the score phase)
    t_start: float = 1.0      # mask temperature at score_start (scores are standardised)
    t_end: float = 0.05       # ... and at prune_at
    budget_power: float = 2.0  # k_t = K + (N - K) (1 - s)^power, s the phase's progress
    score_lr: float = 0.02
    solver: str = "lapsum"    # "lapsum" (fastlapsum.soft_topk) or "bisection"
    bake: bool = True         # fold the final mask into the opacities at the prune
    time_selector: bool = True  # sync around the selector to time it

    def __post_init__(self):
        if self.solver not in ("lapsum", "bisection"):
            raise ValueError(f"solver must be 'lapsum' or 'bisection', got {self.solver!r}")
        if self.prune_at <= self.score_start:
            raise ValueError(f"prune_at ({self.prune_at}) must come after score_start ({self.score_start})")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")

    def initialize_state(self, params, init_scores=None) -> dict:
        """init_scores: any per-Gaussian ranking (e.g. log blend weight), standardised here;
        None starts from the opacity logits."""
        n = params["means"].shape[0]
        if self.keep > n:
            raise ValueError(f"keep ({self.keep}) exceeds the number of Gaussians ({n})")
        s = (params["opacities"].detach() if init_scores is None else init_scores.detach()).float()
        s = (s - s.mean()) / s.std().clamp_min(1e-12)
        scores = torch.nn.Parameter(s.clone())
        return dict(n0=n, scores=scores, opt=torch.optim.Adam([scores], lr=self.score_lr),
                    selector_fwd_s=0.0, selector_bwd_s=0.0, calls=0, pruned=False,
                    last_mask=None, last_k=None)

    def schedule(self, step: int):
        """(progress in [0, 1], temperature) at a step of the score phase."""
        s = min(max((step - self.score_start) / (self.prune_at - self.score_start), 0.0), 1.0)
        return s, self.t_start * (self.t_end / self.t_start) ** s

    def _mask(self, state, step):
        s, t = self.schedule(step)
        k = self.keep + (state["n0"] - self.keep) * (1 - s) ** self.budget_power
        scores = state["scores"]
        dev = scores.device
        if self.time_selector:
            _sync(dev)
        t0 = time.perf_counter()
        if self.solver == "lapsum":
            p = fastlapsum.soft_topk(scores, k, t)
        else:
            p = bisection_soft_topk(scores, k, t)
        if self.time_selector:
            _sync(dev)
            state["selector_fwd_s"] += time.perf_counter() - t0
            if p.requires_grad:  # time the backward: from the mask's gradient to the scores'
                mark = {}

                def start(g):
                    _sync(dev)
                    mark["t"] = time.perf_counter()

                def end(g):
                    _sync(dev)
                    state["selector_bwd_s"] += time.perf_counter() - mark.get("t", time.perf_counter())

                p.register_hook(start)
                state["_hook"] = scores.register_hook(end)
        state["calls"] += 1
        state["last_mask"], state["last_k"] = p.detach(), k
        return p

    def opacities(self, params, state, step):
        """Opacities to render with at this step (masked during the score phase)."""
        opac = torch.sigmoid(params["opacities"])
        if state["pruned"] or step < self.score_start or step > self.prune_at:
            return opac
        return opac * self._mask(state, step)

    def step_pre_backward(self, params, optimizers, state, step, info):
        pass

    @torch.no_grad()
    def step_post_backward(self, params, optimizers, state, step, info=None):
        if state["pruned"] or step < self.score_start:
            return
        hook = state.pop("_hook", None)
        if hook is not None:
            hook.remove()
        if state["scores"].grad is not None:
            state["opt"].step()
            state["opt"].zero_grad(set_to_none=True)
        if step >= self.prune_at:
            self.prune(params, optimizers, state)

    @torch.no_grad()
    def prune(self, params, optimizers, state):
        """Keep exactly the top-`keep` scores, through gsplat's own remove op."""
        from gsplat.strategy import ops

        scores = state["scores"]
        if self.bake and state["last_mask"] is not None:
            # the final soft mask was part of what the other parameters learned to render with
            opac = torch.sigmoid(params["opacities"]) * state["last_mask"]
            params["opacities"].copy_(torch.logit(opac.clamp(1e-6, 1 - 1e-6)))
        drop = torch.ones_like(scores, dtype=torch.bool)
        drop[torch.topk(scores, self.keep, sorted=False).indices] = False
        ops.remove(params, optimizers, {}, drop)
        state["pruned"] = True
        state["scores"] = torch.nn.Parameter(scores[~drop])  # remove() keeps the order
        state["n_after_prune"] = params["means"].shape[0]

    def selector_seconds(self, state) -> float:
        return state["selector_fwd_s"] + state["selector_bwd_s"]
