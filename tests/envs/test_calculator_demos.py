"""configs/multiturn/calculator_sft.yaml's demonstrations (issue 36): without the file, training
stops at once with one line naming the file and the command that makes it; that command
(`python -m rlhflab.envs.calculator_demos CONFIG`) writes a file the preset then trains on."""

import json
import random
import re
from pathlib import Path

import pytest

from rlhflab.cli import main
from rlhflab.envs import calculator_demos
from rlhflab.envs.tools import calculator, parse_tool_call

ROOT = Path(__file__).resolve().parents[2]
PRESET = "configs/multiturn/calculator_sft.yaml"
COMMAND = f"python -m rlhflab.envs.calculator_demos {PRESET}"
SMALL = ["task.n_train=120", "task.n_heldout=8"]


@pytest.fixture
def in_repo_copy(tmp_path, monkeypatch):
    """cwd: a folder holding the preset at its repository path (the command names it so)."""
    (tmp_path / "configs/multiturn").mkdir(parents=True)
    (tmp_path / PRESET).write_text((ROOT / PRESET).read_text())
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_preset_names_the_command():
    text = (ROOT / PRESET).read_text()
    assert f"#   {COMMAND}\n" in text  # in the header
    assert f"made_by: {COMMAND}\n" in text


def test_missing_demonstrations_name_the_file_and_the_command(in_repo_copy, capsys):
    code = main(["train", PRESET, "run.root=out", *SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"error: data.path: file not found: demos.jsonl; make it with `{COMMAND}`"]
    assert not (in_repo_copy / "out").exists() or not any((in_repo_copy / "out").iterdir())


def test_the_command_writes_demonstrations_the_preset_trains_on(in_repo_copy, capsys):
    assert calculator_demos.main([PRESET, *SMALL]) == 0
    assert capsys.readouterr().out.strip() == "wrote 120 demonstrations to demos.jsonl"
    rows = [json.loads(line) for line in (in_repo_copy / "demos.jsonl").read_text().splitlines()]
    assert len(rows) == 120
    # which rows call the tool: Random(seed) draws in order, share 0.4 (seed: the config's, 0)
    rng = random.Random(0)
    want_tool = [rng.random() < calculator_demos.TOOL_SHARE for _ in rows]
    assert 0 < sum(want_tool) < len(rows)
    for row, tool in zip(rows, want_tool, strict=True):
        msgs = row["messages"]
        assert [m["role"] for m in msgs] == (
            ["user", "assistant", "user", "assistant"] if tool else ["user", "assistant"]
        )
        expr = re.fullmatch(r"Calculate (.*)\.", msgs[0]["content"]).group(1)
        answer = re.fullmatch(r"<answer>(.*)</answer>", msgs[-1]["content"]).group(1)
        assert calculator(expr) == answer  # the demonstrated answer is the product
        if tool:  # the call CalculatorEnv parses, and the result its calculator returns
            call = parse_tool_call(msgs[1]["content"])
            assert (call.name, call.input.strip()) == ("calc", expr)
            assert msgs[2]["content"] == calculator(expr)
    code = main(["train", PRESET, "run.root=out", "train.steps=1", "model.build.size=tiny",
                 "model.build.tokenizer_texts=200", *SMALL])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-2000:]
    (run,) = (in_repo_copy / "out").glob("calc-sft-*")
    assert json.loads((run / "final_results.json").read_text())["status"] == "complete"


def test_bad_input_is_one_line(in_repo_copy, capsys):
    assert calculator_demos.main([PRESET, "--tool-share", "1.5"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --tool-share must be in [0, 1], got 1.5"
    ]
    assert calculator_demos.main(["configs/pg/nope.yaml"]) == 2
    assert capsys.readouterr().err.strip() == "error: config file not found: configs/pg/nope.yaml"
