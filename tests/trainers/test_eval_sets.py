"""eval.sets: further held-out sets of a policy-gradient run, each logged as eval/<set>/...,
plotted on its own and reported in final_results.json (issue #27 item 3)."""

import json
from pathlib import Path

import pytest
from factories import tiny_pg, tiny_sft

from rlhflab.config import config_from_dict
from rlhflab.errors import ConfigError
from rlhflab.eval.accuracy import evaluate
from rlhflab.models.loading import load_model, load_tokenizer
from rlhflab.rewards.verifier import Verifier
from rlhflab.trainers import run_config

HARDER = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 2}


@pytest.mark.slow
def test_each_eval_set_is_logged_plotted_and_reported(tmp_path):
    sft = run_config(config_from_dict(tiny_sft(tmp_path / "sft", precision={"threads": 1})))
    sets = [{"name": "harder", "task": {"config": HARDER}, "n": 5},
            {"name": "other", "task": {"name": "basic_arithmetic", "config": {}}, "n": 4}]  # fmt: skip
    cfg = tiny_pg(tmp_path / "pg", sft["model_dir"], train={"steps": 2, "micro_batch_size": 16},
                  eval={"n": 6, "every": 1, "max_new_tokens": 6, "sets": sets},
                  precision={"threads": 1})  # fmt: skip
    res = run_config(config_from_dict(cfg))
    run_dir = Path(res["run_dir"])
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for name, n in (("harder", 5), ("other", 4)):
        evals = [r for r in rows if f"eval/{name}/headline" in r]
        assert [r["step"] for r in evals] == [0, 1, 2]  # every evaluation, each set
        assert all(r[f"eval/{name}/n"] == n for r in evals)
        assert (run_dir / "plots" / f"eval_{name}.png").is_file()
        rep = res["eval_sets"][name]
        assert rep["headline"]["value"] == evals[-1][f"eval/{name}/headline"]
        assert rep["headline"]["before"] == evals[0][f"eval/{name}/headline"]
    assert res["eval_sets"]["other"]["task"] == "basic_arithmetic"
    assert res["headline"]["n"] == 6  # the run's own set is unchanged
    # the harder set's final number is the final model evaluated on that set directly
    from rlhflab.data.prompts import task_prompt_splits

    task = config_from_dict(cfg).eval_set_task(0)
    held = task_prompt_splits(task).heldout[:5]
    model, tok = load_model(res["model_dir"]), load_tokenizer(res["model_dir"])
    direct = evaluate(model, tok, held, Verifier(answer_format="plain"), max_new_tokens=6)
    assert direct["accuracy"] == res["eval_sets"]["harder"]["heldout_accuracy"]


def test_eval_sets_config_errors_are_one_line(tmp_path):
    base = tiny_pg(tmp_path, tmp_path, eval={"n": 4, "sets": [{"name": "x", "task": {"nope": 1}}]})
    with pytest.raises(ConfigError, match=r"eval.sets\[0\] \(x\).task.nope"):
        config_from_dict(base)
    dup = [{"name": "a"}, {"name": "a"}]
    with pytest.raises(ConfigError, match="names must differ"):
        config_from_dict(tiny_pg(tmp_path, tmp_path, eval={"sets": dup}))
    with pytest.raises(ConfigError, match="is a metric name"):
        config_from_dict(tiny_pg(tmp_path, tmp_path, eval={"sets": [{"name": "reward"}]}))
    assert config_from_dict(tiny_pg(tmp_path, tmp_path)).eval.sets == []


def test_the_summary_shows_each_eval_set():
    from rlhflab.summary import summary_lines

    sub = {"headline": {"name": "correctness (task verifier)", "value": 0.25, "stderr": 0.1,
                        "before": 0.125, "n": 8}, "heldout_n": 8, "task": "chain_sum"}  # fmt: skip
    lines = summary_lines({"trainer": "policy_gradient", "eval_sets": {"harder": sub}})
    assert lines[-1] == (
        "[harder: chain_sum] held-out accuracy: 25.0% ± 10.0 (n=8; before training 12.5%)"
    )
