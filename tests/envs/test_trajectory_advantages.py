"""Advantages of multi-turn trajectories: environment tokens (mask 0 between the model's turns)
are skipped, so per-token estimators see the model's tokens alone."""

import torch

from rlhflab.losses.advantages import ADVANTAGES, gae, token_rewards
from rlhflab.losses.kl import kl_in_reward


def _compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's valid entries moved to the front (right-padded with 0)."""
    out = torch.zeros_like(x)
    for i in range(x.size(0)):
        v = x[i][mask[i].bool()]
        out[i, : v.numel()] = v
    return out


def test_gae_over_a_trajectory_equals_gae_of_its_model_tokens():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor(
        [[1, 1, 0, 0, 1, 1, 1, 0, 0], [1, 0, 0, 1, 0, 1, 1, 1, 0]], dtype=torch.float64
    )
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    ref_adv, ref_ret = gae(_compact(rewards, mask), _compact(values, mask),
                           _compact(mask, mask), gamma=0.9, lam=0.8)  # fmt: skip
    torch.testing.assert_close(_compact(adv, mask), ref_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(_compact(ret, mask), ref_ret, rtol=0, atol=1e-12)
    assert adv[mask == 0].abs().sum() == 0 and ret[mask == 0].abs().sum() == 0


def test_sequence_reward_lands_on_the_last_model_token():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 1]], dtype=torch.float64)
    shaped = kl_in_reward(torch.tensor([2.0, -1.0], dtype=torch.float64), torch.zeros_like(mask),
                          mask, coef=0.0, per_token=True)  # fmt: skip
    expected = torch.zeros_like(mask)
    expected[0, 4], expected[1, 5] = 2.0, -1.0
    torch.testing.assert_close(shaped, expected)


def test_every_sequence_estimator_runs_per_trajectory():
    """Sequence-level estimators take one reward per trajectory (B,), whatever its turns; those
    that read the mask (lengths, per-token returns) get the trajectory's loss mask, and a
    per-token result is zero on environment tokens."""
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 1, 0], [1, 0, 1, 1, 0, 0]],
        dtype=torch.float64,
    )
    for name, entry in ADVANTAGES.items():
        if entry.needs_values:
            continue
        args = (rewards, mask) if entry.needs_mask else (rewards,)
        kwargs = {"group_size": 2} if entry.needs_groups else {}
        if entry.needs_greedy:
            kwargs["baseline"] = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
        if entry.needs_token_probs:
            kwargs["logp"] = torch.full_like(mask, -1.0) * mask
            kwargs["sum_pi_squared"] = torch.full_like(mask, 0.5) * mask
        if entry.needs_steps:  # the trajectory's reward at its last model token (token_rewards)
            r_tok, kwargs["steps"] = token_rewards(None, None, rewards, mask, outcome=True)
            args = (r_tok, mask)
        if entry.needs_outcome:  # no dense rewards: the outcome apart
            args, kwargs["outcome"] = (torch.zeros_like(mask), mask), rewards
        adv = entry.fn(*args, **kwargs)
        if entry.per_token or entry.needs_mask:  # may broadcast a sequence value over its tokens
            assert adv.shape in {(4,), tuple(mask.shape)}, name
        else:
            assert adv.shape == (4,), name
        if adv.ndim == 2:
            assert adv[mask == 0].abs().sum() == 0, name
