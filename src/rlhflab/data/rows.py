"""The row-parsing kit every dataset loader of `data/` shares: reading rows from a file or the Hub
(`load_rows`), the invalid-row error (`RowError`, with a drop reason), chat-message validation
(`check_messages`, `ROLES`), and what a loader does once its rows are parsed: report the rows
dropped as invalid (per reason) and refuse a dataset left empty (`finish_rows`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from rlhflab.errors import DataError

logger = logging.getLogger(__name__)

#: Chat roles a message may have.
ROLES = ("system", "user", "assistant")


class RowError(Exception):
    """An invalid row: `reason` is a key of the loader's drop counts (its DROP_REASONS); the
    message names the field. Loaders turn it into a DataError naming file and row, or drop the
    row and count `reason`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def check_messages(value: Any, field: str) -> list[dict[str, str]]:
    """A validated copy of a chat message list (only "role" and "content" kept).

    Raises RowError naming the field and message index: "wrong_type" (not a list, a message not
    an object, role/content not a string), "missing_field" (empty list, role/content missing or
    null), "bad_role" (a role outside ROLES).
    """
    if not isinstance(value, list):
        raise RowError("wrong_type", f"field '{field}' must be a list of messages")
    if not value:
        raise RowError("missing_field", f"field '{field}' is an empty list")
    out = []
    for j, msg in enumerate(value):
        f = f"{field}[{j}]"
        if not isinstance(msg, dict):
            raise RowError("wrong_type", f"field '{f}' must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in msg or msg[key] is None:
                raise RowError("missing_field", f"field '{f}.{key}' is missing")
            if not isinstance(msg[key], str):
                raise RowError(
                    "wrong_type",
                    f"field '{f}.{key}' must be a string, got {type(msg[key]).__name__}",
                )
        if msg["role"] not in ROLES:
            raise RowError(
                "bad_role",
                f"field '{f}.role' is {msg['role']!r}; expected one of {', '.join(ROLES)}",
            )
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


_LOCAL_BUILDERS = (".json", ".jsonl", ".parquet", ".csv")


def load_rows(path: str, split: str, field: str) -> Iterable[Any]:
    """Rows of a local .json/.jsonl/.parquet/.csv file or a Hub dataset (`datasets.load_dataset`).

    JSON is read with plain json and CSV with the csv module (`read_json_rows`, `read_csv_rows`)
    so a malformed row can be named and no value is coerced. Raises DataError naming `field` and
    the path (file not found, unknown extension, unreadable dataset).
    """
    import datasets

    ext = os.path.splitext(path)[1].lower()
    try:
        if ext in _LOCAL_BUILDERS:
            if not os.path.isfile(path):
                raise DataError(f"{field}: file not found: {path}")
            if ext in (".json", ".jsonl"):
                # Not through Arrow: it needs one type per column and silently coerces or rejects
                # a file whose rows disagree, so a malformed row could not be named.
                return read_json_rows(path, field)
            if ext == ".csv":
                # Not through pandas either: it would read a completion "4" as the float 4.0.
                return read_csv_rows(path)
            return datasets.load_dataset("parquet", data_files=path, split="train")
        if os.path.exists(path) and not os.path.isdir(path):
            raise DataError(f"{field}: {path}: expected a .json, .jsonl, .parquet or .csv file")
        return datasets.load_dataset(path, split=split)
    except DataError:
        raise
    except Exception as exc:
        msg = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise DataError(f"{field}: cannot load {path!r} (split {split!r}): {msg}") from None


def read_csv_rows(path: str) -> list[dict[str, str]]:
    """Rows of a .csv file with a header line; every value is text (CSV has no types)."""
    import csv

    with open(path, encoding="utf-8", newline="") as fh:
        return list(csv.DictReader(fh))


def read_json_rows(path: str, field: str) -> list[Any]:
    """Rows of a .jsonl file (one object per non-blank line) or a .json array, with plain json.

    Raises DataError naming `field`, the path and (jsonl) the row when the JSON is invalid.
    """
    import json

    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{field}: {path}: invalid JSON ({exc.msg} at line {exc.lineno})"
            ) from None
        return data if isinstance(data, list) else [data]
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{field}: {path} row {len(rows)}: invalid JSON ({exc.msg} at column {exc.colno})"
            ) from None
    return rows


def finish_rows(rows: list, drops: dict[str, int], source: str, empty: str) -> list:
    """Return `rows` after logging one warning with the drop counts (`drops`: reason → count).

    Args:
        rows: the parsed rows kept.
        drops: invalid rows dropped, per reason (zero counts are left out of the message).
        source: the file or dataset, named in the warning.
        empty: the error message when no row is left (" (N invalid rows dropped)" is appended).

    Raises:
        DataError: `rows` is empty.
    """
    n_dropped = sum(drops.values())
    if n_dropped:
        detail = ", ".join(f"{k}={v}" for k, v in drops.items() if v)
        logger.warning("%s: dropped %d invalid rows (%s)", source, n_dropped, detail)
    if not rows:
        detail = f" ({n_dropped} invalid rows dropped)" if n_dropped else ""
        raise DataError(f"{empty}{detail}")
    return rows
