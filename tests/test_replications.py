"""The replications' own arithmetic (`rlhflab replicate`): best-of-n KL, majority vote on a
constructed case, MC step-labelled RM training through the trainer, the synthetic GSM8K rows read by
load_gsm8k and one-line errors for bad replication configs (the R1-Zero replication's own tests:
tests/test_replication_r1_zero.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rlhflab.cli import main
from rlhflab.data.gsm8k import parse_gsm8k_row
from rlhflab.replications.prm_orm_gsm8k import majority_curve, synthetic_rows
from rlhflab.replications.rm_overopt import bon_kl

ROOT = Path(__file__).resolve().parents[1]


def test_best_of_n_kl_is_log_n_minus_n_minus_1_over_n():
    assert bon_kl(1) == 0.0
    assert bon_kl(2) == pytest.approx(math.log(2) - 0.5, abs=1e-15)
    assert bon_kl(64) == pytest.approx(math.log(64) - 63 / 64, abs=1e-15)


def test_majority_vote_on_a_constructed_pool():
    # Problem 0: answers 5,5,7 (5 right): N=3 always votes 5 → 1. Problem 1: 1,2,2 (1 right):
    # N=3 votes 2 → 0. N=1 is the mean correctness: 2/3 and 1/3.
    answers = [["5", "5", "7"], ["1", "2", "2"]]
    correct = [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    got = majority_curve(answers, correct, [3], n_resamples=4, seed=0)
    assert got[3]["accuracy"] == pytest.approx(0.5, abs=1e-12)
    assert got[3]["stderr"] == pytest.approx(0.5, abs=1e-12)  # sqrt(0.5 / 2)
    one = majority_curve(answers, correct, [1], n_resamples=1000, seed=0)
    assert one[1]["accuracy"] == pytest.approx(0.5, abs=0.05)  # (2/3 + 1/3) / 2 in expectation
    # No answer never wins: a pool with only unparseable answers scores 0.
    assert (
        majority_curve([[None, None]], [[1.0, 1.0]], [2], n_resamples=2, seed=0)[2]["accuracy"]
        == 0.0
    )


def test_synthetic_rows_are_gsm8k_rows_whose_steps_add_up():
    for row in synthetic_rows(50, seed=3):
        entry = parse_gsm8k_row(row)
        value = None
        for step in entry["steps"]:
            lhs, rhs = step.split(" = ")
            assert eval(lhs) == int(rhs)  # digits and +/- only
            value = int(rhs)
        assert str(value) == entry["answer"] and value >= 0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["replicate", "rm-overopt", "experiment.ns=[1,2]", "experiment.nn=3"],
         "experiment.nn: Extra inputs are not permitted"),
        (["replicate", "rm-overopt", "rm.train.stepz=3"], "[rm]"),
        (["replicate", "prm-orm"], "unknown replication 'prm-orm' (did you mean 'prm-orm-gsm8k'?)"),
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
        ("rm_overopt", "n_resamples", 0),
        ("rm_overopt", "max_new_tokens", 0),
        ("prm_orm_gsm8k", "ns", [-1]),
        ("prm_orm_gsm8k", "samples_per_prompt", 0),
        ("prm_orm_gsm8k", "mc_rollouts", 0),
        ("prm_orm_gsm8k", "rm_prompts", 0),
        ("prm_orm_gsm8k", "n_heldout", 0),
        ("r1_zero", "n_train", 0),
        ("r1_zero", "n_heldout", 0),
        ("dpo_overopt", "betas", [0.1, 0.0]),
        ("dpo_overopt", "betas", [float("inf")]),
        ("dpo_overopt", "steps", [0, 20]),
        ("dpo_overopt", "kl_problems", 0),
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


def test_mc_step_labels_drop_solutions_without_steps_and_label_by_any_right_rollout(
    tiny_model, tiny_tokenizer
):
    # A sample without a newline has no step: dropped (it broke the step_labelled file: "field
    # 'steps' is empty"). A sample with steps gets one ±1 per step from m rollouts after the prefix;
    # with a verifier that calls everything right, every step is +1.
    from rlhflab.data.reward_data import ScoredSamples
    from rlhflab.replications.prm_orm_gsm8k import mc_step_labels

    class AllRight:
        def score_batch(self, texts, rows):
            return [1.0] * len(texts)

    def ids(text):
        return tiny_tokenizer(text, add_special_tokens=False)["input_ids"]

    texts = ["<answer>5</answer>", "2+3 = 5\n5+1 = 6\n<answer>6</answer>"]
    ss = ScoredSamples(problems=["p"], prompt_ids=[ids("Q:")], completion_ids=[[ids(t) for t in texts]],
                       texts=[texts], scores=[[0.0, 1.0]])  # fmt: skip
    got = mc_step_labels(tiny_model, tiny_tokenizer, ["p"], ss, AllRight(), m=2,
                         max_new_tokens=4, seed=0)  # fmt: skip
    assert got[0][0] is None
    assert got[0][1] == [["2+3 = 5", "5+1 = 6"], [1, 1], "<answer>6</answer>", 1]
