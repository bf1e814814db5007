"""The policy-gradient trainer on the vllm engine: it samples through vLLM, pushes weights after
every update, logs the training–inference mismatch and composes TIS."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.vllm

REWARD = (
    "def text_len(prompts, completions, **kw):\n    return [len(c) / 10 for c in completions]\n"
)


def test_grpo_on_the_vllm_engine_with_tis(tmp_path):
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("RLHFLAB_REQUIRE_VLLM"):
            pytest.fail("RLHFLAB_REQUIRE_VLLM is set but vllm is not installed")
        pytest.skip("vllm is not installed (pip install rlhflab[vllm])")
    reward_file = tmp_path / "reward.py"  # varies within a group, so the policy moves
    reward_file.write_text(REWARD)
    raw = {
        "trainer": "policy_gradient",
        "model": {"build": {"size": "small", "vocab_size": 300, "max_position_embeddings": 64,
                            "tokenizer_texts": 300}},
        "task": {
            "name": "chain_sum",
            "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
            "n_train": 200,
            "n_heldout": 8,
            "seed": 0,
            "answer_format": "plain",
            "reward": "binary",
        },
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 5, "engine": "vllm"},
        "reward": {"components": [{"function": f"{reward_file}:text_len", "weight": 1.0}]},
        "loss": {"tis": {"enabled": True, "cap": 2.0}},
        "train": {"steps": 3, "micro_batch_size": 8},
        "optim": {"lr": 1e-2},
        "eval": {"n": 0},
        "tracking": {"console": False},
        "run": {"name": "vllm", "root": str(tmp_path)},
    }  # fmt: skip
    # In a process of its own: vLLM keeps process-wide parallel state, which a second LLM in the
    # test session's process (the contract suite's) must not share.
    path = tmp_path / "grpo_vllm.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = subprocess.run(
        [sys.executable, "-m", "rlhflab", "train", str(path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # vLLM shuts down cleanly too
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name != "__pycache__"]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "policy/loss" in r]
    assert len(rows) == 3
    for r in rows:  # fp32 on CPU: vLLM's log-probs are the trainer's up to kernel rounding
        assert r["rollout/logp_diff_max"] < 1e-4
        assert 0.0 <= r["rollout/sampler_kl"] < 1e-8
        assert r["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert r["rollout/tis_capped_frac"] == 0.0
    # The policy moved (non-zero gradients at lr 1e-2), so a stale engine's log-probs would differ
    # from the updated trainer's by far more than 1e-4 at steps 2 and 3: the pushes arrived.
    assert all(r["optim/grad_norm"] > 1e-3 for r in rows)
