"""Exact resume after SIGKILL, for every trainer family.

A run is killed with SIGKILL at a chosen step (a fault point, see rlhflab/faults.py) in a
subprocess, resumed with `--resume`, and compared with an uninterrupted run of the same config:
the per-step metrics (everything but wall-clock timings) and the final weights must be identical,
bit for bit (CPU, fp32, one thread).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

TASK = {
    "name": "chain_sum",
    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "n_train": 40,
    "n_heldout": 8,
    "seed": 0,
    "answer_format": "plain",
    "reward": "binary",
}
BUILD = {"size": "tiny", "vocab_size": 300, "max_position_embeddings": 64, "tokenizer_texts": 100}
COMMON = {
    "task": TASK,
    "precision": {"threads": 1},
    "tracking": {"console": False, "samples_every": 2},
}


def sft_raw(root, name="sft", **train):
    return {
        "trainer": "sft",
        "model": {"build": BUILD},
        **COMMON,
        # 40 examples, 8 per step: an epoch is exactly 5 steps.
        "train": {"steps": 12, "batch_size": 8, "micro_batch_size": 4, "max_len": 48, **train},
        "optim": {"lr": 1e-3, "warmup_steps": 2, "schedule": "cosine"},
        "eval": {"n": 4, "max_new_tokens": 4},
        "checkpoint": {"every": 5, "keep_last": 2},
        "run": {"name": name, "root": str(root)},
    }


def grpo_raw(root, model_dir, name="grpo"):
    return {
        "trainer": "policy_gradient",
        "model": {"name_or_path": str(model_dir)},
        **COMMON,
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "loss": {"advantage": "group_zscore", "surrogate": "ppo_clip"},
        "kl": {"coef": 0.05, "controller": "adaptive", "target": 0.01, "horizon": 100},
        "train": {"steps": 7, "micro_batch_size": 4, "update_epochs": 2, "minibatches": 2},
        "optim": {"lr": 1e-3, "warmup_steps": 2, "schedule": "linear"},
        "eval": {"n": 4, "max_new_tokens": 4},
        "checkpoint": {"every": 3, "keep_last": 1},
        "run": {"name": name, "root": str(root)},
    }


def dpo_raw(root, model_dir, name="dpo", rounds=2):
    return {
        "trainer": "direct_alignment",
        "model": {"name_or_path": str(model_dir)},
        **COMMON,
        "data": {"source": "verifiable", "heldout_pairs": 4},
        "verifiable": {
            "n_prompts": 12,
            "samples_per_prompt": 4,
            "chosen": "sampled_or_gold",
            "max_new_tokens": 4,
            "rounds": rounds,
        },
        "loss": {"name": "dpo", "args": {"beta": 0.1}},
        "train": {"steps": 6, "batch_size": 4, "micro_batch_size": 2},
        "optim": {"lr": 1e-3},
        "eval": {"n": 4, "max_new_tokens": 4, "pref_every": 2},
        "checkpoint": {"every": 2, "keep_last": 2},
        "run": {"name": name, "root": str(root)},
    }


def rm_raw(root, model_dir, pairs_path, name="rm"):
    """A Bradley-Terry preference RM on a generic pairs file (17 train / 3 held-out pairs)."""
    return {
        "trainer": "reward_model",
        "kind": "preference",
        "model": {"name_or_path": str(model_dir)},
        **COMMON,
        "data": {"source": "preference", "path": str(pairs_path), "heldout_frac": 0.15},
        "train": {"steps": 9, "batch_size": 4, "micro_batch_size": 2},
        "optim": {"lr": 1e-3},
        "eval": {"n_problems": 4, "max_new_tokens": 4},
        "checkpoint": {"every": 2, "keep_last": 3},
        "run": {"name": name, "root": str(root)},
    }


def run_cli(tmp_path, raw, *args, fault=None, check=True):
    """`rlhflab train` in a subprocess; returns the CompletedProcess."""
    cfg_path = tmp_path / f"{raw['run']['name']}.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("RLHFLAB_FAULT", None)
    if fault:
        env["RLHFLAB_FAULT"] = fault
    proc = subprocess.run(
        [sys.executable, "-m", "rlhflab.cli", "train", str(cfg_path), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


def run_dir_of(root, name) -> Path:
    dirs = sorted(Path(root).glob(f"{name}-*"))
    assert len(dirs) == 1, dirs
    return dirs[0]


def metrics(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]
    return [
        {k: v for k, v in r.items() if not k.startswith("perf/") and k != "time_s"} for r in rows
    ]


def samples(run_dir) -> list[str]:
    path = Path(run_dir) / "samples.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def assert_same_run(a, b, weights="model/model.safetensors"):
    """Same per-step metrics (timings aside), same samples, bitwise-identical final weights."""
    ma, mb = metrics(a), metrics(b)
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    assert ma == mb
    assert samples(a) == samples(b)
    wa, wb = load_file(str(Path(a) / weights)), load_file(str(Path(b) / weights))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.fixture(scope="module")
def sft_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_base")
    res = run_config(config_from_dict(sft_raw(root, steps=6)))
    return res["model_dir"]


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_ref")
    return run_config(config_from_dict(sft_raw(root)))["run_dir"]


def test_sft_killed_mid_run_resumes_exactly(tmp_path, sft_reference):
    # Checkpoints at 5 and 10; killed at the end of step 7: steps 6-7 are redone after resume.
    raw = sft_raw(tmp_path)
    proc = run_cli(tmp_path, raw, fault="step_end@7=sigkill", check=False)
    assert proc.returncode == -9
    run_dir = run_dir_of(tmp_path, "sft")
    assert not (run_dir / "final_results.json").exists()
    run_config(config_from_dict({**raw, "run": {**raw["run"], "resume": str(run_dir)}}))
    assert_same_run(sft_reference, run_dir)


def test_sft_killed_twice_and_at_epoch_boundary(tmp_path, sft_reference):
    # An epoch is 5 steps: the first kill comes right after the step-5 checkpoint (end of epoch
    # 1, the data order is empty); the second during step 9 of the resumed run.
    raw = sft_raw(tmp_path)
    assert run_cli(tmp_path, raw, fault="step_end@5=sigkill", check=False).returncode == -9
    run_dir = run_dir_of(tmp_path, "sft")
    proc = run_cli(tmp_path, raw, "--resume", fault="step_mid@9=sigkill", check=False)
    assert proc.returncode == -9
    run_cli(tmp_path, raw, "--resume")
    assert_same_run(sft_reference, run_dir)
    results = json.loads((run_dir / "final_results.json").read_text())
    assert results["steps"] == 12  # the remaining steps were done, not skipped


def test_grpo_killed_mid_run_resumes_exactly(tmp_path, sft_model_dir):
    ref_root = tmp_path / "ref"
    ref = run_config(config_from_dict(grpo_raw(ref_root, sft_model_dir)))["run_dir"]
    raw = grpo_raw(tmp_path / "runs", sft_model_dir)
    (tmp_path / "runs").mkdir()
    assert run_cli(tmp_path, raw, fault="step_end@5=sigkill", check=False).returncode == -9
    run_cli(tmp_path, raw, "--resume")
    assert_same_run(ref, run_dir_of(tmp_path / "runs", "grpo"))


def test_dpo_online_rounds_killed_mid_round_resumes_exactly(tmp_path, sft_model_dir):
    # 2 rounds of 3 steps: killed in round 2, whose on-policy pairs and reference log-probs were
    # made by the policy at step 3 and must come back from the checkpoint.
    ref = run_config(config_from_dict(dpo_raw(tmp_path / "ref", sft_model_dir)))["run_dir"]
    raw = dpo_raw(tmp_path / "runs", sft_model_dir)
    (tmp_path / "runs").mkdir()
    assert run_cli(tmp_path, raw, fault="step_end@5=sigkill", check=False).returncode == -9
    run_cli(tmp_path, raw, "--resume")
    assert_same_run(ref, run_dir_of(tmp_path / "runs", "dpo"))


def test_reward_model_killed_mid_run_resumes_exactly(tmp_path, sft_model_dir):
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"{i} + 1 =", "chosen": str(i + 1), "rejected": str(i + 3)} for i in range(20)
    ]
    pairs.write_text("\n".join(json.dumps(r) for r in rows))
    ref = run_config(config_from_dict(rm_raw(tmp_path / "ref", sft_model_dir, pairs)))["run_dir"]
    raw = rm_raw(tmp_path / "runs", sft_model_dir, pairs)
    (tmp_path / "runs").mkdir()
    # Checkpoints at 2, 4, ...; killed in the middle of step 5 (epoch boundary is step 4-5).
    assert run_cli(tmp_path, raw, fault="step_mid@5=sigkill", check=False).returncode == -9
    run_cli(tmp_path, raw, "--resume")
    assert_same_run(ref, run_dir_of(tmp_path / "runs", "rm"))


def test_ppo_with_value_model_killed_twice_resumes_exactly(tmp_path, sft_model_dir):
    """PPO: the critic, its optimizer and schedule come back too; two kills, one mid-step."""

    def ppo_raw(root):
        raw = grpo_raw(root, sft_model_dir, name="ppo")
        raw["rollout"] = {"prompts_per_step": 8, "group_size": 1, "max_new_tokens": 4}
        raw["loss"] = {
            "advantage": "gae",
            "advantage_args": {"gamma": 1.0, "lam": 0.95},
            "whiten_advantages": True,
            "surrogate": "ppo_clip",
            "aggregation": "token_mean",
        }
        raw["kl"] = {"coef": 0.05, "estimator": "k1", "placement": "reward_token"}
        raw["value"] = {"clip_range": 0.2, "optim": {"lr": 1e-3, "warmup_steps": 2}}
        raw["eval"]["every"] = 3
        return raw

    ref = run_config(config_from_dict(ppo_raw(tmp_path / "ref")))["run_dir"]
    raw = ppo_raw(tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    assert run_cli(tmp_path, raw, fault="step_end@4=sigkill", check=False).returncode == -9
    assert (
        run_cli(tmp_path, raw, "--resume", fault="step_mid@6=sigkill", check=False).returncode == -9
    )
    run_cli(tmp_path, raw, "--resume")
    run = run_dir_of(tmp_path / "runs", "ppo")
    assert_same_run(ref, run)
    assert_same_run(ref, run, weights="value_model/value_head.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("worker", ["thread", "process"])
def test_grpo_async_rollouts_killed_mid_run_resume_exactly(tmp_path, sft_model_dir, worker):
    """rollout.mode async, 2 steps stale: the queued rollouts are saved with the checkpoint (the
    checkpoint at step 3 holds the batches of steps 4 and 5, generated by older weights that the
    checkpoint does not hold), so the resumed run trains on the same batches; with the
    generation in a thread and in a process of its own."""

    def raw_of(root):
        raw = grpo_raw(root, sft_model_dir, name="grpo_async")
        raw["rollout"].update(mode="async", max_staleness=2, async_worker=worker)
        return raw

    ref = run_config(config_from_dict(raw_of(tmp_path / "ref")))["run_dir"]
    steps = [r for r in metrics(ref) if "rollout/staleness" in r]
    assert [r["rollout/staleness"] for r in steps] == [0, 1, 2, 2, 2, 2, 2]
    raw = raw_of(tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    assert run_cli(tmp_path, raw, fault="step_end@5=sigkill", check=False).returncode == -9
    run_cli(tmp_path, raw, "--resume")
    assert_same_run(ref, run_dir_of(tmp_path / "runs", "grpo_async"))


def test_prime_implicit_prm_killed_mid_step_resumes_exactly(tmp_path, sft_model_dir):
    """PRIME: the implicit PRM, its optimizer and schedule come back. Killed mid-step 3 (after
    the PRM's update of that step, before the policy's), resumed from the step-2 checkpoint."""

    def prime_raw(root):
        raw = grpo_raw(root, sft_model_dir, name="prime")
        raw["loss"] = {"advantage": "prime_rloo", "whiten_advantages": True}
        raw["kl"] = {"coef": 0.0}  # π_ref: the PRM's own frozen copy of the initial policy
        raw["prime"] = {"beta": 0.05, "optim": {"lr": 1e-3, "warmup_steps": 2}}
        raw["train"] = {**raw["train"], "steps": 5}
        raw["checkpoint"] = {"every": 2, "keep_last": 1}
        return raw

    ref = run_config(config_from_dict(prime_raw(tmp_path / "ref")))["run_dir"]
    raw = prime_raw(tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    assert run_cli(tmp_path, raw, fault="step_mid@3=sigkill", check=False).returncode == -9
    run_cli(tmp_path, raw, "--resume")
    run = run_dir_of(tmp_path / "runs", "prime")
    assert_same_run(ref, run)
    assert_same_run(ref, run, weights="prime_model/model.safetensors")
    assert any(r.get("prime/loss") for r in metrics(run))
