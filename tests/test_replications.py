"""The replications' own arithmetic (`rlhflab replicate`): best-of-n KL, majority vote on a
constructed case, MC step-labelled RM training through the trainer, the synthetic GSM8K rows read by
load_gsm8k, one-line errors for bad replication configs, and the R1-Zero base documents' prompt
boundary (the RL prompt is a prefix of every base document, token for token)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rlhflab.cli import main
from rlhflab.data.gsm8k import parse_gsm8k_row
from rlhflab.replications.prm_orm_gsm8k import synthetic_rows
from rlhflab.replications.rm_overopt import bon_kl

ROOT = Path(__file__).resolve().parents[1]


def test_best_of_n_kl_is_log_n_minus_n_minus_1_over_n():
    assert bon_kl(1) == 0.0
    assert bon_kl(2) == pytest.approx(math.log(2) - 0.5, abs=1e-15)
    assert bon_kl(64) == pytest.approx(math.log(64) - 63 / 64, abs=1e-15)


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


def test_r1_zero_base_documents_and_trend_curves():
    # The base model's documents: plain steps + "The answer is n." (no tags), or R1's tagged form
    # that think_format rewards 1.0 (and the plain one 0.0).
    from rlhflab.replications.r1_zero import base_document, curves_from_metrics
    from rlhflab.rewards.functions import think_format

    plain = base_document(["2+3 = 5", "5-1 = 4"], "4", tagged=False)
    tagged = base_document(["2+3 = 5", "5-1 = 4"], "4", tagged=True)
    assert plain == "2+3 = 5\n5-1 = 4\nThe answer is 4."
    assert tagged == "<think> 2+3 = 5\n5-1 = 4 </think> <answer> 4 </answer>"
    assert think_format([None, None], [plain, tagged]) == [0.0, 1.0]
    # The curves: the headline when logged (else eval/reward/math_verify), rows without a key skipped.
    rows = [
        {"step": 0, "eval/headline": 0.1, "eval/reward/math_verify": 0.1,
         "eval/reward/think_format": 0.2},
        {"step": 1, "rollout/response_len_mean": 30.5, "rollout/reward/think_format_mean": 0.25,
         "rollout/reward/math_verify_mean": 0.05},
        {"step": 2, "rollout/response_len_mean": 28.0, "eval/reward/math_verify": 0.3},
    ]  # fmt: skip
    got = curves_from_metrics(rows)
    assert got["correctness"] == [(0, 0.1)]
    assert got["format"] == [(0, 0.2)]
    assert got["response_len"] == [(1, 30.5), (2, 28.0)]
    assert got["train_format"] == [(1, 0.25)] and got["train_correctness"] == [(1, 0.05)]
    no_headline = curves_from_metrics([{k: v for k, v in r.items() if k != "eval/headline"}
                                       for r in rows])  # fmt: skip
    assert no_headline["correctness"] == [(0, 0.1), (2, 0.3)]


def test_r1_zero_base_documents_share_the_rl_prompt_boundary(tmp_path, tiny_tokenizer):
    # An R1-Zero base model has seen plain text, never a chat template: each base document, read
    # and tokenized as the base stage trains on it, starts with exactly the token ids the RL stage
    # prompts with (r1_zero.yaml's template, loaded by the RL prompt loader), and the rest of the
    # document is the completion (tagged ones are what think_format rewards 1.0), then eos.
    from rlhflab.config import read_yaml
    from rlhflab.data.formatting import encode_prompt
    from rlhflab.data.gsm8k import load_gsm8k
    from rlhflab.data.prompts import load_prompt_source, render_row
    from rlhflab.data.sft import load_sft_data, tokenize_sft
    from rlhflab.replications import stage
    from rlhflab.replications.r1_zero import base_documents
    from rlhflab.rewards.functions import think_format
    from rlhflab.serialize import to_json

    path = ROOT / "configs/replications/r1_zero.yaml"
    spec = read_yaml(path)
    rows = synthetic_rows(12, seed=5)
    train_path, held_path = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train_path.write_text("".join(to_json(r) + "\n" for r in rows[:8]))
    held_path.write_text("".join(to_json(r) + "\n" for r in rows[8:]))
    train, _ = load_gsm8k(str(train_path))
    docs, tagged_n = base_documents(train, spec["rl"]["data"]["template"], format_frac=0.5, seed=0)
    assert len(docs) == 8 and 0 < tagged_n < 8
    docs_path = tmp_path / "docs.jsonl"
    docs_path.write_text("".join(to_json(d) + "\n" for d in docs))
    examples, _ = load_sft_data(str(docs_path), tiny_tokenizer)
    features = tokenize_sft(tiny_tokenizer, examples, max_len=1024)

    rl = stage(spec, "rl", str(path), model={"name_or_path": "x"},
               data={"path": str(train_path), "heldout_path": str(held_path)})  # fmt: skip
    prompts = load_prompt_source(rl.data, seed=0).train
    by_question = {p.question: p for p in train}
    tagged_seen = 0
    for row, feats in zip(prompts, features, strict=True):
        problem = train[row.index]
        assert problem.question in row.prompt and by_question[problem.question] is problem
        prompt_ids = encode_prompt(tiny_tokenizer, render_row(tiny_tokenizer, row))
        ids = feats["input_ids"]
        assert ids[: len(prompt_ids)] == prompt_ids, (
            tiny_tokenizer.decode(ids[: len(prompt_ids)]),
            tiny_tokenizer.decode(prompt_ids),
        )
        assert ids[-1] == tiny_tokenizer.eos_token_id
        rest = tiny_tokenizer.decode(ids[len(prompt_ids) : -1])
        assert problem.answer in rest
        tagged_seen += think_format([None], [rest])[0]
    assert tagged_seen == tagged_n
    # A template ending in whitespace would end the RL prompt in a lone space token that no
    # document has there: one line naming the key.
    from rlhflab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^rl\.data\.template: ends with whitespace"):
        base_documents(train, "Q: {prompt} A: ", format_frac=0.5, seed=0)
