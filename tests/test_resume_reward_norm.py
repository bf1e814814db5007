"""A reward model's running score normalisation (`normalize: running`) is part of a run's state:
saved in checkpoints, restored on resume, and reset by a fresh run."""

import json
from pathlib import Path

import pytest
import torch
from test_checkpoint_resume import assert_same_run, grpo_raw, run_cli, run_dir_of

from rlhflab.config import config_from_dict
from rlhflab.rewards import reward_model as rmod
from rlhflab.rollout.sampler import pack
from rlhflab.trainers import run_config


def test_running_statistics_survive_a_new_process(policy_and_rm):
    _, rm_path = policy_and_rm
    batches = [pack([[5, 6], [7]], [[8 + i, 1], [9, 10 + i, 1]], 0) for i in range(4)]

    def score(b):
        return rmod.reward_model_component(rollout=b, path=rm_path, normalize="running")

    rmod.load_running_norm_state({})
    straight = [score(b) for b in batches]
    rmod.load_running_norm_state({})  # a fresh run starts the statistics from zero
    assert torch.equal(score(batches[0]), straight[0])
    saved = json.loads(json.dumps(rmod.running_norm_state()))  # through a checkpoint's JSON
    assert [s["n"] for s in saved.values()] == [2]
    rmod._SCORERS.clear()  # a new process: no scorer loaded yet
    rmod.load_running_norm_state(saved)
    for b, want in zip(batches[1:], straight[1:], strict=True):
        assert torch.equal(score(b), want)


@pytest.mark.slow
def test_grpo_with_running_rm_normalisation_killed_resumes_exactly(tmp_path, policy_and_rm):
    policy, rm_path = policy_and_rm

    def raw(root):
        r = grpo_raw(root, policy)
        r["reward"] = {
            "components": [
                {"name": "reward_model", "args": {"path": rm_path, "normalize": "running"}},
                {"name": "correctness", "weight": 0.0},
            ]
        }
        return r

    ref = run_config(config_from_dict(raw(tmp_path / "ref")))["run_dir"]
    (tmp_path / "runs").mkdir()
    assert run_cli(tmp_path, raw(tmp_path / "runs"), fault="step_end@5=sigkill",
                   check=False).returncode == -9  # fmt: skip
    run_cli(tmp_path, raw(tmp_path / "runs"), "--resume")
    run = run_dir_of(tmp_path / "runs", "grpo")
    assert_same_run(ref, run)
    state = json.loads(sorted((Path(run) / "checkpoints").glob("step-*"))[-1].joinpath(
        "state.json").read_text())  # fmt: skip
    assert [s["n"] for s in state["trainer"]["reward_norm"].values()] == [7 * 8]
