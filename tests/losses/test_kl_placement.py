"""KL in the reward (per sequence, per token) and the adaptive KL controller, by hand."""

import json

import pytest
import torch

from rlhflab.losses.kl import KLController, adaptive_kl_coef, kl_in_reward

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def test_kl_in_reward_sequence_and_token_by_hand():
    rewards = t([1.0, 0.0])
    kl = t([[0.2, 0.4, 9.0], [0.5, 9.0, 9.0]])  # 9.0 at padding must not count
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # sequence: r − β·Σ_t kl = 1 − 0.5·0.6 = 0.7; 0 − 0.5·0.5 = −0.25
    seq = kl_in_reward(rewards, kl, mask, coef=0.5, per_token=False)
    torch.testing.assert_close(seq, t([0.7, -0.25]), rtol=0, atol=1e-12)
    # token: −β·kl_t, plus r at the last valid token
    tok = kl_in_reward(rewards, kl, mask, coef=0.5, per_token=True)
    torch.testing.assert_close(
        tok, t([[-0.1, -0.2 + 1.0, 0.0], [-0.25, 0.0, 0.0]]), atol=1e-12, rtol=0
    )
    # the token rewards sum to the sequence form (γ = 1)
    torch.testing.assert_close(tok.sum(-1), seq, rtol=0, atol=1e-12)


def test_kl_in_reward_is_data_and_errors():
    kl = torch.ones(1, 2, requires_grad=True)
    out = kl_in_reward(torch.zeros(1), kl, torch.ones(1, 2), coef=1.0, per_token=True)
    assert not out.requires_grad
    with pytest.raises(ValueError, match="coef"):
        kl_in_reward(torch.zeros(1), kl, torch.ones(1, 2), coef=-1.0, per_token=True)
    with pytest.raises(ValueError, match="need rewards"):
        kl_in_reward(torch.zeros(2), kl, torch.ones(1, 2), coef=1.0, per_token=True)


def test_adaptive_kl_controller_by_hand():
    # KL 12 vs target 6: e = clip(1, ±0.2) = 0.2; β·(1 + 0.2·256/10000) = 0.1·1.00512
    assert adaptive_kl_coef(0.1, 12.0, target=6.0, horizon=10000, n_steps=256) == pytest.approx(
        0.100512
    )
    # KL 3 vs target 6: e = −0.5 -> −0.2; shrinks
    assert adaptive_kl_coef(0.1, 3.0, target=6.0, horizon=10000, n_steps=256) == pytest.approx(
        0.099488
    )
    # at target: unchanged; small error is proportional: KL 6.6 -> e = 0.1
    assert adaptive_kl_coef(0.1, 6.0, target=6.0, horizon=100, n_steps=10) == pytest.approx(0.1)
    assert adaptive_kl_coef(0.1, 6.6, target=6.0, horizon=100, n_steps=10) == pytest.approx(0.101)
    with pytest.raises(ValueError, match="target"):
        adaptive_kl_coef(0.1, 1.0, target=0.0, horizon=1, n_steps=1)


# -- The stateful controller (KLController) ----------------------------------------------------


def test_kl_controller_adaptive_two_steps_by_hand():
    ctl = KLController(0.1, controller="adaptive", target=6.0, horizon=100)
    # step 1, KL 6.6 per completion: e = 6.6/6 − 1 = 0.1; β = 0.1·(1 + 0.1·10/100) = 0.101
    assert ctl.update(6.6, n_steps=10) == pytest.approx(0.101, rel=1e-12, abs=0)
    # step 2, KL 3: e = clip(3/6 − 1, ±0.2) = −0.2; β = 0.101·(1 − 0.2·10/100) = 0.09898
    assert ctl.update(3.0, n_steps=10) == pytest.approx(0.09898, rel=1e-12, abs=0)
    assert ctl.coef == pytest.approx(0.09898, rel=1e-12, abs=0)
    assert ctl.update(None, n_steps=10) == ctl.coef  # no KL measured this step: unchanged


def test_kl_controller_fixed_keeps_its_coef():
    ctl = KLController(0.05)
    assert ctl.update(100.0, n_steps=64) == 0.05 and ctl.coef == 0.05


def test_kl_controller_state_round_trip():
    a = KLController(0.05, controller="adaptive", target=0.01, horizon=100)
    a.update(0.013, n_steps=8)
    state = json.loads(json.dumps(a.state()))  # as the checkpoint stores it
    assert state == {"kl_coef": a.coef}  # the key of earlier checkpoints
    b = KLController(0.05, controller="adaptive", target=0.01, horizon=100)
    b.load(state)
    assert b.coef == a.coef  # exactly: resume is bitwise
    assert b.update(0.02, n_steps=8) == a.update(0.02, n_steps=8)
    # a checkpoint of an earlier version: the trainer's state dict with "kl_coef" among others
    c = KLController(0.05)
    c.load({"kl_coef": 0.0625, "initial_eval": {}, "verifier_errors": 0, "reward_norm": {}})
    assert c.coef == 0.0625


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"controller": "pid"}, r"unknown KL controller 'pid'; valid: fixed, adaptive"),
        ({"controller": "adaptive"}, r"target must be > 0"),
        ({"controller": "adaptive", "target": 1.0, "horizon": 0}, r"horizon must be >= 1"),
        ({"coef": 0.0, "controller": "adaptive", "target": 1.0}, r"initial coef > 0"),
        ({"coef": -1.0}, r"coef must be >= 0"),
    ],
)
def test_kl_controller_refuses_bad_settings(kwargs, match):
    kwargs = {"coef": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        KLController(kwargs.pop("coef"), **kwargs)
