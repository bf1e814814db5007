"""Ctrl-C / SIGTERM in `quickstart` and `sweep`: the line printed after the interruption is a
command that really continues (each once claimed "continue with --resume", which neither took),
and running it finishes the job: finished stages or cells are skipped, the interrupted one
continues from its checkpoint, the report is written."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from factories import tiny_sft

from rlhflab.cli import main, parse_args

# A quickstart small enough for a test: tiny model, 2 SFT steps, 4 GRPO steps, a checkpoint at
# every step (a stop signal writes one anyway).
TINY_QUICKSTART = [
    "task.n_train=200", "task.n_heldout=8", "sft.model.build.size=tiny", "sft.train.steps=2",
    "sft.train.batch_size=8", "sft.train.micro_batch_size=8", "sft.checkpoint.every=1",
    "grpo.train.steps=4", "grpo.train.micro_batch_size=8", "grpo.rollout.prompts_per_step=2",
    "grpo.rollout.group_size=4", "grpo.eval.n=8", "grpo.eval.every=0", "grpo.checkpoint.every=1",
    "grpo.health.enabled=false",
]  # fmt: skip


def _rlhflab(argv: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("RLHFLAB_FAULT", None)
    if fault:
        env["RLHFLAB_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "rlhflab.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def _continue_argv(stderr: str) -> list[str]:
    """The argv after `rlhflab` of the `continue with:` line (the line is a shell command)."""
    (line,) = [x for x in stderr.splitlines() if x.startswith("continue with: ")]
    words = shlex.split(line.removeprefix("continue with: "))
    assert words[0] == "rlhflab"
    parse_args(words[1:])  # a command the CLI accepts
    return words[1:]


@pytest.mark.slow
def test_interrupted_quickstart_continues_with_the_printed_command(tmp_path):
    argv = ["quickstart", "--root", str(tmp_path), *TINY_QUICKSTART]
    # 1. SIGINT (Ctrl-C) in the middle of SFT step 1.
    first = _rlhflab(argv, fault="step_mid@1=sigint")
    assert first.returncode == 130, first.stderr[-2000:]
    again = _continue_argv(first.stderr)
    (qdir,) = tmp_path.glob("quickstart-*")
    assert f"--resume={qdir}" in again and not (qdir / "report.md").exists()
    # 2. The printed command: SFT continues from its checkpoint and ends; GRPO is interrupted at
    #    step 3 (the fault's step counter is each stage's own: SFT has only 2 steps).
    second = _rlhflab(again, fault="step_mid@3=sigint")
    assert second.returncode == 130, second.stderr[-2000:]
    assert "resumed from" in second.stderr and _continue_argv(second.stderr) == again
    # 3. Again: SFT is finished (skipped), GRPO continues from step 3; the report is written.
    third = _rlhflab(again)
    assert third.returncode == 0, third.stderr[-2000:]
    assert len(list(qdir.glob("sft-*"))) == 1 and len(list(qdir.glob("grpo-*"))) == 1
    results = json.loads((qdir / "final_results.json").read_text())
    assert results["resumed"] is True and results["sft_steps"] == 2 and results["grpo_steps"] == 4
    assert "after GRPO" in (qdir / "report.md").read_text()
    assert third.stdout.startswith("quickstart finished in ") and "resumed" in third.stdout
    grpo = next(qdir.glob("grpo-*"))
    steps = [json.loads(x)["step"] for x in (grpo / "metrics.jsonl").read_text().splitlines()]
    assert sorted(s for s in set(steps) if s > 0) == [1, 2, 3, 4]  # no step lost or repeated
    # resuming with other arguments is refused in one line
    other = _rlhflab([*again, "grpo.optim.lr=1e-4"])
    assert other.returncode == 2 and "was started with overrides" in other.stderr


def _sweep_config(tmp_path: Path) -> str:
    raw = tiny_sft(tmp_path / "unused", train={"steps": 4, "batch_size": 4, "micro_batch_size": 4,
                                               "max_len": 32}, checkpoint={"every": 2})  # fmt: skip
    raw["model"]["build"]["tokenizer_texts"] = 100
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.slow
def test_interrupted_sweep_continues_with_the_printed_command(tmp_path, monkeypatch, capsys):
    argv = ["sweep", _sweep_config(tmp_path), "--grid", "optim.lr=1e-3", "--seeds", "2",
            "--root", str(tmp_path / "exp"), "--slug", "t", "--metric", "steps"]  # fmt: skip
    with monkeypatch.context() as m:
        m.setenv("RLHFLAB_FAULT", "step_end@3=sigterm")  # the first cell, at step 3
        assert main(argv) == 143
    err = capsys.readouterr().err
    again = _continue_argv(err)
    assert again == [*argv, "--resume"]
    assert main(again) == 0
    out = capsys.readouterr().out
    (campaign,) = (tmp_path / "exp").glob("*-t")
    assert (campaign / "README.md").is_file() and f"sweep {campaign}: 2 runs" in out
    assert len(list((campaign / "runs").glob("p00-*-s0-*"))) == 1  # continued in its own folder


def test_sweep_resume_refuses_when_there_is_nothing_to_continue(tmp_path, capsys):
    argv = ["sweep", _sweep_config(tmp_path), "--grid", "optim.lr=1e-3", "--root",
            str(tmp_path / "exp"), "--slug", "none", "--resume"]  # fmt: skip
    assert main(argv) == 2
    assert "sweep --resume: no campaign 'none'" in capsys.readouterr().err


def test_train_continue_line_replaces_an_earlier_resume(tmp_path):
    from types import SimpleNamespace

    from rlhflab.cli import _continue_line

    ckpt = tmp_path / "grpo-1" / "checkpoints" / "step-00000003"
    exc = SimpleNamespace(checkpoint=ckpt)
    for given in (["--resume", "runs/old"], ["--resume=runs/old"], ["--resume"], []):
        argv = ["train", "c.yaml", *given, "optim.lr=1e-4"]
        args = SimpleNamespace(command="train", argv=argv)
        line = _continue_line(args, exc)
        assert (
            line
            == f"continue with: rlhflab train c.yaml optim.lr=1e-4 --resume={ckpt.parent.parent}"
        )
    args = SimpleNamespace(command="compare", argv=["compare", "a.yaml"])
    assert "does not resume" in _continue_line(args, exc)
