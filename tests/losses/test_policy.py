"""Policy surrogates against hand arithmetic and analytic gradients (float64)."""

import math

import pytest
import torch

from rlhflab.losses import policy
from rlhflab.losses.aggregate import aggregate
from rlhflab.ops import masked_mean

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def setup(ratios, adv, logp=None):
    """One row of tokens with the given ratios π/π_old; logp_old chosen so exp(logp − logp_old) = r."""
    r = t([ratios])
    logp = t([logp]) if logp is not None else torch.full_like(r, -1.0)
    logp = logp.clone().requires_grad_(True)
    logp_old = logp.detach() - torch.log(r)
    return logp, logp_old, t([adv]), torch.ones_like(r, dtype=torch.bool)


# --- ppo_clip -----------------------------------------------------------------------------------


def test_ppo_clip_by_hand_both_signs():
    # eps 0.2: clip range [0.8, 1.2]; loss = −min(r·A, clip(r)·A)
    #  r=1.5 A=+1: min(1.5, 1.2)=1.2   -> loss −1.2, clipped_high, grad 0
    #  r=1.1 A=+1: min(1.1, 1.1)=1.1   -> loss −1.1, grad −r·A = −1.1
    #  r=0.5 A=+1: min(0.5, 0.8)=0.5   -> loss −0.5, grad −0.5 (unclipped side)
    #  r=0.5 A=−1: min(−0.5, −0.8)=−0.8 -> loss 0.8, clipped_low, grad 0
    #  r=1.5 A=−1: min(−1.5, −1.2)=−1.5 -> loss 1.5, grad −r·A = 1.5
    #  r=0.9 A=−1: min(−0.9, −0.9)      -> loss 0.9, grad 0.9
    logp, logp_old, adv, mask = setup([1.5, 1.1, 0.5, 0.5, 1.5, 0.9], [1, 1, 1, -1, -1, -1])
    loss, stats = policy.ppo_clip(logp, logp_old, adv, mask, eps_low=0.2, eps_high=0.2)
    torch.testing.assert_close(loss, t([[-1.2, -1.1, -0.5, 0.8, 1.5, 0.9]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        stats["ratio"], t([[1.5, 1.1, 0.5, 0.5, 1.5, 0.9]]), rtol=0, atol=1e-12
    )
    assert stats["clipped_high"].tolist() == [[1, 0, 0, 0, 0, 0]]
    assert stats["clipped_low"].tolist() == [[0, 0, 0, 1, 0, 0]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[0.0, -1.1, -0.5, 0.0, 1.5, 0.9]]), rtol=0, atol=1e-12)
    assert all(not v.requires_grad for v in stats.values())


def test_ppo_clip_asymmetric_clip_higher():
    # DAPO eps_low 0.2, eps_high 0.28, A=+1: r=1.25 inside (−1.25); r=1.3 clipped at 1.28
    logp, logp_old, adv, mask = setup([1.25, 1.3, 0.7], [1, 1, -1])
    loss, stats = policy.ppo_clip(logp, logp_old, adv, mask, eps_low=0.2, eps_high=0.28)
    # r=0.7 A=−1: min(−0.7, −0.8) = −0.8 -> loss 0.8, clipped_low
    torch.testing.assert_close(loss, t([[-1.25, -1.28, 0.8]]), rtol=0, atol=1e-12)
    assert stats["clipped_high"].tolist() == [[0, 1, 0]]
    assert stats["clipped_low"].tolist() == [[0, 0, 1]]


def test_ppo_clip_on_policy_ratio_one_and_broadcast_adv():
    # first update: logp == logp_old -> ratio 1, loss −A, gradient −A (per token, adv (B,) broadcast)
    logp = t([[-1.0, -2.0], [-0.5, -0.1]]).requires_grad_(True)
    adv = t([2.0, -3.0])
    loss, stats = policy.ppo_clip(logp, logp.detach(), adv, torch.ones(2, 2))
    assert torch.equal(stats["ratio"], torch.ones(2, 2, dtype=F64))
    torch.testing.assert_close(loss, t([[-2.0, -2.0], [3.0, 3.0]]), rtol=0, atol=0)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-2.0, -2.0], [3.0, 3.0]]), rtol=0, atol=1e-12)


def test_ppo_clip_gradcheck():
    g = torch.Generator().manual_seed(0)
    logp_old = torch.randn(3, 4, generator=g, dtype=F64)
    logp = (logp_old + 0.5 * torch.randn(3, 4, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]).bool()

    def f(lp):
        return policy.ppo_clip(lp, logp_old, adv, mask, eps_low=0.2, eps_high=0.28)[0]

    assert torch.autograd.gradcheck(f, (logp,))


def test_padding_is_zero_and_garbage_safe():
    logp = t([[-1.0, float("inf")]]).requires_grad_(True)  # padding holds garbage
    logp_old = t([[-1.0, -float("inf")]])
    mask = torch.tensor([[1, 0]])
    for name, fn in policy.POLICY_LOSSES.items():
        loss, stats = fn(logp, logp_old, t([1.0]), mask)
        assert loss[0, 1].item() == 0.0, name
        assert all(v[0, 1].item() == 0.0 for v in stats.values()), name
        (grad,) = torch.autograd.grad(loss.sum(), logp)
        assert torch.isfinite(grad).all() and grad[0, 1].item() == 0.0, name


# --- reinforce ----------------------------------------------------------------------------------


def test_reinforce_by_hand():
    # loss = −A·logp: A=2, logp=−0.5 -> 1.0; A=−1, logp=−2 -> −2.0; gradient −A
    logp, logp_old, adv, mask = setup([1.5, 1.0], [2.0, -1.0], logp=[-0.5, -2.0])
    loss, stats = policy.reinforce(logp, logp_old, adv, mask)
    torch.testing.assert_close(loss, t([[1.0, -2.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(stats["ratio"], t([[1.5, 1.0]]), rtol=0, atol=1e-12)
    assert stats["clipped_low"].sum().item() == 0 and stats["clipped_high"].sum().item() == 0
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-2.0, 1.0]]), rtol=0, atol=0)


# --- cispo --------------------------------------------------------------------------------------


def test_cispo_by_hand_and_gradient_is_clipped_weight_times_adv():
    # eps_high 0.2, no lower bound: weight = min(r, 1.2)
    #  r=1.5 A=+1: w=1.2 -> loss −1.2·logp = 1.2, grad −1.2 (not zero: the token is kept)
    #  r=1.5 A=−1: w=1.2 -> loss −1.2,             grad +1.2
    #  r=0.5 A=+1: w=0.5 -> loss 0.5,              grad −0.5
    #  r=0.5 A=−1: w=0.5 -> loss −0.5,             grad +0.5
    #  r=1.1 A=+2: w=1.1 -> loss 2.2,              grad −2.2
    logp, logp_old, adv, mask = setup([1.5, 1.5, 0.5, 0.5, 1.1], [1, -1, 1, -1, 2])
    loss, stats = policy.cispo(logp, logp_old, adv, mask, eps_high=0.2)
    torch.testing.assert_close(loss, t([[1.2, -1.2, 0.5, -0.5, 2.2]]), rtol=0, atol=1e-12)
    assert stats["clipped_high"].tolist() == [[1, 1, 0, 0, 0]]
    assert stats["clipped_low"].tolist() == [[0, 0, 0, 0, 0]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-1.2, 1.2, -0.5, 0.5, -2.2]]), rtol=0, atol=1e-12)


def test_cispo_lower_bound_and_default_cap():
    # eps_low 0.2: r=0.5 -> w=0.8; default eps_high 2.0: r=4 -> w=3; r=2.5 -> w=2.5
    logp, logp_old, adv, mask = setup([0.5, 4.0, 2.5], [1.0, 1.0, 1.0])
    loss, stats = policy.cispo(logp, logp_old, adv, mask, eps_low=0.2)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, t([[-0.8, -3.0, -2.5]]), rtol=0, atol=1e-12)
    assert stats["clipped_low"].tolist() == [[1, 0, 0]]
    assert stats["clipped_high"].tolist() == [[0, 1, 0]]


# --- gspo ---------------------------------------------------------------------------------------


def gspo_batch():
    # row 0: 3 valid tokens, log-ratios [0.3, −0.1, 0.1] -> mean 0.1; row 1: 2 valid, [0.2, −0.6] -> −0.2
    log_ratio = t([[0.3, -0.1, 0.1], [0.2, -0.6, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()
    logp = t([[-1.0, -2.0, -0.5], [-0.3, -1.5, -4.0]]).requires_grad_(True)
    return logp, logp.detach() - log_ratio, mask


def test_gspo_sequence_ratio_and_hand_values():
    logp, logp_old, mask = gspo_batch()
    s0, s1 = math.exp(0.1), math.exp(-0.2)
    # wide clip (0.5): unclipped, loss_{i,t} = −s_i·A_i; A = [+1, −2]
    loss, stats = policy.gspo(logp, logp_old, t([1.0, -2.0]), mask, eps_low=0.5, eps_high=0.5)
    torch.testing.assert_close(stats["ratio"], t([[s0, s0, s0], [s1, s1, 0.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        loss, t([[-s0, -s0, -s0], [2 * s1, 2 * s1, 0.0]]), rtol=0, atol=1e-12
    )
    assert stats["clipped_low"].sum().item() == 0 and stats["clipped_high"].sum().item() == 0
    # paper defaults 3e-4/4e-4: s0=1.105 > 1.0004 with A>0 -> clipped_high, loss −1.0004;
    # s1=0.819 < 0.9997 with A<0 -> clipped_low, loss −(1−3e-4)·(−2) = 1.9994
    loss, stats = policy.gspo(logp, logp_old, t([1.0, -2.0]), mask)
    torch.testing.assert_close(loss, t([[-1.0004] * 3, [1.9994, 1.9994, 0.0]]), rtol=0, atol=1e-12)
    assert stats["clipped_high"].tolist() == [[1, 1, 1], [0, 0, 0]]
    assert stats["clipped_low"].tolist() == [[0, 0, 0], [1, 1, 0]]
    # both clipped on the flat side: no gradient
    (grad,) = torch.autograd.grad(aggregate(loss, mask, "seq_mean_token_mean", num_seqs=2), logp)
    assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("eps", [(0.5, 0.5), (0.05, 0.08)])
def test_gspo_gradient_equals_sequence_objective(eps):
    # with seq_mean_token_mean, ∇ of the token form == ∇ of −(1/G)Σ_i min(s_i A_i, clip(s_i) A_i)
    eps_low, eps_high = eps
    logp, logp_old, mask = gspo_batch()
    adv = t([1.0, -2.0])
    loss, _ = policy.gspo(logp, logp_old, adv, mask, eps_low=eps_low, eps_high=eps_high)
    (got,) = torch.autograd.grad(aggregate(loss, mask, "seq_mean_token_mean", num_seqs=2), logp)

    s = torch.exp(masked_mean(logp - logp_old, mask, dim=-1))
    seq_obj = torch.minimum(s * adv, torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv).mean()
    (want,) = torch.autograd.grad(-seq_obj, logp)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    # analytic, unclipped case: ∂/∂logp_{i,t} = −A_i·s_i / (G·|o_i|)
    if eps_low == 0.5:
        s0, s1 = math.exp(0.1), math.exp(-0.2)
        expected = t([[-s0 / 6] * 3, [2 * s1 / 4, 2 * s1 / 4, 0.0]])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_gspo_gradcheck_of_aggregated_loss():
    _, logp_old, mask = gspo_batch()
    g = torch.Generator().manual_seed(1)
    logp = (logp_old + 0.1 * torch.randn(2, 3, generator=g, dtype=F64)).requires_grad_(True)

    def f(lp):
        loss, _ = policy.gspo(lp, logp_old, t([1.0, -2.0]), mask, eps_low=0.5, eps_high=0.5)
        return aggregate(loss, mask, "seq_mean_token_mean", num_seqs=2)

    assert torch.autograd.gradcheck(f, (logp,))


# --- validation and registry --------------------------------------------------------------------


def test_bad_arguments_raise():
    logp, logp_old, adv, mask = setup([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="eps_low"):
        policy.ppo_clip(logp, logp_old, adv, mask, eps_low=1.0)
    with pytest.raises(ValueError, match="eps_high"):
        policy.ppo_clip(logp, logp_old, adv, mask, eps_high=-0.1)
    with pytest.raises(ValueError, match="eps_low"):
        policy.cispo(logp, logp_old, adv, mask, eps_low=-0.1)
    with pytest.raises(ValueError, match="adv"):
        policy.gspo(logp, logp_old, t([1.0, 2.0, 3.0]), mask)
    with pytest.raises(ValueError, match="logp_old"):
        policy.reinforce(logp, logp_old[:, :1], adv, mask)
    with pytest.raises(ValueError, match="mask"):
        policy.reinforce(logp, logp_old, adv, mask[0])


def test_registry_every_loss_calls_with_same_signature():
    assert set(policy.POLICY_LOSSES) == {
        "reinforce", "ppo_clip", "gspo", "cispo", "ppo_dual_clip", "sapo", "gmpo", "clip_cov",
        "kl_cov",
    }  # fmt: skip
    g = torch.Generator().manual_seed(2)
    logp = torch.randn(2, 3, generator=g, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    for fn in policy.POLICY_LOSSES.values():
        loss, stats = fn(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask)
        assert loss.shape == (2, 3) and loss.dtype == torch.float32
        assert {"ratio", "clipped_low", "clipped_high"} <= set(stats)
        assert all(v.shape == (2, 3) and not v.requires_grad for v in stats.values())
        loss.sum().backward()
