"""`model.build.arch: gpt` through the trainers: SFT builds the from-scratch GPT, GRPO and DPO
continue from its saved directory, the reward-model trainer builds on it, `rlhflab eval` reads it,
and the sampler's log-probs equal the trainer's on it."""

import json
import math
from pathlib import Path

import pytest
import torch
from factories import tiny_build, tiny_sft, tiny_task
from safetensors.torch import load_file

from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

TASK = tiny_task()
BUILD = tiny_build(arch="gpt")


@pytest.fixture(scope="module")
def gpt_sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    cfg = config_from_dict(
        tiny_sft(
            root,
            model={"build": BUILD},
            train={"steps": 30, "batch_size": 8, "micro_batch_size": 4, "max_len": 48},
            optim={"lr": 3e-3},
            eval={"n": 8, "max_new_tokens": 6},
            run={"name": "sft-gpt", "root": str(root)},
        )
    )
    return run_config(cfg)


def _rows(run_dir):
    return [json.loads(x) for x in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def test_sft_builds_and_trains_the_gpt(gpt_sft):
    config = json.loads(Path(gpt_sft["model_dir"], "config.json").read_text())
    assert config["model_type"] == "rlhflab_gpt"
    losses = [r["train/loss"] for r in _rows(gpt_sft["run_dir"]) if "train/loss" in r]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) < sum(losses[:5])  # it learns the format
    assert gpt_sft["health"]["ok"], gpt_sft["health"]


def test_grpo_on_the_gpt(gpt_sft, tmp_path):
    res = run_config(
        config_from_dict(
            {
                "trainer": "policy_gradient",
                "model": {"name_or_path": gpt_sft["model_dir"]},
                "task": TASK,
                "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6},
                "train": {"steps": 3, "micro_batch_size": 8},
                "kl": {"coef": 0.05},
                "optim": {"lr": 1e-3},
                "eval": {"n": 8, "max_new_tokens": 6},
                "tracking": {"console": False},
                "run": {"name": "grpo-gpt", "root": str(tmp_path)},
            }
        )
    )
    rows = [r for r in _rows(res["run_dir"]) if "policy/loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert r["rollout/logp_diff_mean"] < 1e-5  # sampler (KV cache) vs trainer log-probs
        assert r["policy/ratio_mean"] == 1.0
    assert rows[0]["policy/kl"] == pytest.approx(0.0, abs=1e-6)
    before = load_file(f"{gpt_sft['model_dir']}/model.safetensors")
    after = load_file(f"{res['model_dir']}/model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in after)


def test_reward_model_on_the_gpt(gpt_sft, tmp_path):
    res = run_config(
        config_from_dict(
            {
                "trainer": "reward_model",
                "kind": "orm",
                "model": {"name_or_path": gpt_sft["model_dir"]},
                "task": TASK,
                "data": {"source": "worked_solutions", "n_prompts": 16, "max_len": 64},
                "train": {"steps": 3, "batch_size": 8, "micro_batch_size": 4},
                "optim": {"lr": 1e-3},
                "eval": {"n_problems": 4},
                "tracking": {"console": False},
                "run": {"name": "rm-gpt", "root": str(tmp_path)},
            }
        )
    )
    assert res["steps"] == 3 and math.isfinite(res["final_loss"])
    config = json.loads(Path(res["model_dir"], "config.json").read_text())
    assert config["architectures"] == ["GPTForSequenceClassification"]


def test_eval_command_reads_the_gpt(gpt_sft):
    from rlhflab.eval.cli import run_eval_command

    printed = []
    res = run_eval_command(
        gpt_sft["model_dir"], task=TASK["name"], task_config=TASK["config"], n=8,
        n_train_exclude=300, seed=0, k=0, temperature=1.0, max_new_tokens=6,
        answer_format="last_number", reward="binary", batch_size=8, system="Be brief.",
        instruction="none",  # the model was trained on plain prompts (and has a short context)
        threads=1, show=2, print_fn=printed.append,
    )  # fmt: skip
    assert res["n"] >= 1 and 0.0 <= res["accuracy"] <= 1.0
    # the settings that differ from the SFT run's held-out evaluation are named first
    assert printed[0].startswith("warning: not the run's own held-out evaluation")
    printed = printed[1:]
    assert len(printed) == 3 and printed[0].count("completion:") == 1
    assert "majority-answer baseline" in printed[-1]
    assert res["majority_answer"] is not None and 0.0 <= res["majority_accuracy"] <= 1.0
