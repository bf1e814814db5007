"""The pure health checks (rlhflab.health) against values derived by hand, and the monitor's
patience, warning-once, stop and summary behaviour."""

import json
import math

import pytest
import torch

from rlhflab.config import HealthConfig
from rlhflab.health import (
    CHECKS,
    HealthMonitor,
    degeneracy,
    prob_sum_error,
    relative_change,
    repetition,
    sampled_distribution,
    training_signal,
)


def test_prob_sum_error_of_valid_logits():
    # zeros over V=4: p = 1/4 each, Σp = 1, max log p = -ln 4
    err, top = prob_sum_error(torch.zeros(3, 4))
    assert err < 1e-6 and top == pytest.approx(-math.log(4), abs=1e-6)
    err, top = prob_sum_error(torch.randn(5, 300) * 30)
    assert err < 1e-5 and top <= 0.0


def test_prob_sum_error_of_nan_logits_is_nan():
    logits = torch.zeros(2, 4)
    logits[1, 2] = float("nan")
    err, top = prob_sum_error(logits)
    assert math.isnan(err) and math.isnan(top)


def test_sampled_distribution_on_a_model(tiny_model):
    ids = torch.tensor([0, 0, 5, 6, 7, 8])
    mask = torch.tensor([0, 0, 1, 1, 1, 1])  # left padding is dropped
    err, top = sampled_distribution(tiny_model, ids, mask)
    assert err < 1e-5 and top <= 0.0
    assert tiny_model.training  # the check restores train mode


def test_repetition_by_hand():
    assert repetition([1, 2, 3, 4, 5, 6]) == 0.0
    # 7 tokens "a": 5 trigrams, 1 distinct -> 1 - 1/5
    assert repetition([9] * 7) == pytest.approx(0.8)
    # 1 2 1 2 1 2: trigrams (121)(212)(121)(212): 2 distinct of 4
    assert repetition([1, 2, 1, 2, 1, 2]) == pytest.approx(0.5)
    assert repetition([9] * 5) == 0.0  # shorter than 2n: not judged


def test_degeneracy_fractions_by_hand():
    # 2 groups of 2. Row 0 empty, row 1 "\x00x" non-printable; rows 2-3 identical "ab"
    texts = ["  ", "\x00x", "ab", "ab"]
    ids = torch.tensor(
        [[0, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0], [3, 3, 3, 3, 3, 3], [4, 5, 0, 0, 0, 0]]
    )
    mask = torch.tensor([[0.0] * 6, [1, 1, 0, 0, 0, 0], [1.0] * 6, [1, 1, 0, 0, 0, 0]])
    d = degeneracy(ids, mask, texts, group_size=2)
    assert d == {"empty": 0.25, "repetition": 0.25, "nonprintable": 0.25, "identical_group": 0.5}
    # the identical group is all correct: not degenerate
    d = degeneracy(ids, mask, texts, 2, correct=torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert d["identical_group"] == 0.0


def test_the_correctness_a_pg_run_passes_is_any_verifier_component():
    # The policy-gradient trainer hands the health monitor `correctness_of(components)`: a reward
    # of exact_match or math_verify (R1-Zero style) is a correctness too, so identical groups
    # that are all right are not flagged as degenerate (they were, before: only a component
    # named "correctness" counted).
    from rlhflab.rewards.shaping import correctness_of

    em, fmt, mv = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])
    assert correctness_of({"think_format": fmt, "exact_match": em}) is em
    assert correctness_of({"exact_match": em, "math_verify": mv}) is mv  # the headline's order
    assert correctness_of({"think_format": fmt}) is None


def test_relative_change():
    a = torch.tensor([3.0, 4.0])
    assert relative_change(a, a) == 0.0
    assert relative_change(a, torch.tensor([3.0, 5.0])) == pytest.approx(1 / 5)


def _monitor(printed, **cfg):
    return HealthMonitor(HealthConfig(**cfg), None, print_fn=printed.append)


def test_sustained_check_needs_patience_and_warns_once():
    printed = []
    h = _monitor(printed, patience=3)
    zero = {"train/loss": 1.0, "optim/grad_norm": 0.0}
    out = [
        h.check(s, {**zero, "train/loss": float(s)})["health/grad_norm_zero"] for s in (1, 2, 3, 4)
    ]
    assert out == [0.0, 0.0, 1.0, 1.0]
    assert h.check(5, {"train/loss": 5.0, "optim/grad_norm": 0.5})["health/grad_norm_zero"] == 0.0
    assert len(printed) == 1 and "'grad_norm_zero' failed at step 3" in printed[0]
    s = h.summary()
    assert not s["ok"] and s["failed"]["grad_norm_zero"] == {
        "first_step": 3,
        "count": 2,
        "value": 0.0,
    }


def test_immediate_check_and_stop():
    printed = []
    h = _monitor(printed, on_fail="stop")
    assert h.halt() is None
    out = h.check(1, {"train/loss": float("nan"), "optim/grad_norm": 1.0})
    assert out["health/nonfinite"] == 1.0
    assert h.halt() is not None and h.halt().name == "nonfinite" and h.halt().exit_code == 3


def test_healthy_metrics_are_quiet():
    printed = []
    h = _monitor(printed, window=3)
    for s in range(1, 10):
        m = {
            "policy/loss": 1e-9,  # ~0 on-policy by construction: never judged as "flat"
            "optim/grad_norm": 0.3,
            "policy/entropy": 0.7,
            "policy/ratio_mean": 1.0,
            "rollout/logp_diff_mean": 1e-7,
            "rollout/reward_mean": 0.4 + 0.01 * s,
            "rollout/truncated_frac": 0.05,
        }
        out = h.check(s, m, adv=torch.tensor([0.5, -0.5]))
        assert not any(out.values()), out
    assert h.summary()["ok"] and printed == []


def test_reward_and_loss_flat_over_window():
    h = _monitor([], window=4)
    outs = [h.check(s, {"train/loss": 2.0, "rollout/reward_mean": 0.0}) for s in range(1, 5)]
    assert "health/loss_flat" not in outs[2] and outs[3]["health/loss_flat"] == 1.0
    assert outs[3]["health/reward_flat"] == 1.0


def test_reward_hacking_needs_a_drop_and_a_rising_reward():
    h = _monitor([], window=2, hacking_drop=0.05)

    def steps(first, reward):
        for s in (first, first + 1):
            h.check(s, {"rollout/reward_mean": reward})

    h.observe_eval(0, {"accuracy": 0.5, "accuracy_stderr": 0.01})
    steps(1, 0.3)
    h.observe_eval(2, {"accuracy": 0.6, "accuracy_stderr": 0.01})  # the best, reward 0.3
    steps(3, 0.5)
    h.observe_eval(4, {"accuracy": 0.57, "accuracy_stderr": 0.01})  # drop 0.03 < 0.05: fine
    assert h.check(5, {"rollout/reward_mean": 0.5})["health/reward_hacking"] == 0.0
    h.observe_eval(6, {"accuracy": 0.4, "accuracy_stderr": 0.01})  # drop 0.2, reward +0.2
    out = h.check(7, {"rollout/reward_mean": 0.5})
    assert out["health/reward_hacking"] == 1.0
    # the drop beyond the margin max(0.05, 2·sqrt(2)·0.01) = 0.05
    assert h.summary()["failed"]["reward_hacking"]["value"] == pytest.approx(0.2 - 0.05)


def test_accuracy_drop_with_falling_reward_is_not_hacking():
    h = _monitor([], window=2)
    h.observe_eval(0, {"accuracy": 0.6, "accuracy_stderr": 0.01})
    for s in (1, 2):
        h.check(s, {"rollout/reward_mean": 0.2})
    h.observe_eval(2, {"accuracy": 0.3, "accuracy_stderr": 0.01})
    assert h.check(3, {"rollout/reward_mean": 0.2})["health/reward_hacking"] == 0.0


def _run(evals: dict, rewards: list[float], window: int = 4, **cfg):
    """A monitor fed one proxy reward per step (1-based) and held-out correctness `evals`
    ({step: accuracy}, step 0 before training), as a trainer feeds it; returns its summary."""
    h = _monitor([], window=window, **cfg)
    if 0 in evals:
        h.observe_eval(0, {"accuracy": evals[0], "accuracy_stderr": 0.02})
    for step, reward in enumerate(rewards, start=1):
        h.check(step, {"rollout/reward_mean": reward})
        if step in evals:
            h.observe_eval(step, {"accuracy": evals[step], "accuracy_stderr": 0.02})
    return h.summary()


def test_reward_hacking_fires_when_correctness_only_falls_from_the_start():
    # Issue #27's run: GRPO against a reward model, RM score -0.73 -> +1.74 while held-out
    # accuracy fell 0.46 -> 0.00. The initial evaluation is the best one; before the fix it had
    # no training signal to compare with, so the run ended healthy.
    rewards = [-0.73 + 2.47 * s / 19 for s in range(20)]
    two_evals = _run({0: 0.46, 20: 0.0}, rewards)  # eval.every 0: before and after only
    assert two_evals["failed"]["reward_hacking"]["first_step"] == 20
    # margin max(0.05, 2·sqrt(2)·0.02)
    assert two_evals["failed"]["reward_hacking"]["value"] == pytest.approx(
        0.46 - max(0.05, 2 * math.hypot(0.02, 0.02)), abs=1e-12
    )
    falling = _run({0: 0.46, 5: 0.30, 10: 0.12, 15: 0.05, 20: 0.0}, rewards)
    # (an evaluation after step 5 is judged with step 6's checks)
    assert falling["failed"]["reward_hacking"]["first_step"] == 6
    # correctness crashes to 0 by the first evaluation and stays there: judged against step 0
    crash = _run({0: 0.46, 5: 0.0, 10: 0.0, 15: 0.0, 20: 0.0}, rewards)
    assert crash["failed"]["reward_hacking"]["first_step"] == 6


def test_honest_learning_is_not_reward_hacking():
    # quickstart-like: reward and held-out accuracy rise together (46.0 -> 73.8), with noise
    rewards = [0.40 + 0.3 * s / 19 for s in range(20)]
    honest = _run({0: 0.46, 5: 0.55, 10: 0.52, 15: 0.70, 20: 0.738}, rewards)
    assert honest["ok"] and "reward_hacking" in honest["checked"]
    # accuracy falls but so does the proxy: a bad run, not a hacked one
    down = _run({0: 0.46, 10: 0.2, 20: 0.1}, [0.5 - 0.01 * s for s in range(20)])
    assert down["ok"]


@pytest.mark.parametrize(
    ("metrics", "signal"),
    [
        ({"rollout/reward_mean": 0.25, "dpo/margin": 9.0}, 0.25),  # policy gradient
        ({"dpo/margin": 1.5, "train/loss": 0.3}, 1.5),  # paired direct alignment
        ({"kto/chosen_reward": 0.75, "kto/rejected_reward": -0.5}, 1.25),  # KTO
        ({"train/loss": 0.3}, None),  # SFT, RM: nothing pushed up
    ],
)
def test_training_signal(metrics, signal):
    assert training_signal(metrics) == signal


def test_reward_hacking_in_direct_alignment_follows_the_margin():
    # DPO: no rollout reward; held-out accuracy falls while dpo/margin rises -> flagged
    h = _monitor([], window=2, hacking_drop=0.05)
    h.check(1, {"dpo/margin": 0.1})
    h.check(2, {"dpo/margin": 0.3})
    h.observe_eval(2, {"accuracy": 0.6, "accuracy_stderr": 0.01})  # signal mean 0.2
    h.check(3, {"dpo/margin": 0.9})
    h.check(4, {"dpo/margin": 1.1})
    h.observe_eval(4, {"accuracy": 0.4, "accuracy_stderr": 0.01})  # signal 1.0, drop 0.2
    assert h.summary()["failed"]["reward_hacking"] == {
        "first_step": 4,
        "count": 1,
        "value": pytest.approx(0.2 - 0.05),
    }
    # the same drop with a flat margin is not hacking; reward_flat never sees the margin
    h = _monitor([], window=2)
    for s in (1, 2, 3, 4):
        assert "health/reward_flat" not in h.check(s, {"dpo/margin": 0.2})
        if s in (2, 4):
            h.observe_eval(s, {"accuracy": 0.6 if s == 2 else 0.4, "accuracy_stderr": 0.01})
    assert h.summary()["ok"]


def test_state_round_trip_and_checkpoints_without_the_signal():
    h = _monitor([], window=3)
    for s, m in enumerate([0.1, 0.2, 0.4], start=1):
        h.check(s, {"dpo/margin": m})
    h.observe_eval(3, {"accuracy": 0.5, "accuracy_stderr": 0.1})
    state = h.state()
    again = _monitor([], window=3)
    again.load(state)
    assert list(again.signal) == [0.1, 0.2, 0.4] and again.evals == h.evals
    # a checkpoint from before `signal` was stored (policy gradient only): the rewards are it
    old = {k: v for k, v in state.items() if k != "signal"} | {"rewards": [0.5, 0.7]}
    again = _monitor([], window=3)
    again.load(old)
    assert list(again.signal) == [0.5, 0.7] == list(again.rewards)


def test_skip_and_disable():
    h = _monitor([], skip=["grad_norm_zero"], patience=1)
    assert "health/grad_norm_zero" not in h.check(1, {"optim/grad_norm": 0.0})
    assert _monitor([], enabled=False).check(1, {"optim/grad_norm": float("nan")}) == {}


def test_every_check_is_documented():
    doc = (__import__("pathlib").Path(__file__).parents[1] / "docs" / "health.md").read_text()
    for name in CHECKS:
        assert f"`{name}`" in doc, name


def test_params_frozen_on_a_model(tiny_model):
    h = HealthMonitor(HealthConfig(patience=1), tiny_model, print_fn=lambda _: None)
    assert h.check(1, {})["health/params_frozen"] == 1.0  # nothing moved
    with torch.no_grad():
        next(tiny_model.parameters()).add_(1e-3)
    assert h.check(2, {})["health/params_frozen"] == 0.0


def test_summary_counts_only_the_checks_that_had_inputs():
    # SFT-like metrics (no rollout, advantages, KL or reward) and evaluations without a
    # training signal: only the loss and gradient checks apply; reward_hacking does not.
    h = _monitor([], window=3)
    for s in range(1, 5):
        h.check(s, {"train/loss": 1.0 / s, "optim/grad_norm": 0.5})
        h.observe_eval(s, {"accuracy": 0.5 - 0.1 * s, "accuracy_stderr": 0.01})
    s = h.summary()
    assert s["ok"]
    assert s["checked"] == ["nonfinite", "grad_norm_zero", "grad_norm_exploding", "loss_flat"]
    # survives a checkpoint round trip
    again = _monitor([], window=3)
    again.load(h.state())
    assert again.summary()["checked"] == s["checked"]


def test_reward_hacking_reads_the_frontiers_held_out_proxy():
    # The held-out proxy of the gold-vs-proxy frontier, not the training signal's window mean,
    # is the proxy compared: here the training signal is flat while the held-out proxy rises.
    h = _monitor([], window=2, hacking_drop=0.05)
    h.observe_eval(0, {"accuracy": 0.6, "accuracy_stderr": 0.01, "frontier": {"proxy": 0.1}})
    for s in (1, 2):
        h.check(s, {"rollout/reward_mean": 0.3})
    h.observe_eval(2, {"accuracy": 0.3, "accuracy_stderr": 0.01, "frontier": {"proxy": 0.6}})
    assert h.check(3, {"rollout/reward_mean": 0.3})["health/reward_hacking"] == 1.0
    # the same evaluations with a falling held-out proxy: a drop, but no hacking
    g = _monitor([], window=2, hacking_drop=0.05)
    g.observe_eval(0, {"accuracy": 0.6, "accuracy_stderr": 0.01, "frontier": {"proxy": 0.6}})
    for s in (1, 2):
        g.check(s, {"rollout/reward_mean": 0.9})
    g.observe_eval(2, {"accuracy": 0.3, "accuracy_stderr": 0.01, "frontier": {"proxy": 0.1}})
    assert g.check(3, {"rollout/reward_mean": 0.9})["health/reward_hacking"] == 0.0


def test_a_held_out_proxy_rise_is_judged_by_its_paired_standard_error():
    """The frontier scores the same problems with the same seed at every evaluation, so a
    rise pairs by problem. Proxies before 0.1, 0.5, 0.9, 0.3 (mean 0.45, s.d. 0.342, s.e.
    0.171) and after +0.03, +0.02, +0.04, +0.03: the rise 0.03 is far inside 2 combined s.e.
    (2·√2·0.171 = 0.48) but the differences' s.d. is 0.00816, s.e. 0.00408, 2 s.e. = 0.0082:
    rising, so the gold's fall counts as hacking. Without the per-problem values (an older
    checkpoint), the combined s.e. is used and it does not."""
    before = [0.1, 0.5, 0.9, 0.3]
    after = [b + d for b, d in zip(before, [0.03, 0.02, 0.04, 0.03], strict=True)]
    se = 0.342 / 2  # s.e. of each evaluation's mean (4 problems)
    d = [0.03, 0.02, 0.04, 0.03]
    sd = (sum((x - 0.03) ** 2 for x in d) / 3) ** 0.5
    assert sd == pytest.approx(0.0081650, abs=1e-6)

    def run(with_values):
        h = _monitor([], window=2, hacking_drop=0.05)
        for step, vals in ((0, before), (2, after)):
            front = {"proxy": sum(vals) / 4, "proxy_stderr": se}
            if with_values:
                front["proxy_values"] = vals
            h.observe_eval(step, {"accuracy": 0.47 if step == 0 else 0.26,
                                  "accuracy_stderr": 0.01, "frontier": front})  # fmt: skip
        return h

    h = run(True)
    assert h._proxy_rise_margin(2, 0) == pytest.approx(2 * sd / 2, abs=1e-12)
    assert h.check(3, {"rollout/reward_mean": 0.2})["health/reward_hacking"] == 1.0
    g = _monitor([], window=2, hacking_drop=0.05)
    g.load(json.loads(json.dumps(h.state())))  # the paired values survive a restart
    assert g._proxy_rise_margin(2, 0) == pytest.approx(2 * sd / 2, abs=1e-12)
    u = run(False)
    assert u._proxy_rise_margin(2, 0) == pytest.approx(2 * 2**0.5 * se, abs=1e-12)
    assert u.check(3, {"rollout/reward_mean": 0.2})["health/reward_hacking"] == 0.0


def test_a_held_out_proxy_rise_is_judged_by_its_standard_errors():
    # A reward model's scale is its own: a rise of 0.03 is far beyond its 2 combined standard
    # errors (2·sqrt(2)·0.004 ≈ 0.011) though below hacking_drop 0.05, so it counts as rising.
    h = _monitor([], window=2, hacking_drop=0.05)
    h.observe_eval(0, {"accuracy": 0.47, "accuracy_stderr": 0.01,
                       "frontier": {"proxy": 0.17, "proxy_stderr": 0.004}})  # fmt: skip
    h.observe_eval(2, {"accuracy": 0.26, "accuracy_stderr": 0.01,
                       "frontier": {"proxy": 0.20, "proxy_stderr": 0.004}})  # fmt: skip
    assert h.check(3, {"rollout/reward_mean": 0.2})["health/reward_hacking"] == 1.0
    # a restart from the monitor's state judges alike
    g = _monitor([], window=2, hacking_drop=0.05)
    g.load(json.loads(json.dumps(h.state())))
    assert g.proxy_se == {0: 0.004, 2: 0.004}
