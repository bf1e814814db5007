"""Supervised fine-tuning data: examples from tasks or JSONL files, and their tokenization.

An `SFTExample` is a rendered prompt plus a completion text; `tokenize_sft` turns it into
`input_ids = encode_prompt(prompt) + encode_completion(completion)` with `labels = -100` on the
prompt, so the loss covers the completion and its eos only (see `rlhflab.data.formatting`).

JSONL formats accepted by `load_sft_jsonl`, one JSON object per line (blank lines are skipped):

    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    {"prompt": "2+2?", "completion": "4"}
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
     "completion": "4"}

In the messages form the last message is the completion and must have role "assistant"; the
earlier ones are rendered with the chat template plus the generation prompt. A string prompt is
user text rendered by `render_prompt`. Other keys in a row are ignored.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rlhflab.data.formatting import (
    check_answer_format,
    encode_completion,
    encode_prompt,
    format_completion,
    render_messages,
    render_prompt,
)
from rlhflab.data.tasks import Problem
from rlhflab.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100

#: Reasons a JSONL row can be invalid; keys of the drop counts returned by `load_sft_jsonl`.
DROP_REASONS: tuple[str, ...] = (
    "invalid_json",
    "not_an_object",
    "missing_field",
    "wrong_type",
    "empty_completion",
    "bad_role",
    "last_role_not_assistant",
    "no_user_turn",
)

ROLES = ("system", "user", "assistant")


@dataclass
class SFTExample:
    """A rendered prompt (chat template applied, ends with the assistant header) and its target
    completion text (no eos; `encode_completion` appends it)."""

    prompt: str
    completion: str


def sft_examples_from_problems(
    problems: Iterable[Problem],
    tokenizer: Any,
    *,
    answer_format: str,
    system: str | None = None,
) -> list[SFTExample]:
    """One `SFTExample` per problem: `render_prompt(question)` → `format_completion(answer)`.

    Problems without a reference answer (`answer is None`: verifier-only tasks) are skipped; the
    number skipped is logged as a warning.

    Raises:
        ConfigError: bad `answer_format`.
        DataError: every problem lacks an answer (nothing to train on).
    """
    check_answer_format(answer_format)
    examples: list[SFTExample] = []
    n_skipped = 0
    for problem in problems:
        if problem.answer is None:
            n_skipped += 1
            continue
        examples.append(
            SFTExample(
                prompt=render_prompt(tokenizer, problem.question, system=system),
                completion=format_completion(problem.answer, answer_format=answer_format),
            )
        )
    if n_skipped:
        logger.warning("skipped %d problems without a reference answer", n_skipped)
    if not examples and n_skipped:
        raise DataError(
            f"data: none of the {n_skipped} problems has a reference answer; "
            "this task can only be trained with a verifier (RL), not SFT"
        )
    return examples


class _RowError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _check_messages(value: Any, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise _RowError("wrong_type", f"field '{field}' must be a list of messages")
    if not value:
        raise _RowError("missing_field", f"field '{field}' is an empty list")
    messages = []
    for j, msg in enumerate(value):
        f = f"{field}[{j}]"
        if not isinstance(msg, dict):
            raise _RowError(
                "wrong_type", f"field '{f}' must be an object with 'role' and 'content'"
            )
        for key in ("role", "content"):
            if key not in msg:
                raise _RowError("missing_field", f"field '{f}.{key}' is missing")
            if not isinstance(msg[key], str):
                raise _RowError(
                    "wrong_type",
                    f"field '{f}.{key}' must be a string, got {type(msg[key]).__name__}",
                )
        if msg["role"] not in ROLES:
            raise _RowError(
                "bad_role",
                f"field '{f}.role' is {msg['role']!r}; expected one of {', '.join(ROLES)}",
            )
        messages.append({"role": msg["role"], "content": msg["content"]})
    return messages


def _parse_row(row: Any, tokenizer: Any) -> SFTExample:
    if not isinstance(row, dict):
        raise _RowError(
            "not_an_object", "expected a JSON object with 'messages' or 'prompt' and 'completion'"
        )
    if "messages" in row:
        if "prompt" in row or "completion" in row:
            raise _RowError(
                "wrong_type", "has both 'messages' and 'prompt'/'completion'; use one format"
            )
        messages = _check_messages(row["messages"], "messages")
        last = len(messages) - 1
        if messages[-1]["role"] != "assistant":
            raise _RowError(
                "last_role_not_assistant",
                f"field 'messages[{last}].role' is {messages[-1]['role']!r}; the last message "
                "must be the assistant's (the completion)",
            )
        if len(messages) < 2:
            raise _RowError(
                "missing_field", "field 'messages' has no message before the completion"
            )
        if not any(m["role"] == "user" for m in messages[:-1]):
            raise _RowError(
                "no_user_turn", "field 'messages' has no user message before the completion"
            )
        if not messages[-1]["content"].strip():
            raise _RowError("empty_completion", f"field 'messages[{last}].content' is empty")
        prompt = render_messages(tokenizer, messages[:-1], add_generation_prompt=True)
        return SFTExample(prompt=prompt, completion=messages[-1]["content"])

    for key in ("prompt", "completion"):
        if key not in row:
            raise _RowError(
                "missing_field",
                f"field '{key}' is missing (expected 'messages' or 'prompt' and 'completion')",
            )
    completion = row["completion"]
    if not isinstance(completion, str):
        raise _RowError(
            "wrong_type", f"field 'completion' must be a string, got {type(completion).__name__}"
        )
    if not completion.strip():
        raise _RowError("empty_completion", "field 'completion' is empty")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise _RowError("missing_field", "field 'prompt' is empty")
        return SFTExample(prompt=render_prompt(tokenizer, prompt), completion=completion)
    if isinstance(prompt, list):
        messages = _check_messages(prompt, "prompt")
        if not any(m["role"] == "user" for m in messages):
            raise _RowError("no_user_turn", "field 'prompt' has no user message")
        if messages[-1]["role"] == "assistant":
            raise _RowError(
                "wrong_type",
                f"field 'prompt[{len(messages) - 1}].role' is 'assistant'; a prompt must end "
                "with a user or system message",
            )
        rendered = render_messages(tokenizer, messages, add_generation_prompt=True)
        return SFTExample(prompt=rendered, completion=completion)
    raise _RowError(
        "wrong_type",
        f"field 'prompt' must be a string or a list of messages, got {type(prompt).__name__}",
    )


def load_sft_jsonl(
    path: str | os.PathLike[str],
    tokenizer: Any,
    *,
    on_invalid: str = "error",
) -> tuple[list[SFTExample], dict[str, int]]:
    """Read SFT examples from a JSONL file (formats in the module docstring).

    Args:
        path: the file.
        tokenizer: renders prompts with its chat template.
        on_invalid: "error" raises on the first invalid row; "drop" skips invalid rows and counts
            them by reason.

    Returns:
        `(examples, drop_counts)`; `drop_counts` has every key of `DROP_REASONS` (0 if none).

    Raises:
        ConfigError: `on_invalid` not "error"/"drop" (names `data.on_invalid`).
        DataError: file missing/unreadable; an invalid row with on_invalid="error", as
            "data.path: train.jsonl line 7: field 'completion' is empty" (lines count from 1);
            no valid rows.
    """
    if on_invalid not in ("error", "drop"):
        raise ConfigError(f"data.on_invalid: must be 'error' or 'drop', got {on_invalid!r}")
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise DataError(f"data.path: file not found: {name}")
    drops = dict.fromkeys(DROP_REASONS, 0)
    examples: list[SFTExample] = []
    try:
        with open(name, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise _RowError(
                            "invalid_json", f"invalid JSON ({exc.msg} at column {exc.colno})"
                        ) from exc
                    examples.append(_parse_row(row, tokenizer))
                except _RowError as err:
                    if on_invalid == "error":
                        raise DataError(f"data.path: {name} line {lineno}: {err}") from None
                    drops[err.reason] += 1
    except UnicodeDecodeError as exc:
        raise DataError(f"data.path: {name} is not UTF-8 text ({exc.reason})") from None
    n_dropped = sum(drops.values())
    if n_dropped:
        detail = ", ".join(f"{k}={v}" for k, v in drops.items() if v)
        logger.warning("%s: dropped %d invalid rows (%s)", name, n_dropped, detail)
    if not examples:
        detail = f" ({n_dropped} invalid rows dropped)" if n_dropped else ""
        raise DataError(f"data.path: {name} has no valid examples{detail}")
    return examples, drops


def tokenize_sft_example(
    tokenizer: Any, example: SFTExample, *, max_len: int, row: int = 0
) -> tuple[dict[str, list[int]], bool]:
    """Tokenize one example; returns `(features, truncated)`. See `tokenize_sft`."""
    prompt_ids = encode_prompt(tokenizer, example.prompt)
    if len(prompt_ids) >= max_len:
        raise DataError(
            f"data: prompt of row {row} has {len(prompt_ids)} tokens >= max_len {max_len}, "
            "leaving no room for the completion; raise max_len or shorten the prompt"
        )
    completion_ids = encode_completion(tokenizer, example.completion)
    room = max_len - len(prompt_ids)
    truncated = len(completion_ids) > room
    completion_ids = completion_ids[:room]
    return {
        "input_ids": prompt_ids + completion_ids,
        "labels": [IGNORE_INDEX] * len(prompt_ids) + completion_ids,
    }, truncated


def tokenize_sft(
    tokenizer: Any,
    examples: Iterable[SFTExample],
    *,
    max_len: int,
    on_invalid: str = "error",
    drops: dict[str, int] | None = None,
) -> list[dict[str, list[int]]]:
    """Token ids and labels for SFT, one dict per example, unpadded.

    Each dict: `input_ids` (list[int], length ≤ max_len) = prompt ids + completion ids + eos;
    `labels` (same length) = -100 on every prompt token, else equal to `input_ids`.
    A completion that does not fit is truncated on the right (then it has no eos); the number of
    truncated examples is logged as a warning. Use `tokenize_sft_example` to get the flag per row.
    A prompt of max_len tokens or more leaves no room for the completion: an error, or with
    `on_invalid="drop"` the row is dropped and counted in `drops["prompt_too_long"]`.

    Raises:
        ConfigError: `max_len` < 2.
        DataError: a prompt has ≥ max_len tokens (on_invalid "error"; the message names the row
            index, from 0); no example left after dropping.
    """
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ConfigError(f"data.max_len: must be an integer >= 2, got {max_len!r}")
    out: list[dict[str, list[int]]] = []
    n_truncated = n_too_long = 0
    for i, example in enumerate(examples):
        try:
            features, truncated = tokenize_sft_example(tokenizer, example, max_len=max_len, row=i)
        except DataError:
            if on_invalid != "drop":
                raise
            n_too_long += 1
            continue
        n_truncated += truncated
        out.append(features)
    if drops is not None and n_too_long:
        drops["prompt_too_long"] = drops.get("prompt_too_long", 0) + n_too_long
    if not out:
        raise DataError(
            f"data: no example left: all {n_too_long} prompts have >= max_len {max_len} tokens"
        )
    if n_truncated:
        logger.warning(
            "truncated %d of %d completions to fit max_len %d", n_truncated, len(out), max_len
        )
    return out
