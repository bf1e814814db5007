"""Dense process rewards in RL (`credit: dense`): a PRM's per-step P(correct) lands at the
step-separator tokens, the config refuses what cannot take per-token rewards, and GRPO with
process supervision (`process_group_zscore`) and PPO with GAE run on a tiny policy and PRM."""

import json
import math
from pathlib import Path

import pytest
import torch
from factories import tiny_pg, write_separators

from rlhflab.config import RewardComponentConfig, config_from_dict
from rlhflab.errors import ConfigError

SEP = "\n"


@pytest.fixture(scope="module")
def policy_and_prm(tmp_path_factory, tiny_tokenizer):
    """A tiny untrained policy that writes the step separator often, and an untrained 2-class
    PRM on its backbone: (policy directory, PRM directory, separator id)."""
    from rlhflab.models.build import build_model, save_pretrained
    from rlhflab.models.reward import reward_model_from_causal_lm, save_reward_model

    root = tmp_path_factory.mktemp("dense")
    tok = tiny_tokenizer
    policy = build_model(tok, size="tiny", max_position_embeddings=128, seed=0)
    sep = write_separators(policy, tok, SEP)
    save_pretrained(policy, tok, root / "policy")
    prm = reward_model_from_causal_lm(
        build_model(tok, size="tiny", max_position_embeddings=128, seed=1),
        num_labels=2,
        pad_token_id=tok.pad_token_id,
    )
    save_reward_model(prm, tok, root / "prm")
    return str(root / "policy"), str(root / "prm"), sep


def test_dense_prm_step_rewards_land_at_the_separators(policy_and_prm):
    """Each step's P(correct) at its separator token, read from an unpadded forward of the
    prefix alone (the PRM is causal), and 0 elsewhere; the logged score is the min over steps,
    as `credit: sequence` gives."""
    from rlhflab.models.loading import load_tokenizer
    from rlhflab.rewards.reward_model import StepRewards, reward_model_component
    from rlhflab.rollout.sampler import pack

    _, prm_path, sep = policy_and_prm
    tok = load_tokenizer(prm_path)
    prompts = [tok("1 + 2 =", add_special_tokens=False)["input_ids"], [5, 6, 7, 8]]
    comps = [[11, sep, 12, 13, sep, tok.eos_token_id], [14, 15]]  # the second: no separator
    rollout = pack(prompts, comps, tok.pad_token_id)
    args = {"path": prm_path, "kind": "prm", "step_separator": SEP}
    out = reward_model_component(rollout=rollout, credit="dense", **args)
    assert isinstance(out, StepRewards)
    want_steps = torch.zeros_like(rollout.mask, dtype=torch.bool)
    want_steps[0, 1] = want_steps[0, 4] = True
    assert torch.equal(out.steps, want_steps)

    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(prm_path).eval()
    want = torch.zeros(rollout.mask.shape)
    for t in (1, 4):
        ids = torch.tensor([prompts[0] + comps[0][: t + 1]])
        with torch.no_grad():
            logits = hf.model(ids).last_hidden_state[0, -1] @ hf.score.weight.T
        want[0, t] = torch.softmax(logits.float(), -1)[-1]
    torch.testing.assert_close(out.values, want, rtol=0, atol=1e-5)
    assert out.values[0, 1] != out.values[0, 4]  # two different step scores, not a constant
    seq = reward_model_component(rollout=rollout, **args)  # credit: sequence (min)
    torch.testing.assert_close(out.score, seq)
    assert out.score[1] == 1.0  # no step: no evidence of an error, as prm_solution_score
    one_by_one = reward_model_component(rollout=rollout, credit="dense", micro_batch_size=1, **args)
    torch.testing.assert_close(one_by_one.values, out.values, rtol=0, atol=1e-6)


def test_score_components_keeps_dense_apart(policy_and_prm):
    from rlhflab.models.loading import load_tokenizer
    from rlhflab.rewards.shaping import dense_step_rewards, score_components
    from rlhflab.rollout.sampler import pack

    _, prm_path, sep = policy_and_prm
    tok = load_tokenizer(prm_path)
    rollout = pack([[5, 6], [7]], [[9, sep, 10, sep], [sep, 3]], tok.pad_token_id)
    args = {"path": prm_path, "kind": "prm", "credit": "dense"}
    comps = [
        RewardComponentConfig(name="reward_model", weight=0.5, args=args),
        RewardComponentConfig(name="length", weight=1.0),
    ]
    supplied = {"texts": ["a", "b"], "rollout": rollout, "lengths": rollout.lengths,
                "max_new_tokens": 4}  # fmt: skip
    dense = []
    total, parts = score_components(comps, supplied, dense=dense)
    torch.testing.assert_close(total, -rollout.lengths.float() / 4)  # the outcome part alone
    assert set(parts) == {"reward_model", "length"} and parts["reward_model"].shape == (2,)
    step_r, steps = dense_step_rewards(dense, rollout.mask)
    assert steps.tolist() == [[False, True, False, True], [True, False, False, False]]
    raw = dense[0].values / 0.5
    assert torch.equal(step_r, dense[0].values) and (raw[steps] > 0).all()
    assert (step_r[~steps] == 0).all()
    with pytest.raises(ConfigError, match="credit"):  # a caller with one reward per completion
        score_components(comps, supplied)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"args": {"credit": "per_step"}}, "credit: one of sequence, dense"),
        ({"args": {"kind": "orm", "credit": "dense"}}, "needs kind 'prm'"),
        ({"args": {"normalize": "running"}}, "normalize"),
        ({"loss": {"advantage": "group_zscore"}}, "per-token rewards"),
        ({"kl": {"coef": 0.1, "placement": "reward_token"}}, "kl.placement"),
    ],
)
def test_config_refuses_what_cannot_take_dense_rewards(tmp_path, policy_and_prm, change, match):
    policy, prm_path, _ = policy_and_prm
    raw = _dense_grpo(tmp_path, policy, prm_path)
    comp = raw["reward"]["components"][0]
    comp["args"].update(change.pop("args", {}))
    raw.update(change)
    with pytest.raises(ConfigError, match=match):
        config_from_dict(raw)


def _dense_prm(path):
    return {"name": "reward_model", "weight": 1.0,
            "args": {"path": path, "kind": "prm", "credit": "dense"}}  # fmt: skip


def _dense_grpo(root, policy, prm_path, **sections):
    return tiny_pg(
        root,
        policy,
        rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 12},
        reward={"components": [_dense_prm(prm_path), {"name": "correctness", "weight": 1.0}]},
        loss={"advantage": "process_group_zscore"},
        train={"steps": 2, "micro_batch_size": 8},
        **sections,
    )


def _rows(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "policy/loss" in r]


@pytest.mark.parametrize("family", ["grpo", "ppo"])
def test_dense_credit_runs_two_steps_and_logs(tmp_path, policy_and_prm, family):
    from rlhflab.trainers import run_config

    policy, prm_path, _ = policy_and_prm
    extra = {}
    if family == "ppo":  # per-step returns with GAE and a critic
        extra = {"value": {}, "kl": {"coef": 0.05, "estimator": "k1", "placement": "reward_token"}}
    if family == "grpo":  # held-out evaluation: the gold-vs-proxy frontier reads the PRM's score
        extra = {"eval": {"n": 4, "max_new_tokens": 12}}
    raw = _dense_grpo(tmp_path, policy, prm_path, **extra)
    if family == "ppo":
        raw["loss"] = {"advantage": "gae", "advantage_args": {"gamma": 1.0, "lam": 0.95}}
    res = run_config(config_from_dict(raw))
    rows = _rows(res["run_dir"])
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["policy/loss"]) and math.isfinite(r["optim/grad_norm"])
        assert r["rollout/steps_mean"] > 0  # the PRM's step rewards were given
        assert 0.0 <= r["rollout/no_step_frac"] <= 1.0
        assert "rollout/reward/reward_model_mean" in r and "rollout/reward/correctness_mean" in r
        assert r["policy/ratio_mean"] == 1.0  # first update on-policy
    assert any(r["optim/grad_norm"] > 0 for r in rows)  # the step rewards gave a signal
    if family == "grpo":
        lines = (Path(res["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        assert any("frontier/proxy" in json.loads(x) for x in lines)


def _dense_batch():
    """Two groups of 2: step rewards at hand-placed steps, outcome rewards, uneven lengths."""
    from rlhflab.rollout.dynamic import ScoredBatch
    from rlhflab.rollout.sampler import pack

    rollout = pack([[5], [5], [6, 7], [6, 7]], [[9, 9, 9], [9, 9], [9, 9, 9, 9], [9]], 0)
    steps = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    step_rewards = torch.where(steps, torch.tensor([[0.25], [0.5], [0.75], [1.0]]), 0.0)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    batch = ScoredBatch(rollout, rewards, {"correctness": rewards}, ["a"] * 4, [None] * 4,
                        step_rewards=step_rewards, steps=steps)  # fmt: skip
    return batch


def test_the_trainer_seam_places_step_and_outcome_rewards():
    """`pg_phases.advantages` on a dense batch: the per-token rewards are the step rewards at
    their steps plus the outcome at the last valid token (written out by hand here), and the
    advantage is process_group_zscore of those, with the reward positions."""
    from types import SimpleNamespace

    from rlhflab.losses.advantages import process_group_zscore
    from rlhflab.trainers import pg_phases

    batch = _dense_batch()
    cfg = SimpleNamespace(
        loss=SimpleNamespace(advantage="process_group_zscore", whiten_advantages=False),
        kl=SimpleNamespace(placement="loss"),
        reward=SimpleNamespace(has_outcome=True),
    )
    data = pg_phases.StepData(batch=batch, local=batch, r0=0, r1=4)
    pg_phases.advantages(data, cfg, 0.0, {"group_size": 2})
    # row 0: step 0.25 at t=0, outcome 1 at its last token t=2; row 1: step 0.5 at t=1, its
    # last token, where the outcome 0 adds to it; row 2: steps 0.75 at t=0 and t=2, outcome 0
    # at t=3; row 3: no step, outcome 1 at t=0 (its only token).
    rewards = torch.tensor(
        [[0.25, 0, 1.0, 0], [0, 0.5, 0, 0], [0.75, 0, 0.75, 0.0], [1.0, 0, 0, 0]]
    )
    given = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 0], [1, 0, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    mask = batch.rollout.mask
    want = process_group_zscore(rewards, mask, group_size=2, steps=given)
    torch.testing.assert_close(data.adv, want, rtol=0, atol=0)
    assert data.adv.abs().sum() > 0
    cfg.reward.has_outcome = False  # no weighted outcome: only the steps carry rewards
    pg_phases.advantages(data, cfg, 0.0, {"group_size": 2})
    want = process_group_zscore(batch.step_rewards, mask, group_size=2, steps=batch.steps)
    torch.testing.assert_close(data.adv, want, rtol=0, atol=0)


def test_scored_batch_keeps_step_rewards_aligned():
    from rlhflab.rollout.dynamic import ScoredBatch
    from rlhflab.rollout.sampler import pack

    batch = _dense_batch()
    second = batch.select_groups(torch.tensor([1]), 2)
    assert torch.equal(second.steps, batch.steps[2:]) and second.step_rewards.shape == (2, 4)
    # a rank's share of group 0 at its own width (3 tokens): concat re-pads steps with False
    narrow = ScoredBatch(
        pack([[5], [5]], [[9, 9, 9], [9, 9]], 0),
        batch.rewards[:2],
        {"correctness": batch.rewards[:2]},
        ["a"] * 2,
        [None] * 2,
        step_rewards=batch.step_rewards[:2, :3],
        steps=batch.steps[:2, :3],
    )
    joined = ScoredBatch.concat([second, narrow], pad_token_id=0)
    assert joined.steps.shape == joined.rollout.mask.shape
    assert torch.equal(joined.steps[2:, :3], batch.steps[:2, :3])
    assert not joined.steps[2:, 3].any() and (joined.step_rewards[2:, 3] == 0).all()


def test_online_dpo_refuses_dense_credit(policy_and_prm):
    from rlhflab.config.direct_alignment import VerifiablePairsConfig

    _, prm_path, _ = policy_and_prm
    comp = {"name": "reward_model", "args": {"path": prm_path, "kind": "prm", "credit": "dense"}}
    with pytest.raises(ValueError, match=r"verifiable\.reward: credit 'dense'"):
        VerifiablePairsConfig(reward=[comp])
    VerifiablePairsConfig(reward=[{**comp, "args": {**comp["args"], "credit": "sequence"}}])
