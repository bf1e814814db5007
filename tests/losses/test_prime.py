"""PRIME (Cui et al. 2025, arXiv 2502.01456): the implicit process reward, the online PRM's
cross-entropy loss and the advantage, against their definitions (float64, hand arithmetic or a
naive loop)."""

import math

import pytest
import torch
from test_prime_helpers import naive_prime_rloo

from rlhflab.losses.advantages import ADVANTAGES, prime_rloo
from rlhflab.losses.reward_model import (
    implicit_prm_ce,
    implicit_prm_pair_accuracy,
    implicit_process_rewards,
)

F64 = torch.float64


def test_implicit_reward_is_beta_times_the_log_ratio():
    # π_φ(y_t) = 0.5, 0.25 | 0.8 ; π_ref(y_t) = 0.25, 0.5 | 0.4 ; second row has one token
    p_prm = torch.tensor([[0.5, 0.25], [0.8, 1.0]], dtype=F64)
    p_ref = torch.tensor([[0.25, 0.5], [0.4, 0.3]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]])
    r = implicit_process_rewards(p_prm.log(), p_ref.log(), mask, beta=0.05)
    # β·log 2, β·log ½ | β·log 2, padding 0
    lg2 = 0.05 * math.log(2)
    expected = torch.tensor([[lg2, -lg2], [lg2, 0.0]], dtype=F64)
    torch.testing.assert_close(r, expected, rtol=0, atol=1e-15)
    assert r.dtype == F64
    with pytest.raises(ValueError, match="beta"):
        implicit_process_rewards(p_prm.log(), p_ref.log(), mask, beta=0.0)
    with pytest.raises(ValueError, match="shape"):
        implicit_process_rewards(p_prm.log(), p_ref.log()[:, :1], mask, beta=1.0)


def test_ce_loss_by_hand():
    # r_φ(y_0) = 1·(log 2 + log 2) = log 4 -> σ = 0.8, label 1: loss = −log 0.8
    # r_φ(y_1) = 1·log(1/4) = −log 4 -> σ = 0.2, label 1: loss = −log 0.2 (padding ignored)
    # r_φ(y_2) = log 4, label 0: loss = −log(1 − 0.8) = −log 0.2
    logp_prm = torch.tensor([[0.0, 0.0], [0.0, 5.0], [0.0, 0.0]], dtype=F64, requires_grad=True)
    logp_ref = torch.tensor(
        [[-math.log(2)] * 2, [math.log(4), -9.0], [-math.log(2)] * 2], dtype=F64
    )
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    labels = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    losses, stats = implicit_prm_ce(logp_prm, logp_ref, mask, labels, beta=1.0)
    expected = torch.tensor([-math.log(0.8), -math.log(0.2), -math.log(0.2)], dtype=F64)
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        stats["score"], torch.tensor([1.0, -1.0, 1.0], dtype=F64) * math.log(4)
    )
    assert stats["correct"].tolist() == [1.0, 0.0, 0.0]
    # gradient w.r.t. a token's log π_φ is β·(σ(r_φ(y)) − r_o); 0 at padding
    losses.sum().backward()
    grad = torch.tensor([[-0.2, -0.2], [-0.8, 0.0], [0.8, 0.8]], dtype=F64)
    torch.testing.assert_close(logp_prm.grad, grad, rtol=0, atol=1e-12)
    # β scales the sequence score: β = 0.5 on row 0 gives σ(log 2) = 2/3
    l05, _ = implicit_prm_ce(logp_prm.detach(), logp_ref, mask, labels, beta=0.5)
    assert l05[0].item() == pytest.approx(-math.log(2 / 3), abs=1e-12)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        implicit_prm_ce(logp_prm, logp_ref, mask, labels * 2, beta=1.0)


def test_pair_accuracy_as_the_prime_code():
    # group 0: labels 1,0,0,1, scores 3,1,2,0 -> pairs with different labels: (0,1)✓ (0,2)✓
    # (1,3)✗ (2,3)✗ -> 0.5; group 1: all labels equal -> 0.5; group 2: 1,0,0,0 best first -> 1
    scores = torch.tensor([3.0, 1.0, 2.0, 0.0, 1.0, 2.0, 3.0, 4.0, 9.0, 1.0, 2.0, 3.0])
    labels = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0])
    acc = implicit_prm_pair_accuracy(scores, labels, group_size=4)
    assert acc.item() == pytest.approx((0.5 + 0.5 + 1.0) / 3)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_prime_rloo_against_a_naive_loop(gamma):
    gen = torch.Generator().manual_seed(0)
    B, T, G = 6, 5, 3
    r = torch.randn(B, T, generator=gen, dtype=F64)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5])
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    outcome = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=F64)  # group 1 constant
    adv = prime_rloo(r, mask, group_size=G, outcome=outcome, gamma=gamma)
    torch.testing.assert_close(
        adv, naive_prime_rloo(r, mask, outcome, G, gamma), rtol=0, atol=1e-12
    )
    assert adv[mask == 0].abs().sum() == 0
    # no process rewards: RLOO of the outcome broadcast over the tokens (hand: G=3, [1, 0, 1]
    # -> 1 − ½, 0 − 1, 1 − ½)
    only_outcome = prime_rloo(torch.zeros(B, T, dtype=F64), mask, group_size=G, outcome=outcome)
    assert only_outcome[0, 0].item() == 0.5 and only_outcome[1, 0].item() == -1.0
    assert only_outcome[3:].abs().sum() == 0  # constant group: exactly 0
    assert ADVANTAGES["prime_rloo"].needs_outcome


def test_prime_rloo_refuses_bad_input():
    r, mask = torch.zeros(4, 3), torch.ones(4, 3)
    with pytest.raises(ValueError, match="outcome"):
        prime_rloo(r, mask, group_size=2, outcome=torch.zeros(3))
    with pytest.raises(ValueError, match="gamma"):
        prime_rloo(r, mask, group_size=2, outcome=torch.zeros(4), gamma=1.5)
    with pytest.raises(ValueError, match="group_size"):
        prime_rloo(r, mask, group_size=1, outcome=torch.zeros(4))
