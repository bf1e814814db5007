"""The gold-vs-proxy frontier (`rlhflab.eval.frontier`): one point from its definition on fakes,
and a GRPO run against a reward model logging it at every evaluation, with its plot."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from test_checkpoint_resume import grpo_raw

from rlhflab.config import config_from_dict
from rlhflab.eval.frontier import frontier_point
from rlhflab.models.loading import load_model, load_tokenizer
from rlhflab.trainers import run_config


class _Reward:  # the proxy: 0.25 per sampled character
    def score(self, texts, rollout, problems, *, where, raw_scores=False):
        assert raw_scores  # the frontier measures: reward models unnormalised
        total = torch.tensor([0.25 * len(t) for t in texts])
        return total, {"chars": total}


class _Verifier:  # the gold: 1 for an even number of characters
    def score_batch(self, texts, problems):
        return [1.0 if len(t) % 2 == 0 else 0.0 for t in texts]


def test_a_point_of_the_policy_against_itself_has_zero_kl_and_the_samples_scores(policy_and_rm):
    from factories import tiny_task

    from rlhflab.data.tasks import make_splits
    from rlhflab.experience.scoring import VerifierOnly
    from rlhflab.rollout.engines import make_engine

    policy_dir, _ = policy_and_rm
    tok, model = load_tokenizer(policy_dir), load_model(policy_dir).eval()
    t = tiny_task()
    problems = make_splits(t["name"], config=t.get("config", {}), n_train=50, n_heldout=12,
                           seed=0).heldout  # fmt: skip
    texts = []

    class Recording(_Reward):
        def score(self, texts_, rollout, problems_, *, where, raw_scores=False):
            texts.extend(texts_)
            return super().score(texts_, rollout, problems_, where=where, raw_scores=raw_scores)

    got = frontier_point(model, lambda: contextlib.nullcontext(model), tok, problems, Recording(),
                         VerifierOnly(_Verifier()),
                         engine=make_engine(None, model, tok), system=None, instruction="",
                         max_new_tokens=6, temperature=1.0, seed=0, batch=5)  # fmt: skip
    assert got["n"] == 12 == len(texts)
    assert got["kl"] == 0.0 and got["sqrt_kl"] == 0.0  # π = π_init: every token's log-ratio is 0
    assert got["proxy"] == pytest.approx(sum(0.25 * len(x) for x in texts) / 12, abs=1e-12)
    assert got["gold"] == pytest.approx(sum(len(x) % 2 == 0 for x in texts) / 12, abs=1e-12)


def test_grpo_against_a_reward_model_logs_the_frontier_at_every_evaluation(tmp_path,
                                                                           policy_and_rm):  # fmt: skip
    policy, rm_path = policy_and_rm
    raw = grpo_raw(tmp_path, policy)
    raw["reward"] = {"components": [{"name": "reward_model", "args": {"path": rm_path}},
                                    {"name": "correctness", "weight": 0.0}]}  # fmt: skip
    raw["train"] = {**raw["train"], "steps": 4}
    raw["eval"] = {**raw.get("eval", {}), "n": 8, "every": 2, "frontier_n": 8}
    raw["kl"] = {"coef": 0.0}  # no reference: the frontier keeps the initial policy itself
    res = run_config(config_from_dict(raw))
    rows = [json.loads(line) for line in (Path(res["run_dir"]) / "metrics.jsonl").open()]
    points = [r for r in rows if "frontier/sqrt_kl" in r]
    assert [r["step"] for r in points] == [0, 2, 4]
    assert points[0]["frontier/kl"] == 0.0 and points[-1]["frontier/kl"] != 0.0
    assert all(r["frontier/n"] == 8 and 0.0 <= r["frontier/gold"] <= 1.0 for r in points)
    assert (Path(res["run_dir"]) / "plots" / "frontier.png").stat().st_size > 0
    # a LoRA policy: π_init is the policy with its adapters disabled only while it is scored
    # (sampling and the policy's own log-probs keep them), so the KL grows as it trains
    lora = {**raw, "model": {**raw["model"], "lora": {"r": 4, "alpha": 8.0}},
            "optim": {**raw.get("optim", {}), "lr": 1e-2},
            "run": {**raw["run"], "root": str(tmp_path / "lora")}}  # fmt: skip
    res = run_config(config_from_dict(lora))
    rows = [json.loads(line) for line in (Path(res["run_dir"]) / "metrics.jsonl").open()]
    kls = [r["frontier/kl"] for r in rows if "frontier/kl" in r]
    assert len(kls) == 3 and kls[0] == 0.0 and kls[-1] != 0.0
    # off when asked, and then no initial policy is kept for it
    raw["eval"]["frontier"] = False
    raw["run"] = {**raw["run"], "root": str(tmp_path / "off")}
    res = run_config(config_from_dict(raw))
    rows = [json.loads(line) for line in (Path(res["run_dir"]) / "metrics.jsonl").open()]
    assert not any("frontier/kl" in r for r in rows)


def test_raw_scores_leave_a_running_normalisation_untouched(policy_and_rm, monkeypatch):
    from rlhflab.rewards import reward_model as rmod
    from rlhflab.rollout.sampler import pack

    monkeypatch.setattr(rmod, "_SCORERS", {})  # this test's scorers only, dropped after it
    monkeypatch.setattr(rmod, "_PENDING", {})
    _, rm_path = policy_and_rm
    batch = pack([[5, 6], [7]], [[8, 1], [9, 10, 1]], 0)

    def score(**kw):
        return rmod.reward_model_component(rollout=batch, path=rm_path, normalize="running", **kw)

    rmod.load_running_norm_state({})
    trained = score()  # a training step's call moves the statistics
    before = json.dumps(rmod.running_norm_state())
    raw = score(raw_scores=True)
    assert json.dumps(rmod.running_norm_state()) == before
    (scorer,) = [s for s in rmod._SCORERS.values() if s.normalize == "running"]
    assert torch.equal(raw, scorer.raw_scores_rollout(batch).cpu()) and not torch.equal(
        raw, trained
    )
    rmod.load_running_norm_state({})
