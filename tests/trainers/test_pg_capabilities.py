"""The advantage registry's declared capabilities drive the policy-gradient trainer: an estimator
registered with `needs_groups` gets rollout.group_size, one without it does not (whatever its
signature accepts)."""

import pytest
from factories import tiny_build, tiny_task

from rlhflab.config import config_from_dict
from rlhflab.losses.advantages import ADVANTAGES, Advantage, group_mean
from rlhflab.trainers import run_config


def _raw(root, advantage: str) -> dict:
    return {
        "trainer": "policy_gradient",
        "model": {"build": tiny_build()},
        "task": tiny_task(),
        "rollout": {"prompts_per_step": 2, "group_size": 3, "max_new_tokens": 3},
        "loss": {"advantage": advantage},
        "train": {"steps": 1, "micro_batch_size": 6},
        "eval": {"n": 0},
        "tracking": {"console": False},
        "run": {"name": advantage, "root": str(root), "save_model": False},
    }


@pytest.mark.parametrize("needs_groups", [True, False])
def test_registered_advantage_gets_group_size_as_declared(tmp_path, monkeypatch, needs_groups):
    seen = []

    def spy(rewards, *, group_size=None):  # accepts group_size either way: nothing to sniff
        seen.append(group_size)
        return group_mean(rewards, group_size=3)

    monkeypatch.setitem(ADVANTAGES, "spy", Advantage(spy, needs_groups=needs_groups))
    run_config(config_from_dict(_raw(tmp_path, "spy")))
    assert seen == [3 if needs_groups else None]
