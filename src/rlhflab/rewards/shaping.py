"""Reward components: the scalar reward of a completion is Σ_k weight_k · component_k.

A component is a function with keyword-only arguments. The trainer supplies, by name, whichever of
these it accepts (SUPPLIED_ARGS):

    texts            list[str] (B)     decoded completions
    problems         list[Problem] (B) the prompts' problems (question, answer, verifier)
    verifier         Verifier          the task's verifier (task.answer_format, task.reward)
    lengths          (B,) float        completion lengths in tokens (EOS included)
    truncated        (B,) bool         no EOS within the budget
    max_new_tokens   int               the generation budget L_max
    rollout          Rollout           the sampled token ids (for reward models)

and the preset gives the others (`reward.components[i].args`, checked against the signature when
the config loads). Each returns a (B,) float32 tensor, logged as `rollout/reward/<name>_mean`
before weighting. The names of REWARD_COMPONENTS are the valid `reward.components[i].name` values.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from rlhflab.rewards.reward_model import reward_model_component

__all__ = [
    "REWARD_COMPONENTS",
    "SUPPLIED_ARGS",
    "correctness",
    "format_reward",
    "length_penalty",
    "overlong_penalty",
    "score_components",
    "soft_overlong_penalty",
]

SUPPLIED_ARGS = {
    "texts",
    "problems",
    "verifier",
    "lengths",
    "truncated",
    "max_new_tokens",
    "rollout",
}


def soft_overlong_penalty(lengths: Tensor, *, max_len: int, cache: int) -> Tensor:
    """DAPO's soft overlong punishment R_length(y), piecewise linear in |y|.

        R = 0                                 if |y| <= L_max − L_cache
        R = ((L_max − L_cache) − |y|) / L_cache  if L_max − L_cache < |y| <= L_max
        R = −1                                if |y| > L_max
    with L_max = max_len, L_cache = cache. A completion truncated at the budget (|y| = L_max) gets −1.
    Shapes: lengths (B,) int or float. Returns (B,) float32.
    Source: Yu et al. 2025, DAPO, arXiv 2503.14476, §3.4, eq. 13 (the paper uses L_max = 20480,
    L_cache = 4096).
    Raises: ValueError unless 0 < cache <= max_len.
    """
    if not 0 < cache <= max_len:
        raise ValueError(f"need 0 < cache <= max_len, got cache={cache}, max_len={max_len}")
    n = lengths.float()
    start = max_len - cache
    ramp = (start - n) / cache
    return torch.where(n <= start, 0.0, torch.where(n <= max_len, ramp, -1.0))


def correctness(*, texts: list[str], problems: list, verifier) -> Tensor:
    """The task verifier's score of the extracted answer: 1/0 ("binary") or in [0, 1] ("partial")."""
    return torch.tensor(verifier.score_batch(texts, problems), dtype=torch.float32)


def format_reward(*, texts: list[str], verifier) -> Tensor:
    """1.0 where an answer can be extracted in the task's answer_format or by its extractor (tags
    present and non-empty for "tags"; any non-blank text for "plain"; a number for
    "last_number"; ...), else 0.0."""
    return torch.tensor(
        [float(verifier.extract(t) is not None) for t in texts], dtype=torch.float32
    )


def length_penalty(*, lengths: Tensor, max_new_tokens: int) -> Tensor:
    """−|y| / L_max: a linear cost per generated token, −1 at the budget (scale it with `weight`)."""
    return -lengths.float() / max_new_tokens


def overlong_penalty(
    *, lengths: Tensor, max_new_tokens: int, cache: int, max_len: int | None = None
) -> Tensor:
    """DAPO's soft overlong punishment (see `soft_overlong_penalty`) with L_max = max_len, or the
    generation budget max_new_tokens when max_len is None."""
    return soft_overlong_penalty(lengths, max_len=max_len or max_new_tokens, cache=cache)


REWARD_COMPONENTS = {
    "correctness": correctness,
    "format": format_reward,
    "length": length_penalty,
    "overlong": overlong_penalty,
    "reward_model": reward_model_component,  # rlhflab.rewards.reward_model
}


def score_components(components, supplied: dict) -> tuple[Tensor, dict[str, Tensor]]:
    """Total reward Σ weight·component and each component's unweighted (B,) values.

    Args:
        components: `RewardComponentConfig`s (name, weight, args).
        supplied: the SUPPLIED_ARGS values for this batch; each component receives the ones its
            signature names.
    Returns:
        (total (B,) float32, {name: (B,) float32}).
    """
    total, parts = None, {}
    for comp in components:
        fn = REWARD_COMPONENTS[comp.name]
        accepted = inspect.signature(fn).parameters
        values = fn(**{k: v for k, v in supplied.items() if k in accepted}, **comp.args).float()
        parts[comp.name] = values
        total = comp.weight * values if total is None else total + comp.weight * values
    return total, parts
