"""Truncated importance sampling and the mismatch diagnostics, from their definitions."""

import math

import pytest
import torch

from rlhflab.losses.correction import mismatch_stats, tis, truncated_importance_weights
from rlhflab.losses.policy import ppo_clip

MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_weights_by_hand():
    # log-ratios: ln 0.5, 0, ln 1.5, (padding) | ln 3, ln 2.5
    logp_old = torch.tensor([[math.log(0.5), -1.0, math.log(1.5), 7.0], [math.log(3.0), 0.0, 0, 0]])
    logp_s = torch.tensor([[0.0, -1.0, 0.0, -9.0], [0.0, -math.log(2.5), 0, 0]])
    w, st = truncated_importance_weights(logp_old, logp_s, MASK, cap=2.0)
    # min(0.5, 2) = 0.5, min(1, 2) = 1, min(1.5, 2) = 1.5, pad 0 | min(3, 2) = 2, min(2.5, 2) = 2
    expected = torch.tensor([[0.5, 1.0, 1.5, 0.0], [2.0, 2.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=0)
    assert st["capped"].tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]


def test_equal_logps_leave_the_loss_unchanged_bitwise():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 4, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(2, generator=g, dtype=torch.float64)
    loss, _ = ppo_clip(logp, logp, adv, MASK.double())
    out, st = tis(loss, logp, logp.clone(), MASK.double(), cap=2.0)
    assert torch.equal(out, loss)
    assert st["capped"].sum() == 0


def test_cap_binds_only_above_cap():
    logp_s = torch.zeros(1, 3)
    logp_old = torch.tensor([[math.log(1.99), math.log(2.0), math.log(2.01)]])
    w, st = truncated_importance_weights(logp_old, logp_s, torch.ones(1, 3), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.99, 2.0, 2.0]]), atol=1e-6, rtol=0)
    assert st["capped"].tolist() == [[0.0, 0.0, 1.0]]


def test_gradient_is_the_weighted_surrogate_gradient():
    # REINFORCE-style per-token loss −A·logp: d/dlogp of w·(−A·logp) = −w·A, with w detached.
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    logp_old = torch.tensor([[-1.0, -1.0, -1.0, 0.0]], dtype=torch.float64)
    logp_s = torch.tensor([[-2.0, -1.0, -1.0 + math.log(4.0), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0, -1.0, 3.0, 5.0]], dtype=torch.float64)
    out, _ = tis(-adv * logp * mask, logp_old, logp_s, mask, cap=2.0)
    out.sum().backward()
    w = torch.tensor([[2.0, 1.0, 0.25, 0.0]], dtype=torch.float64)  # min(e, 2), 1, 1/4, pad
    torch.testing.assert_close(logp.grad, -w * adv * mask, atol=1e-12, rtol=0)
    # gradcheck with respect to the surrogate's input; the weights are constants (stop-gradient:
    # no gradient reaches logp_old, though the value depends on it)
    torch.autograd.gradcheck(
        lambda a: tis(-adv * a, logp_old, logp_s, mask, cap=2.0)[0],
        (logp.detach().requires_grad_(),),
    )
    lo = logp_old.clone().requires_grad_(True)
    out = tis(-adv * logp, lo, logp_s, mask, cap=2.0)[0].sum()
    assert torch.autograd.grad(out, lo, allow_unused=True)[0] is None  # no path to logp_old


def test_mismatch_stats_by_hand():
    logp = torch.tensor([[-1.0, -2.0, 5.0]])
    logp_s = torch.tensor([[-1.5, -2.0, 0.0]])
    st = mismatch_stats(logp, logp_s, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(st["logp_diff"], torch.tensor([[0.5, 0.0, 0.0]]))
    r = 0.5  # k3 = e^r − 1 − r
    torch.testing.assert_close(st["sampler_kl"], torch.tensor([[math.exp(r) - 1 - r, 0.0, 0.0]]))


def test_k3_of_sampler_vs_trainer_is_the_exact_kl_in_expectation():
    # Enumerated: tokens drawn from q (sampler); E_q[k3(r)] with r = log p − log q equals KL(q‖p).
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    p = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    st = mismatch_stats(p.log()[None], q.log()[None], torch.ones(1, 3, dtype=torch.float64))
    exact = (q * (q.log() - p.log())).sum()
    torch.testing.assert_close((q * st["sampler_kl"][0]).sum(), exact, atol=1e-12, rtol=0)


def test_bad_shapes_and_cap_raise():
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), cap=0)
    with pytest.raises(ValueError, match="share one"):
        truncated_importance_weights(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), cap=2)
    with pytest.raises(ValueError, match="loss has shape"):
        tis(torch.zeros(2, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), cap=2)
