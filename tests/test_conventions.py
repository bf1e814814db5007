"""Conventions that every command shares: mean ± standard error, one default torch thread count,
files readable by the group (the umask decides, not mkstemp's 0600), tables that name the metric
they show."""

import importlib
import inspect
import json
import os
import stat
from pathlib import Path

import pytest

from rlhflab.cli import parse_args
from rlhflab.compare import comparison_table
from rlhflab.config.sections import PrecisionConfig
from rlhflab.serialize import write_json_atomic, write_text_atomic, write_yaml_atomic


def _preset(name: str, acc: list[float]) -> dict:
    return {
        "path": f"configs/pg/{name}.yaml",
        "family": "policy_gradient",
        "signal": "rollout/reward_mean",
        "overrides": [],
        "composition": "group_zscore / ppo_clip / token_mean / none",
        "steps": [10, 10],
        "completions_per_step": 8,
        "headline_name": "correctness (task verifier)",
        "heldout_accuracy_before": [0.4, 0.4],
        "heldout_accuracy": acc,
        "heldout_majority_baseline": [0.0, 0.0],
        "heldout_n": 500,
        "reward_last10": [0.2, 0.4],
        "wall_s": [60.0, 80.0],
        "curves": {"reward": [], "accuracy": []},
    }


def test_compare_table_shows_standard_errors_and_names_the_headline():
    results = {
        "presets": {"grpo": _preset("grpo", [0.5, 0.7]), "rloo": _preset("rloo", [0.3, 0.3])},
        "seeds": 2,
        "overrides": [],
        "family": "policy_gradient",
        "signal": "rollout/reward_mean",
        "signal_name": "reward",
    }
    table = comparison_table(results)
    # grpo: mean 0.6; sample variance ((0.1)² + (0.1)²) / (2 − 1) = 0.02; s.e. √(0.02 / 2) = 0.1
    # (the std would be √0.02 = 0.141)
    assert "| 0.600 ± 0.100 |" in table and "0.141" not in table
    # reward [0.2, 0.4]: s.e. 0.1 as well; wall [60, 80]: s.e. 10
    assert "| 0.300 ± 0.100 |" in table and "| 70 ± 10 |" in table
    footer = table.strip().splitlines()[-1]
    assert footer.startswith("Mean ± s.e. (standard error of the mean) over 2 seeds")
    # the footer names the headline, not the last preset of the table (a loop variable did)
    assert "held-out headline (correctness (task verifier))" in footer
    assert "(rloo)" not in footer


def test_every_command_has_the_same_default_thread_count():
    """One value, `precision.threads`' default (torch's own): train / quickstart / sweep /
    compare configs, `pipeline`'s `threads:`, `replicate`'s `experiment.threads`, and the
    `--threads` of eval, best-of-n and prm-vs-orm."""
    from rlhflab.pipeline import PipelineConfig
    from rlhflab.prm_vs_orm import run_prm_vs_orm
    from rlhflab.replications import REPLICATIONS

    default = PrecisionConfig.model_fields["threads"].default
    seen = {
        "eval": parse_args(["eval", "m", "--task", "chain_sum"]).threads,
        "best-of-n": parse_args(["best-of-n", "p", "--rm", "r:orm", "--task", "x"]).threads,
        "prm-vs-orm": parse_args(["prm-vs-orm"]).threads,
        "run_prm_vs_orm": inspect.signature(run_prm_vs_orm).parameters["threads"].default,
        "pipeline": PipelineConfig.model_fields["threads"].default,
    }
    for name, (module, _) in REPLICATIONS.items():
        spec = importlib.import_module(module).Spec
        seen[f"replicate {name}"] = spec.model_fields["threads"].default
    assert seen == dict.fromkeys(seen, default)


@pytest.fixture
def umask():
    """Set the process umask for a test; restored after."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield os.umask
    os.umask(saved)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_atomic_writes_respect_the_umask(tmp_path, umask, mask, mode):
    """Results, configs and reports get the mode of an ordinary `open` (0o666 less the umask),
    not mkstemp's 0600: readable by the group under the usual umask 022."""
    umask(mask)
    write_json_atomic(tmp_path / "final_results.json", {"a": 1})
    write_yaml_atomic(tmp_path / "config.yaml", {"a": 1})
    write_text_atomic(tmp_path / "report.md", "# r\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # what the umask gives any file
    for name in ("final_results.json", "config.yaml", "report.md"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert stat.S_IMODE(plain.stat().st_mode) == mode
    assert json.loads((tmp_path / "final_results.json").read_text()) == {"a": 1}


def test_a_run_directory_is_readable_by_the_group(tmp_path, umask):
    """Under umask 022 every file of a finished run is 0644: config, results, metrics, plots, the
    model (safetensors writes its files 0600 whatever the umask) and the checkpoints."""
    from test_checkpoint_resume import sft_raw

    from rlhflab.config import config_from_dict
    from rlhflab.trainers import run_config

    umask(0o022)
    raw = sft_raw(tmp_path, steps=2)
    raw["checkpoint"] = {"every": 1, "keep_last": None}
    run_dir = run_config(config_from_dict(raw))["run_dir"]
    files = [p for p in Path(run_dir).rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.yaml", "final_results.json", "model.safetensors", "rng.safetensors"} <= names
    modes = {str(p.relative_to(run_dir)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files}
    assert {k: v for k, v in modes.items() if v != "0o644"} == {}
