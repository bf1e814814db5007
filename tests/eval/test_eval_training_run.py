"""`rlhflab eval MODEL` evaluates a run's model as the run evaluated it (issue #36): the run's task
kwargs, held-out seed and size, prompt format and decoding from its config.yaml instead of the
task's defaults, a warning naming each given value that differs, and a multi-turn run's model by
episodes with the run's environment."""

import json
from pathlib import Path

import pytest
from factories import tiny_pg, tiny_task

from rlhflab.cli import main
from rlhflab.config import config_from_dict, dump_config

# the run's task differs from chain_sum's defaults in every setting that defines the held-out set
RUN_TASK = tiny_task(
    config={"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 2},
    seed=7, n_train=50, n_heldout=30, answer_format="tags", system="Be brief.",
)  # fmt: skip


def _run_dir(tmp_path: Path, **sections) -> tuple[Path, object]:
    """A finished run's directory as the harness writes it: the resolved config.yaml and a
    model/ folder (empty: the evaluation itself is replaced in these tests)."""
    (tmp_path / "base").mkdir()
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    cfg = config_from_dict(tiny_pg(tmp_path, tmp_path / "base", task=RUN_TASK, **sections))
    (run / "config.yaml").write_text(dump_config(cfg))
    return run, cfg


@pytest.fixture
def evaluated(monkeypatch):
    """What `rlhflab eval` hands to the evaluation: the rows and the keywords."""
    import rlhflab.eval.cli as cli

    seen = {}

    def fake(model_path, rows, scorer, **kw):
        seen.update(kw, rows=rows, scorer=scorer)
        return {"accuracy": 0.5, "accuracy_stderr": 0.1, "n": len(rows)}

    monkeypatch.setattr(cli, "load_and_evaluate", fake)
    return seen


def test_eval_takes_the_task_settings_of_the_run_that_trained_the_model(
    tmp_path, evaluated, capsys
):
    from rlhflab.data.formatting import task_instruction
    from rlhflab.data.prompts import load_prompt_source

    template = "Q: {prompt}\nA:"
    run, cfg = _run_dir(
        tmp_path, eval={"n": 12, "max_new_tokens": 5},
        data={"source": "task", "template": template},
    )  # fmt: skip
    assert main(["eval", str(run / "model"), "--task", "chain_sum", "--json"]) == 0
    # the rows the policy-gradient trainer evaluates: its prompt source, the first eval.n
    expected = load_prompt_source(cfg.data, cfg.task, seed=cfg.seed).heldout[: cfg.eval.n]
    got = evaluated["rows"]
    assert [r.question for r in got] == [r.question for r in expected] and len(got) == 12
    assert all(r.prompt.startswith("Q: ") and r.rendered for r in got)  # the run's template
    assert evaluated["system"] == "Be brief." and evaluated["max_new_tokens"] == 5
    assert evaluated["instruction"] == task_instruction(cfg.task)  # the tags sentence
    assert evaluated["scorer"].answer_format == "tags"
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["task_config"] == RUN_TASK["config"] and out["settings"]["seed"] == 7
    assert out["training_config"] == str((run / "config.yaml").resolve())
    # not the task's defaults (what eval used before): other questions altogether
    from rlhflab.data.tasks import make_splits

    default = make_splits("chain_sum", n_train=100, n_heldout=12, seed=0).heldout
    assert [p.question for p in default] != [r.problem.question for r in got]
    # MODEL alone: the run's task too
    assert main(["eval", str(run / "model")]) == 0
    assert [r.prompt for r in evaluated["rows"]] == [r.prompt for r in expected]


def test_a_given_setting_that_differs_from_the_run_is_used_and_named_in_one_warning(
    tmp_path, evaluated, capsys
):
    from rlhflab.data.tasks import make_splits

    run, _ = _run_dir(tmp_path, eval={"n": 12})
    argv = ["eval", str(run / "model"), "--task", "chain_sum", "--n", "4", "--task-config", "{}",
            "--answer-format", "tags", "--json"]  # fmt: skip
    assert main(argv) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert err == [
        f"warning: not the run's own held-out evaluation ({(run / 'config.yaml').resolve()}): "
        f"--task-config '{{}}' (run: '{json.dumps(RUN_TASK['config'])}'), --n 4 (run: 12)"
    ]  # --answer-format tags is the run's: not named
    # the given values are used: the task's default kwargs, 4 rows
    expected = make_splits(
        "chain_sum", config={}, n_train=RUN_TASK["n_train"], n_heldout=4, seed=RUN_TASK["seed"]
    ).heldout
    assert [r.prompt for r in evaluated["rows"]] == [p.question for p in expected]


def test_without_a_run_and_without_a_task_is_one_line(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    assert main(["eval", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: eval: give --task NAME or --data PATH") and "\n" not in err


def test_another_task_keeps_its_own_distribution_and_the_runs_format(tmp_path, evaluated, capsys):
    from rlhflab.eval.training_run import default_settings

    run, _ = _run_dir(tmp_path)
    assert main(["eval", str(run / "model"), "--task", "basic_arithmetic", "--n", "3",
                 "--exclude-train", "100", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)["settings"]
    d = default_settings()
    assert out["task_config"] == d["task_config"] and out["seed"] == d["seed"]  # the task's own
    assert out["n_train_exclude"] == 100 and out["n"] == 3
    assert out["answer_format"] == "tags" and out["system"] == "Be brief."  # the model's format


@pytest.mark.slow
def test_a_multi_turn_runs_model_is_evaluated_by_episodes_as_the_run_did(
    tmp_path, tiny_model, tiny_tokenizer, capsys
):
    """A GRPO run with an environment, then `rlhflab eval RUN/model`: greedy episodes with the
    run's environment, the same success, turns and tool calls as the run's own final
    evaluation (same weights, rows and greedy decoding)."""
    import shlex

    from rlhflab.models.build import save_pretrained
    from rlhflab.next_steps import next_command
    from rlhflab.trainers import run_config

    env_file = tmp_path / "script_env.py"
    env_file.write_text(
        "class ScriptEnv:\n"
        "    def reset(self, problem):\n"
        "        self.n = 0\n"
        "        return [{'role': 'user', 'content': problem.question}]\n"
        "    def step(self, messages, turn):\n"
        "        self.n += 1\n"
        "        if self.n < 2:\n"
        "            return 'tool said 123', 0.0, False, {'tool_call': 1}\n"
        "        ok = float(len(turn) % 2)\n"
        "        return None, ok, True, {'success': ok}\n"
    )
    save_pretrained(tiny_model, tiny_tokenizer, tmp_path / "base")
    raw = tiny_pg(
        tmp_path, tmp_path / "base", env={"class": f"{env_file}:ScriptEnv", "max_turns": 2},
        train={"steps": 1, "micro_batch_size": 16}, eval={"n": 6, "every": 0},
        precision={"threads": 1}, checkpoint={"every": 0},
    )  # fmt: skip
    res = run_config(config_from_dict(raw))
    rows = [
        json.loads(x) for x in (Path(res["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    final = [r for r in rows if "eval/tool_calls" in r][-1]
    capsys.readouterr()
    # the command the run printed as `next:`
    hint = next_command(config_from_dict(raw), res)
    argv = shlex.split(hint.removeprefix("next:"), comments=True)
    assert argv == ["rlhflab", "eval", res["model_dir"]]
    assert main([*argv[1:], "--threads", "1", "--json"]) == 0  # the printed command, + the object
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["env"] == f"{env_file}:ScriptEnv" and out["n"] == 6
    assert out["accuracy"] == final["eval/accuracy"] == res["heldout_accuracy"]
    for key in ("turns", "tool_calls", "truncated"):
        assert out[key] == final[f"eval/{key}"]
    assert out["tool_calls"] > 0  # the environment answered
    assert "held-out episodes with the run's environment" in captured.err
    # pass@k of episodes is refused, in one line
    assert main(["eval", res["model_dir"], "--k", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pass@k of episodes is not implemented" in err and "\n" not in err
    # the checkpoint curve of the run directory: episodes too (initial and final model)
    assert main(["eval", res["run_dir"], "--checkpoints", "--threads", "1", "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["checkpoints"]["points"]
    assert [p["step"] for p in points] == [0, 1]
    assert [p["headline"] for p in points] == [res["headline"]["before"], res["headline"]["value"]]
    assert all(p["env"] == out["env"] for p in points)
