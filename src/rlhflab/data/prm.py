"""Process-reward data: multi-step worked solutions with a label per step, and PRM800K.

Worked solutions (arithmetic tasks: chain_sum, basic_arithmetic, anything whose metadata has an
`expression` of integers and + − × ÷): the expression is reduced one binary operation at a time,
innermost-leftmost first (Python's precedence and left associativity), one step per line:

    4 - 1 = 3
    3 - 7 = -4
    <answer>-4</answer>

Step labels (PRM800K's ratings): +1 the step is right and so is everything before it (its result is
the true intermediate value); −1 the step itself is wrong (wrong operands for the current state,
arithmetic error, or unparseable); 0 the step's arithmetic is right but it builds on an earlier
error ("neutral": locally valid, globally wrong). Binary labels map +1 → 1 (correct) and −1, 0 → 0.
The same checker labels planted errors (`plant_error`) and a policy's sampled solutions
(`label_steps`): the state after a step is what the step *claimed*, so later steps are judged on
the solution's own path.

Token layout: the completion text is `step_1 SEP step_2 SEP … step_K SEP final`, tokenized as one
completion (`encode_completion`, as SFT does), where SEP (default "\\n") must be a single token.
Step k's label sits on the k-th SEP token of the completion and nowhere else (−100 elsewhere).

PRM800K (Lightman et al. 2023, https://github.com/openai/prm800k) rows: {"question": {"problem",
"ground_truth_answer", ...}, "label": {"steps": [{"completions": [{"text", "rating", "flagged"}],
"human_completion", "chosen_completion"}], "finish_reason"}}. Per step we take the completion the
labeller chose (`chosen_completion`), else the human-written one; a step without a choice is the
step where the labeller found the error: its −1-rated completion ends the solution. Sibling
alternatives are never used.
"""

from __future__ import annotations

import ast
import os
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from typing import Any

from rlhflab.data.formatting import encode_completion, encode_prompt, render_prompt
from rlhflab.data.rows import RowError
from rlhflab.errors import ConfigError, DataError

IGNORE_INDEX = -100
RATINGS = (-1, 0, 1)
DEFAULT_SEP = "\n"

# ---------------------------------------------------------------------------------------------
# Arithmetic worked solutions
# ---------------------------------------------------------------------------------------------

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
#: one worked-solution line "a op b = c" (integers): groups a, op, b, c
STEP_RE = re.compile(r"^\s*(-?\d+)\s*([-+*/])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")


def _parse_expr(expression: str) -> Any:
    """Nested tuples (op, left, right) with Fraction leaves."""

    def conv(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = conv(node.operand)
            if isinstance(v, Fraction):
                return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return (_OPS[type(node.op)], conv(node.left), conv(node.right))
        raise ValueError(f"unsupported expression element {ast.dump(node)[:40]}")

    try:
        return conv(ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval").body)
    except SyntaxError as exc:
        raise ValueError(f"cannot parse expression {expression!r}") from exc


def _apply(op: str, a: Fraction, b: Fraction) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return None if b == 0 else a / b


def _next_redex(node: Any) -> tuple | None:
    """Path (tuple of 1/2 child indices) to the leftmost innermost operation, or None if a number."""
    if isinstance(node, Fraction):
        return None
    _, left, right = node
    if isinstance(left, Fraction) and isinstance(right, Fraction):
        return ()
    p = _next_redex(left)
    return (1, *p) if p is not None else (2, *_next_redex(right))


def _get(node: Any, path: tuple) -> Any:
    for i in path:
        node = node[i]
    return node


def _replace(node: Any, path: tuple, value: Fraction) -> Any:
    if not path:
        return value
    parts = list(node)
    parts[path[0]] = _replace(node[path[0]], path[1:], value)
    return tuple(parts)


def _fmt(x: Fraction) -> str:
    if x.denominator != 1:
        raise ValueError(f"non-integer intermediate value {x}")
    return str(x.numerator)


def solve_steps(expression: str) -> list[str]:
    """Canonical worked solution of an integer expression: one "a op b = c" string per operation.

    Raises:
        ValueError: unsupported syntax, division by zero or a non-integer intermediate value.
    """
    state = _parse_expr(expression)
    steps = []
    while not isinstance(state, Fraction):
        path = _next_redex(state)
        op, a, b = _get(state, path)
        c = _apply(op, a, b)
        if c is None:
            raise ValueError("division by zero")
        steps.append(f"{_fmt(a)} {op} {_fmt(b)} = {_fmt(c)}")
        state = _replace(state, path, c)
    return steps


def label_steps(expression: str, steps: list[str]) -> list[int]:
    """Rating in {−1, 0, +1} of each step of a solution to `expression` (see module docstring).

    Extra steps after the expression is fully reduced are rated −1.
    """
    state: Any = _parse_expr(expression)
    labels: list[int] = []
    broken = False  # an earlier step was wrong, or the state is no longer trackable
    for text in steps:
        m = STEP_RE.match(text)
        if m is None or isinstance(state, Fraction) or state is None:
            labels.append(-1)
            broken, state = True, None if m is None else state
            continue
        x, op, y, z = Fraction(int(m[1])), m[2], Fraction(int(m[3])), Fraction(int(m[4]))
        path = _next_redex(state)
        e_op, a, b = _get(state, path)
        if (x, op, y) != (a, e_op, b) or _apply(op, x, y) != z:
            labels.append(-1)
            broken = True
        else:
            labels.append(0 if broken else 1)
        state = _replace(state, path, z)  # continue on the solution's own path
    return labels


def plant_error(steps: list[str], expression: str, rng: random.Random) -> list[str]:
    """The worked solution with one step's result perturbed by a small non-zero amount, and the
    later steps recomputed correctly from the wrong value (so they are rated 0, the planted one −1).
    """
    k = rng.randrange(len(steps))
    state = _parse_expr(expression)
    out: list[str] = []
    for i in range(len(steps)):
        path = _next_redex(state)
        op, a, b = _get(state, path)
        c = _apply(op, a, b)
        if c is None:
            raise ValueError("division by zero")
        if i == k:
            c = c + rng.choice([-10, -2, -1, 1, 2, 10])
        out.append(f"{_fmt(a)} {op} {_fmt(b)} = {_fmt(c)}")
        state = _replace(state, path, c)
    return out


def final_value(steps: list[str]) -> str | None:
    """The result of the last step ("= c"), the answer a worked solution arrives at."""
    if not steps:
        return None
    m = STEP_RE.match(steps[-1])
    return m[4] if m else None


def solution_text(steps: list[str], final: str, sep: str = DEFAULT_SEP) -> str:
    """The completion text of a worked solution: each step followed by `sep`, then the final answer."""
    return "".join(s + sep for s in steps) + final


# ---------------------------------------------------------------------------------------------
# PRM examples and tokenization
# ---------------------------------------------------------------------------------------------


@dataclass
class PRMExample:
    """A rendered prompt, the solution's steps and their ratings, and the text after the steps."""

    prompt: str
    steps: list[str]
    ratings: list[int]
    final: str = ""
    meta: dict = field(default_factory=dict)


def worked_solution_examples(
    problems: list,
    tokenizer: Any,
    *,
    error_frac: float = 0.5,
    seed: int = 0,
    sep: str = DEFAULT_SEP,
    system: str | None = None,
) -> tuple[list[PRMExample], dict[str, int]]:
    """PRM examples from arithmetic `Problem`s: the canonical solution, and with probability
    `error_frac` a copy with one planted error instead. The final text is "<answer>v</answer>"
    with v the last step's result. Problems whose metadata has no usable `expression` are skipped
    and counted under "unsupported"."""
    rng = random.Random(seed)
    out: list[PRMExample] = []
    counts = {"unsupported": 0, "planted": 0, "clean": 0}
    for p in problems:
        expression = (p.entry.get("metadata") or {}).get("expression")
        try:
            steps = solve_steps(expression)
            if rng.random() < error_frac:
                steps = plant_error(steps, expression, rng)
                counts["planted"] += 1
            else:
                counts["clean"] += 1
        except (ValueError, TypeError):
            counts["unsupported"] += 1
            continue
        if not steps:
            counts["unsupported"] += 1
            continue
        out.append(
            PRMExample(
                prompt=render_prompt(tokenizer, p.question, system=system),
                steps=steps,
                ratings=label_steps(expression, steps),
                final=f"<answer>{final_value(steps)}</answer>",
                meta={"expression": expression},
            )
        )
    return out, counts


def separator_id(tokenizer: Any, sep: str = DEFAULT_SEP) -> int:
    """The token id of the step separator; ConfigError unless `sep` is exactly one token."""
    ids = tokenizer(sep, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ConfigError(
            f"data.step_separator: {sep!r} is {len(ids)} tokens; it must be one token"
        )
    return ids[0]


def step_label_ids(ratings: list[int], num_classes: int) -> list[int]:
    """Class ids of ratings: 3-class {−1, 0, +1} → {0, 1, 2}; binary +1 → 1, −1/0 → 0."""
    if num_classes == 3:
        return [r + 1 for r in ratings]
    if num_classes == 2:
        return [1 if r == 1 else 0 for r in ratings]
    raise ConfigError(f"num_classes: must be 2 or 3, got {num_classes}")


def tokenize_prm(
    tokenizer: Any,
    example: PRMExample,
    *,
    num_classes: int = 2,
    sep: str = DEFAULT_SEP,
    row: int = 0,
) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, completion_ids, labels) with labels aligned to completion_ids: the class of step
    k on the k-th separator token, −100 everywhere else.

    Raises:
        DataError: a step contains the separator, or tokenization did not keep one separator token
            per step (names the row).
    """
    sep_id = separator_id(tokenizer, sep)
    for j, s in enumerate(example.steps):
        if sep in s:
            raise DataError(f"data: row {row}: field 'steps[{j}]' contains the step separator")
    prompt_ids = encode_prompt(tokenizer, example.prompt)
    completion_ids = encode_completion(tokenizer, solution_text(example.steps, example.final, sep))
    positions = [i for i, t in enumerate(completion_ids) if t == sep_id]
    if example.final and sep in example.final:
        raise DataError(f"data: row {row}: field 'final' contains the step separator")
    if len(positions) != len(example.steps):
        raise DataError(
            f"data: row {row}: {len(example.steps)} steps but {len(positions)} separator tokens "
            "after tokenization (the separator merged with neighbouring text)"
        )
    labels = [IGNORE_INDEX] * len(completion_ids)
    for pos, cls in zip(positions, step_label_ids(example.ratings, num_classes), strict=True):
        labels[pos] = cls
    return prompt_ids, completion_ids, labels


# ---------------------------------------------------------------------------------------------
# PRM800K
# ---------------------------------------------------------------------------------------------

PRM800K_DROP_REASONS = ("missing_field", "unknown_rating", "no_steps", "wrong_type")


def _prm800k_row(row: dict) -> tuple[str, list[str], list[int], str | None]:
    question = row.get("question")
    if not isinstance(question, dict) or not isinstance(question.get("problem"), str):
        raise RowError("missing_field", "field 'question.problem' is missing")
    label = row.get("label")
    if not isinstance(label, dict) or not isinstance(label.get("steps"), list):
        raise RowError("missing_field", "field 'label.steps' is missing")
    steps: list[str] = []
    ratings: list[int] = []
    for k, step in enumerate(label["steps"]):
        if not isinstance(step, dict):
            raise RowError("wrong_type", f"field 'label.steps[{k}]' is not an object")
        completions = step.get("completions") or []
        chosen = step.get("chosen_completion")
        human = step.get("human_completion")
        stop = False
        if chosen is not None:
            if not isinstance(chosen, int) or not 0 <= chosen < len(completions):
                raise RowError(
                    "wrong_type", f"field 'label.steps[{k}].chosen_completion' is out of range"
                )
            comp, where = completions[chosen], f"label.steps[{k}].completions[{chosen}]"
        elif human is not None:
            comp, where = human, f"label.steps[{k}].human_completion"
        else:  # no choice: the labeller stopped here; a −1 completion is the error found
            bad = [j for j, c in enumerate(completions) if (c or {}).get("rating") == -1]
            if not bad:
                break
            comp, where, stop = completions[bad[0]], f"label.steps[{k}].completions[{bad[0]}]", True
        if not isinstance(comp, dict) or not isinstance(comp.get("text"), str):
            raise RowError("missing_field", f"field '{where}.text' is missing")
        rating = comp.get("rating")
        if rating is None and where.endswith("human_completion"):
            rating = 1  # human-written replacements are correct by construction
        if isinstance(rating, bool) or rating not in RATINGS:
            raise RowError(
                "unknown_rating", f"field '{where}.rating' is {rating!r}; expected -1, 0 or 1"
            )
        steps.append(comp["text"])
        ratings.append(int(rating))
        if stop:
            break
    if not steps:
        raise RowError("no_steps", "field 'label.steps' has no rated step")
    return question["problem"], steps, ratings, question.get("ground_truth_answer")


def load_rows(source: str, *, split: str = "train", name: str | None = None) -> Any:
    """Rows of a dataset through `datasets.load_dataset`: a local .json/.jsonl/.parquet file, or a
    Hub id (with `split`). Raises DataError (one line) when it cannot be read."""
    import datasets

    try:
        if os.path.isfile(source):
            kind = "parquet" if source.endswith(".parquet") else "json"
            return datasets.load_dataset(kind, data_files=source, split="train")
        return datasets.load_dataset(source, name, split=split)
    except Exception as exc:
        msg = " ".join(str(exc).split())[:300]
        raise DataError(f"data.path: cannot load {source!r} (split {split!r}): {msg}") from exc


def _parsed_rows(
    source: str,
    split: str,
    parse: Callable[[Any], tuple],
    on_invalid: str,
    drops: dict[str, int],
    limit: int | None,
) -> Iterator[tuple]:
    """`parse(row)` of each row of `source` (`load_rows`), at most `limit` of them. A row that
    raises RowError stops with a DataError naming the row (from 0) when `on_invalid` is "error";
    with "drop" it is counted in `drops[reason]` and skipped.

    Raises:
        ConfigError: `on_invalid` is neither "error" nor "drop".
        DataError: an invalid row with on_invalid "error", or an unreadable source.
    """
    if on_invalid not in ("error", "drop"):
        raise ConfigError(f"data.on_invalid: must be 'error' or 'drop', got {on_invalid!r}")
    kept = 0
    for i, row in enumerate(load_rows(source, split=split)):
        if limit is not None and kept >= limit:
            return
        try:
            parsed = parse(row)
        except RowError as err:
            if on_invalid == "error":
                raise DataError(f"data.path: {source} row {i}: {err}") from None
            drops[err.reason] += 1
            continue
        kept += 1
        yield parsed


def load_prm800k(
    source: str,
    tokenizer: Any,
    *,
    split: str = "train",
    on_invalid: str = "error",
    sep: str = DEFAULT_SEP,
    system: str | None = None,
    limit: int | None = None,
) -> tuple[list[PRMExample], dict[str, int]]:
    """PRM examples from PRM800K rows (schema in the module docstring).

    Step texts have their own newlines replaced by spaces so the separator is unambiguous.

    Returns:
        (examples, drop counts by `PRM800K_DROP_REASONS`).
    Raises:
        DataError: with on_invalid "error", naming the row (from 0) and field; no valid rows.
    """
    drops = dict.fromkeys(PRM800K_DROP_REASONS, 0)
    out: list[PRMExample] = []
    for problem, steps, ratings, answer in _parsed_rows(
        source, split, _prm800k_row, on_invalid, drops, limit
    ):
        steps = [" ".join(s.replace(sep, " ").split()) for s in steps]
        out.append(
            PRMExample(
                prompt=render_prompt(tokenizer, problem, system=system),
                steps=steps,
                ratings=ratings,
                final="",
                meta={"answer": answer},
            )
        )
    if not out:
        raise DataError(f"data.path: {source} has no valid PRM800K rows ({drops})")
    return out, drops


# ---------------------------------------------------------------------------------------------
# Step-labelled samples (your own labels: Monte-Carlo, a checker, humans)
# ---------------------------------------------------------------------------------------------

STEP_LABELLED_DROP_REASONS = ("missing_field", "wrong_type", "unknown_rating", "no_steps")


def _step_labelled_row(row: Any, sep: str) -> tuple[str, list[str], list[int], str, float]:
    if not isinstance(row, dict):
        raise RowError("wrong_type", "expected an object")
    for key in ("prompt", "steps", "ratings"):
        if row.get(key) is None:
            raise RowError("missing_field", f"field '{key}' is missing")
    prompt, steps, ratings = row["prompt"], row["steps"], row["ratings"]
    final = row.get("final") or ""
    if not isinstance(prompt, str) or not isinstance(final, str):
        raise RowError("wrong_type", "fields 'prompt' and 'final' must be strings")
    if not isinstance(steps, list) or not all(isinstance(t, str) for t in steps):
        raise RowError("wrong_type", "field 'steps' must be a list of strings")
    if not steps:
        raise RowError("no_steps", "field 'steps' is empty")
    if not isinstance(ratings, list) or len(ratings) != len(steps):
        raise RowError("wrong_type", f"field 'ratings' must be a list of {len(steps)} ratings")
    if any(isinstance(r, bool) or r not in RATINGS for r in ratings):
        raise RowError("unknown_rating", f"field 'ratings' is {ratings!r}; expected -1, 0 or 1")
    for j, t in enumerate(steps):
        if sep in t:
            raise RowError("wrong_type", f"field 'steps[{j}]' contains the step separator")
    outcome = row.get("outcome")  # missing (None in a column that other rows fill): all +1
    if outcome is None:
        outcome = float(all(r == 1 for r in ratings))
    if isinstance(outcome, bool) or outcome not in (0, 1):
        raise RowError("wrong_type", f"field 'outcome' is {outcome!r}; expected 0 or 1")
    return prompt, list(steps), [int(r) for r in ratings], final, float(outcome)


def load_step_labelled(
    source: str,
    tokenizer: Any,
    *,
    split: str = "train",
    on_invalid: str = "error",
    sep: str = DEFAULT_SEP,
    system: str | None = None,
    limit: int | None = None,
) -> tuple[list[PRMExample], list[float], dict[str, int]]:
    """Solutions with a rating per step, from a JSON/JSONL/Parquet file or a Hub dataset (rows
    `{"prompt": question, "steps": [str], "ratings": [-1|0|1], "final": str (text after the last
    step, e.g. "<answer>14</answer>"), "outcome": 0|1 (optional: the final answer's correctness;
    default 1 iff every rating is +1)}`). The prompt is chat-rendered (`render_prompt`), as the
    policy saw it; the completion is `step_1 SEP … step_K SEP final` (the layout above). The ORM
    learns `outcome`, the PRM the ratings: e.g. the exact step labels written by `rlhflab replicate
    prm-orm`, or Monte-Carlo ones (Math-Shepherd, Wang et al. 2024, arXiv 2312.08935).

    Returns:
        (examples, outcomes, drop counts by `STEP_LABELLED_DROP_REASONS`).
    Raises:
        DataError: with on_invalid "error", naming the row (from 0) and field; no valid rows.
    """
    drops = dict.fromkeys(STEP_LABELLED_DROP_REASONS, 0)
    out: list[PRMExample] = []
    outcomes: list[float] = []
    parse = partial(_step_labelled_row, sep=sep)
    for prompt, steps, ratings, final, outcome in _parsed_rows(
        source, split, parse, on_invalid, drops, limit
    ):
        out.append(PRMExample(render_prompt(tokenizer, prompt, system=system), steps, ratings,
                              final))  # fmt: skip
        outcomes.append(outcome)
    if not out:
        raise DataError(f"data.path: {source} has no valid step-labelled rows ({drops})")
    return out, outcomes, drops
