"""Clipped value loss and explained variance by hand."""

import pytest
import torch

from rlhflab.losses.value import clipped_value_loss, explained_variance

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def test_clipped_value_loss_by_hand():
    # c = 0.2, loss = 0.5·max((V − R)², (clip(V, V_old ± c) − R)²)
    #  V=1.5 V_old=1.0 R=2.0: (−0.5)² = 0.25; V_c = 1.2, (−0.8)² = 0.64 -> 0.32, clipped, grad 0
    #  V=1.1 V_old=1.0 R=2.0: V_c = V: 0.81 both -> 0.405, not clipped, grad V − R = −0.9
    #  V=2.5 V_old=2.0 R=2.0: 0.25; V_c = 2.2: 0.04 -> 0.125, not clipped, grad V − R = 0.5
    #  V=0.0 V_old=1.0 R=2.0: 4.0;  V_c = 0.8: 1.44 -> 2.0, not clipped, grad −2.0
    #  padding -> 0
    values = t([[1.5, 1.1, 2.5, 0.0, 7.0]]).requires_grad_(True)
    values_old = t([[1.0, 1.0, 2.0, 1.0, 0.0]])
    returns = t([[2.0, 2.0, 2.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, stats = clipped_value_loss(values, values_old, returns, mask, clip_range=0.2)
    torch.testing.assert_close(loss, t([[0.32, 0.405, 0.125, 2.0, 0.0]]), rtol=0, atol=1e-12)
    assert stats["clipped"].tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    loss.sum().backward()
    torch.testing.assert_close(values.grad, t([[0.0, -0.9, 0.5, -2.0, 0.0]]), rtol=0, atol=1e-12)


def test_clipped_value_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_range"):
        clipped_value_loss(x, x, x, x, clip_range=0.0)
    with pytest.raises(ValueError, match="returns"):
        clipped_value_loss(x, x, x[:, :2], x, clip_range=0.2)


def test_explained_variance():
    returns = t([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert (
        explained_variance(returns.clone(), returns, mask).item() == 1.0
    )  # perfect critic, exactly
    # predicting the mean (3) everywhere: Var(R − V) = Var(R) -> 0
    assert explained_variance(torch.full_like(returns, 3.0), returns, mask).item() == pytest.approx(
        0.0, abs=1e-12
    )
    # V = R + 1 offset: Var(R − V) = 0 -> 1; V = 0.5·R: 1 − 0.25 = 0.75
    assert explained_variance(returns + 1.0, returns, mask).item() == 1.0
    assert explained_variance(0.5 * returns, returns, mask).item() == pytest.approx(0.75, abs=1e-12)
    assert torch.isnan(explained_variance(returns, torch.ones_like(returns), mask))  # Var(R) = 0
