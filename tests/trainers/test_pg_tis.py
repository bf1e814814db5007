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
        # float64: the two runs differ by TIS weights within rounding of 1, whose effect on the
        # weights is then far below any tolerance (in float32 it depends on the CPU)
        "model": {"build": tiny_build(), "dtype": "float64"},
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
    tol = 1e4 * torch.finfo(torch.float64).eps  # float64 rounding, with margin
    for r in plain + tis:  # log-probs of size ~10: sampler (KV cache) vs trainer (packed)
        assert r["rollout/logp_diff_mean"] < 10 * tol and r["rollout/logp_diff_max"] < 10 * tol
        assert 0.0 <= r["rollout/sampler_kl"] < 10 * tol
    for r in tis:
        assert r["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=10 * tol)
        assert r["rollout/tis_capped_frac"] == 0.0
    assert "rollout/tis_weight_mean" not in plain[0]
    for a, b in zip(plain, tis, strict=True):
        assert math.isclose(a["policy/loss"], b["policy/loss"], rel_tol=tol, abs_tol=tol)
    assert all(r["optim/grad_norm"] > 1e-3 for r in plain)
    # The same training run up to TIS weights within rounding of 1: gradients differ by at most
    # tol·|g| (|g| <= grad_norm), which AdamW turns into at most lr·δ/eps_adam per step.
    g_max = max(r["optim/grad_norm"] for r in plain)
    atol = len(plain) * 1e-2 / 1e-8 * tol * g_max  # optim.lr, AdamW's default eps
    for k in w_plain:
        assert w_plain[k].dtype == torch.float64
        torch.testing.assert_close(w_tis[k], w_plain[k], atol=atol, rtol=0)
