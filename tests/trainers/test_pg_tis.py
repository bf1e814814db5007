"""The training–inference mismatch under the hf engine (0 by construction) and TIS composed by
config: with the sampler's log-probs equal to the trainer's, TIS weights are 1 and change nothing."""

import json
import math
from pathlib import Path

import pytest
import torch
from factories import tiny_build, tiny_task
from safetensors.torch import load_file

from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

REWARD = (
    "def text_len(prompts, completions, **kw):\n    return [len(c) / 10 for c in completions]\n"
)


def _run(root, name, **loss):
    reward_file = root / "reward.py"  # varies within a group, so the policy moves
    reward_file.write_text(REWARD)
    raw = {
        "trainer": "policy_gradient",
        "model": {"build": tiny_build()},
        "task": tiny_task(n_train=200, n_heldout=8),
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 5},
        "reward": {"components": [{"function": f"{reward_file}:text_len", "weight": 1.0}]},
        "loss": loss,
        "train": {"steps": 2, "micro_batch_size": 8, "minibatches": 2},
        "optim": {"lr": 1e-2},
        "eval": {"n": 0},
        "tracking": {"console": False},
        "run": {"name": name, "root": str(root)},
    }
    res = run_config(config_from_dict(raw))
    run_dir = Path(res["run_dir"])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "policy/loss" in r], load_file(run_dir / "model/model.safetensors")


def test_hf_engine_mismatch_is_zero_and_tis_changes_nothing(tmp_path):
    plain, w_plain = _run(tmp_path, "plain")
    tis, w_tis = _run(tmp_path, "tis", tis={"enabled": True, "cap": 2.0})
    assert len(plain) == len(tis) == 2
    for r in plain + tis:
        assert r["rollout/logp_diff_mean"] < 1e-5 and r["rollout/logp_diff_max"] < 1e-5
        assert 0.0 <= r["rollout/sampler_kl"] < 1e-9
    for r in tis:
        assert r["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
        assert r["rollout/tis_capped_frac"] == 0.0
    assert "rollout/tis_weight_mean" not in plain[0]
    for a, b in zip(plain, tis, strict=True):
        assert math.isclose(a["policy/loss"], b["policy/loss"], rel_tol=1e-4, abs_tol=1e-7)
    assert all(r["optim/grad_norm"] > 1e-3 for r in plain)
    for k in w_plain:  # the same training run, up to the rounding of weights ≈ 1
        torch.testing.assert_close(w_tis[k], w_plain[k], atol=1e-4, rtol=0)
