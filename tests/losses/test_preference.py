"""Preference losses against hand arithmetic and their defining properties."""

import inspect
import math

import pytest
import torch

from rlhflab.losses import preference as P

t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731


def test_dpo_at_reference_is_log2_with_gradient_minus_beta_over_2():
    beta = 0.3
    pc = t(-5.0, -2.0).requires_grad_()
    pr = t(-7.0, -1.0).requires_grad_()
    losses, stats = P.dpo(pc, pr, pc.detach().clone(), pr.detach().clone(), beta=beta)
    assert torch.allclose(losses, t(math.log(2), math.log(2)), atol=0, rtol=1e-15)
    losses.sum().backward()
    assert torch.allclose(pc.grad, t(-beta / 2, -beta / 2))
    assert torch.allclose(pr.grad, t(beta / 2, beta / 2))
    assert stats["accuracy"].tolist() == [0.0, 0.0] and stats["margin"].tolist() == [0.0, 0.0]


def test_dpo_hand_values():
    # logratios: chosen -1 - (-2) = 1, rejected -3 - (-2) = -1; h = 2; beta 0.5 -> -log σ(1)
    losses, stats = P.dpo(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5)
    assert losses.item() == pytest.approx(-math.log(sig(1.0)), rel=1e-12)
    assert stats["chosen_reward"].item() == pytest.approx(0.5)
    assert stats["rejected_reward"].item() == pytest.approx(-0.5)
    assert stats["margin"].item() == pytest.approx(1.0) and stats["accuracy"].item() == 1.0


def test_cdpo_eps0_is_dpo_and_hand_value():
    args = (t(-1.0, -4.0), t(-3.0, -2.0), t(-2.0, -2.5), t(-2.0, -2.0))
    d, _ = P.dpo(*args, beta=0.5)
    c, _ = P.cdpo(*args, beta=0.5, label_smoothing=0.0)
    assert torch.equal(c, d)
    c, _ = P.cdpo(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.5, label_smoothing=0.2)
    expect = -0.8 * math.log(sig(1.0)) - 0.2 * math.log(sig(-1.0))
    assert c.item() == pytest.approx(expect, rel=1e-12)


def test_ipo_minimiser_is_half_over_beta():
    beta = 0.25
    h = torch.linspace(-5, 10, 3001, dtype=torch.float64)
    losses, _ = P.ipo(h, torch.zeros_like(h), torch.zeros_like(h), torch.zeros_like(h), beta=beta)
    assert h[losses.argmin()].item() == pytest.approx(1 / (2 * beta), abs=1e-9)
    # hand value: h = 1, 1/(2β) = 2 -> (1 - 2)² = 1
    loss, _ = P.ipo(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=beta)
    assert loss.item() == pytest.approx((2.0 - 2.0) ** 2)  # h = 2 here
    loss, _ = P.ipo(t(-1.0), t(-2.0), t(-2.0), t(-2.0), beta=beta)
    assert loss.item() == pytest.approx(1.0)


def test_hinge_hand_values_with_and_without_reference():
    # with ref: h = 2, beta 0.25 -> relu(1 - 0.5) = 0.5; beta 1 -> relu(1 - 2) = 0
    loss, _ = P.hinge(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=0.25)
    assert loss.item() == pytest.approx(0.5)
    loss, _ = P.hinge(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=1.0)
    assert loss.item() == 0.0
    # reference-free: policy margin -1 - (-3) = 2 -> relu(1 - 0.1·2) = 0.8
    loss, _ = P.hinge(t(-1.0), t(-3.0), None, None, beta=0.1)
    assert loss.item() == pytest.approx(0.8)


def test_length_averaged_losses_divide_by_lengths():
    # summed policy logps -6 (3 tokens) and -8 (2 tokens): averages -2 and -4
    pc, pr, lc, lr = t(-6.0), t(-8.0), t(3.0), t(2.0)
    loss, stats = P.simpo(
        pc, pr, None, None, chosen_lengths=lc, rejected_lengths=lr, beta=2.0, gamma=1.0
    )
    # β(-2) - β(-4) - γ = -4 + 8 - 1 = 3
    assert loss.item() == pytest.approx(-math.log(sig(3.0)), rel=1e-12)
    assert stats["chosen_reward"].item() == pytest.approx(-4.0)
    # The sum would give β(-6 + 8) - 1 = 3 as well only by coincidence; change lengths to check.
    loss2, _ = P.simpo(
        pc, pr, None, None, chosen_lengths=t(6.0), rejected_lengths=lr, beta=2.0, gamma=1.0
    )
    assert loss2.item() == pytest.approx(-math.log(sig(-2 + 8 - 1)), rel=1e-12)
    # dpo_norm: ((-6+3)/3 - (-8+2)/2) = -1 + 3 = 2; beta 0.5 -> -log σ(1)
    loss, _ = P.dpo_norm(pc, pr, t(-3.0), t(-2.0), chosen_lengths=lc, rejected_lengths=lr, beta=0.5)
    assert loss.item() == pytest.approx(-math.log(sig(1.0)), rel=1e-12)
    # dpo with the same numbers sums: (-6+3) - (-8+2) = 3 -> -log σ(1.5)
    loss, _ = P.dpo(pc, pr, t(-3.0), t(-2.0), beta=0.5)
    assert loss.item() == pytest.approx(-math.log(sig(1.5)), rel=1e-12)


def test_log1mexp_accurate_near_zero_and_far():
    x = t(-1e-12, -1e-6, -0.5, -1.0, -30.0)
    # reference: each branch of the textbook formula where it is the accurate one
    expect = [
        math.log(-math.expm1(v)) if v > -math.log(2) else math.log1p(-math.exp(v))
        for v in x.tolist()
    ]
    assert torch.allclose(P.log1mexp(x), t(*expect), rtol=1e-12, atol=0)
    # float32 near 0: the naive log(1 - exp(x)) loses everything, log1mexp does not
    x32 = torch.tensor([-1e-6, -1e-4], dtype=torch.float32)
    naive = torch.log(1 - torch.exp(x32))
    want = torch.tensor([math.log(-math.expm1(-1e-6)), math.log(-math.expm1(-1e-4))])
    assert torch.allclose(P.log1mexp(x32), want.float(), rtol=1e-6)
    assert not torch.allclose(naive, want.float(), rtol=1e-4)  # naive is off by ~1e-3
    assert torch.isfinite(P.log1mexp(torch.zeros(1))).all()  # P = 1 exactly: finite


def test_orpo_hand_values():
    # average logps: chosen log(0.5) (2 tokens), rejected log(0.2) (1 token)
    a, b = math.log(0.5), math.log(0.2)
    loss, stats = P.orpo(
        t(2 * a), t(b), None, None, chosen_lengths=t(2.0), rejected_lengths=t(1.0), lam=0.5
    )
    log_odds = math.log(0.5 / 0.5) - math.log(0.2 / 0.8)  # = log 4
    assert stats["log_odds_ratio"].item() == pytest.approx(log_odds, rel=1e-12)
    or_loss = -math.log(sig(log_odds))
    assert stats["or_loss"].item() == pytest.approx(or_loss, rel=1e-12)
    assert stats["sft_loss"].item() == pytest.approx(-a, rel=1e-12)
    assert loss.item() == pytest.approx(-a + 0.5 * or_loss, rel=1e-12)
    # log-probs near 0 (P ≈ 1): log odds = x - log(1 - e^x) with x = -1e-6 -> ≈ -1e-6 - log(1e-6)
    x = -1e-6
    loss, stats = P.orpo(
        t(x), t(b), None, None, chosen_lengths=t(1.0), rejected_lengths=t(1.0), lam=1.0
    )
    want = (x - math.log(-math.expm1(x))) - (b - math.log(1 - 0.2))
    assert stats["log_odds_ratio"].item() == pytest.approx(want, rel=1e-12)
    assert torch.isfinite(loss).all()
    # float32, x = -1e-7: finite and close to the float64 value
    _, stats32 = P.orpo(
        torch.tensor([-1e-7]), torch.tensor([b]), None, None,
        chosen_lengths=torch.ones(1), rejected_lengths=torch.ones(1), lam=1.0,
    )  # fmt: skip
    want = (-1e-7 - math.log(-math.expm1(-1e-7))) - (b - math.log(0.8))
    assert stats32["log_odds_ratio"].item() == pytest.approx(want, rel=1e-5)


def test_apo_hand_values():
    # Δw = 1, Δl = -1, beta 1
    z, _ = P.apo_zero(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=1.0)
    assert z.item() == pytest.approx((1 - sig(1)) + sig(-1), rel=1e-12)
    d, _ = P.apo_down(t(-1.0), t(-3.0), t(-2.0), t(-2.0), beta=1.0)
    assert d.item() == pytest.approx(sig(1) + (1 - sig(2)), rel=1e-12)


def test_kto_reference_point_and_clamp():
    beta = 0.5
    # r = [1, -1]; mismatched log-ratios [0.4, 0.2] -> z0 = 0.3
    pol, ref = t(-1.0, -3.0), t(-2.0, -2.0)
    des = torch.tensor([True, False])
    losses, stats = P.kto(
        pol, ref, des, t(-1.6, -1.8), t(-2.0, -2.0), beta=beta, desirable_weight=1.0,
        undesirable_weight=2.0,
    )  # fmt: skip
    assert stats["kl"].item() == pytest.approx(0.3)
    expect = [1 - sig(beta * (1 - 0.3)), 2 - 2 * sig(beta * (0.3 - (-1)))]
    assert torch.allclose(losses, t(*expect), rtol=1e-12)
    # negative estimate is clamped to 0
    losses, stats = P.kto(pol, ref, des, t(-3.0), t(-2.0), beta=beta)
    assert stats["kl_raw"].item() == pytest.approx(-1.0) and stats["kl"].item() == 0.0
    assert torch.allclose(losses, t(1 - sig(0.5), 1 - sig(0.5)), rtol=1e-12)
    # z0 carries no gradient
    kl_pol = t(-1.6, -1.8).requires_grad_()
    losses, _ = P.kto(pol, ref, des, kl_pol, t(-2.0, -2.0), beta=beta)
    assert not losses.requires_grad or kl_pol.grad is None


PAIRED = sorted(n for n, loss in P.PREFERENCE_LOSSES.items() if not loss.unpaired)


@pytest.mark.parametrize("name", PAIRED)
def test_every_paired_loss_gradcheck_and_stats(name):
    loss = P.PREFERENCE_LOSSES[name]
    fn = loss.fn
    kw = {}
    if loss.lengths:  # declared: the trainer supplies the completion lengths
        kw = {"chosen_lengths": t(3.0, 5.0), "rejected_lengths": t(4.0, 2.0)}
    pc = t(-4.0, -2.5).requires_grad_()
    pr = t(-5.0, -1.5).requires_grad_()
    rc, rr = t(-4.5, -2.0), t(-4.0, -2.0)
    torch.autograd.gradcheck(lambda a, b: fn(a, b, rc, rr, **kw)[0], (pc, pr))
    losses, stats = fn(pc, pr, rc, rr, **kw)
    assert losses.shape == (2,)
    for key in ("chosen_reward", "rejected_reward", "margin", "accuracy"):
        assert stats[key].shape == (2,) and not stats[key].requires_grad
    if loss.reference_free:  # declared: it never reads the reference log-probs
        assert torch.equal(fn(pc, pr, None, None, **kw)[0], losses)
        assert torch.equal(fn(pc, pr, rc + 1.0, rr - 2.0, **kw)[0], losses)


@pytest.mark.parametrize("name", sorted(P.PREFERENCE_LOSSES))
def test_declared_capabilities_agree_with_the_functions(name):
    """The registry's declarations (read by the trainer and the config) match each function:
    `lengths` exactly when it takes chosen_lengths / rejected_lengths, `unpaired` exactly for the
    KTO signature (labelled completions, then mismatched pairs); the call is the function's."""
    loss = P.PREFERENCE_LOSSES[name]
    params = list(inspect.signature(loss.fn).parameters)
    assert loss.lengths == ("chosen_lengths" in params) == ("rejected_lengths" in params)
    assert loss.trainer_args == ({"chosen_lengths", "rejected_lengths"} if loss.lengths else set())
    assert loss.unpaired == (params[:3] == ["policy_logps", "ref_logps", "desirable"])
    assert not (loss.unpaired and loss.reference_free)
    if not loss.unpaired:
        kw = {"chosen_lengths": t(3.0), "rejected_lengths": t(4.0)} if loss.lengths else {}
        args = (t(-4.0), t(-5.0), t(-4.5), t(-4.0))
        assert torch.equal(loss(*args, **kw)[0], loss.fn(*args, **kw)[0])


def test_reference_free_losses_are_declared():
    free = {n for n, loss in P.PREFERENCE_LOSSES.items() if loss.reference_free}
    assert free == {"simpo", "orpo"}
    assert P.unpaired_loss_names() == "'kto'"


def test_trl_loss_type_aliases_name_our_losses():
    """TRL's `loss_type` "sigmoid" is DPO, "sigmoid_norm" DPO on length-averaged log-ratios:
    the same numbers as ours (TRL's formulas written out here)."""
    assert P.PREFERENCE_ALIASES == {"sigmoid": "dpo", "sigmoid_norm": "dpo_norm"}
    assert not set(P.PREFERENCE_ALIASES) & set(P.PREFERENCE_LOSSES)
    pc, pr, rc, rr = t(-6.0, -2.0), t(-8.0, -1.0), t(-3.0, -2.5), t(-2.0, -1.5)
    lc, lr = t(3.0, 1.0), t(2.0, 4.0)
    beta = 0.5
    sigmoid = -torch.nn.functional.logsigmoid(beta * ((pc - rc) - (pr - rr)))
    loss, _ = P.PREFERENCE_LOSSES[P.PREFERENCE_ALIASES["sigmoid"]](pc, pr, rc, rr, beta=beta)
    torch.testing.assert_close(loss, sigmoid, rtol=1e-12, atol=0)
    norm = -torch.nn.functional.logsigmoid(beta * ((pc - rc) / lc - (pr - rr) / lr))
    loss, _ = P.PREFERENCE_LOSSES[P.PREFERENCE_ALIASES["sigmoid_norm"]](
        pc, pr, rc, rr, chosen_lengths=lc, rejected_lengths=lr, beta=beta
    )
    torch.testing.assert_close(loss, norm, rtol=1e-12, atol=0)


def test_rpo_is_dpo_plus_length_averaged_nll():
    # h = 2, beta 0.5 -> DPO -log σ(1); NLL of chosen: 1 / 2 tokens = 0.5; alpha 2 -> + 1.0
    loss, stats = P.rpo(
        t(-1.0), t(-3.0), t(-2.0), t(-2.0), chosen_lengths=t(2.0), rejected_lengths=t(5.0),
        beta=0.5, alpha=2.0,
    )  # fmt: skip
    assert loss.item() == pytest.approx(-math.log(sig(1.0)) + 1.0, rel=1e-12)
    assert stats["nll_loss"].item() == pytest.approx(0.5)
