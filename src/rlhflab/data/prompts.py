"""Prompt sources for on-policy training and evaluation: reasoning_gym tasks or any prompt dataset.

A prompt source yields `PromptRow`s — `{prompt, **columns}` in TRL's prompt-only formats — with a
training and a held-out split. The policy-gradient trainer, online DPO, best-of-N and `rlhflab eval`
take their prompts from here; reward functions receive the rows' other columns.

* `data.source: task` — a reasoning_gym task (`rlhflab.data.tasks.make_splits`, unchanged): the
  row's prompt is the question, its columns `answer` and `task`, and `row.problem` keeps the
  reasoning_gym item for the task's verifier.
* `data.source: dataset` — a Hub id through `datasets.load_dataset(path, name, split=split)` or a
  local `.json` / `.jsonl` / `.parquet` file. Prompt formats (TRL "prompt-only"):
    standard        `prompt`: str                       (rendered as one user turn)
    conversational  `prompt`: [{"role", "content"}, …]  (system turns kept; must not end with an
                                                         assistant turn)
  `prompt_column` maps datasets that name it otherwise (GSM8K `question`, MATH `problem`,
  UltraFeedback `prompt`); `prompt_format: hh_transcript` takes an HH-RLHF transcript column
  (`chosen`) and keeps every turn before the last assistant turn as the prompt. Every other column
  travels with the row (`answer`, `solution`, …).

Held-out rows: a named split (`heldout_split: test`, a Hub split or, for local files,
`heldout_path`) or a seeded fraction of the training rows (`heldout_frac`). Held-out rows whose
prompt is also a training prompt (exact match after stripping) are dropped and counted, as are
repeats inside the held-out set. Everything is validated when loaded, before a run directory exists:
a bad row is one `DataError` naming the file, row and field (or is dropped with on_invalid "drop");
a split that is empty after filtering is an error.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

from rlhflab.data.formatting import render_messages, render_prompt, with_instruction
from rlhflab.data.rows import RowError, check_messages, read_json_rows
from rlhflab.data.tasks import dedup_key
from rlhflab.errors import ConfigError, DataError

Messages = list[dict[str, str]]
PROMPT_FORMATS = ("auto", "hh_transcript")
DROP_REASONS = ("missing_field", "wrong_type", "bad_role", "empty_prompt", "bad_transcript")
_LOCAL = (".json", ".jsonl", ".parquet")


@dataclass(frozen=True)
class PromptRow:
    """One prompt and the columns that travel with it.

    Attributes:
        prompt: str (standard) or a list of `{"role", "content"}` messages (conversational).
        columns: every other column of the source row (e.g. `answer`, `solution`), passed by name
            to reward functions.
        index: row number in its source file / split (for messages).
        problem: for `data.source: task`, the reasoning_gym `Problem` (its verifier scores it).
        rendered: True when `prompt` is the final prompt text (`data.template` applied), used
            as is without the chat template (base models, R1-Zero's prompt).
    """

    prompt: str | Messages
    columns: dict = field(default_factory=dict, hash=False)
    index: int = 0
    problem: Any = field(default=None, compare=False, hash=False, repr=False)
    rendered: bool = False

    @property
    def question(self) -> str:
        """The prompt as plain text (the last user turn for messages), for logs and samples."""
        if isinstance(self.prompt, str):
            return self.prompt
        users = [m["content"] for m in self.prompt if m["role"] == "user"]
        return users[-1] if users else self.prompt[-1]["content"]

    @property
    def answer(self) -> Any:
        """`columns["answer"]` (None when absent), for samples and tokenizer texts."""
        return self.columns.get("answer")

    def score(self, answer_text: str | None) -> float:
        """The task verifier's score (task rows only); see `rlhflab.data.tasks.Problem.score`.

        Raises: DataError for dataset rows (they have no task verifier; use a reward function)."""
        if self.problem is None:
            raise DataError(
                "the 'correctness' reward needs data.source 'task'; for a dataset use "
                "math_verify, exact_match or a reward function"
            )
        return self.problem.score(answer_text)


@dataclass
class PromptSplits:
    """Training and held-out prompt rows of one source, with what filtering removed.

    Attributes:
        train, heldout: the rows.
        n_heldout_overlap_dropped: held-out rows dropped because their prompt is a training prompt.
        n_heldout_internal_dupes_dropped: held-out rows dropped as repeats of an earlier one.
        n_invalid_dropped: rows dropped as invalid (on_invalid "drop"), by reason.
        source: a short description ("task chain_sum", "dataset gsm8k.jsonl").
    """

    train: list[PromptRow]
    heldout: list[PromptRow]
    n_heldout_overlap_dropped: int = 0
    n_heldout_internal_dupes_dropped: int = 0
    n_invalid_dropped: dict = field(default_factory=dict)
    source: str = ""


def prompt_key(prompt: str | Messages) -> str:
    """The text two prompts are compared by when deduplicating: each content normalised by
    `rlhflab.data.tasks.dedup_key` (Unicode NFKC, case-folded, whitespace collapsed), roles kept."""
    if isinstance(prompt, str):
        return dedup_key(prompt)
    return json.dumps([[m["role"], dedup_key(m["content"])] for m in prompt])


def render_row(
    tokenizer: Any, row: Any, *, system: str | None = None, instruction: str | None = None
) -> str:
    """The chat-formatted prompt text of a `PromptRow` or a task `Problem`, ending where the
    model's answer starts.

    A string prompt (or a Problem's question) is one user turn after `system`, if given, with
    `instruction` (the task's answer-format instruction, `formatting.answer_instruction`) after
    the question and one blank line. Messages are rendered as they are, `instruction` appended
    to the last user turn; `system` is prepended only when they have no system turn.
    A row with `rendered` set (a `data.template` prompt) is returned as is: the template owns the
    whole prompt, instruction included.
    Raises ModelError when the tokenizer has no chat template.
    """
    prompt = getattr(row, "prompt", None)
    if getattr(row, "rendered", False):
        return prompt
    if prompt is None or isinstance(prompt, str):
        text = row.question if prompt is None else prompt
        return render_prompt(tokenizer, text, system=system, instruction=instruction)
    messages = list(prompt)
    if instruction:
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        content = with_instruction(messages[last]["content"], instruction)
        messages[last] = {**messages[last], "content": content}
    if system is not None and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    return render_messages(tokenizer, messages, add_generation_prompt=True)


def rows_from_problems(problems: list) -> list[PromptRow]:
    """Task `Problem`s as rows: prompt = question, columns `answer` and `task`."""
    return [
        PromptRow(p.question, {"answer": p.answer, "task": p.task}, i, problem=p)
        for i, p in enumerate(problems)
    ]


def task_prompt_splits(task) -> PromptSplits:
    """`data.source: task`: the reasoning_gym splits of `task` (a TaskConfig) as rows."""
    from rlhflab.data.tasks import make_splits

    s = make_splits(
        task.name,
        config=task.config,
        n_train=task.n_train,
        n_heldout=task.n_heldout,
        seed=task.seed,
    )
    return PromptSplits(
        train=rows_from_problems(s.train),
        heldout=rows_from_problems(s.heldout),
        n_heldout_overlap_dropped=s.n_heldout_overlap_dropped,
        n_heldout_internal_dupes_dropped=s.n_heldout_internal_dupes_dropped,
        source=f"task {task.name}",
    )


def load_prompt_source(data, task=None, *, seed: int = 0) -> PromptSplits:
    """The prompt splits a `data` section (PromptDataConfig) asks for.

    Args:
        data: `source` "task" (then `task`, a TaskConfig, is used) or "dataset" (see
            `load_prompt_dataset`).
        task: the run's `task` section.
        seed: seeds the held-out fraction's shuffle (data.seed overrides when set).
    Raises:
        ConfigError, DataError: one line naming the key, file, row or field.
    """
    if data.source == "task":
        if task is None:
            raise ConfigError("data.source 'task' needs a task section")
        splits = task_prompt_splits(task)
    else:
        splits = load_prompt_dataset(data, seed=seed if data.seed is None else data.seed)
    if data.template is not None:
        splits.train = apply_template(splits.train, data.template)
        splits.heldout = apply_template(splits.heldout, data.template)
    return splits


def apply_template(rows: list[PromptRow], template: str) -> list[PromptRow]:
    """Rows whose prompt is `template` with `{prompt}` replaced by the row's prompt text, marked
    `rendered` (used without the chat template: R1-Zero / TinyZero prompts for base models).

    Raises: DataError for a conversational row (a template takes text prompts only).
    """
    out = []
    for r in rows:
        if not isinstance(r.prompt, str):
            raise DataError(
                f"data.template: row {r.index} has a conversational prompt; a template takes text "
                "prompts (remove data.template to use the chat template)"
            )
        text = template.replace("{prompt}", r.prompt)
        out.append(PromptRow(text, r.columns, r.index, problem=r.problem, rendered=True))
    return out


# ---------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------


def _messages(value: Any, fld: str) -> Messages:
    if not value:
        raise RowError("empty_prompt", f"field '{fld}' is empty")
    out = check_messages(value, fld)
    if out[-1]["role"] == "assistant":
        raise RowError(
            "bad_role",
            f"field '{fld}[{len(out) - 1}].role' is 'assistant'; a prompt must end "
            "with a user or system turn",
        )
    if not any(m["role"] == "user" and m["content"].strip() for m in out):
        raise RowError("empty_prompt", f"field '{fld}' has no non-empty user turn")
    return out


def parse_prompt_row(row: Any, *, prompt_column: str = "prompt", prompt_format: str = "auto"):
    """One source row → (prompt, other columns). Raises RowError naming the field.

    prompt_format "auto": the column holds a str (standard) or a message list (conversational);
    "hh_transcript": the column holds an HH-RLHF transcript ("\\n\\nHuman: …\\n\\nAssistant: …");
    the prompt is every turn before the last assistant turn, as messages.
    """
    from rlhflab.data.preference import parse_hh_transcript

    if not isinstance(row, dict):
        raise RowError("wrong_type", "expected an object (a mapping of fields)")
    if row.get(prompt_column) is None:
        have = ", ".join(sorted(map(str, row))) or "none"
        raise RowError(
            "missing_field",
            f"field '{prompt_column}' is missing (columns: {have}; set data.prompt_column)",
        )
    value = row[prompt_column]
    columns = {k: v for k, v in row.items() if k != prompt_column}
    if prompt_format == "hh_transcript":
        try:
            turns = parse_hh_transcript(value, prompt_column)
        except RowError as err:
            raise RowError("bad_transcript", str(err)) from None
        last = max((i for i, m in enumerate(turns) if m["role"] == "assistant"), default=None)
        return _messages(turns[:last] if last is not None else turns, prompt_column), columns
    if isinstance(value, str):
        if not value.strip():
            raise RowError("empty_prompt", f"field '{prompt_column}' is empty")
        return value, columns
    if isinstance(value, list):
        return _messages(value, prompt_column), columns
    raise RowError(
        "wrong_type",
        f"field '{prompt_column}' must be a string or a list of messages, "
        f"got {type(value).__name__}",
    )


def read_rows(path: str, *, name: str | None, split: str, key: str) -> list[dict]:
    """Rows of a local .json/.jsonl/.parquet file or a Hub dataset (`datasets.load_dataset(path,
    name, split=split)`). Local JSON is read with plain json so a malformed row can be named.
    Raises DataError naming `key` and the path."""
    ext = os.path.splitext(path)[1].lower()
    if ext in _LOCAL:
        if not os.path.isfile(path):
            raise DataError(f"{key}: file not found: {path}")
        if ext != ".parquet":
            return read_json_rows(path, key)
    elif os.path.isfile(path):
        raise DataError(f"{key}: {path}: expected a .json, .jsonl or .parquet file")
    import datasets

    try:
        if ext == ".parquet":
            ds = datasets.load_dataset("parquet", data_files=path, split="train")
        else:
            ds = datasets.load_dataset(path, name, split=split)
    except Exception as exc:
        msg = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise DataError(f"{key}: cannot load {path!r} (split {split!r}): {msg}") from None
    return list(ds)


def _parse_all(rows, data, where: str, drops: dict) -> list[PromptRow]:
    out = []
    for i, row in enumerate(rows):
        try:
            prompt, columns = parse_prompt_row(
                row, prompt_column=data.prompt_column, prompt_format=data.prompt_format
            )
        except RowError as err:
            if data.on_invalid == "error":
                raise DataError(f"{where} row {i}: {err}") from None
            drops[err.reason] = drops.get(err.reason, 0) + 1
            continue
        out.append(PromptRow(prompt, columns, i))
    return out


def load_prompt_dataset(data, *, seed: int = 0) -> PromptSplits:
    """Train and held-out `PromptRow`s of a prompt dataset (see the module doc).

    Args:
        data: a `PromptDataConfig` with source "dataset": path, name, split, prompt_column,
            prompt_format, heldout_split / heldout_path / heldout_frac, n_heldout, max_rows,
            on_invalid.
        seed: shuffles the rows before a held-out fraction is taken.
    Returns:
        PromptSplits; held-out rows never share a prompt with a training row.
    Raises:
        DataError: unreadable source; invalid row ("data.path: gsm8k.jsonl row 3: field
            'question' is missing (columns: …)"); no training or held-out rows left after filtering.
    """
    drops: dict[str, int] = {}
    train_rows = read_rows(data.path, name=data.name, split=data.split, key="data.path")
    train = _parse_all(train_rows, data, f"data.path: {data.path}", drops)
    if data.heldout_path or data.heldout_split:
        hpath = data.heldout_path or data.path
        key = "data.heldout_path" if data.heldout_path else "data.heldout_split"
        hrows = read_rows(hpath, name=data.name, split=data.heldout_split or "train", key=key)
        heldout = _parse_all(hrows, data, f"{key}: {hpath}", drops)
    else:
        order = list(range(len(train)))
        random.Random(seed).shuffle(order)
        n_held = round(data.heldout_frac * len(train))
        held_idx = set(order[:n_held])
        heldout = [train[i] for i in order[:n_held]]
        train = [r for i, r in enumerate(train) if i not in held_idx]
    if data.max_rows is not None:
        train = train[: data.max_rows]
    if not train:
        raise DataError(
            f"data.path: {data.path} has no training prompts left after filtering "
            f"(invalid rows dropped: {drops or 0})"
        )
    seen = {prompt_key(r.prompt) for r in train}
    kept, held_keys, n_overlap, n_dupes = [], set(), 0, 0
    for r in heldout:
        k = prompt_key(r.prompt)
        if k in seen:
            n_overlap += 1
        elif k in held_keys:
            n_dupes += 1
        else:
            held_keys.add(k)
            kept.append(r)
    if data.n_heldout is not None:
        kept = kept[: data.n_heldout]
    if not kept and heldout:  # there were held-out rows, and filtering removed them all
        raise DataError(
            f"data: no held-out prompts left after filtering ({n_overlap} were training prompts, "
            f"{n_dupes} repeats); set data.heldout_split / heldout_path, raise data.heldout_frac, "
            "or set eval.n=0"
        )
    return PromptSplits(
        train=train,
        heldout=kept,
        n_heldout_overlap_dropped=n_overlap,
        n_heldout_internal_dupes_dropped=n_dupes,
        n_invalid_dropped=drops,
        source=f"dataset {data.path}",
    )
