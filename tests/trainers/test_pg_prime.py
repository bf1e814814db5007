"""PRIME in the policy-gradient trainer (`prime:`): a short GRPO-style run on the tiny factories
logs the implicit PRM's metrics, its weights move, its dense rewards reach the advantage, and the
config refuses what it cannot run. (Maths: tests/losses/test_prime.py; exact resume:
tests/test_checkpoint_resume.py.)"""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from factories import tiny_pg, tiny_sft
from safetensors.torch import load_file

from rlhflab.config import config_from_dict
from rlhflab.errors import ConfigError


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    from rlhflab.trainers import run_config

    root = tmp_path_factory.mktemp("prime_sft")
    return run_config(config_from_dict(tiny_sft(root, train={"steps": 4, "batch_size": 8,
                                                              "micro_batch_size": 8,
                                                              "max_len": 48})))["model_dir"]  # fmt: skip


def _prime_grpo(root, policy, **sections):
    raw = tiny_pg(
        root,
        policy,
        rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
        loss={"advantage": "prime_rloo", "whiten_advantages": True},
        prime={"beta": 0.05, "coef": 1.0, "optim": {"lr": 1e-3}},
        train={"steps": 3, "micro_batch_size": 4},
    )
    raw.update(sections)
    return raw


def _weights(path):
    return load_file(str(next(Path(path).glob("*.safetensors"))))


def test_prime_runs_logs_and_trains_its_prm(tmp_path, sft_dir):
    from rlhflab.trainers import run_config

    res = run_config(config_from_dict(_prime_grpo(tmp_path, sft_dir)))
    run = Path(res["run_dir"])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "policy/loss" in r]
    assert len(rows) == 3
    for r in rows:
        for key in ("prime/loss", "prime/accuracy", "prime/classify_acc", "prime/grad_norm"):
            assert math.isfinite(r[key]), key
        assert 0.0 <= r["prime/accuracy"] <= 1.0
        assert r["prime/lr"] == 1e-3
    assert rows[0]["prime/loss"] == pytest.approx(math.log(2), abs=1e-6)  # π_φ = π_ref: σ(0)
    assert rows[0]["prime/score_mean"] == 0.0  # r_φ ≡ 0 before the first PRM step
    assert rows[1]["prime/score_mean"] != 0.0  # after it, the PRM has moved
    init, final = _weights(sft_dir), _weights(run / "prime_model")
    changed = [k for k in final if k in init and not torch.equal(init[k], final[k])]
    assert changed, "the implicit PRM's weights did not change"


def test_the_implicit_rewards_reach_the_advantage(tmp_path, sft_dir):
    """`pg_phases.advantages` with prime_rloo: the dense rewards set by the PRM step, the
    outcome apart, give the naive-loop advantage (test_prime's reference)."""
    from test_prime_helpers import naive_prime_rloo

    from rlhflab.trainers import pg_phases

    cfg = config_from_dict(_prime_grpo(tmp_path, sft_dir, loss={"advantage": "prime_rloo"}))
    B, G = 4, 2
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    dense = torch.tensor([[0.1, -0.2, 0.3], [0.5, 0.1, 0.0], [-0.4, 0.0, 0.0], [0.2, 0.2, 0.2]])

    outcome = torch.tensor([1.0, 0.0, 0.0, 0.0])
    local = SimpleNamespace(  # the fields of ScoredBatch that the phase reads
        rewards=outcome, step_rewards=dense, steps=mask.bool(), rollout=SimpleNamespace(mask=mask)
    )
    data = pg_phases.StepData(batch=None, local=local, r0=0, r1=B)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"group_size": G})})
    pg_phases.advantages(data, cfg, 0.0, {"group_size": G})
    expected = naive_prime_rloo(dense.double(), mask, outcome.double(), G, 1.0)
    torch.testing.assert_close(data.adv.double(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"loss": {"advantage": "group_zscore"}}, "loss.advantage: prime gives per-token"),
        ({"reward": {"components": [{"name": "format", "weight": 1.0}]}}, "prime: the implicit"),
        ({"prime": {"beta": 0}}, "prime.beta"),
        ({"prime": {"bta": 0.1}}, "prime"),
    ],
)
def test_config_refuses_what_prime_cannot_run(tmp_path, change, match):
    raw = _prime_grpo(tmp_path, "unused")
    raw.update(change)
    with pytest.raises((ConfigError, ValueError), match=match):
        config_from_dict(raw)
