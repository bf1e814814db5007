"""KL estimators: exact expectations over an enumerated categorical distribution (float64)."""

import pytest
import torch

from rlhflab.losses import kl

F64 = torch.float64
P = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05], dtype=F64)  # π_θ, the sampling distribution
Q = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15], dtype=F64)  # π_ref


def exact_kl(p, q):
    return torch.distributions.kl_divergence(
        torch.distributions.Categorical(probs=p), torch.distributions.Categorical(probs=q)
    )


def expectation(estimator, p, q):
    """E_{x~p}[k(x)] = Σ_x p(x)·k(logp=log p(x), logp_ref=log q(x)), enumerated exactly."""
    return (p * estimator(p.log(), q.log())).sum()


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_k1_k3_are_unbiased_for_kl_policy_to_ref(name):
    est = kl.KL_ESTIMATORS[name]
    want = exact_kl(P, Q)  # KL(π_θ ‖ π_ref)
    torch.testing.assert_close(expectation(est, P, Q), want, rtol=0, atol=1e-6)
    # direction: samples from π_θ estimate KL(π_θ ‖ π_ref), not KL(π_ref ‖ π_θ) (they differ here)
    assert abs(exact_kl(Q, P) - want) > 0.1
    assert abs(expectation(est, P, Q) - exact_kl(Q, P)) > 0.1


def test_k2_is_second_order_accurate_for_close_distributions():
    u = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=F64)

    def err(delta):
        q = P * torch.exp(delta * u)
        q = q / q.sum()
        return (expectation(kl.k2, P, q) - exact_kl(P, q)).abs(), exact_kl(P, q)

    e1, kl1 = err(0.02)
    e2, _ = err(0.01)
    assert e1 / kl1 < 0.05  # within 5% of KL at δ = 0.02
    assert 1 / 16 < e2 / e1 < 1 / 4  # bias is third order: halving δ divides it by ≈ 8


def test_elementwise_values_by_hand():
    # r = π_ref/π_θ = 2, log r = 0.693147...: k1 = −0.693147, k2 = 0.693147²/2 = 0.240227,
    # k3 = (2 − 1) − 0.693147 = 0.306853
    logp = torch.tensor([-1.0], dtype=F64)
    logp_ref = logp + torch.tensor(2.0, dtype=F64).log()
    torch.testing.assert_close(
        kl.k1(logp, logp_ref), torch.tensor([-0.6931471805599453], dtype=F64), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(
        kl.k2(logp, logp_ref), torch.tensor([0.2402265069591007], dtype=F64), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(
        kl.k3(logp, logp_ref), torch.tensor([0.3068528194400547], dtype=F64), rtol=0, atol=1e-15
    )
    # equal policies (first on-policy step): every estimator is 0
    same = torch.randn(3, 4, dtype=F64)
    for name in kl.KL_ESTIMATORS:
        assert torch.equal(kl.kl_penalty(same, same, name), torch.zeros(3, 4, dtype=F64))


def test_k3_and_k2_non_negative_everywhere():
    log_r = torch.linspace(-30, 30, 2001, dtype=F64)
    logp = torch.zeros_like(log_r)
    assert (kl.k3(logp, log_r) >= 0).all()
    assert (kl.k2(logp, log_r) >= 0).all()
    assert (kl.k1(logp, log_r) < 0).any()  # k1 alone can be negative


def test_kl_penalty_dispatch_and_errors():
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    for name, fn in kl.KL_ESTIMATORS.items():
        assert torch.equal(kl.kl_penalty(a, b, name), fn(a, b))
    with pytest.raises(ValueError, match=r"k1, k2, k3, abs, k1\+, k3\+, abs\+"):
        kl.kl_penalty(a, b, "k4")
    with pytest.raises(ValueError, match="logp_ref"):
        kl.k3(a, b[:, :2])
    assert set(kl.KL_ESTIMATORS) == {"k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"}
