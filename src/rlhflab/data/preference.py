"""Preference data: pairs (prompt, chosen, rejected) and unpaired (prompt, completion, label) rows.

Formats read by `load_preference_data` (through `datasets.load_dataset`: a hub id, a local dataset
directory, or a local .json / .jsonl / .parquet / .csv file), one row each. TRL's dataset types;
standard (strings) vs conversational (lists of `{"role", "content"}`) is told by the value type:

* ``auto`` (the default) — detected from the first row's fields: `label` → unpaired; `prompt`
  with `chosen`/`rejected` → pairs (or implicit when `chosen` is a whole conversation, as in
  UltraFeedback); `chosen`/`rejected` alone → hh_rlhf for "\n\nHuman:" transcripts, else
  implicit. Every row is then parsed in the detected format (a row in another format is an error
  naming its field, not a silent switch).
* ``implicit`` — implicit prompt, TRL's `{"chosen", "rejected"}`. Conversational: both are full
  conversations; the messages both share are the prompt (each side must end with exactly one
  differing assistant turn); a `prompt` column is only informative. Standard: both are strings;
  the prompt is their longest common prefix cut back to a word boundary (`split_shared_text`)
  and is used as raw text (no chat template), as TRL does. ``ultrafeedback`` is an alias
  (HuggingFaceH4/ultrafeedback_binarized).
* ``hh_rlhf`` — Anthropic/hh-rlhf: `chosen` and `rejected` are transcripts
  ``"\n\nHuman: …\n\nAssistant: …"`` (multi-turn allowed). Both are split into messages
  (Human → user, Assistant → assistant, contents stripped); the shared prefix is the prompt and
  each side must end with exactly one differing assistant turn.
* ``pairs`` — explicit prompt: `prompt` is user text (str) or a list of messages; `chosen` /
  `rejected` are strings, one assistant message, or a full conversation that starts with the prompt.
* ``unpaired`` — KTO: `prompt` (str or messages), `completion` (str or one assistant message),
  `label` (bool: desirable or not; 0/1 accepted).

Hub ids, directories and .parquet files go through `datasets.load_dataset`; local .json/.jsonl
files are read with the json module and .csv files with the csv module (every value is text), row
by row, because Arrow and pandas coerce columns to one type (a malformed row would be silently
changed — a completion "4" read as 4.0 — or make the whole file fail without naming the row).

Every loader returns `(rows, drop_counts)`. Invalid rows raise a `DataError` naming the source,
the row (counted from 0) and the field — "data.path: hh.jsonl row 3: field 'chosen' …" — or, with
`on_invalid="drop"`, are skipped and counted per reason (`DROP_REASONS`).

A `PreferencePair.prompt` is a list of chat messages (rendered later with the tokenizer's chat
template, `render_prompt_text`) or a string that is *already rendered* (verifiable pairs built from
task prompts; the raw text prompt of an implicit string pair). Completions carry no eos;
`tokenize_pairs` appends it through `encode_completion`, so pairs are scored on exactly the
prompt/completion boundary SFT and the sampler use.
"""

from __future__ import annotations

import itertools
import logging
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from rlhflab.data.formatting import encode_completion, encode_prompt, render_messages
from rlhflab.data.rows import RowError, check_messages, finish_rows, load_rows
from rlhflab.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]
PreferenceFormat = Literal["auto", "implicit", "ultrafeedback", "hh_rlhf", "pairs", "unpaired"]
PREFERENCE_FORMATS: tuple[str, ...] = (
    "auto",
    "implicit",
    "ultrafeedback",
    "hh_rlhf",
    "pairs",
    "unpaired",
)

#: Reasons a row can be invalid; keys of the drop counts.
DROP_REASONS: tuple[str, ...] = (
    "not_an_object",
    "missing_field",
    "wrong_type",
    "bad_role",
    "empty_completion",
    "identical",
    "no_shared_prompt",
    "bad_transcript",
    "bad_label",
)


@dataclass
class PreferencePair:
    """A prompt with a preferred and a dispreferred completion.

    Attributes:
        prompt: chat messages ending in a user/system message, or an already rendered prompt (str).
        chosen / rejected: assistant completion texts (no eos).
    """

    prompt: Messages | str
    chosen: str
    rejected: str


@dataclass
class UnpairedExample:
    """A prompt and one completion labelled desirable (True) or undesirable (False) — KTO data."""

    prompt: Messages | str
    completion: str
    label: bool


@dataclass
class TokenizedPair:
    """Token ids of a pair; `chosen_ids` / `rejected_ids` end in eos unless truncated."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


# ---------------------------------------------------------------------------------------------
# Row parsers (one per format); each returns a PreferencePair / UnpairedExample or raises RowError
# ---------------------------------------------------------------------------------------------


def _get(row: Any, key: str) -> Any:
    if not isinstance(row, dict):
        raise RowError("not_an_object", "expected an object (a mapping of fields)")
    if key not in row or row[key] is None:
        raise RowError("missing_field", f"field '{key}' is missing")
    return row[key]


def _prompt(value: Any, field: str = "prompt") -> Messages:
    if isinstance(value, str):
        if not value.strip():
            raise RowError("missing_field", f"field '{field}' is empty")
        return [{"role": "user", "content": value}]
    messages = check_messages(value, field)
    if messages[-1]["role"] == "assistant":
        raise RowError(
            "bad_role",
            f"field '{field}[{len(messages) - 1}].role' is 'assistant'; a prompt must end with a "
            "user or system message",
        )
    return messages


def _nonempty(text: str, field: str) -> str:
    if not text.strip():
        raise RowError("empty_completion", f"field '{field}' is empty")
    return text


def split_shared_prompt(
    chosen: Messages, rejected: Messages, *, fields: tuple[str, str] = ("chosen", "rejected")
) -> tuple[Messages, str, str]:
    """Split two conversations into (shared prompt messages, chosen answer, rejected answer).

    The prompt is the longest common prefix of messages; after it each side must hold exactly one
    assistant message (RowError "no_shared_prompt" otherwise, "identical" if both are equal).
    """
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if n == len(chosen) and n == len(rejected):
        raise RowError("identical", f"fields '{fields[0]}' and '{fields[1]}' are identical")
    if n == 0:
        raise RowError(
            "no_shared_prompt", f"fields '{fields[0]}' and '{fields[1]}' share no prompt message"
        )
    for side, msgs in zip(fields, (chosen, rejected), strict=True):
        if len(msgs) - n != 1 or msgs[-1]["role"] != "assistant":
            raise RowError(
                "no_shared_prompt",
                f"field '{side}' differs from the other side before its last assistant turn "
                f"(shared prefix: {n} messages of {len(msgs)})",
            )
    prompt = chosen[:n]
    if prompt[-1]["role"] == "assistant":
        raise RowError(
            "no_shared_prompt",
            f"fields '{fields[0]}' and '{fields[1]}' share the assistant message {n - 1}; "
            "the shared prefix must end with a user message",
        )
    return prompt, chosen[-1]["content"], rejected[-1]["content"]


_HH_TURN = re.compile(r"\n\n(Human|Assistant):[ ]?")


def parse_hh_transcript(text: Any, field: str) -> Messages:
    """'\\n\\nHuman: a\\n\\nAssistant: b' → [{"role": "user", "content": "a"}, {assistant, "b"}]."""
    if not isinstance(text, str):
        raise RowError("wrong_type", f"field '{field}' must be a string, got {type(text).__name__}")
    parts = _HH_TURN.split(text)
    if parts[0].strip() or len(parts) < 3:
        raise RowError(
            "bad_transcript",
            f"field '{field}' is not a '\\n\\nHuman: …\\n\\nAssistant: …' transcript",
        )
    roles = {"Human": "user", "Assistant": "assistant"}
    return [
        {"role": roles[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts), 2)
    ]


def parse_ultrafeedback_row(row: Any) -> PreferencePair:
    """One UltraFeedback-binarized row (`chosen`/`rejected` message lists sharing the prompt) → PreferencePair.

    Raises DataError naming the field when a field is missing or malformed."""
    chosen = check_messages(_get(row, "chosen"), "chosen")
    rejected = check_messages(_get(row, "rejected"), "rejected")
    prompt, c, r = split_shared_prompt(chosen, rejected)
    last = len(chosen) - 1
    return PreferencePair(
        prompt, _nonempty(c, f"chosen[{last}].content"), _nonempty(r, f"rejected[{last}].content")
    )


def split_shared_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Split two texts with an implicit shared prompt into (prompt, chosen, rejected) completions.

    The prompt is the longest common prefix of the two strings, cut back to the last position
    where both texts start a whitespace run after a non-space character; the completions start
    with that whitespace. "The sky is blue." / "The sky is green." → ("The sky is", " blue.",
    " green."); "The cat sat" / "The car sat" → ("The", " cat sat", " car sat"). TRL's
    `extract_prompt` cuts at the first differing character and moves one preceding space into the
    completions (so BPE sees " blue" as in pre-training); cutting at a shared word boundary also
    keeps a word from being split between prompt and completion. Both completions are non-empty.

    Raises:
        RowError: "identical" when the texts are equal; "no_shared_prompt" when no such boundary
            exists (no shared word before the first difference).
    """
    if chosen == rejected:
        raise RowError("identical", "fields 'chosen' and 'rejected' are identical")
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    for j in range(min(n, len(chosen) - 1, len(rejected) - 1), 0, -1):
        if chosen[j].isspace() and rejected[j].isspace() and not chosen[j - 1].isspace():
            return chosen[:j], chosen[j:], rejected[j:]
    raise RowError(
        "no_shared_prompt",
        "fields 'chosen' and 'rejected' share no prompt (no common prefix ending at a word "
        "boundary before they differ)",
    )


def parse_implicit_row(row: Any) -> PreferencePair:
    """One implicit-prompt row {chosen, rejected} → PreferencePair: two conversations sharing their
    leading messages (the prompt; UltraFeedback-binarized), or two strings sharing a text prefix
    (`split_shared_text`; the prompt stays raw text). A `prompt` column is ignored.

    Raises RowError naming the field when a field is missing, malformed or of mixed type."""
    chosen, rejected = _get(row, "chosen"), _get(row, "rejected")
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt, c, r = split_shared_text(chosen, rejected)
        return PreferencePair(prompt, c, r)
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise RowError(
            "wrong_type",
            "fields 'chosen' and 'rejected' must both be strings or both lists of messages",
        )
    return parse_ultrafeedback_row(row)


def parse_hh_row(row: Any) -> PreferencePair:
    """One HH-RLHF row (`chosen`/`rejected` "\\n\\nHuman: … \\n\\nAssistant: …" transcripts; the
    shared prefix is the prompt) → PreferencePair. Raises DataError naming the field."""
    chosen = parse_hh_transcript(_get(row, "chosen"), "chosen")
    rejected = parse_hh_transcript(_get(row, "rejected"), "rejected")
    prompt, c, r = split_shared_prompt(chosen, rejected)
    return PreferencePair(prompt, _nonempty(c, "chosen"), _nonempty(r, "rejected"))


def _completion(value: Any, field: str, prompt: Messages) -> str:
    """A completion given as text, one assistant message, or a conversation starting with prompt."""
    if isinstance(value, str):
        return _nonempty(value, field)
    msgs = check_messages(value, field)
    if len(msgs) > 1 and msgs[: len(prompt)] == prompt:
        msgs = msgs[len(prompt) :]
    if len(msgs) != 1 or msgs[0]["role"] != "assistant":
        raise RowError(
            "bad_role",
            f"field '{field}' must be one assistant message (or the prompt followed by one)",
        )
    return _nonempty(msgs[0]["content"], f"{field}[{len(value) - 1}].content")


def parse_pairs_row(row: Any) -> PreferencePair:
    """One generic row {prompt, chosen, rejected} → PreferencePair. Raises DataError naming the field."""
    prompt = _prompt(_get(row, "prompt"))
    chosen = _completion(_get(row, "chosen"), "chosen", prompt)
    rejected = _completion(_get(row, "rejected"), "rejected", prompt)
    if chosen == rejected:
        raise RowError("identical", "fields 'chosen' and 'rejected' are identical")
    return PreferencePair(prompt, chosen, rejected)


def parse_unpaired_row(row: Any) -> UnpairedExample:
    """One unpaired row {prompt, completion, label} (KTO) → UnpairedExample. Raises DataError
    naming the field."""
    prompt = _prompt(_get(row, "prompt"))
    completion = _completion(_get(row, "completion"), "completion", prompt)
    label = _get(row, "label")
    if isinstance(label, bool):
        pass
    elif isinstance(label, int | float) and label in (0, 1):
        label = bool(label)
    else:
        raise RowError("bad_label", f"field 'label' must be true/false (or 1/0), got {label!r}")
    return UnpairedExample(prompt, completion, label)


ROW_PARSERS = {
    "implicit": parse_implicit_row,
    "ultrafeedback": parse_implicit_row,  # alias: UltraFeedback-binarized is the implicit format
    "hh_rlhf": parse_hh_row,
    "pairs": parse_pairs_row,
    "unpaired": parse_unpaired_row,
}


def detect_preference_format(row: Any) -> str | None:
    """The format of one row from its fields and value types (module docstring, ``auto``); None
    when the row is not an object or has none of the preference fields."""
    if not isinstance(row, dict):
        return None
    if "label" in row and "completion" in row:
        return "unpaired"
    if "chosen" not in row or "rejected" not in row:
        return None
    chosen = row["chosen"]
    if row.get("prompt") is not None:
        conversation = isinstance(chosen, list) and any(
            isinstance(m, dict) and m.get("role") != "assistant" for m in chosen
        )
        return "implicit" if conversation else "pairs"
    if isinstance(chosen, str) and _HH_TURN.match(chosen):
        return "hh_rlhf"
    return "implicit"


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def parse_rows(
    rows: Iterable[Any],
    fmt: str,
    *,
    on_invalid: str = "error",
    source: str = "data",
    max_rows: int | None = None,
) -> tuple[list, dict[str, int]]:
    """Parse already loaded rows (dicts) with the parser of `fmt`.

    `fmt="auto"` detects the format from the first row that has preference fields
    (`detect_preference_format`) and parses every row in it.

    Returns `(examples, drop_counts)`; raises DataError "<source> row i: …" on the first invalid
    row when on_invalid == "error", when no row is valid, and ("auto") when no row has
    preference fields.
    """
    if fmt == "auto":
        head, rest = [], iter(rows)
        for row in rest:  # the first row with preference fields decides
            head.append(row)
            fmt = detect_preference_format(row) or "auto"
            if fmt != "auto":
                break
        rows = itertools.chain(head, rest)
        if fmt == "auto":
            raise DataError(
                f"{source}: cannot detect the preference format: no row has 'chosen' and "
                "'rejected' (optionally 'prompt'), or 'prompt', 'completion' and 'label'"
            )
        logger.info("%s: detected preference format %r", source, fmt)
    if fmt not in ROW_PARSERS:
        raise ConfigError(
            f"data.format: must be one of {', '.join(PREFERENCE_FORMATS)}, got {fmt!r}"
        )
    if on_invalid not in ("error", "drop"):
        raise ConfigError(f"data.on_invalid: must be 'error' or 'drop', got {on_invalid!r}")
    parser = ROW_PARSERS[fmt]
    drops = dict.fromkeys(DROP_REASONS, 0)
    out = []
    for i, row in enumerate(rows):
        if max_rows is not None and len(out) >= max_rows:
            break
        try:
            out.append(parser(row))
        except RowError as err:
            if on_invalid == "error":
                raise DataError(f"{source} row {i}: {err}") from None
            drops[err.reason] += 1
    return finish_rows(out, drops, source, empty=f"{source}: no valid {fmt} rows"), drops


def load_preference_data(
    path: str,
    fmt: str = "auto",
    *,
    split: str = "train",
    on_invalid: str = "error",
    max_rows: int | None = None,
    field: str = "data.path",
) -> tuple[list, dict[str, int]]:
    """Load preference pairs (or unpaired KTO rows for fmt="unpaired") from a file or the hub.

    Args:
        path: local .json/.jsonl/.parquet/.csv file, a local dataset directory, or a hub dataset
            id (e.g. "HuggingFaceH4/ultrafeedback_binarized" with split "train_prefs").
        fmt: one of PREFERENCE_FORMATS (module docstring); "auto" detects it from the rows.
        split: hub split (ignored for local files, which are one split).
        on_invalid: "error" or "drop" (per-reason counts in the second return value).
        max_rows: stop after this many valid rows.
        field: the config key named in errors.

    Returns:
        (list of PreferencePair — or UnpairedExample for "unpaired" —, drop counts by reason).

    Raises:
        ConfigError: unknown `fmt` or `on_invalid`.
        DataError: missing file, unreadable dataset, undetectable format, an invalid row
            (on_invalid "error"), or no valid row.
    """
    rows = load_rows(path, split, field)
    return parse_rows(
        rows, fmt, on_invalid=on_invalid, source=f"{field}: {path}", max_rows=max_rows
    )


def unpair(pairs: Sequence[PreferencePair]) -> list[UnpairedExample]:
    """Paired data as KTO data: each pair gives (prompt, chosen, True) and (prompt, rejected, False)."""
    out = []
    for p in pairs:
        out.append(UnpairedExample(p.prompt, p.chosen, True))
        out.append(UnpairedExample(p.prompt, p.rejected, False))
    return out


# ---------------------------------------------------------------------------------------------
# Verifiable pairs: correct vs incorrect completions of the same prompt
# ---------------------------------------------------------------------------------------------


def pairs_from_scored_samples(
    prompts: Sequence[Messages | str],
    samples: Sequence[Sequence[str]],
    scores: Sequence[Sequence[float]],
    *,
    gold: Sequence[str | None] | None = None,
    chosen_source: Literal["sampled", "gold", "sampled_or_gold"] = "sampled_or_gold",
    rng: random.Random | None = None,
) -> tuple[list[PreferencePair], dict[str, int]]:
    """Best-vs-worst pairs from K scored samples per prompt (verifier or reward model scores).

    For prompt i: rejected = a sample with the lowest score; chosen = a sample with the highest
    score ("sampled"), the gold completion ("gold"), or the best sample if it beats the worst and
    the gold completion otherwise ("sampled_or_gold"). Ties are broken with `rng`. A prompt gives
    no pair when chosen would not score strictly higher than rejected (gold counts as score +inf)
    or the two texts are equal.

    Returns:
        (pairs, counts) with counts {"prompts", "pairs", "no_contrast"}.
    """
    rng = rng or random.Random(0)
    if chosen_source not in ("sampled", "gold", "sampled_or_gold"):
        raise ConfigError(f"chosen_source: unknown value {chosen_source!r}")
    if chosen_source != "sampled" and gold is None:
        raise ConfigError(f"chosen_source {chosen_source!r} needs gold completions")
    pairs = []
    for i, (texts, sc) in enumerate(zip(samples, scores, strict=True)):
        lo, hi = min(sc), max(sc)
        worst = rng.choice([t for t, s in zip(texts, sc, strict=True) if s == lo])
        best = rng.choice([t for t, s in zip(texts, sc, strict=True) if s == hi])
        g = gold[i] if gold is not None else None
        if chosen_source == "sampled":
            chosen = best if hi > lo else None
        elif chosen_source == "gold":
            chosen = g
        else:
            chosen = best if hi > lo else g
        if chosen is None or chosen == worst:
            continue
        pairs.append(PreferencePair(prompts[i], chosen, worst))
    return pairs, {
        "prompts": len(samples),
        "pairs": len(pairs),
        "no_contrast": len(samples) - len(pairs),
    }


# ---------------------------------------------------------------------------------------------
# Tokenization
# ---------------------------------------------------------------------------------------------


def render_prompt_text(tokenizer: Any, prompt: Messages | str) -> str:
    """The prompt text: messages rendered with the chat template (+ generation prompt); a string is
    taken as already rendered."""
    if isinstance(prompt, str):
        return prompt
    return render_messages(tokenizer, prompt, add_generation_prompt=True)


def truncate_prompt(ids: list[int], max_len: int | None, side: str) -> list[int]:
    """Keep at most `max_len` prompt tokens: "left" drops the start (keeps the end, which holds the
    question and the assistant header), "right" drops the end."""
    if max_len is None or len(ids) <= max_len:
        return ids
    return ids[len(ids) - max_len :] if side == "left" else ids[:max_len]


def tokenize_pairs(
    tokenizer: Any,
    pairs: Sequence[PreferencePair],
    *,
    max_prompt_len: int | None = None,
    max_completion_len: int | None = None,
    truncation_side: Literal["left", "right"] = "left",
) -> tuple[list[TokenizedPair], dict[str, int]]:
    """Token ids of pairs: `encode_prompt(render_prompt_text(prompt))`, `encode_completion(text)`.

    Prompts longer than `max_prompt_len` are truncated on `truncation_side`; completions longer
    than `max_completion_len` lose their end (and then their eos). No padding: batches are padded
    to their own longest sequence when packed.

    Returns:
        (tokenized pairs, {"prompt_truncated": n, "completion_truncated": n}).
    """
    if truncation_side not in ("left", "right"):
        raise ConfigError(
            f"data.truncation_side: must be 'left' or 'right', got {truncation_side!r}"
        )
    out = []
    counts = {"prompt_truncated": 0, "completion_truncated": 0}
    for pair in pairs:
        p = encode_prompt(tokenizer, render_prompt_text(tokenizer, pair.prompt))
        tp = truncate_prompt(p, max_prompt_len, truncation_side)
        counts["prompt_truncated"] += len(tp) < len(p)
        comps = []
        for text in (pair.chosen, pair.rejected):
            c = encode_completion(tokenizer, text)
            if max_completion_len is not None and len(c) > max_completion_len:
                c = c[:max_completion_len]
                counts["completion_truncated"] += 1
            comps.append(c)
        out.append(TokenizedPair(tp, comps[0], comps[1]))
    return out, counts
