"""`reward_hacking` on real tiny runs (issue #27): a policy taught to answer "ok" (held-out
exact_match 1.0), then GRPO on a proxy that rewards length (a surface feature) with exact_match
as a weight-0 gold reward — the proxy rises while correctness falls, and the check fires; the
same run rewarding exact_match itself learns honestly and passes."""

import json
from pathlib import Path

import pytest
from factories import tiny_build

from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ok_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("ok")
    rows = [{"prompt": f"Say ok to {i}.", "answer": "ok"} for i in range(40)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "sft.jsonl").write_text(
        "".join(json.dumps({"prompt": r["prompt"], "completion": "ok"}) + "\n" for r in rows)
    )
    sft = config_from_dict(
        {
            "trainer": "sft",
            "model": {"build": tiny_build()},
            "data": {"source": "jsonl", "path": str(root / "sft.jsonl")},
            "train": {"steps": 30, "batch_size": 8, "micro_batch_size": 8, "max_len": 32},
            "optim": {"lr": 3e-3},
            "eval": {"n": 0},
            "precision": {"threads": 1},
            "tracking": {"console": False},
            "run": {"name": "sft", "root": str(root)},
        }
    )
    return run_config(sft)["model_dir"], root / "prompts.jsonl"


def _grpo(root, ok_model, components):
    model_dir, prompts = ok_model
    return config_from_dict(
        {
            "trainer": "policy_gradient",
            "model": {"name_or_path": str(model_dir)},
            "data": {"source": "dataset", "path": str(prompts), "heldout_frac": 0.25},
            "reward": {"components": components},
            "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8},
            "train": {"steps": 12, "micro_batch_size": 16},
            "optim": {"lr": 3e-3},
            "eval": {"n": 10, "every": 4, "max_new_tokens": 8},
            "health": {"window": 4},
            "precision": {"threads": 1},
            "tracking": {"console": False},
            "run": {"name": "grpo", "root": str(root), "save_model": False},
        }
    )


def test_a_proxy_rewarding_length_is_flagged(tmp_path, ok_model):
    gold = {"name": "exact_match", "weight": 0.0}  # reported, never optimised
    res = run_config(_grpo(tmp_path, ok_model, [{"name": "length", "weight": -1.0}, gold]))
    rows = [json.loads(r) for r in Path(res["run_dir"], "metrics.jsonl").read_text().splitlines()]
    reward = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    assert sum(reward[-4:]) > sum(reward[:4]) + 0.2, reward  # the proxy rose
    head = res["headline"]
    assert head["name"] == "correctness (exact_match)"
    assert head["value"] < head["before"] - 0.3, head  # correctness fell
    assert "reward_hacking" in res["health"]["failed"], res["health"]


def test_rewarding_correctness_is_not_hacking(tmp_path, ok_model):
    res = run_config(_grpo(tmp_path, ok_model, [{"name": "exact_match", "weight": 1.0}]))
    assert "reward_hacking" in res["health"]["checked"]
    assert "reward_hacking" not in res["health"]["failed"], res["health"]
