"""What the commands print: a few summary lines on stdout by default, the whole results object
with `--json` (stdout then holds one JSON document, the summary lines go to stderr), as
`rlhflab train` does. The work of each command is replaced by a stub returning results of the
real shape, so these run in well under a second each."""

import json
from pathlib import Path

import pytest

import rlhflab.cli as cli
from rlhflab.cli import main

ROOT = Path(__file__).resolve().parents[1]

TASK_EVAL = {
    "model": "runs/q/grpo/model", "task": "spell_backward", "n": 500,
    "headline_name": "correctness (task verifier)", "headline": 0.788, "headline_stderr": 0.0183,
    "accuracy": 0.788, "accuracy_stderr": 0.0183, "pass@1": 0.61, "pass@1_stderr": 0.019,
    "pass@8": 0.902, "pass@8_stderr": 0.013, "pass@k": 0.902, "pass@k_stderr": 0.013, "k": 8,
    "n_samples": 8, "majority_answer": "eht", "majority_accuracy": 0.02,
    "majority_accuracy_stderr": 0.0063, "heldout_overlap_dropped": 1350, "verifier_errors": 0,
    "completions_note": "x" * 50,
}  # fmt: skip
QUICKSTART = {
    "task": "spell_backward", "task_config": {"min_word_len": 3}, "fast": False,
    "heldout_accuracy_sft": 0.46, "heldout_accuracy_rl": 0.776, "rl_gain_points": 31.6,
    "heldout_accuracy_rl_stderr": 0.019, "heldout_majority_answer": "eht",
    "heldout_majority_baseline": 0.02, "heldout_majority_baseline_stderr": 0.006,
    "heldout_n": 500, "heldout_overlap_dropped": 1350, "sft_steps": 130, "sft_wall_s": 40.0,
    "grpo_steps": 600, "grpo_wall_s": 120.0, "wall_s": 162.0, "resumed": False,
    "sft_run": "runs/q/sft-1", "grpo_run": "runs/q/grpo-1", "model_dir": "runs/q/grpo-1/model",
    "health": {"sft": {"ok": True, "checked": ["a"] * 6, "failed": {}},
               "grpo": {"ok": True, "checked": ["a"] * 19, "failed": {}}},
    "report": "runs/q/report.md",
}  # fmt: skip
SWEEP = {
    "out_dir": "experiments/2026-11-27-beta", "ran": ["p00-coef0-s0"], "skipped": ["p01-s0"],
    "cells": 2, "readme": "experiments/2026-11-27-beta/README.md", "metric": "headline",
    "metric_name": "correctness (task verifier)",
    "points": [{"label": "kl.coef=0", "metric": {"mean": 0.5, "se": 0.1, "n": 2}},
               {"label": "kl.coef=0.05", "metric": {"mean": 0.25, "se": None, "n": 1}}],
}  # fmt: skip
COMPARE = {
    "out_dir": "runs/compare-1", "wall_s": 125.0, "table": "runs/compare-1/comparison.md",
    "seeds": 2, "presets": {"grpo": {"headline_name": "correctness (task verifier)",
                                     "heldout_accuracy_before": [0.4, 0.4],
                                     "heldout_accuracy": [0.5, 0.7],
                                     "heldout": {"mean": 0.6, "se": 0.1, "n": 2},
                                     "heldout_before": {"mean": 0.4, "se": 0.0, "n": 2}}},
}  # fmt: skip
REPLICATE = {
    "headline": {"name": "correctness (math_verify)", "value": 0.12, "stderr": 0.02,
                 "before": 0.05, "n": 200},
    "curves": {"correctness": [[i, 0.1] for i in range(400)]},
    "wall_s": 420.0, "plot": "runs/r1/r1_zero.png",
}  # fmt: skip


def test_eval_summary_lines_name_the_headline_and_the_baseline():
    from rlhflab.summary import eval_lines

    lines = eval_lines(TASK_EVAL)
    assert lines[0] == (
        "held-out accuracy: 78.8% ± 1.8 (n=500, greedy); majority-answer baseline 2.0% ± 0.6 "
        "(answering 'eht' to all)"
    )
    # pass@k in points with its standard error; the `pass@k` alias of pass@8 is not repeated
    assert lines[1] == "sampled (8 per problem): pass@1 61.0% ± 1.9, pass@8 90.2% ± 1.3"
    assert len(lines) == 2


def _stub(monkeypatch, target: str, results: dict):
    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(__import__(module, fromlist=[name]), name, lambda *a, **k: results)


CASES = {
    "eval": (["eval", "m", "--task", "spell_backward"], "rlhflab.eval.cli.run_eval_command",
             TASK_EVAL, "held-out accuracy: 78.8% ± 1.8"),
    "quickstart": (["quickstart"], "rlhflab.quickstart.run_quickstart", QUICKSTART,
                   "held-out accuracy: after SFT 46.0%, after GRPO 77.6% (± 1.9)"),
    "sweep": (["sweep", "c.yaml", "--grid", "kl.coef=0,0.05"], "rlhflab.sweep.run_sweep", SWEEP,
              "  kl.coef=0: 0.500 ± 0.100 (2 seeds)"),
    "compare": (["compare", "configs/pg/grpo.yaml"], "rlhflab.compare.run_compare", COMPARE,
                "  grpo: 0.600 ± 0.100 (before 0.400)"),
    "replicate": (["replicate", "r1-zero", "--out", "runs/r1"],
                  "rlhflab.replications.run_replication", REPLICATE,
                  "held-out correctness (math_verify): 12.0% ± 2.0"),
}  # fmt: skip


@pytest.mark.parametrize("command", list(CASES))
def test_summary_lines_by_default_and_the_object_with_json(command, monkeypatch, capsys):
    argv, target, results, expected = CASES[command]
    _stub(monkeypatch, target, results)
    monkeypatch.setattr(cli.commands, "_print_next", lambda hint: None)  # quickstart's hint
    assert main(argv) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert any(line.startswith(expected) for line in lines), out
    assert 2 <= len(lines) <= 8 and not out.lstrip().startswith("{")
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == json.loads(json.dumps(results))  # the whole object, nothing else
    assert any(line.startswith(expected) for line in err.splitlines())  # the summary, on stderr


def test_train_json_prints_the_results_object(monkeypatch, capsys):
    import rlhflab.trainers
    from rlhflab.summary import summary_lines

    results = {"trainer": "sft", "steps": 4, "wall_s": 3.0, "run_dir": "runs/sft-1", "x": [1]}
    monkeypatch.setattr(rlhflab.trainers, "run_config", lambda cfg: results)
    sft = str(ROOT / "configs/sft/tiny_scratch.yaml")
    assert main(["train", sft]) == 0
    assert capsys.readouterr().out.splitlines() == summary_lines(results)
    assert main(["train", sft, "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == results and err.splitlines()[:2] == summary_lines(results)


# -- rlhflab replicate: names, list, usage, README, progress -------------------------------------


def test_replicate_help_and_list_name_every_replication(capsys):
    from rlhflab.replications import REPLICATIONS

    with pytest.raises(SystemExit):
        main(["replicate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in REPLICATIONS), text  # r1-zero was missing
    assert main(["replicate", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(REPLICATIONS)
    assert all(len(line.split()) > 8 for line in lines)  # each with its description


def test_replicate_usage_error_names_what_is_required(capsys):
    assert main(["replicate"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "NAME and --out DIR" in err and "r1-zero" in err and "key=value" not in err
    assert main(["replicate", "r1-zero"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("error: replicate r1-zero: --out DIR is required")


def test_readme_replicate_commands_run_as_written():
    """Every `rlhflab replicate` command in the shell blocks of README.md and docs/*.md parses
    and names a replication and --out (the README once had `rlhflab replicate NAME` without
    --out)."""
    import shlex

    from rlhflab.cli import parse_args
    from rlhflab.replications import REPLICATIONS

    found = 0
    in_block = False
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for line in (ln for page in pages for ln in page.read_text().splitlines()):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block and line.startswith("rlhflab replicate"):
            args = parse_args(shlex.split(line, comments=True)[1:])
            assert args.list or (args.name in REPLICATIONS and args.out), line
            found += 1
    assert found >= 1


def test_stages_of_a_long_command_report_progress(tmp_path):
    """`announce_runs` (what `rlhflab replicate` wraps around its stages): a training run whose
    console is off still reports a start line, progress lines and an end line."""
    from test_checkpoint_resume import sft_raw

    from rlhflab.config import config_from_dict
    from rlhflab.tracking import announce_runs
    from rlhflab.trainers import run_config

    said = []
    raw = sft_raw(tmp_path, steps=3)  # tracking.console: false, as in the replication configs
    with announce_runs("replicate x", print_fn=said.append, every_s=0.0):
        res = run_config(config_from_dict(raw))
    assert said[0] == f"replicate x: sft: 3 steps -> {res['run_dir']}"
    assert any(line.startswith("replicate x: sft step 3/3") for line in said), said
    assert said[-1].startswith("replicate x: sft: ended after ")
    said.clear()
    run_config(config_from_dict(sft_raw(tmp_path, steps=1)))  # outside the block: silent
    assert said == []
