"""The decoupled PPO objective for stale rollouts (rlhflab.losses.correction.decoupled), checked
against its definition by a naive per-token loop in float64 (Hilton et al. 2022)."""

import math

import pytest
import torch

from rlhflab.losses.correction import CORRECTIONS, decoupled
from rlhflab.losses.policy import ppo_clip


def _inputs(seed=0, b=3, t=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp_prox = logp + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)
    logp_behav = logp_prox + 0.8 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, 3:] = 0  # padding
    mask[2, 1:] = 0
    return logp, logp_prox, logp_behav, adv, mask


def test_decoupled_ppo_equals_its_definition_naive_loop():
    logp, prox, behav, adv, mask = _inputs()
    eps, cap = 0.2, 1.5
    surrogate, _ = ppo_clip(logp, prox, adv, mask, eps_low=eps, eps_high=eps)
    loss, stats = decoupled(surrogate, prox, behav, mask, cap=cap)
    n_capped = n_below = 0
    for i in range(logp.shape[0]):
        for j in range(logp.shape[1]):
            if not mask[i, j]:
                assert loss[i, j].item() == 0.0 and stats["behav_ratio"][i, j].item() == 0.0
                continue
            r = math.exp(logp[i, j].item() - prox[i, j].item())  # π_θ / π_prox
            a = adv[i].item()
            ppo = -min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            behav_ratio = math.exp(prox[i, j].item() - behav[i, j].item())  # π_prox / π_behav
            w = min(behav_ratio, cap)
            n_capped += behav_ratio > cap
            n_below += behav_ratio < 1
            assert loss[i, j].item() == pytest.approx(w * ppo, rel=1e-12, abs=1e-14)
            assert stats["behav_ratio"][i, j].item() == pytest.approx(behav_ratio, rel=1e-12)
            assert stats["behav_weight"][i, j].item() == pytest.approx(w, rel=1e-12)
            assert stats["behav_capped"][i, j].item() == float(behav_ratio > cap)
    assert n_capped > 0 and n_below > 0  # both sides of the truncation are exercised


def test_gradient_is_the_behaviour_weighted_ppo_gradient():
    logp, prox, behav, adv, mask = _inputs(seed=1)
    logp = logp.clone().requires_grad_(True)
    surrogate, _ = ppo_clip(logp, prox, adv, mask)
    loss, stats = decoupled(surrogate, prox, behav, mask, cap=2.0)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    logp2 = logp.detach().clone().requires_grad_(True)
    s2, _ = ppo_clip(logp2, prox, adv, mask)
    (g_plain,) = torch.autograd.grad(s2.sum(), logp2)
    torch.testing.assert_close(g, g_plain * stats["behav_weight"], rtol=1e-12, atol=0)


def test_zero_staleness_is_the_synchronous_loss_bitwise():
    logp, prox, _, adv, mask = _inputs(seed=2)
    for cap in (1.0, 2.0):
        surrogate, _ = ppo_clip(logp, prox, adv, mask)
        loss, stats = decoupled(surrogate, prox, prox.clone(), mask, cap=cap)
        assert torch.equal(loss, surrogate)
        assert torch.equal(stats["behav_weight"], mask)  # exactly 1 on tokens
        assert stats["behav_capped"].sum().item() == 0.0


def test_registered_and_bad_input_raises():
    assert CORRECTIONS["decoupled"] is decoupled
    logp, prox, behav, _, mask = _inputs()
    with pytest.raises(ValueError, match="cap must be > 0"):
        decoupled(logp, prox, behav, mask, cap=0.0)
    with pytest.raises(ValueError, match="loss has shape"):
        decoupled(logp[:, :2], prox, behav, mask, cap=2.0)
    with pytest.raises(ValueError, match="share one"):
        decoupled(logp, prox, behav[:, :2], mask, cap=2.0)
