"""Supervised fine-tuning data: examples from tasks or dataset files, and their tokenization.

An `SFTExample` is a rendered prompt plus a completion text; `tokenize_sft` turns it into
`input_ids = encode_prompt(prompt) + encode_completion(completion)` with `labels = -100` on the
prompt, so the loss covers the completion and its eos only (see `rlhflab.data.formatting`).
Multi-turn conversations also train their earlier assistant turns (`SFTExample.trained_spans`),
and language-modelling rows train every token.

Row formats (TRL's dataset types; standard vs conversational is told apart per row by the value
type: a string, or a list of `{"role", "content"}` messages). Other keys in a row are ignored,
and so is a `prompt` beside `text` or `messages` when there is no `completion` (ultrachat_200k's
rows carry one).

    {"text": "The sky is blue."}                                   language modelling
    {"messages": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]}          conversational language modelling
    {"prompt": "2+2?", "completion": "4"}                           prompt-completion
    {"prompt": [{"role": "user", "content": "2+2?"}],
     "completion": [{"role": "assistant", "content": "4"}]}      conversational prompt-completion

* `text`: no chat template; the loss covers every token that has a predecessor (the tokenizer's
  bos, if it has one, is prepended and not trained; without bos the first token is context only)
  plus an appended eos.
* `messages`: rendered with the tokenizer's chat template. The last message must be the
  assistant's. With `assistant_turns="all"` (the default, TRL's `assistant_only_loss`) every
  assistant message is trained: its content followed by the eos token, which is how the chat
  template must close an assistant turn (checked per row). With `assistant_turns="last"` only the
  last one is trained; earlier turns are prompt.
* `prompt`/`completion`: the loss covers the completion (and its eos). A string prompt is user
  text rendered by `render_prompt` (a departure from TRL, which leaves a standard prompt
  unrendered: rlhflab's SFT, RL and eval share one chat-formatted prompt boundary); a message
  list is rendered with the generation prompt. A conversational completion is one assistant
  message.

Files: `load_sft_data` reads a local .jsonl (row by row with the json module, errors name the line,
from 1), .json, .parquet or .csv file, a local dataset directory or a Hub id (through
`datasets.load_dataset`, errors name the row, from 0).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from rlhflab.data.formatting import (
    check_answer_format,
    encode_completion,
    encode_prompt,
    format_completion,
    render_messages,
    render_prompt,
)
from rlhflab.data.rows import RowError, check_messages, finish_rows, load_rows
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
    "template_mismatch",
)

AssistantTurns = Literal["all", "last"]
ASSISTANT_TURNS: tuple[str, ...] = ("all", "last")


@dataclass
class SFTExample:
    """A rendered prompt (chat template applied, ends with the assistant header) and its target
    completion text (no eos; `encode_completion` appends it).

    Attributes:
        prompt: the rendered text before the completion; "" marks a language-modelling row
            (`completion` is the whole text, trained on every token).
        completion: the trained text (no eos).
        trained_spans: `(start, end)` character spans in `prompt` of earlier assistant turns'
            contents that are trained too (multi-turn `messages`, `assistant_turns="all"`); each
            is followed in `prompt` by the eos token's text, which is trained with it.
    """

    prompt: str
    completion: str
    trained_spans: tuple[tuple[int, int], ...] = ()


def sft_examples_from_problems(
    problems: Iterable[Problem],
    tokenizer: Any,
    *,
    answer_format: str,
    system: str | None = None,
    instruction: str | None = None,
) -> list[SFTExample]:
    """One `SFTExample` per problem: `render_prompt(question)` → `format_completion(answer)`,
    the prompt with `system` and the answer-format `instruction` (as in RL and evaluation).

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
                prompt=render_prompt(
                    tokenizer, problem.question, system=system, instruction=instruction
                ),
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


def _messages_example(
    tokenizer: Any, messages: list[dict[str, str]], assistant_turns: str
) -> SFTExample:
    """A `messages` conversation (already checked) as an example; with "all", earlier assistant
    turns become `trained_spans` after checking the template renders each as content + eos."""
    prompt = render_messages(tokenizer, messages[:-1], add_generation_prompt=True)
    example = SFTExample(prompt=prompt, completion=messages[-1]["content"])
    if assistant_turns == "last":
        return example
    eos = tokenizer.eos_token
    spans = []
    for i, msg in enumerate(messages[:-1]):
        if msg["role"] != "assistant":
            continue
        head = render_messages(tokenizer, messages[:i], add_generation_prompt=True)
        if eos is None or not prompt.startswith(head + msg["content"] + eos):
            raise RowError(
                "template_mismatch",
                f"field 'messages[{i}]': the chat template does not render this assistant turn "
                f"as the generation prompt + its content + the eos token {eos!r}; "
                "set data.assistant_turns=last to train the last turn only",
            )
        spans.append((len(head), len(head) + len(msg["content"])))
    example.trained_spans = tuple(spans)
    return example


def _completion_text(value: Any) -> str:
    """A prompt-completion row's completion: a string or one assistant message."""
    if isinstance(value, str):
        text, field = value, "completion"
    elif isinstance(value, list):
        messages = check_messages(value, "completion")
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise RowError(
                "bad_role",
                f"field 'completion' must be one assistant message, got roles "
                f"{[m['role'] for m in messages]}",
            )
        text, field = messages[0]["content"], "completion[0].content"
    else:
        raise RowError(
            "wrong_type",
            "field 'completion' must be a string or a list of messages, "
            f"got {type(value).__name__}",
        )
    if not text.strip():
        raise RowError("empty_completion", f"field '{field}' is empty")
    return text


def _parse_row(row: Any, tokenizer: Any, assistant_turns: str = "all") -> SFTExample:
    if not isinstance(row, dict):
        raise RowError(
            "not_an_object",
            "expected a JSON object with 'text', 'messages' or 'prompt' and 'completion'",
        )
    # Arrow sources (parquet, Hub) give every column to every row: a null is an absent field.
    row = {k: v for k, v in row.items() if v is not None}
    # A `prompt` column beside `text` or `messages` but without `completion` is informative only
    # (HuggingFaceH4/ultrachat_200k carries one), as in TRL.
    if "text" in row:
        others = [k for k in ("messages", "completion") if k in row]
        if others:
            raise RowError("wrong_type", f"has both 'text' and '{others[0]}'; use one format")
        text = row["text"]
        if not isinstance(text, str):
            raise RowError(
                "wrong_type", f"field 'text' must be a string, got {type(text).__name__}"
            )
        if not text.strip():
            raise RowError("empty_completion", "field 'text' is empty")
        return SFTExample(prompt="", completion=text)
    if "messages" in row:
        if "completion" in row:
            raise RowError("wrong_type", "has both 'messages' and 'completion'; use one format")
        messages = check_messages(row["messages"], "messages")
        last = len(messages) - 1
        if messages[-1]["role"] != "assistant":
            raise RowError(
                "last_role_not_assistant",
                f"field 'messages[{last}].role' is {messages[-1]['role']!r}; the last message "
                "must be the assistant's (the completion)",
            )
        if len(messages) < 2:
            raise RowError("missing_field", "field 'messages' has no message before the completion")
        if not any(m["role"] == "user" for m in messages[:-1]):
            raise RowError(
                "no_user_turn", "field 'messages' has no user message before the completion"
            )
        if not messages[-1]["content"].strip():
            raise RowError("empty_completion", f"field 'messages[{last}].content' is empty")
        return _messages_example(tokenizer, messages, assistant_turns)

    for key in ("prompt", "completion"):
        if key not in row:
            raise RowError(
                "missing_field",
                f"field '{key}' is missing "
                "(expected 'text', 'messages' or 'prompt' and 'completion')",
            )
    completion = _completion_text(row["completion"])
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RowError("missing_field", "field 'prompt' is empty")
        return SFTExample(prompt=render_prompt(tokenizer, prompt), completion=completion)
    if isinstance(prompt, list):
        messages = check_messages(prompt, "prompt")
        if not any(m["role"] == "user" for m in messages):
            raise RowError("no_user_turn", "field 'prompt' has no user message")
        if messages[-1]["role"] == "assistant":
            raise RowError(
                "wrong_type",
                f"field 'prompt[{len(messages) - 1}].role' is 'assistant'; a prompt must end "
                "with a user or system message",
            )
        rendered = render_messages(tokenizer, messages, add_generation_prompt=True)
        return SFTExample(prompt=rendered, completion=completion)
    raise RowError(
        "wrong_type",
        f"field 'prompt' must be a string or a list of messages, got {type(prompt).__name__}",
    )


def _check_options(on_invalid: str, assistant_turns: str) -> None:
    if on_invalid not in ("error", "drop"):
        raise ConfigError(f"data.on_invalid: must be 'error' or 'drop', got {on_invalid!r}")
    if assistant_turns not in ASSISTANT_TURNS:
        raise ConfigError(f"data.assistant_turns: must be 'all' or 'last', got {assistant_turns!r}")


def load_sft_jsonl(
    path: str | os.PathLike[str],
    tokenizer: Any,
    *,
    on_invalid: str = "error",
    assistant_turns: AssistantTurns = "all",
) -> tuple[list[SFTExample], dict[str, int]]:
    """Read SFT examples from a JSONL file (formats in the module docstring).

    Args:
        path: the file.
        tokenizer: renders prompts with its chat template.
        on_invalid: "error" raises on the first invalid row; "drop" skips invalid rows and counts
            them by reason.
        assistant_turns: "all" trains every assistant turn of a `messages` row, "last" only the
            last one.

    Returns:
        `(examples, drop_counts)`; `drop_counts` has every key of `DROP_REASONS` (0 if none).

    Raises:
        ConfigError: `on_invalid` not "error"/"drop" (names `data.on_invalid`); bad
            `assistant_turns`.
        DataError: file missing/unreadable; an invalid row with on_invalid="error", as
            "data.path: train.jsonl line 7: field 'completion' is empty" (lines count from 1);
            no valid rows.
    """
    _check_options(on_invalid, assistant_turns)
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
                        raise RowError(
                            "invalid_json", f"invalid JSON ({exc.msg} at column {exc.colno})"
                        ) from exc
                    examples.append(_parse_row(row, tokenizer, assistant_turns))
                except RowError as err:
                    if on_invalid == "error":
                        raise DataError(f"data.path: {name} line {lineno}: {err}") from None
                    drops[err.reason] += 1
    except UnicodeDecodeError as exc:
        raise DataError(f"data.path: {name} is not UTF-8 text ({exc.reason})") from None
    return finish_rows(
        examples, drops, name, empty=f"data.path: {name} has no valid examples"
    ), drops


def load_sft_data(
    path: str | os.PathLike[str],
    tokenizer: Any,
    *,
    split: str = "train",
    on_invalid: str = "error",
    assistant_turns: AssistantTurns = "all",
) -> tuple[list[SFTExample], dict[str, int]]:
    """Read SFT examples from a local file, a local dataset directory or a Hub dataset.

    A `.jsonl` file goes through `load_sft_jsonl` (errors name the line, from 1). A `.json`
    array, a `.parquet` or `.csv` file (`datasets.load_dataset("parquet", data_files=path)`), a
    dataset directory or a Hub id (`datasets.load_dataset(path, split=split)`) are read as rows;
    errors name the row, from 0: "data.path: sft.parquet row 3: field 'text' is empty".
    Row formats and `assistant_turns`: module docstring.

    Args:
        path: file, directory or Hub id.
        tokenizer: renders chat rows with its chat template.
        split: the split of a directory / Hub dataset (a single file is one split).
        on_invalid: "error" or "drop" (counts per reason in the second return value).
        assistant_turns: "all" or "last" (which assistant turns of `messages` rows are trained).

    Returns:
        `(examples, drop_counts)`; `drop_counts` has every key of `DROP_REASONS`.

    Raises:
        ConfigError: bad `on_invalid` / `assistant_turns`.
        DataError: missing file, unreadable dataset, an invalid row (on_invalid "error"), or no
            valid row.
    """
    _check_options(on_invalid, assistant_turns)
    name = os.fspath(path)
    if name.lower().endswith(".jsonl"):
        return load_sft_jsonl(
            name, tokenizer, on_invalid=on_invalid, assistant_turns=assistant_turns
        )
    rows = load_rows(name, split, "data.path")
    drops = dict.fromkeys(DROP_REASONS, 0)
    examples: list[SFTExample] = []
    for i, row in enumerate(rows):
        try:
            examples.append(_parse_row(row, tokenizer, assistant_turns))
        except RowError as err:
            if on_invalid == "error":
                raise DataError(f"data.path: {name} row {i}: {err}") from None
            drops[err.reason] += 1
    return finish_rows(
        examples, drops, name, empty=f"data.path: {name} has no valid examples"
    ), drops


def sft_segments(tokenizer: Any, example: SFTExample) -> list[tuple[list[int], bool]]:
    """The example's token ids as `(ids, trained)` segments, in order.

    Context text is encoded with `encode_prompt`, each trained text with `encode_completion`
    (its ids + eos), separately, so every trained turn has the same boundary as a single-turn
    completion. A language-modelling example (`prompt == ""`) is `[bos]` (untrained) + the text's
    ids + eos, or without a bos token its first token (untrained) + the rest.

    Raises:
        ModelError: the tokenizer has no eos token.
    """
    if example.prompt == "":
        ids = encode_completion(tokenizer, example.completion)
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None:
            return [([bos], False), (ids, True)]
        return [(ids[:1], False), (ids[1:], True)]
    segments: list[tuple[list[int], bool]] = []
    pos = 0
    n_eos = len(tokenizer.eos_token or "")
    for start, end in example.trained_spans:
        segments.append((encode_prompt(tokenizer, example.prompt[pos:start]), False))
        segments.append((encode_completion(tokenizer, example.prompt[start:end]), True))
        pos = end + n_eos
    segments.append((encode_prompt(tokenizer, example.prompt[pos:]), False))
    segments.append((encode_completion(tokenizer, example.completion), True))
    return segments


def tokenize_sft_example(
    tokenizer: Any, example: SFTExample, *, max_len: int, row: int = 0
) -> tuple[dict[str, list[int]], bool]:
    """Tokenize one example; returns `(features, truncated)`. See `tokenize_sft`."""
    segments = sft_segments(tokenizer, example)
    prompt_ids = segments[0][0]  # the context before the first trained token
    if len(prompt_ids) >= max_len:
        raise DataError(
            f"data: prompt of row {row} has {len(prompt_ids)} tokens >= max_len {max_len}, "
            "leaving no room for the completion; raise max_len or shorten the prompt"
        )
    input_ids: list[int] = []
    labels: list[int] = []
    for ids, trained in segments:
        input_ids += ids
        labels += ids if trained else [IGNORE_INDEX] * len(ids)
    truncated = len(input_ids) > max_len
    input_ids, labels = input_ids[:max_len], labels[:max_len]
    while labels[-1] == IGNORE_INDEX:  # a cut inside a later context: drop its untrained tail
        input_ids.pop()
        labels.pop()
    return {"input_ids": input_ids, "labels": labels}, truncated


def split_features(features: dict[str, list[int]]) -> tuple[list[int], list[int], list[int]]:
    """`(prompt_ids, completion_ids, loss_mask)` of tokenized features: the prompt is everything
    before the first trained token; `loss_mask[t]` is 1 where `completion_ids[t]` is trained (0 on
    the untrained context of later turns)."""
    labels = features["labels"]
    n = next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    ids = features["input_ids"]
    return ids[:n], ids[n:], [int(label != IGNORE_INDEX) for label in labels[n:]]


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
    `labels` (same length) = -100 on every prompt token, else equal to `input_ids`. A multi-turn
    example alternates context (-100) and trained segments (`sft_segments`); a language-modelling
    example is trained on all but its first token.
    A sequence that does not fit is truncated on the right (then it has no final eos; an
    untrained tail left by the cut is dropped); the number of truncated examples is logged as a
    warning. Use `tokenize_sft_example` to get the flag per row.
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
