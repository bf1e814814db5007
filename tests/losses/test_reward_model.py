"""Reward-model losses against hand arithmetic and gradcheck."""

import math

import pytest
import torch

from rlhflab.losses.reward_model import (
    IGNORE_INDEX,
    RM_LOSSES,
    bradley_terry,
    orm_bce,
    orm_seq_bce,
    prm_solution_score,
    prm_step_ce,
)


def test_bradley_terry_values_by_hand():
    # −log σ(1 − 0) = log(1 + e^−1) = 0.3132617;  −log σ(0 − 2) = log(1 + e^2) = 2.1269280
    losses, stats = bradley_terry(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]))
    torch.testing.assert_close(losses, torch.tensor([0.3132617, 2.1269280]))
    assert stats["accuracy"].tolist() == [1.0, 0.0]
    assert stats["margin"].tolist() == [1.0, -2.0]


def test_bradley_terry_margin_and_centering():
    # margin 0.5: log(1 + e^−0.5) = 0.4740770; centring η(r_c + r_r)² = 0.1·(1 + 0)² = 0.1
    losses, _ = bradley_terry(torch.tensor([1.0]), torch.tensor([0.0]), margin=0.5)
    assert losses.item() == pytest.approx(0.4740770, abs=1e-6)
    losses, _ = bradley_terry(torch.tensor([1.0]), torch.tensor([0.0]), center_coef=0.1)
    assert losses.item() == pytest.approx(0.3132617 + 0.1, abs=1e-6)
    per_pair = torch.tensor([0.0, 1.0])
    losses, _ = bradley_terry(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]), margin=per_pair)
    assert losses.tolist() == pytest.approx([0.3132617, math.log(2)], abs=1e-6)


def test_bradley_terry_gradient_by_hand():
    # d/dr_c softplus(−(r_c − r_r)) = −σ(−d); d = 1 → −0.2689414; d/dr_r = +0.2689414
    rc = torch.tensor([1.0], requires_grad=True)
    rr = torch.tensor([0.0], requires_grad=True)
    bradley_terry(rc, rr, center_coef=0.1)[0].sum().backward()
    # centring adds 2η(r_c + r_r) = 0.2 to both
    assert rc.grad.item() == pytest.approx(-0.2689414 + 0.2, abs=1e-6)
    assert rr.grad.item() == pytest.approx(0.2689414 + 0.2, abs=1e-6)


def test_bradley_terry_gradcheck_and_stability():
    rc = torch.randn(5, dtype=torch.float64, requires_grad=True)
    rr = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: bradley_terry(a, b, margin=0.3, center_coef=0.05)[0], (rc, rr)
    )
    losses, _ = bradley_terry(torch.tensor([200.0, -200.0]), torch.tensor([0.0, 0.0]))
    assert torch.isfinite(losses).all() and losses[1].item() == pytest.approx(200.0)


def test_orm_bce_broadcasts_label_over_completion_tokens():
    logits = torch.tensor([[0.0, 2.0, 5.0], [0.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    losses, stats = orm_bce(logits, torch.tensor([1.0, 0.0]), mask)
    # y=1: −log σ(0) = log 2, −log σ(2) = 0.1269280; y=0: −log(1 − σ(z)) = softplus(z)
    expect = torch.tensor(
        [[math.log(2), 0.1269280, 0.0], [math.log(2), math.log(1 + math.exp(-1)), math.log(2)]]
    )
    torch.testing.assert_close(losses, expect)
    assert stats["accuracy"][0].tolist() == [0.0, 1.0, 0.0]  # z=0 predicts "incorrect"
    # same as an explicitly broadcast (B, T) label
    torch.testing.assert_close(
        orm_bce(logits, torch.tensor([[1.0] * 3, [0.0] * 3]), mask)[0], losses
    )


def test_orm_seq_bce():
    losses, stats = orm_seq_bce(torch.tensor([2.0, 2.0]), torch.tensor([1.0, 0.0]))
    assert losses.tolist() == pytest.approx([0.1269280, 2.1269280], abs=1e-6)
    assert stats["accuracy"].tolist() == [1.0, 0.0]


def test_prm_step_ce_only_at_labelled_positions():
    logits = torch.zeros(1, 4, 3)
    logits[0, 1] = torch.tensor([0.0, 0.0, math.log(2)])  # p(class 2) = 2/4
    labels = torch.tensor([[IGNORE_INDEX, 2, IGNORE_INDEX, 0]])
    losses, stats = prm_step_ce(logits, labels)
    assert losses[0, 0] == 0 and losses[0, 2] == 0
    assert losses[0, 1].item() == pytest.approx(math.log(2), abs=1e-6)
    assert losses[0, 3].item() == pytest.approx(math.log(3), abs=1e-6)
    assert stats["step_mask"].tolist() == [[0.0, 1.0, 0.0, 1.0]]
    # no gradient reaches unlabelled positions
    logits.requires_grad_(True)
    prm_step_ce(logits, labels)[0].sum().backward()
    assert logits.grad[0, 0].abs().sum() == 0 and logits.grad[0, 2].abs().sum() == 0


def test_prm_solution_score_min_and_prod():
    probs = torch.tensor([[0.9, 0.5, 0.8, 0.1], [0.3, 0.3, 0.3, 0.3]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    assert prm_solution_score(probs, mask, reduce="min").tolist() == pytest.approx([0.5, 1.0])
    assert prm_solution_score(probs, mask, reduce="prod").tolist() == pytest.approx([0.36, 1.0])
    with pytest.raises(ValueError):
        prm_solution_score(probs, mask, reduce="mean")


def test_registry_names():
    assert set(RM_LOSSES) == {"bradley_terry", "orm_bce", "orm_seq_bce", "prm_step_ce"}
