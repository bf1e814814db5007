"""GRPO on a prompt JSONL with a user reward function file: the held-out reward rises."""

import json
from pathlib import Path

import pytest

from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

FIX = str(Path(__file__).parents[1] / "data" / "fixtures" / "prompts")


def _cfg(root, **kw):
    raw = {
        "trainer": "policy_gradient",
        "seed": 0,
        "model": {
            "build": {
                "size": "tiny",
                "vocab_size": 300,
                "max_position_embeddings": 96,
                "tokenizer_texts": 300,
            }
        },
        # 60 prompts with a `max_chars` column; 15 held out by a seeded fraction.
        "data": {"source": "dataset", "path": f"{FIX}/brevity.jsonl", "heldout_frac": 0.25},
        "reward": {"components": [{"function": f"{FIX}/user_rewards.py:brevity"}]},
        "rollout": {"prompts_per_step": 8, "group_size": 8, "max_new_tokens": 8},
        "train": {"steps": 20, "micro_batch_size": 64},
        "optim": {"lr": 3e-3},
        "eval": {"n": 15, "max_new_tokens": 8},
        "precision": {"threads": 1},
        "tracking": {"console": False},
        "run": {"name": "grpo-brevity", "root": str(root), "save_model": False},
    }
    for key, value in kw.items():
        raw[key] = {**raw[key], **value}
    return config_from_dict(raw)


@pytest.mark.slow
def test_grpo_on_prompt_jsonl_with_user_reward_raises_heldout_reward(tmp_path):
    # Measured (seeds 0, 1, 2): held-out greedy reward 0.058 → 0.758, 0.060 → 0.775,
    # 0.057 → 0.742 in 20 steps (~10 s on one CPU thread).
    res = run_config(_cfg(tmp_path))
    assert res["heldout_metric"] == "reward" and res["heldout_n"] == 15
    assert res["prompt_source"] == f"dataset {FIX}/brevity.jsonl"
    # no correctness reward: the headline is the named weighted reward, never "accuracy"
    head = res["headline"]
    assert head["name"] == "reward (weighted sum: brevity=1)" and res["heldout_accuracy"] is None
    assert head["value"] > head["before"] + 0.3
    assert head["value"] == res["heldout_reward"] == res["heldout_rewards"]["brevity"]
    run_dir = Path(res["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "rollout/reward/brevity_mean" in r]
    assert len(train) == 20
    assert train[-1]["rollout/reward/brevity_mean"] == pytest.approx(
        train[-1]["rollout/reward_mean"]
    )
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and samples[0]["prompt"].startswith("Answer in at most")


def test_bad_prompt_dataset_fails_before_the_run_directory(tmp_path):
    from rlhflab.errors import DataError

    with pytest.raises(DataError, match=r"brevity.jsonl row 0: field 'question' is missing"):
        run_config(_cfg(tmp_path, data={"prompt_column": "question"}))
    assert not any(tmp_path.iterdir())
