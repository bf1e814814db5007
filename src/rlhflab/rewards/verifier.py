"""Verifiable rewards: extract the answer from a completion and score it with reasoning_gym.

Decisions (measured reasoning_gym behaviour):
* Answers are always stripped before scoring: reasoning_gym's default `score_answer` gives partial
  credit `len(reference) / len(answer)` when the reference is a substring, so " 42 " would score
  below "42" for formatting alone.
* `reward="binary"` (default recommendation) maps a score to 1.0 iff reasoning_gym says exactly
  1.0; many tasks give partial credit to wrong answers (countdown 0.05, spell_backward near misses),
  which `reward="partial"` passes through unchanged.
* Verifiers can raise on malformed answers (prime_factorization on non-numbers): such a call scores
  0.0 and is counted in `n_errors`; it never stops training.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence

from rlhflab.data.formatting import check_answer_format
from rlhflab.data.tasks import Problem
from rlhflab.errors import ConfigError

REWARD_KINDS: tuple[str, ...] = ("binary", "partial")


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def _last_number(text: str) -> str | None:
    """The last number in `text` ("... which is 1,234." -> "1234"; "-3.5" stays "-3.5")."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "").lstrip("+") if found else None


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces matched (nested braces kept)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed


def extract_answer(text: str, *, answer_format: str) -> str | None:
    """The answer contained in a completion, stripped of surrounding whitespace.

    Args:
        text: decoded completion (special tokens removed; `<answer>` tags are ordinary text).
        answer_format: "tags": content of the LAST `<answer>…</answer>` pair (the semantics of
            `reasoning_gym.utils.extract_answer`); "plain": the whole text; "last_number": the
            last number (thousands separators removed: real instruct models answer in sentences,
            "…which is 68."); "last_line": the last non-empty line; "boxed": the content of the
            last `\\boxed{…}`.

    Returns:
        The stripped answer, or None when there is none (no tag pair / number / box, or empty
        after stripping).
    """
    check_answer_format(answer_format)
    if answer_format == "tags":
        from reasoning_gym.utils import extract_answer as rg_extract

        answer = rg_extract(text, tag_name="answer", strip=True)
    elif answer_format == "last_number":
        answer = _last_number(text)
    elif answer_format == "last_line":
        lines = [line for line in text.splitlines() if line.strip()]
        answer = lines[-1] if lines else None
    elif answer_format == "boxed":
        answer = _last_boxed(text)
    else:
        answer = text
    if answer is None:
        return None
    answer = answer.strip()
    return answer or None


def load_extractor(spec: str) -> Callable[[str], str | None]:
    """The user extractor named by "module:function" (`task.extractor`): a function taking the
    completion text and returning the answer string or None.

    Raises:
        ConfigError: naming `task.extractor` when the module or function cannot be found.
    """
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ConfigError(f"task.extractor: expected 'module:function', got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"task.extractor: cannot load {spec!r}: {exc}") from None
    if not callable(fn):
        raise ConfigError(f"task.extractor: {spec!r} is not callable")
    return fn


class Verifier:
    """Scores completions of `Problem`s; keeps counters for logging.

    Args:
        answer_format: "tags", "plain", "last_number", "last_line" or "boxed" (`extract_answer`).
        extractor: "module:function" of a user extractor (text -> answer or None) used instead of
            `answer_format`; an extractor that raises counts as no answer.
        reward: "binary" (1.0 iff reasoning_gym's score is 1.0, else 0.0) or "partial"
            (reasoning_gym's score, clipped to [0, 1]).

    Counters (cumulative; reset with `reset_counters`):
        n_scored: completions scored; n_no_answer: of which no answer could be extracted;
        n_errors: of which the task's verifier raised (scored 0.0).

    Raises:
        ConfigError: bad `answer_format` or `reward`.
    """

    def __init__(
        self, *, answer_format: str = "tags", reward: str = "binary", extractor: str | None = None
    ):
        self.answer_format = check_answer_format(answer_format)
        self.extractor = load_extractor(extractor) if extractor else None
        if reward not in REWARD_KINDS:
            raise ConfigError(f"reward: must be one of {', '.join(REWARD_KINDS)}, got {reward!r}")
        self.reward = reward
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the counts of scored completions, verifier errors and answers not found."""
        self.n_scored = 0
        self.n_errors = 0
        self.n_no_answer = 0

    def extract(self, completion_text: str) -> str | None:
        """The answer of a completion: the user extractor's (stripped; None if it raises) or
        `extract_answer` in `answer_format`."""
        if self.extractor is None:
            return extract_answer(completion_text, answer_format=self.answer_format)
        try:
            answer = self.extractor(completion_text)
        except Exception:
            return None
        return str(answer).strip() or None if answer is not None else None

    def raw_score(self, completion_text: str, problem: Problem) -> float:
        """reasoning_gym's score of the extracted answer in [0, 1]; 0.0 if none or if it raises."""
        self.n_scored += 1
        answer = self.extract(completion_text)
        if answer is None:
            self.n_no_answer += 1
            return 0.0
        try:
            score = float(problem.score(answer))
        except Exception:
            self.n_errors += 1
            return 0.0
        if math.isnan(score):
            self.n_errors += 1
            return 0.0
        return min(max(score, 0.0), 1.0)

    def score_answer(self, answer: str, problem: Problem) -> float:
        """Reward of an already extracted answer (binary or partial, as `score`); 0.0 if the
        task's verifier raises."""
        try:
            score = float(problem.score(answer.strip()))
        except Exception:
            return 0.0
        score = 0.0 if math.isnan(score) else min(max(score, 0.0), 1.0)
        if self.reward == "binary":
            return 1.0 if score >= 1.0 else 0.0
        return score

    def score(self, completion_text: str, problem: Problem) -> float:
        """Reward in [0, 1] for one decoded completion (see class doc for binary vs partial)."""
        score = self.raw_score(completion_text, problem)
        if self.reward == "binary":
            return 1.0 if score >= 1.0 else 0.0
        return score

    def score_batch(self, texts: Sequence[str], problems: Sequence[Problem]) -> list[float]:
        """`[score(t, p) for t, p in zip(texts, problems)]`; lengths must match (ValueError)."""
        if len(texts) != len(problems):
            raise ValueError(f"{len(texts)} completions but {len(problems)} problems")
        return [self.score(t, p) for t, p in zip(texts, problems, strict=True)]

    def counters(self) -> dict[str, int]:
        """Counters as a dict, for logging."""
        return {
            "n_scored": self.n_scored,
            "n_errors": self.n_errors,
            "n_no_answer": self.n_no_answer,
        }
