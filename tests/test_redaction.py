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
