"""policy/kl_ref: the k3 KL to the reference on the rollout's own tokens, every step; with
β = 0 against the initial policy: by default for LoRA (adapters disabled), for a full fine-tune
only when asked (kl.track_initial) (issue #27 item 4)."""

import json
from pathlib import Path

import pytest
from factories import tiny_pg, tiny_sft

from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

pytestmark = pytest.mark.slow
REWARD = {"components": [{"name": "correctness"}, {"name": "length", "weight": 0.1}]}


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    return run_config(config_from_dict(tiny_sft(root, precision={"threads": 1})))["model_dir"]


def _rows(tmp_path, sft_dir, **sections):
    cfg = tiny_pg(tmp_path, sft_dir, reward=REWARD, optim={"lr": 3e-3},
                  precision={"threads": 1}, run={"name": "grpo", "root": str(tmp_path),
                                                 "save_model": False}, **sections)  # fmt: skip
    res = run_config(config_from_dict(cfg))
    lines = Path(res["run_dir"], "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "rollout/reward_mean" in r]


def test_beta_zero_measures_nothing_unless_asked(tmp_path, sft_dir):
    rows = _rows(tmp_path, sft_dir)
    assert not any("policy/kl_ref" in r or "policy/kl" in r for r in rows)


def test_beta_zero_lora_measures_by_default(tmp_path, sft_dir):
    # adapters disabled are the initial policy: no copy, so it is on unless turned off
    model = {"name_or_path": str(sft_dir), "lora": {"r": 4, "alpha": 8.0}}
    rows = _rows(tmp_path, sft_dir, model=model)
    assert all("policy/kl_ref" in r and "policy/kl" not in r for r in rows)
    off = _rows(tmp_path / "off", sft_dir, model=model, kl={"coef": 0.0, "track_initial": False})
    assert not any("policy/kl_ref" in r for r in off)


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8.0}], ids=["copy", "lora"])
def test_track_initial_measures_the_distance_from_the_start(tmp_path, sft_dir, lora):
    model = {"name_or_path": str(sft_dir), **({"lora": lora} if lora else {})}
    rows = _rows(tmp_path, sft_dir, kl={"coef": 0.0, "track_initial": True}, model=model)
    kl = [r["policy/kl_ref"] for r in rows]
    assert len(kl) == 5 and "policy/kl" not in rows[0]  # measured, not in the loss
    # step 1 samples from the initial policy itself: KL 0 up to the sampler/trainer rounding
    assert abs(kl[0]) < 1e-5, kl
    assert all(v >= -1e-7 for v in kl) and max(kl[1:]) > 1e-4, kl  # k3 >= 0; it moved


def test_with_a_reference_it_is_the_k3_kl_of_the_loss(tmp_path, sft_dir):
    rows = _rows(tmp_path, sft_dir, kl={"coef": 0.1, "estimator": "k3", "placement": "loss"})
    for r in rows:  # the same tokens, the loss's trainer log-probs vs the sampler's
        assert r["policy/kl_ref"] == pytest.approx(r["policy/kl"], rel=1e-3, abs=1e-6)
