"""The held-out headline is a correctness, never a weighted sum called accuracy (issue #27)."""

import json
from pathlib import Path

import pytest
from factories import tiny_build

from rlhflab.config import config_from_dict, load_config
from rlhflab.data.prompts import load_prompt_source
from rlhflab.eval.accuracy import heldout_results
from rlhflab.eval.cli import run_prompt_eval_command
from rlhflab.rewards.shaping import TextRewardScorer
from rlhflab.trainers import run_config

ROOT = Path(__file__).resolve().parents[2]
GSM8K = ROOT / "tests/data/fixtures/prompts/gsm8k_short.jsonl"


def _components(*specs):
    from rlhflab.eval.common import reward_components_from_specs

    return reward_components_from_specs(list(specs))


def test_text_scorer_names_its_headline():
    r1 = TextRewardScorer(_components("math_verify", "think_format"))
    assert r1.correctness_key == "reward/math_verify"
    assert r1.headline_name == "correctness (math_verify)"
    fmt = TextRewardScorer(_components("think_format=0.5", "exact_match=0"))
    # a weight-0 verifier-like reward is still the headline (reported, not optimised)
    assert fmt.headline_name == "correctness (exact_match)"
    assert [c.name for c in fmt.components] == ["think_format"]
    only = TextRewardScorer(_components("think_format=0.5"))
    assert only.correctness_key is None
    assert only.headline_name == "reward (weighted sum: think_format=0.5)"


def test_heldout_results_never_call_a_weighted_sum_accuracy():
    ev = {"n": 3, "reward": 0.9, "reward_stderr": 0.1, "reward/think_format": 0.9,
          "reward/think_format_stderr": 0.1, "headline_name": "reward (weighted sum: t=1)"}  # fmt: skip
    res = heldout_results({"n": 3, "reward": 0.2}, ev)
    assert res["heldout_accuracy"] is None and res["heldout_metric"] == "reward"
    assert res["headline"] == {"name": "reward (weighted sum: t=1)", "value": 0.9,
                               "stderr": 0.1, "before": 0.2, "n": 3}  # fmt: skip
    assert res["heldout_rewards"] == {"think_format": 0.9}


@pytest.mark.slow
def test_r1_zero_headline_is_math_verify_with_format_its_own_column(tmp_path):
    """A tiny model taught to answer every question "<think>…</think><answer>8</answer>" (format
    reward 1, correct only where the gold is 8), then one R1-Zero preset step: the run's held-out
    headline equals `rlhflab eval --reward-fn math_verify` on its saved model, the format reward
    is its own column, and the weighted sum (what used to be called accuracy) is neither."""
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    sft_data = tmp_path / "sft.jsonl"
    completion = "<think>add</think><answer>8</answer>"
    sft_data.write_text(
        "".join(
            json.dumps({"prompt": r["question"], "completion": completion}) + "\n" for r in rows
        )
    )
    sft = config_from_dict(
        {
            "trainer": "sft",
            "model": {"build": tiny_build(max_position_embeddings=96)},
            "data": {"source": "jsonl", "path": str(sft_data)},
            "train": {"steps": 40, "batch_size": 12, "micro_batch_size": 12, "max_len": 96},
            "optim": {"lr": 3e-3},
            "eval": {"n": 0},
            "precision": {"threads": 1},
            "tracking": {"console": False},
            "run": {"name": "sft", "root": str(tmp_path)},
        }
    )
    sft_dir = run_config(sft)["model_dir"]
    cfg = load_config(
        ROOT / "configs/pg/r1_zero_gsm8k.yaml",
        [
            f"data.path={GSM8K}", "data.name=null", "data.heldout_split=null",
            "data.heldout_frac=0.34", "data.n_heldout=4", "data.template=null",
            f"model.name_or_path={sft_dir}", "rollout.prompts_per_step=2",
            "rollout.group_size=2", "rollout.max_new_tokens=40", "train.steps=1",
            "train.micro_batch_size=4", "optim.lr=1e-9", "optim.warmup_steps=0",
            "eval.n=4", "eval.max_new_tokens=40", "precision.threads=1",
            "tracking.console=false", f"run.root={tmp_path}",
        ],
    )  # fmt: skip
    res = run_config(cfg)
    head = res["headline"]
    assert head["name"] == "correctness (math_verify)" and res["heldout_metric"] == "accuracy"
    assert res["heldout_rewards"]["think_format"] == 1.0  # the format column, on its own
    assert head["value"] == res["heldout_accuracy"] == res["heldout_rewards"]["math_verify"]
    assert res["heldout_reward"] == pytest.approx(head["value"] + 1.0, abs=1e-6)  # the sum
    # the same held-out rows, scored by `rlhflab eval --reward-fn math_verify` alone
    held = load_prompt_source(cfg.data, cfg.task, seed=cfg.seed).heldout[: cfg.eval.n]
    held_file = tmp_path / "heldout.jsonl"
    held_file.write_text(
        "".join(json.dumps({"prompt": r.prompt, **r.columns}) + "\n" for r in held)
    )
    out = run_prompt_eval_command(
        res["model_dir"], data=str(held_file), rewards=["math_verify"], max_new_tokens=40
    )
    assert out["headline_name"] == "correctness (math_verify)"
    assert out["accuracy"] == head["value"] and out["n"] == head["n"] == 4
    assert 0.0 < head["value"] < 1.0  # not a trivial 0 = 0: some gold answers are 8
