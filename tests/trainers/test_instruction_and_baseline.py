"""Wiring: the answer-format instruction reaches every prompt a trainer renders (RL and held-out
eval) and `rlhflab eval`; the majority-answer baseline is logged beside every held-out accuracy
and lands in final_results.json, the quickstart's report and `rlhflab compare`'s table."""

import json
from pathlib import Path

import pytest

from rlhflab.config import config_from_dict
from rlhflab.data.formatting import ANSWER_INSTRUCTIONS
from rlhflab.trainers import run_config

# chain_sum a ± b, one digit. Training answers (n_train 6, seed 0): -4 3 6 -4 -5 8, so the
# majority answer is "-4". Held-out answers (16, none a training question): 11 5 9 4 13 -5 5 8
# -3 1 -4 12 0 -1 11 14: "-4" is right on 1 of 16, baseline 1/16 = 0.0625, standard error
# sqrt(0.0625 · 0.9375 / 15) = 0.0625.
TASK = {
    "name": "chain_sum",
    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "n_train": 6,
    "n_heldout": 16,
    "seed": 0,
    "answer_format": "tags",
}


def _spy(monkeypatch, module, seen):
    real = module.render_row

    def render_row(tokenizer, row, *, system=None, instruction=None):
        seen.append(instruction)
        return real(tokenizer, row, system=system, instruction=instruction)

    monkeypatch.setattr(module, "render_row", render_row)


def test_policy_gradient_instruction_and_baseline(tmp_path, monkeypatch):
    import rlhflab.eval.accuracy as accuracy
    import rlhflab.experience.prompts as prompts  # the policy gradient's prompt set

    train_seen, eval_seen = [], []
    _spy(monkeypatch, prompts, train_seen)
    _spy(monkeypatch, accuracy, eval_seen)
    cfg = config_from_dict(
        {
            "trainer": "policy_gradient",
            "model": {
                "build": {
                    "size": "tiny",
                    "vocab_size": 300,
                    "max_position_embeddings": 96,
                    "tokenizer_texts": 100,
                }
            },
            "task": TASK,
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
            "train": {"steps": 1},
            "eval": {"n": 16, "max_new_tokens": 4},
            "tracking": {"console": False},
            "run": {"name": "pg", "root": str(tmp_path), "save_model": False},
        }
    )
    res = run_config(cfg)
    tags = ANSWER_INSTRUCTIONS["tags"]
    assert train_seen and set(train_seen) == {tags}  # the RL prompts
    assert len(eval_seen) == 32 and set(eval_seen) == {tags}  # held-out eval before and after
    final = json.loads((Path(res["run_dir"]) / "final_results.json").read_text())
    assert final["heldout_majority_answer"] == "-4"
    assert final["heldout_majority_baseline"] == 0.0625
    assert final["heldout_majority_baseline_stderr"] == pytest.approx(0.0625)
    rows = (Path(res["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, rows) if "eval/accuracy" in r]
    assert len(evals) == 2 and all(r["eval/majority_baseline"] == 0.0625 for r in evals)


def test_eval_command_passes_the_instruction(monkeypatch):
    import rlhflab.eval.cli as cli

    seen = {}

    def fake(model_path, rows, scorer, **kw):
        seen.update(kw)
        return {"accuracy": 0.5, "accuracy_stderr": 0.1, "n": len(rows)}

    monkeypatch.setattr(cli, "load_and_evaluate", fake)
    kw = dict(task="chain_sum", task_config=TASK["config"], n=16, n_train_exclude=6, seed=0, k=0,
              temperature=1.0, max_new_tokens=4, reward="binary", batch_size=8,
              print_fn=lambda line: None)  # fmt: skip
    res = cli.run_eval_command("m", answer_format="boxed", **kw)
    assert seen["instruction"] == "Put your final answer in \\boxed{}."
    assert res["majority_answer"] == "-4" and res["majority_accuracy"] == 0.0625
    cli.run_eval_command("m", answer_format="boxed", instruction="none", **kw)
    assert seen["instruction"] is None
    cli.run_eval_command("m", answer_format="plain", **kw)
    assert seen["instruction"] is None
    cli.run_eval_command("m", answer_format="plain", instruction="Be exact.", **kw)
    assert seen["instruction"] == "Be exact."


def test_quickstart_results_and_report_show_the_baseline(tmp_path, monkeypatch):
    from rlhflab import quickstart
    from rlhflab.trainers import policy_gradient, sft

    base = {"steps": 3, "wall_s": 1.0, "health": {"ok": True, "checked": ["x"], "failed": {}}}

    def stage(cfg) -> dict:  # a run directory inside the quickstart's, as the trainers make
        run = Path(cfg.run.root) / cfg.run.name
        return {**base, "run_dir": str(run), "model_dir": str(run / "model")}

    monkeypatch.setattr(sft, "train", stage)
    monkeypatch.setattr(
        policy_gradient,
        "train",
        lambda cfg: {
            **stage(cfg),
            "heldout_accuracy_before": 0.456,
            "heldout_accuracy": 0.722,
            "heldout_accuracy_stderr": 0.02,
            "heldout_n": 500,
            "heldout_overlap_dropped": 0,
            "heldout_majority_answer": "-4",
            "heldout_majority_baseline": 0.0625,
            "heldout_majority_baseline_stderr": 0.0625,
        },
    )
    res = quickstart.run_quickstart(root=str(tmp_path))
    final = json.loads(Path(res["report"]).with_name("final_results.json").read_text())
    assert final["heldout_majority_baseline"] == 0.0625
    assert final["heldout_majority_answer"] == "-4"
    report = Path(res["report"]).read_text()
    assert "| majority-answer baseline | 6.2% (± 6.2, answering '-4' to all) | – | – |" in report
    assert quickstart.summary_line(final) == (
        "held-out accuracy: after SFT 45.6%, after GRPO 72.2% (± 2.0); majority-answer baseline "
        "6.2% (± 6.2, answering '-4' to all)"
    )


def test_compare_table_shows_the_baseline():
    from rlhflab.compare import comparison_table

    row = {
        "family": "policy_gradient",
        "composition": "c",
        "steps": [2],
        "completions_per_step": 8,
        "heldout_accuracy_before": [0.1],
        "heldout_accuracy": [0.3],
        "heldout_majority_baseline": [0.0625],
        "heldout_n": 16,
        "reward_last10": [0.5],
        "wall_s": [1.0],
    }
    table = comparison_table(
        {"presets": {"grpo": row}, "seeds": 1, "overrides": [], "family": "policy_gradient"}
    )
    assert "| held-out acc. after | majority baseline |" in table
    assert "| grpo | c | 2 × 8 | 0.100 | 0.300 | 0.062 | 0.500 | 1 |" in table
