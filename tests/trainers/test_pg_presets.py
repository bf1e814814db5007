"""Every configs/pg preset runs 3 steps on a tiny SFT model: finite numbers, parameters change,
the first update of a step is on-policy, and each preset's own parts show up in its metrics."""

import json
import math
from pathlib import Path

import pytest
import torch
from factories import tiny_sft, tiny_task
from safetensors.torch import load_file

from rlhflab.config import config_from_dict, load_config
from rlhflab.errors import ConfigError
from rlhflab.trainers import run_config

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "configs/pg").glob("*.yaml"))
TASK = tiny_task(n_train=200, n_heldout=8)


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    cfg = config_from_dict(
        tiny_sft(
            root,
            task=TASK,
            train={"steps": 20, "batch_size": 8, "micro_batch_size": 8, "max_len": 48},
            eval={"n": 1, "max_new_tokens": 4},
        )
    )
    return run_config(cfg)["model_dir"]


def _overrides(path, model_dir, run_root):
    raw = load_config(path)
    group = raw.rollout.group_size > 1
    # A small length term makes rewards vary even when no answer is right, so every preset gets
    # a non-zero policy gradient (and DAPO's dynamic sampling finds varied groups).
    first = "[{name: correctness}"
    data = ["data.template=null"]  # the tiny model has 64 positions: no long text templates
    if raw.data.source == "dataset":  # the preset's own rewards, on a local GSM8K-schema file
        first = "[" + ", ".join(c.model_dump_json(exclude_none=True) for c in raw.reward.components)
        data += [
            f"data.path={ROOT / 'tests/data/fixtures/prompts/gsm8k_short.jsonl'}",
            "data.name=null",
            "data.heldout_split=null",
            "data.heldout_frac=0.25",
            "data.n_heldout=3",
        ]
    components = first + ", {name: length, weight: 0.1}"
    components += ", {name: overlong, args: {cache: 2}}]" if path.stem == "dapo" else "]"
    return [
        *data,
        f"model.name_or_path={model_dir}",
        f"task={json.dumps(TASK)}",
        f"rollout.prompts_per_step={4 if group else 8}",
        f"rollout.group_size={2 if group else 1}",
        "rollout.max_new_tokens=5",
        f"reward.components={components}",
        "train.steps=3",
        "train.micro_batch_size=3",
        "optim.warmup_steps=0",
        "optim.lr=1e-3",
        "eval.n=4",
        "eval.every=0",
        "eval.max_new_tokens=5",
        "tracking.console=false",
        f"run.root={run_root}",
    ]


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_runs_three_steps(path, sft_model, tmp_path):
    cfg = load_config(path, _overrides(path, sft_model, tmp_path))
    res = run_config(cfg)
    run_dir = Path(res["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "policy/loss" in r]
    assert len(rows) == 3
    for r in rows:
        for key in ("policy/loss", "optim/grad_norm", "policy/entropy", "update/ratio_mean"):
            assert math.isfinite(r[key]), key
        assert r["policy/ratio_mean"] == 1.0  # first optimizer step of every batch is on-policy
        assert r["rollout/logp_diff_mean"] < 1e-5
        first = cfg.reward.components[0].name
        assert f"rollout/reward/{first}_mean" in r and "rollout/reward/length_mean" in r
        assert ("policy/kl" in r) == (cfg.kl.coef > 0)
        assert ("value/loss" in r) == (cfg.value is not None)
    if cfg.value is not None:
        assert all(math.isfinite(r["value/loss"]) for r in rows)
        assert math.isfinite(rows[-1]["value/explained_var"])
        assert (run_dir / "value_model/value_head.safetensors").exists()
    if cfg.rollout.dynamic_sampling.enabled:
        assert all(r["rollout/rounds"] >= 1 for r in rows)
    if cfg.train.update_epochs * cfg.train.minibatches > 1:  # later steps are off-policy
        assert any(r["update/ratio_max"] != 1.0 for r in rows)
    before, after = (
        load_file(f"{sft_model}/model.safetensors"),
        load_file(run_dir / "model/model.safetensors"),
    )
    assert any(not torch.equal(before[k], after[k]) for k in after)


def test_compare_writes_plot_table_and_results(sft_model, tmp_path):
    from rlhflab.compare import run_compare

    presets = [str(ROOT / "configs/pg/grpo.yaml"), str(ROOT / "configs/pg/reinforce.yaml")]
    overrides = [
        o
        for o in _overrides(ROOT / "configs/pg/grpo.yaml", sft_model, tmp_path)
        if not o.startswith(("run.root", "train.steps", "rollout."))
    ]
    overrides += ["train.steps=2", "rollout.max_new_tokens=4", "rollout.prompts_per_step=4"]
    overrides += ["rollout.group_size=2"]
    # every config is validated before the first run starts: no directory is created
    with pytest.raises(ConfigError, match=r"rollout\.group_size must be >= 2"):
        run_compare(
            presets,
            seeds=1,
            overrides=[*overrides, "rollout.group_size=1"],
            root=str(tmp_path / "bad"),
        )
    assert not (tmp_path / "bad").exists()
    res = run_compare(presets[:1], seeds=2, overrides=overrides, root=str(tmp_path))
    out = Path(res["out_dir"])
    for name in ("comparison.png", "comparison.md", "results.json"):
        assert (out / name).exists(), name
    results = json.loads((out / "results.json").read_text())
    assert results["presets"]["grpo"]["steps"] == [2, 2]
    base = results["presets"]["grpo"]["heldout_majority_baseline"]
    assert len(base) == 2 and all(0.0 <= b <= 1.0 for b in base)
    assert len(results["presets"]["grpo"]["curves"]["reward"]) == 2
    table = (out / "comparison.md").read_text()
    assert "| majority baseline |" in table
    assert "| grpo | group_zscore / ppo_clip / seq_mean_token_mean / none |" in table
    assert results["paired"] == [] and "nothing to compare" in results["conclusion"]
    # two presets: the second against the first, paired by seed, in the table and its conclusion
    two = run_compare(presets, seeds=2, overrides=overrides, root=str(tmp_path / "two"))
    (row,) = two["paired"]
    acc = {n: p["heldout_accuracy"] for n, p in two["presets"].items()}
    assert row["label"] == "reinforce" and row["seeds"] == [0, 1]
    assert row["mean"] == pytest.approx(
        sum(a - b for a, b in zip(acc["reinforce"], acc["grpo"], strict=True)) / 2, abs=1e-12
    )
    table = (Path(two["out_dir"]) / "comparison.md").read_text()
    assert (
        "| preset − grpo | paired seeds |" in table and f"Conclusion: {two['conclusion']}" in table
    )


# Issue #29's parts that no preset uses, swapped into the GRPO preset (one process; their
# batch statistics across ranks are in tests/distributed/test_distributed.py).
OTHER_PARTS = {
    "otb": ["loss.advantage=optimal_token_baseline", "loss.advantage_args={}",
            "loss.surrogate=ppo_dual_clip",
            "kl.coef=0.05", "kl.estimator=k1+"],
    "pass_k_kl_cov": ["loss.advantage=grpo_passk", "loss.advantage_args={}", "loss.surrogate=kl_cov",
                      "loss.surrogate_args={cov_ratio: 0.1}", "loss.entropy_coef=0.01",
                      "loss.rollout_correction={is_level: sequence, reject: token}"],
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(OTHER_PARTS))
def test_other_parts_run(case, sft_model, tmp_path):
    path = ROOT / "configs/pg/grpo.yaml"
    cfg = load_config(path, [*_overrides(path, sft_model, tmp_path), *OTHER_PARTS[case]])
    rows = [
        json.loads(line)
        for line in (Path(run_config(cfg)["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    rows = [r for r in rows if "policy/loss" in r]
    assert len(rows) == 3 and all(math.isfinite(r["policy/loss"]) for r in rows)
    if case == "pass_k_kl_cov":
        assert cfg.loss.advantage == "pass_k"  # verl's name resolved
        assert all(r["rollout/rc_weight_mean"] > 0 for r in rows)
        assert all(0 < r["policy/cov_selected_frac"] <= 0.1 + 1e-9 for r in rows)
