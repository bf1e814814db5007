"""Reward functions in TRL's calling convention, by name or by import path.

    fn(prompts=..., completions=..., **columns) -> list[float | None]

Called by keyword, as TRL's GRPOTrainer does (`_calculate_rewards`). TRL also passes
`completion_ids`, `trainer_state`, `log_extra` and `log_metric` (and `environments`); rlhflab
does not, so a function that reads them fails with a one-line RewardError.
`prompts` and `completions` hold one entry per completion (a prompt repeated group_size times):
strings for standard prompts; for conversational prompts, `prompts[i]` is the message list and
`completions[i]` is `[{"role": "assistant", "content": text}]`, as TRL passes them. `columns` are
the prompt rows' other columns (each a list aligned with `completions`, e.g. `answer`). A None
entry means "no reward for this sample"; it is left out of the sum and of the logged mean.

Users bring their own by import path (`reward.components[i].function`):
`"package.module:function"` or `"path/to/file.py:function"`. Built-in functions (REWARD_FUNCTIONS):

* `math_verify` — equivalence of the completion's final answer and the gold answer through the
  math-verify library (Hugging Face): the gold is GSM8K's `#### 42` line or MATH's last `\\boxed{}`
  (whichever the gold column holds), the completion's answer is the content of its last
  `<answer>…</answer>` pair when there is one, else the whole text (math-verify takes the last
  `\\boxed{}` or number). 1.0 if equivalent, else 0.0.
* `exact_match` — 1.0 iff the extracted answer equals the gold column's text, both stripped.
* `think_format` — 1.0 iff the completion is `<think>…</think>` followed by `<answer>…</answer>`
  and nothing else (DeepSeek-R1's format reward, arXiv 2501.12948 §2.2.2).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhflab.errors import ConfigError

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"  # text without a think/answer tag in it
_THINK_ANSWER = re.compile(
    rf"^\s*<think>{_NO_TAG}</think>\s*<answer>{_NO_TAG}</answer>\s*$", re.DOTALL
)


def completion_text(completion: Any) -> str:
    """The text of a completion: itself (str) or the content of its last message (TRL's
    conversational form `[{"role": "assistant", "content": …}]`)."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"]


def final_answer(text: str) -> str:
    """The content of the last `<answer>…</answer>` pair, stripped; the whole text when none."""
    found = _ANSWER.findall(text)
    return (found[-1] if found else text).strip()


def gold_answer_text(gold: str) -> str:
    """The gold answer as math-verify should read it: GSM8K's text after the last `####`
    (thousands separators removed); MATH's solution as is (math-verify takes its last
    `\\boxed{}`); anything else as is."""
    if "####" in gold:
        return gold.rpartition("####")[2].strip().replace(",", "")
    return gold


def _mv_parse(text: str):
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()])


def math_verify(
    prompts: list, completions: list, *, gold_column: str = "answer", **columns
) -> list[float | None]:
    """1.0 where math-verify finds the completion's final answer equivalent to the gold answer.

    Args:
        prompts, completions: TRL convention (see module doc).
        gold_column: the column holding the gold answer (GSM8K "answer", MATH "solution").
    Returns:
        list[float] of 0.0 / 1.0; None where the gold answer is missing or math-verify cannot
        parse it (no reward rather than a wrong one).
    Source: math-verify (github.com/huggingface/Math-Verify): `parse` then `verify(gold, answer)`.
    """
    from math_verify import verify

    golds = columns.get(gold_column)
    if golds is None:
        raise ValueError(f"no column {gold_column!r} (columns: {', '.join(sorted(columns))})")
    out: list[float | None] = []
    cache: dict[str, Any] = {}
    for completion, gold in zip(completions, golds, strict=True):
        if gold is None:
            out.append(None)
            continue
        gold = str(gold)
        if gold not in cache:
            cache[gold] = _mv_parse(gold_answer_text(gold))
        parsed_gold = cache[gold]
        if not parsed_gold:
            out.append(None)
            continue
        answer = _mv_parse(final_answer(completion_text(completion)))
        out.append(1.0 if answer and verify(parsed_gold, answer) else 0.0)
    return out


def exact_match(
    prompts: list, completions: list, *, gold_column: str = "answer", **columns
) -> list[float | None]:
    """1.0 iff the completion's final answer (see `final_answer`) equals the gold column's text
    (GSM8K golds: the number after `####`), both stripped; None where the gold is missing."""
    golds = columns.get(gold_column)
    if golds is None:
        raise ValueError(f"no column {gold_column!r} (columns: {', '.join(sorted(columns))})")
    return [
        None if g is None else float(final_answer(completion_text(c)) == gold_answer_text(str(g)))
        for c, g in zip(completions, golds, strict=True)
    ]


def think_format(prompts: list, completions: list, **columns) -> list[float]:
    """1.0 iff the completion is exactly `<think>…</think><answer>…</answer>` (whitespace around
    allowed), else 0.0 — R1-Zero's format reward (arXiv 2501.12948 §2.2.2). Exactly one block of
    each: a block whose text contains a think/answer tag (repeated or nested blocks, e.g.
    `…</answer><answer>…</answer>`) gets 0.0."""
    return [float(bool(_THINK_ANSWER.match(completion_text(c)))) for c in completions]


REWARD_FUNCTIONS: dict[str, Callable] = {
    "math_verify": math_verify,
    "exact_match": exact_match,
    "think_format": think_format,
}


def load_reward_function(spec: str) -> Callable:
    """The function named by `spec`: "package.module:function" or "path/to/file.py:function".

    Raises:
        ConfigError: malformed spec, module or file not found, import failure, no such attribute,
            or not callable (one line naming the spec).
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(
            f"reward function {spec!r}: expected 'package.module:function' or "
            "'path/to/file.py:function'"
        )
    target, attr = spec.split(":")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise ConfigError(f"reward function {spec!r}: file not found: {target}")
            mod_name = f"rlhflab_user_reward_{abs(hash(str(path)))}"
            module = sys.modules.get(mod_name)
            if module is None:
                loader_spec = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(loader_spec)
                loader_spec.loader.exec_module(module)
                sys.modules[mod_name] = module
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as exc:
        msg = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(
            f"reward function {spec!r}: cannot import {target}: {type(exc).__name__}: {msg}"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"reward function {spec!r}: {target} has no attribute {attr!r}")
    if not callable(fn):
        raise ConfigError(f"reward function {spec!r}: {attr} is not callable")
    return fn


def call_kwargs(fn: Callable, columns: dict) -> dict:
    """The columns `fn` accepts: all of them when it takes **kwargs, else those it names."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return columns
    return {k: v for k, v in columns.items() if k in params}
