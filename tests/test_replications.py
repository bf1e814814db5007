"""The replications' shared checks (`rlhflab replicate`): best-of-n KL and one-line errors for bad
replication configs (each replication's own tests: tests/test_replication_<name>.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rlhflab.cli import main
from rlhflab.replications.rm_overopt import bon_kl

ROOT = Path(__file__).resolve().parents[1]


def test_best_of_n_kl_is_log_n_minus_n_minus_1_over_n():
    assert bon_kl(1) == 0.0
    assert bon_kl(2) == pytest.approx(math.log(2) - 0.5, abs=1e-15)
    assert bon_kl(64) == pytest.approx(math.log(64) - 63 / 64, abs=1e-15)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["replicate", "rm-overopt", "experiment.ns=[1,2,4]", "experiment.nn=3"],
         "experiment.nn: Extra inputs are not permitted"),
        (["replicate", "rm-overopt", "rm.train.stepz=3"], "[rm]"),
        (["replicate", "prm-orn"], "unknown replication 'prm-orn' (did you mean 'prm-orm'?)"),
    ],
)  # fmt: skip
def test_bad_replication_config_is_one_line(argv, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code = main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and expected in err[0], err
    assert not (tmp_path / "out" / "runs").exists()


def test_bad_best_of_n_ns_is_one_line_naming_the_key(tmp_path, capsys, monkeypatch):
    """issue 37: `experiment.ns=[0,2]` trained the stages, then ended in a traceback (log 0)."""
    monkeypatch.chdir(ROOT)
    policy = tmp_path / "no-such-policy"  # before the fix: fails fast in the rm stage instead
    code = main(["replicate", "rm-overopt", "experiment.ns=[0,2]", f"experiment.policy={policy}",
                 "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith(
        "experiment.ns: must be a non-empty list of distinct integers >= 1, e.g. [1, 2, 4, 8] "
        "(got [0, 2])"
    ), err
    assert not (tmp_path / "out" / "runs").exists()


@pytest.mark.parametrize(
    ("module", "key", "value"),
    [
        ("rm_overopt", "ns", []),
        ("rm_overopt", "ns", [2, 2]),
        ("rm_overopt", "heldout_problems", 0),
        ("rm_overopt", "ns", [2, 4, 8]),
        ("rm_overopt", "proxy_prompts", [64]),
        ("rm_overopt", "rl_seeds", [1, 1]),
        ("rm_overopt", "n_boot", 10),
        ("rm_overopt", "max_new_tokens", 0),
        ("prm_orm", "ns", [-1]),
        ("prm_orm", "samples_per_prompt", 0),
        ("prm_orm", "rm_solutions", 1),
        ("prm_orm", "rm_prompts", 0),
        ("prm_orm", "n_heldout", 1),
        ("r1_zero", "n_train", 0),
        ("r1_zero", "n_heldout", 0),
        ("dpo_overopt", "betas", [0.1, 0.0]),
        ("dpo_overopt", "betas", [float("inf")]),
        ("dpo_overopt", "seeds", [1, 1]),
        ("dpo_overopt", "every", 0),
        ("dpo_overopt", "heldout_problems", 0),
        ("dpo_overopt", "samples_per_problem", 0),
    ],
)  # fmt: skip
def test_experiment_counts_refuse_values_out_of_range(module, key, value):
    import importlib

    from rlhflab.errors import ConfigError
    from rlhflab.replications import check_experiment

    spec = importlib.import_module(f"rlhflab.replications.{module}").Spec
    with pytest.raises(ConfigError, match=rf"^x\.yaml: experiment\.{key}: .* \(got "):
        check_experiment(spec, {key: value}, "x.yaml")


@pytest.mark.parametrize("path", sorted((ROOT / "configs/replications").glob("*.yaml")), ids=str)
def test_every_replication_config_validates(path):
    import importlib

    from rlhflab.config import read_yaml
    from rlhflab.replications import REPLICATIONS, check_experiment, stage

    name = path.stem.removesuffix("_gpu")
    (module,) = [m for m, default in REPLICATIONS.values() if Path(default).stem == name]
    spec = read_yaml(path)
    check_experiment(importlib.import_module(module).Spec, spec["experiment"], str(path))
    for section in [k for k in spec if k != "experiment"]:
        built = "build" in (spec[section].get("model") or {})  # a model from scratch (sft, base)
        over = {} if built else {"model": {"name_or_path": "x"}}
        if isinstance(spec[section].get("data"), dict) and "path" in spec[section]["data"]:
            over["data"] = {"path": "x"}
        stage(spec, section, str(path), **over)
