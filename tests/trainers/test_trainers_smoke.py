"""Smoke runs of the SFT and policy-gradient trainers on a tiny model: finite numbers, parameters
change, the run directory is complete, and the first update of a step is exactly on-policy."""

import json
import math

import pytest
import torch
from factories import spy_micro_batches, tiny_sft, tiny_task
from safetensors.torch import load_file

from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

TASK = tiny_task()
RUN_FILES = [
    "config.yaml",
    "metrics.jsonl",
    "final_results.json",
    "model/config.json",
    "model/model.safetensors",
    "model/tokenizer.json",
]


def _sft_cfg(root, **train):
    return config_from_dict(
        tiny_sft(
            root,
            train={"steps": 3, "batch_size": 8, "micro_batch_size": 4, "max_len": 48, **train},
            eval={"n": 8, "max_new_tokens": 6},
        )
    )


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return run_config(_sft_cfg(root, steps=40))


def _weights(model_dir):
    return load_file(f"{model_dir}/model.safetensors")


def _rows(run_dir):
    with open(f"{run_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_sft_smoke(sft_run, tiny_tokenizer):
    from rlhflab.models.build import build_model
    from rlhflab.models.loading import load_tokenizer

    run_dir = sft_run["run_dir"]
    for name in RUN_FILES:
        assert (__import__("pathlib").Path(run_dir) / name).exists(), name
    assert any((__import__("pathlib").Path(run_dir) / "plots").glob("*.png"))
    train_rows = [r for r in _rows(run_dir) if "train/loss" in r]
    assert len(train_rows) == 40 and all(math.isfinite(r["train/loss"]) for r in train_rows)
    assert sft_run["heldout_n"] == 8 and 0.0 <= sft_run["heldout_accuracy"] <= 1.0
    # the majority-answer baseline sits beside the accuracy: in the results and every eval row
    base = sft_run["heldout_majority_baseline"]
    assert 0.0 <= base <= 1.0 and sft_run["heldout_majority_answer"] is not None
    eval_rows = [r for r in _rows(run_dir) if "eval/accuracy" in r]
    assert eval_rows and all(r["eval/majority_baseline"] == base for r in eval_rows)
    # Parameters changed: compare with the same initialisation (same tokenizer, size and seed).
    tok = load_tokenizer(sft_run["model_dir"])
    init = build_model(tok, size="tiny", max_position_embeddings=64, seed=0).state_dict()
    trained = _weights(sft_run["model_dir"])
    assert any(not torch.equal(init[k], trained[k]) for k in trained)


@pytest.mark.parametrize(
    "extra",
    [
        {},  # GRPO as in the preset
        {
            "kl": {"coef": 0.1},
            "train": {"update_epochs": 2, "minibatches": 2},
        },  # ref model, off-policy steps
    ],
    ids=["grpo", "grpo-kl-offpolicy"],
)
def test_policy_gradient_smoke(sft_run, tmp_path, extra):
    raw = {
        "trainer": "policy_gradient",
        "model": {"name_or_path": sft_run["model_dir"]},
        "task": TASK,
        "rollout": {"prompts_per_step": 8, "group_size": 4, "max_new_tokens": 6},
        "train": {"steps": 3, "micro_batch_size": 5},
        "optim": {"lr": 1e-3},
        "eval": {"n": 8, "max_new_tokens": 6},
        "tracking": {"console": False, "samples_every": 1},
        "run": {"name": "grpo", "root": str(tmp_path)},
    }
    for key, value in extra.items():
        raw[key] = {**raw.get(key, {}), **value}
    res = run_config(config_from_dict(raw))
    run_dir = __import__("pathlib").Path(res["run_dir"])
    for name in [*RUN_FILES, "samples.jsonl"]:
        assert (run_dir / name).exists(), name
    rows = [r for r in _rows(run_dir) if "policy/loss" in r]
    assert len(rows) == 3
    for r in rows:
        assert math.isfinite(r["policy/loss"]) and math.isfinite(r["optim/grad_norm"])
        # First optimizer step of every batch is on-policy: ratio exactly 1, nothing clipped.
        assert r["policy/ratio_mean"] == 1.0
        assert r["policy/clip_frac_low"] == 0.0 and r["policy/clip_frac_high"] == 0.0
        assert r["rollout/logp_diff_mean"] < 1e-5  # sampler vs trainer log-probs
        assert ("policy/kl" in r) == ("kl" in extra)
    if "kl" in extra:
        assert rows[0]["policy/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    # Some group had reward variance, so the policy gradient is not zero and parameters move.
    assert any(r["rollout/zero_std_group_frac"] < 1.0 for r in rows)
    before, after = _weights(sft_run["model_dir"]), _weights(run_dir / "model")
    assert any(not torch.equal(before[k], after[k]) for k in after)
    assert res["heldout_n"] == 8


@pytest.mark.parametrize("split", ["rows", "tokens"])
def test_sft_micro_batches_match_one_batch(sft_run, tmp_path, monkeypatch, split):
    """k micro-batches give the same update as one batch (denominator counted over the step):
    2 rows each, or grouped by length under `train.max_tokens_per_micro_batch`.

    In float64 (`model.dtype`, from the SFT run's model): the two add the same terms in other
    orders, which in float32 moves results by ~1e-7 relative, differently per CPU kernels."""
    eps = torch.finfo(torch.float64).eps
    runs = []
    splits = spy_micro_batches(monkeypatch)
    for micro in (8, 2):
        monkeypatch.setenv("RLHFLAB_GRAD_DUMP", str(tmp_path / f"grads-{micro}"))
        extra = {"max_tokens_per_micro_batch": 100} if micro == 2 and split == "tokens" else {}
        cfg = _sft_cfg(
            tmp_path / str(micro), steps=1, batch_size=8, micro_batch_size=micro, **extra
        )
        cfg = cfg.model_copy(
            update={"model": cfg.model.model_copy(
                update={"build": None, "name_or_path": sft_run["model_dir"], "dtype": "float64"}
            )}
        )  # fmt: skip
        runs.append(run_config(cfg))
    a, b = runs
    if split == "tokens":  # several micro-batches, not all of one size
        assert len(splits[-1]) > 1 and len({len(rows) for rows in splits[-1]}) > 1, splits[-1]
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e4 * eps)
    (ga,), (gb,) = (
        [load_file(p) for p in (tmp_path / f"grads-{m}").glob("*.safetensors")] for m in (8, 2)
    )
    g_max = max(g.abs().max().item() for g in ga.values())
    for k in ga:
        assert ga[k].dtype == torch.float64
        torch.testing.assert_close(gb[k], ga[k], atol=1e4 * eps * g_max, rtol=0, msg=k)
    # Adam's first step moves a weight by lr·g/(|g| + eps_adam): a gradient difference δ moves
    # it by at most lr·δ/eps_adam (where g ≈ 0), with δ bounded as above.
    lr, eps_adam = cfg.optim.lr, cfg.optim.eps
    wa, wb = _weights(a["model_dir"]), _weights(b["model_dir"])
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=lr / eps_adam * 1e4 * eps * g_max, rtol=0)


def test_sft_evaluates_at_step_0_without_changing_training(tmp_path):
    # SFT evaluates the held-out set before its first step, like the RL trainers; greedy
    # evaluation draws from no generator, so training is the same as without any evaluation.
    ev = run_config(_sft_cfg(tmp_path / "eval", steps=4))
    rows = _rows(ev["run_dir"])
    first_eval = next(r for r in rows if "eval/accuracy" in r)
    assert first_eval["step"] == 0 and rows.index(first_eval) < min(
        i for i, r in enumerate(rows) if "train/loss" in r
    )
    assert ev["heldout_accuracy_before"] == first_eval["eval/accuracy"]
    cfg = _sft_cfg(tmp_path / "no-eval", steps=4)
    quiet = run_config(cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"n": 0})}))
    assert quiet["heldout_accuracy_before"] is None
    assert ev["final_loss"] == quiet["final_loss"]  # bit for bit
    wa, wb = _weights(ev["model_dir"]), _weights(quiet["model_dir"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
