"""Advantage estimators against hand arithmetic; GAE against a naive per-sequence loop."""

import math

import pytest
import torch

from rlhflab.losses import advantages as A

F64 = torch.float64


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def test_group_zscore_by_hand_and_pinned_std_convention():
    # group [1, 0]: mean 0.5; unbiased std = sqrt((0.25 + 0.25)/1) = 0.70711 -> ±0.5/0.70711 = ±0.70711
    # group [0, 1, 2]: mean 1; unbiased std = sqrt((1 + 0 + 1)/2) = 1 -> [−1, 0, 1]
    adv = A.group_zscore(t([1.0, 0.0]), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, t([math.sqrt(0.5), -math.sqrt(0.5)]), rtol=0, atol=1e-12)
    adv = A.group_zscore(t([0.0, 1.0, 2.0, 5.0, 5.0, 5.0]), group_size=3, eps=0.0)
    torch.testing.assert_close(adv, t([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), rtol=0, atol=1e-12)
    # population std (unbiased=False): sqrt(2/3) -> ±1/sqrt(2/3) = ±1.224745
    adv = A.group_zscore(t([0.0, 1.0, 2.0]), group_size=3, eps=0.0, unbiased=False)
    torch.testing.assert_close(adv, t([-math.sqrt(1.5), 0.0, math.sqrt(1.5)]), rtol=0, atol=1e-12)
    # default matches torch.std (Bessel) per group, eps 1e-6 in the denominator
    r = torch.randn(12, dtype=F64, generator=torch.Generator().manual_seed(0))
    g = r.view(3, 4)
    want = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
    torch.testing.assert_close(A.group_zscore(r, group_size=4), want, rtol=0, atol=1e-12)


def test_zero_variance_group_gives_exactly_zero():
    # float32 mean([0.9, 0.9, 0.9]) rounds: r − mean = 6e-8, and (r − mean)/(std + 1e-6) would be
    # 0.056, a spurious advantage; it must be exactly 0
    r = torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0, 0.0], dtype=torch.float32)
    assert (r[:3] - r[:3].mean()).abs().max() > 0  # the rounding this guards against
    for fn in (A.group_zscore, A.group_mean, A.rloo):
        adv = fn(r, group_size=3)
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[:3], torch.zeros(3)), fn.__name__


def test_group_mean_and_rloo_by_hand():
    r = t([1.0, 0.0, 0.0, 1.0])
    # mean 0.5 -> [0.5, −0.5, −0.5, 0.5]
    torch.testing.assert_close(
        A.group_mean(r, group_size=4), t([0.5, -0.5, -0.5, 0.5]), rtol=0, atol=0
    )
    # RLOO: A_0 = 1 − (0 + 0 + 1)/3 = 2/3; A_1 = 0 − (1 + 0 + 1)/3 = −2/3
    torch.testing.assert_close(
        A.rloo(r, group_size=4), t([2 / 3, -2 / 3, -2 / 3, 2 / 3]), rtol=0, atol=1e-15
    )
    # RLOO = G/(G−1) · group_mean
    x = torch.randn(8, dtype=F64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(
        A.rloo(x, group_size=4), 4 / 3 * A.group_mean(x, group_size=4), rtol=0, atol=1e-12
    )


def test_batch_mean_and_no_baseline():
    r = t([1.0, 2.0, 6.0])  # mean 3
    torch.testing.assert_close(A.batch_mean(r), t([-2.0, -1.0, 3.0]), rtol=0, atol=0)
    assert torch.equal(A.no_baseline(r), r)
    ints = torch.tensor([1, 0, 0, 1])
    assert A.group_mean(ints, group_size=2).dtype == torch.float32
    assert A.no_baseline(ints).dtype == torch.float32


def test_group_errors():
    with pytest.raises(ValueError, match="group_size"):
        A.group_zscore(t([1.0, 2.0]), group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        A.rloo(t([1.0, 2.0, 3.0]), group_size=2)
    with pytest.raises(ValueError, match="rewards"):
        A.group_mean(t([[1.0, 2.0]]), group_size=2)
    with pytest.raises(ValueError, match="eps"):
        A.group_zscore(t([1.0, 2.0]), group_size=2, eps=-1.0)


# --- GAE ----------------------------------------------------------------------------------------


def naive_gae(rewards, values, lengths, gamma, lam):
    """Per-sequence reverse loop straight from δ_t = r_t + γV_{t+1} − V_t, A_t = δ_t + γλA_{t+1}."""
    b, t_max = rewards.shape
    adv = [[0.0] * t_max for _ in range(b)]
    for i in range(b):
        n = lengths[i]
        running = 0.0
        for step in reversed(range(n)):
            next_v = values[i][step + 1].item() if step + 1 < n else 0.0
            delta = rewards[i][step].item() + gamma * next_v - values[i][step].item()
            running = delta + gamma * lam * running
            adv[i][step] = running
    adv = torch.tensor(adv, dtype=F64)
    mask = torch.arange(t_max)[None, :] < torch.tensor(lengths)[:, None]
    return adv, torch.where(mask, adv + values, 0.0)


def test_gae_by_hand():
    # T=2, r=[0, 1], V=[0.5, 0.2], γ=λ=1: δ_1 = 1 − 0.2 = 0.8, δ_0 = 0 + 0.2 − 0.5 = −0.3,
    # A_0 = −0.3 + 0.8 = 0.5 (= Monte Carlo return 1 − V_0); returns = [1, 1]
    adv, ret = A.gae(t([[0.0, 1.0]]), t([[0.5, 0.2]]), torch.ones(1, 2), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, t([[0.5, 0.8]]), rtol=0, atol=1e-15)
    torch.testing.assert_close(ret, t([[1.0, 1.0]]), rtol=0, atol=1e-15)
    # λ=0: A_t = δ_t -> [−0.3, 0.8]
    adv, _ = A.gae(t([[0.0, 1.0]]), t([[0.5, 0.2]]), torch.ones(1, 2), gamma=1.0, lam=0.0)
    torch.testing.assert_close(adv, t([[-0.3, 0.8]]), rtol=0, atol=1e-15)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_gae_matches_naive_loop_with_masks(gamma, lam):
    g = torch.Generator().manual_seed(2)
    lengths = [6, 3, 1, 0, 5]
    b, t_max = len(lengths), 6
    mask = torch.arange(t_max)[None, :] < torch.tensor(lengths)[:, None]
    rewards = torch.randn(b, t_max, generator=g, dtype=F64)
    values = torch.randn(b, t_max, generator=g, dtype=F64)
    clean_r, clean_v = torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0)
    want_adv, want_ret = naive_gae(clean_r, clean_v, lengths, gamma, lam)
    # padding holds garbage: it must not change anything
    rewards[~mask] = float("nan")
    values[~mask] = 1e6
    adv, ret = A.gae(rewards, values, mask, gamma=gamma, lam=lam)
    torch.testing.assert_close(adv, want_adv, rtol=0, atol=1e-10)
    torch.testing.assert_close(ret, want_ret, rtol=0, atol=1e-10)


def test_gae_errors_and_detached():
    v = torch.zeros(2, 3, requires_grad=True)
    adv, ret = A.gae(torch.zeros(2, 3), v, torch.ones(2, 3), gamma=1.0, lam=0.95)
    assert not adv.requires_grad and not ret.requires_grad
    with pytest.raises(ValueError, match="gamma"):
        A.gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), gamma=1.5, lam=0.95)
    with pytest.raises(ValueError, match="lam"):
        A.gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), gamma=1.0, lam=-0.1)
    with pytest.raises(ValueError, match="values"):
        A.gae(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3), gamma=1.0, lam=0.95)


def test_whiten():
    adv = t([[1.0, 3.0, 100.0], [5.0, 7.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]]).bool()
    # valid [1, 3, 5, 7]: mean 4, population var (9 + 1 + 1 + 9)/4 = 5
    w = A.whiten(adv, mask)
    torch.testing.assert_close(
        w[mask], (t([1.0, 3.0, 5.0, 7.0]) - 4) / math.sqrt(5 + 1e-8), rtol=0, atol=1e-12
    )
    assert torch.equal(w[~mask], torch.zeros(2, dtype=F64))
    w = A.whiten(t([1.0, 3.0, 5.0, 7.0]), shift_mean=False)  # rescale only: mean stays 4
    assert w.mean().item() == pytest.approx(4.0, abs=1e-12)


def test_registry_every_name_calls():
    assert set(A.ADVANTAGES) == {
        "group_zscore", "group_mean", "rloo", "batch_mean", "none", "gae", "reinforce_pp",
        "reinforce_pp_baseline", "remax", "opo", "gpg", "pass_k", "optimal_token_baseline",
        "process_group_zscore", "prime_rloo",
    }  # fmt: skip
    r = t([1.0, 0.0, 0.5, 0.5])
    mask = torch.ones(4, 3)
    for name, entry in A.ADVANTAGES.items():
        kw = {"group_size": 2} if entry.needs_groups else {}
        if entry.needs_greedy:
            kw["baseline"] = t([0.5, 0.5, 0.0, 0.0])
        if entry.needs_token_probs:
            kw["logp"], kw["sum_pi_squared"] = torch.full((4, 3), -0.5), torch.full((4, 3), 0.5)
        if entry.needs_steps:
            r_tok, kw["steps"] = A.token_rewards(None, None, r, mask, outcome=True)
            adv = entry(r_tok, mask, **kw)
        elif entry.needs_outcome:  # dense rewards (B, T) and the outcome apart
            adv = entry(torch.zeros(4, 3, dtype=F64), mask, outcome=r, **kw)
        elif name == "gae":
            adv, _ = entry(
                r.view(2, 2), torch.zeros(2, 2, dtype=F64), torch.ones(2, 2), gamma=1.0, lam=0.95
            )
        elif entry.needs_mask:
            adv = entry(r, mask, **kw)
        else:
            adv = entry(r, **kw)
        assert adv.numel() in (4, 12) and torch.isfinite(adv).all(), name


def test_registry_declares_capabilities():
    """What the config and the trainer read instead of the signatures."""
    declared = {
        flag: {name for name, entry in A.ADVANTAGES.items() if getattr(entry, flag)}
        for flag in (
            "needs_groups", "needs_values", "per_token", "needs_mask", "batch_stats",
            "needs_greedy", "needs_token_probs", "needs_steps", "needs_outcome",
        )
    }  # fmt: skip
    assert declared["needs_groups"] == {
        "group_zscore", "group_mean", "rloo", "reinforce_pp_baseline", "opo", "gpg", "pass_k",
        "optimal_token_baseline", "process_group_zscore", "prime_rloo",
    }  # fmt: skip
    assert declared["needs_values"] == {"gae"}
    assert declared["per_token"] == {
        "gae", "reinforce_pp", "optimal_token_baseline", "process_group_zscore", "prime_rloo",
    }  # fmt: skip
    assert declared["needs_steps"] == {"process_group_zscore"}
    assert declared["needs_outcome"] == {"prime_rloo"}
    assert declared["batch_stats"] == {"batch_mean", "reinforce_pp", "reinforce_pp_baseline", "gpg"}
    assert declared["needs_greedy"] == {"remax"}
    assert declared["needs_token_probs"] == {"optimal_token_baseline"}
    assert A.ADVANTAGE_ALIASES == {  # verl's adv_estimator names
        "grpo": "group_zscore",
        "reinforce_plus_plus": "reinforce_pp",
        "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
        "grpo_passk": "pass_k",
    }
