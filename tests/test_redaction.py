"""Secret redaction: by environment value (any length) and by the key a value sits under."""

import json
import sys
import types

import pytest
from test_checkpoint_resume import sft_raw

from rlhflab.config import config_from_dict
from rlhflab.runs import REDACTED, is_secret_name, redact, redact_obj

SHORT = "q7Zp4x"  # a 6-character secret: shorter than the 8 characters redaction once required


@pytest.mark.parametrize(
    "name",
    [
        "HF_TOKEN",
        "WANDB_API_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "GITHUB_TOKEN",
        "token",
        "hf-token",
        "api_key",
        "apiKey",
        "accessToken",
        "db_password",
        "client_secret",
        "credentials",
    ],
)
def test_secret_names(name):
    assert is_secret_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "max_new_tokens",
        "tokenizer",
        "tokenizer_texts",
        "stop_token_ids",
        "eval_key",
        "key",
        "sort_key",
        "pad_token",
        "eos_token",
        "TOKENIZERS_PARALLELISM",
        "SSH_AUTH_SOCK",
        "PWD",  # the working directory: redacting it would hide every path in a traceback
        "OLDPWD",
        "perf/tokens_per_s",
    ],
)
def test_harmless_names(name):
    assert not is_secret_name(name)


def test_short_env_secret_is_redacted_in_values_and_text(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SHORT)
    obj = {"data": {"path": f"/data/{SHORT}.jsonl"}, "steps": 4}
    assert redact_obj(obj) == {"data": {"path": f"/data/{REDACTED}.jsonl"}, "steps": 4}
    assert redact(f"cannot read /data/{SHORT}") == f"cannot read /data/{REDACTED}"


def test_value_under_a_secret_key_is_redacted_whatever_its_length(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)  # not in the environment: the key decides
    obj = {
        "task": {"config": {"token": "ab12", "name": "gsm8k"}},
        "reward": {"args": {"api_key": 123456, "password": ["x", "y"], "use_auth_token": True}},
    }
    assert redact_obj(obj) == {
        "task": {"config": {"token": REDACTED, "name": "gsm8k"}},
        "reward": {
            "args": {"api_key": REDACTED, "password": [REDACTED, REDACTED], "use_auth_token": True}
        },
    }


def test_harmless_keys_and_flag_env_values_are_left_alone(monkeypatch):
    # Flag-valued variables with secret-like names must not redact every '1' or 'false'.
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    obj = {
        "max_new_tokens": 64,
        "tokenizer": "gpt2",
        "eval_key": "answer",
        "stop_token_ids": [1, 2],
        "pad_token": "<pad>",
        "prompt": "is 1 + 1 = 2? false",
    }
    assert redact_obj(obj) == obj


def test_tracked_config_with_a_short_secret_is_redacted(tmp_path, monkeypatch):
    from rlhflab.tracking import Tracker

    seen = {}
    fake = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or fake, finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("HF_TOKEN", SHORT)
    raw = sft_raw(tmp_path) | {"tracking": {"console": False, "wandb": True}}
    cfg = config_from_dict(raw)
    cfg.task.system = f"use {SHORT}"
    cfg.task.config = {"token": "zz99zz"}  # not in the environment: redacted by its key
    Tracker.for_run(tmp_path, cfg, headline=()).close()
    assert seen["config"]["task"]["system"] == f"use {REDACTED}"
    assert seen["config"]["task"]["config"] == {"token": REDACTED}
    assert seen["config"]["eval"]["max_new_tokens"] == cfg.eval.max_new_tokens
    dumped = json.dumps(seen)
    assert SHORT not in dumped and "zz99zz" not in dumped


# -- Every line the CLI prints --------------------------------------------------------------------

CLI_SECRET = "K svc-8a7f3e21c"  # a service token with a space: shell-quoted in the `next:` line


def _grep_tree(root, needle: bytes) -> list:
    """Every file under `root` whose bytes contain `needle`."""
    from pathlib import Path

    return [p for p in Path(root).rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.slow
def test_train_prints_no_secret_on_stdout_or_stderr(tmp_path):
    """`rlhflab train` of a GRPO run whose task.system holds a secret of the environment: the
    `next:` hint (which repeats --system), the summary and the progress lines are redacted like
    the run directory's files. Before the fix the hint printed `--system 'K svc-...'` whole."""
    import os
    import subprocess

    import yaml
    from test_checkpoint_resume import grpo_raw

    from rlhflab.trainers import run_config

    sft = run_config(config_from_dict(sft_raw(tmp_path / "runs", steps=2)))
    raw = grpo_raw(tmp_path / "runs", sft["model_dir"])
    raw["train"]["steps"] = 2
    raw["tracking"]["console"] = True  # plain progress lines on stderr (not a terminal)
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(raw))
    env = {**os.environ, "SERVICE_TOKEN": CLI_SECRET, "HF_HUB_OFFLINE": "1"}
    env.pop("RLHFLAB_FAULT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "rlhflab.cli", "train", str(tmp_path / "grpo.yaml"),
         f"task.system={CLI_SECRET}"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "next: rlhflab eval" in proc.stderr and f"--system '{REDACTED}'" in proc.stderr
    assert "policy_gradient finished" in proc.stdout
    assert CLI_SECRET not in proc.stdout + proc.stderr
    assert "svc-8a7f3e21c" not in proc.stdout + proc.stderr
    grpo_dir = next((tmp_path / "runs").glob("grpo-*"))
    assert (grpo_dir / "config.yaml").is_file()
    assert _grep_tree(grpo_dir, b"svc-8a7f3e21c") == []


def test_next_hint_redacts_a_secret_named_task_kwarg(tmp_path, monkeypatch):
    """A value under a secret-named key of task.config is '***' in config.yaml (`redact_obj`),
    and so in the printed `next:` command, whether or not it is in the environment."""
    from test_checkpoint_resume import grpo_raw

    from rlhflab.next_steps import next_command

    monkeypatch.delenv("HF_TOKEN", raising=False)
    raw = grpo_raw(tmp_path, tmp_path / "model")
    raw["task"] = {**raw["task"], "config": {**raw["task"]["config"], "api_token": "zz99zz"}}
    cfg = config_from_dict(raw)
    hint = next_command(cfg, {"model_dir": str(tmp_path / "grpo-1/model")})
    assert "--task-config" in hint and '"api_token": "***"' in hint and "zz99zz" not in hint


def test_every_cli_stream_is_redacted_line_by_line(monkeypatch, capsys):
    """`main` wraps stdout and stderr: a secret printed by any code, in pieces or at once, on
    either stream, comes out as '***' (argparse's own error line included)."""
    from rlhflab.cli import main

    monkeypatch.setenv("HF_TOKEN", SHORT)

    def noisy(args):
        sys.stdout.write(SHORT[:3])  # a secret written in two pieces
        sys.stdout.write(SHORT[3:] + " done\n")
        print(f"warning: {SHORT}", file=sys.stderr)
        sys.stderr.write(f"progress {SHORT}")  # no newline: held until flush / exit
        return 0

    import rlhflab.cli as cli

    monkeypatch.setattr(cli, "_cmd_prm_vs_orm", noisy)  # build_parser reads it at call time
    assert main(["prm-vs-orm"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{REDACTED} done\n"
    assert err == f"warning: {REDACTED}\nprogress {REDACTED}"
    with pytest.raises(SystemExit):
        main(["eval", "--bogus", SHORT])
    assert SHORT not in capsys.readouterr().err
