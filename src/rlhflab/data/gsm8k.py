"""GSM8K (Cobbe et al. 2021, arXiv 2110.14168) as verifiable problems.

Rows of `openai/gsm8k` (configs "main" / "socratic"): `{"question": str, "answer": str}` where the
answer is a worked solution whose last line is `#### <number>`; calculator annotations `<<48/2=24>>`
are inline. `load_gsm8k` turns each row into a `rlhflab.data.tasks.Problem` whose `answer` is the
number after `####` (thousands separators removed) and whose `score` compares numbers exactly, so the
usual `Verifier` scores completions (answer_format "tags" or "plain"). The worked solution's lines,
annotations removed, are kept in `entry["steps"]` (a source of reference solutions for SFT / PRM).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from rlhflab.data.rows import RowError
from rlhflab.data.tasks import Problem
from rlhflab.errors import ConfigError, DataError

GSM8K_DROP_REASONS = ("missing_field", "wrong_type", "no_final_answer")
_CALC = re.compile(r"<<[^>]*>>")
_NUMBER = re.compile(r"^-?\d+(\.\d+)?$")


def parse_number(text: Any) -> Fraction | None:
    """'1,234' / '-3.50' / '$12' / '7.' → Fraction, or None if not a plain number."""
    if not isinstance(text, str):
        return None
    t = text.strip().replace(",", "").lstrip("$").rstrip(".").strip()
    if not _NUMBER.match(t):
        return None
    return Fraction(t)


class NumericAnswerScorer:
    """The `dataset` of GSM8K `Problem`s: score_answer is 1.0 iff the numbers are equal."""

    def score_answer(self, answer: str | None, entry: dict) -> float:
        """1.0 when `answer` and `entry["answer"]` parse to the same number, else 0.0 (also
        when either does not parse); never raises."""
        got, want = parse_number(answer), parse_number(entry.get("answer"))
        return 1.0 if got is not None and want is not None and got == want else 0.0


def parse_gsm8k_row(row: Any) -> dict:
    """{"question", "answer" (the number as text), "steps" (list[str])}; raises RowError."""
    if not isinstance(row, dict):
        raise RowError("wrong_type", "expected an object")
    for key in ("question", "answer"):
        if row.get(key) is None:
            raise RowError("missing_field", f"field '{key}' is missing")
        if not isinstance(row[key], str) or not row[key].strip():
            raise RowError("wrong_type", f"field '{key}' must be a non-empty string")
    body, sep, final = row["answer"].rpartition("####")
    if not sep or parse_number(final) is None:
        raise RowError("no_final_answer", "field 'answer' has no '#### <number>' final line")
    number = final.strip().replace(",", "").lstrip("$")
    steps = [_CALC.sub("", line).strip() for line in body.strip().splitlines() if line.strip()]
    return {"question": row["question"].strip(), "answer": number, "steps": steps}


def load_gsm8k(
    source: str = "openai/gsm8k",
    *,
    split: str = "train",
    config_name: str = "main",
    on_invalid: str = "error",
    limit: int | None = None,
) -> tuple[list[Problem], dict[str, int]]:
    """GSM8K problems from a hub id (`openai/gsm8k`, config "main") or a local json/jsonl/parquet
    file, via `datasets.load_dataset`.

    Returns:
        (problems, drop counts by `GSM8K_DROP_REASONS`).
    Raises:
        DataError: an invalid row with on_invalid "error" ("data.path: f row 3: field 'answer' …");
            no valid rows; the source cannot be loaded.
    """
    from rlhflab.data.prm import load_rows

    if on_invalid not in ("error", "drop"):
        raise ConfigError(f"data.on_invalid: must be 'error' or 'drop', got {on_invalid!r}")
    scorer = NumericAnswerScorer()
    drops = dict.fromkeys(GSM8K_DROP_REASONS, 0)
    out: list[Problem] = []
    for i, row in enumerate(load_rows(source, split=split, name=config_name)):
        if limit is not None and len(out) >= limit:
            break
        try:
            entry = parse_gsm8k_row(row)
        except RowError as err:
            if on_invalid == "error":
                raise DataError(f"data.path: {source} row {i}: {err}") from None
            drops[err.reason] += 1
            continue
        out.append(Problem(entry["question"], entry["answer"], entry, "gsm8k", scorer))
    if not out:
        raise DataError(f"data.path: {source} has no valid GSM8K rows ({drops})")
    return out, drops
