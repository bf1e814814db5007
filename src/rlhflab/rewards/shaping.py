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
    parallel         ParallelConfig    the run's `parallel` section (reward models under FSDP2)
    vllm             VLLMConfig        the run's `rollout.vllm` section (a judge on its own vLLM
                                       engine), or None
    raw_scores       bool              True when measuring, not training (the gold-vs-proxy
                                       frontier): reward models return unnormalised scores

and the preset gives the others (`reward.components[i].args`, checked against the signature when
the config loads). Each returns a (B,) float32 tensor, logged as `rollout/reward/<name>_mean`
before weighting, or a pair (values (B,), extras {key: (B,)}) whose extras are diagnostics logged
beside it as `rollout/reward/<name>/<key>_mean` and never summed into the reward (the judge's
per-criterion scores and parse failures). The names of REWARD_COMPONENTS are the valid `reward.components[i].name` values.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from rlhflab.errors import ConfigError, NonFiniteError
from rlhflab.rewards.judge import judge_component
from rlhflab.rewards.reward_model import StepRewards, reward_model_component

__all__ = [
    "CORRECTNESS_COMPONENTS",
    "REWARD_COMPONENTS",
    "SUPPLIED_ARGS",
    "check_finite_reward",
    "correctness",
    "correctness_of",
    "dense_step_rewards",
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
    "parallel",
    "raw_scores",
    "vllm",
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
    "judge": judge_component,  # rlhflab.rewards.judge: an LLM judge
}


def score_components(
    components, supplied: dict, *, where: str = "batch", dense: list | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Total reward Σ weight·component and each component's unweighted (B,) values.

    A component with dense credit (it returns `StepRewards`, e.g. a PRM with `credit: dense`)
    does not enter the total: its weighted step rewards (weight·values, steps) are appended to
    `dense`, for the trainer to place per token, and its per-completion `score` is its logged
    value. The total is then the sequence-level (outcome) part of the reward alone.

    Args:
        components: `RewardComponentConfig`s (name, function, weight, args). A named component of
            REWARD_COMPONENTS receives the SUPPLIED_ARGS its signature names; a reward function
            (REWARD_FUNCTIONS name, or `function` import path) is called in TRL's convention on
            `supplied["problems"]` (the prompt rows) and `supplied["texts"]`.
        supplied: the SUPPLIED_ARGS values for this batch.
        where: names the batch in errors ("step 3", "eval").
    Returns:
        (total (B,) float32, {name: (B,) float32}; a component's extras as "<name>/<key>", never
        in the total). A reward function's None entries are NaN in
        its values (left out of its logged mean) and 0 in the total; a weight-0 component is
        computed and logged only and never enters the total, so a NaN it returns cannot reach
        the loss.
    Raises:
        RewardError: a reward function raised, returned the wrong length, a non-number or NaN.
        NonFiniteError: a weighted named component returned NaN/inf (names it and the row).
        ConfigError: a weighted component with dense credit where `dense` is None (a caller
            that takes one reward per completion).
    """
    n = len(supplied["texts"])
    total, parts = torch.zeros(n, dtype=torch.float32), {}
    for comp in components:
        fn = component_function(comp)
        if fn is None:
            fn = REWARD_COMPONENTS[comp.name]
            accepted = inspect.signature(fn).parameters
            values = fn(**{k: v for k, v in supplied.items() if k in accepted}, **comp.args)
            if isinstance(values, StepRewards):
                label = getattr(comp, "label", None) or comp.name
                parts[label] = values.score.float()
                if comp.weight != 0:
                    check_finite_reward(comp.name, values.values.sum(-1))  # NaN stays NaN
                    if dense is None:
                        raise ConfigError(
                            f"reward.components[{label}].args.credit: 'dense' gives per-token "
                            f"rewards, which {where} cannot take (one reward per completion)"
                        )
                    dense.append(
                        StepRewards(comp.weight * values.values, values.steps, values.score)
                    )
                continue
            if isinstance(values, tuple):  # (values, extras): extras are logged only
                values, extras = values
                label = getattr(comp, "label", None) or comp.name
                parts.update({f"{label}/{k}": v.float() for k, v in extras.items()})
            values = values.float()
            if comp.weight != 0:
                check_finite_reward(comp.name, values)
        else:
            values = call_reward_function(
                fn, comp, supplied["problems"], supplied["texts"], where=where
            )
        parts[getattr(comp, "label", None) or comp.name] = values
        if comp.weight != 0:
            total = total + comp.weight * torch.nan_to_num(values, nan=0.0)
    return total, parts


def component_function(comp):
    """The TRL-convention reward function of a component (by `function` path or REWARD_FUNCTIONS
    name), or None for a named component of REWARD_COMPONENTS."""
    from rlhflab.rewards.functions import REWARD_FUNCTIONS, load_reward_function

    if getattr(comp, "function", None):
        return load_reward_function(comp.function)
    return REWARD_FUNCTIONS.get(comp.name)


def call_reward_function(fn, comp, rows: list, texts: list[str], *, where: str) -> Tensor:
    """Call `fn(prompts=prompts, completions=completions, **columns, **comp.args)` for prompt
    rows and completions: by keyword, as TRL's GRPOTrainer calls reward functions, so a function
    written for TRL as `f(completions, **kwargs)` works.

    Conversational rows (prompt = messages) get completions as `[{"role": "assistant",
    "content": text}]`, as in TRL. Columns missing from a row are None in its list.
    Returns (B,) float32 with NaN for None. Raises RewardError (one line naming the function and
    `where`) when fn raises, returns a non-list or the wrong length, a non-number or NaN.
    """
    import math

    from rlhflab.errors import RewardError
    from rlhflab.rewards.functions import call_kwargs

    label = comp.name if not getattr(comp, "function", None) else f"{comp.name} ({comp.function})"
    prompts = [getattr(r, "prompt", getattr(r, "question", None)) for r in rows]
    completions = [
        t if isinstance(p, str) else [{"role": "assistant", "content": t}]
        for p, t in zip(prompts, texts, strict=True)
    ]
    keys = sorted({k for r in rows for k in getattr(r, "columns", {})})
    columns = {k: [getattr(r, "columns", {}).get(k) for r in rows] for k in keys}
    kwargs = call_kwargs(fn, {**columns, **comp.args})
    try:
        out = fn(prompts=prompts, completions=completions, **kwargs)
    except Exception as exc:
        msg = " ".join(str(exc).split())[:200]
        raise RewardError(
            f"reward function '{label}' raised {type(exc).__name__}: {msg} "
            f"(on {where}, {len(texts)} completions)"
        ) from None
    if isinstance(out, Tensor):
        out = out.tolist()
    if not isinstance(out, list | tuple) or len(out) != len(texts):
        got = f"length {len(out)}" if isinstance(out, list | tuple) else type(out).__name__
        raise RewardError(
            f"reward function '{label}' returned {got} for {len(texts)} completions (on {where})"
        )
    values = []
    for i, v in enumerate(out):
        if v is None:
            values.append(float("nan"))
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise RewardError(
                f"reward function '{label}' returned {type(v).__name__} at index {i} "
                f"(on {where}); expected float or None"
            )
        if math.isnan(v):
            raise RewardError(
                f"reward function '{label}' returned NaN at index {i} (on {where}); "
                "return None for no reward"
            )
        values.append(float(v))
    return torch.tensor(values, dtype=torch.float32)


#: Components whose value is a correctness (a verifier's judgement of the answer), in the order
#: in which one is chosen as the held-out headline of a prompt dataset (`TextRewardScorer`).
CORRECTNESS_COMPONENTS = ("correctness", "math_verify", "exact_match")


def correctness_of(components: dict[str, Tensor]) -> Tensor | None:
    """The (B,) correctness among a batch's reward components (name -> (B,) values): the first
    of CORRECTNESS_COMPONENTS present (1 = right), None when the reward has none."""
    for name in CORRECTNESS_COMPONENTS:
        if name in components:
            return components[name]
    return None


class TextRewardScorer:
    """Held-out scoring of a prompt dataset: `score_batch(texts, rows)` is the weighted sum of the
    reward components computable from text alone (reward functions, `format`); components that
    need the sampled tokens (length, overlong, reward_model) are left out and listed in `skipped`.
    Used in place of a task `Verifier` by `rlhflab.eval.accuracy.evaluate`, which also reads
    `score_detail` (every text-computable component, weight-0 ones included, on its own) and
    `correctness_key`: the first component named in CORRECTNESS_COMPONENTS (math_verify, ...),
    the held-out headline ("correctness (math_verify)"); without one the headline is the
    weighted sum, named as such ("reward (weighted sum: a=1, b=0.5)"), never "accuracy".
    """

    def __init__(self, components, verifier=None):
        self.verifier = verifier
        self.components, self.skipped, self.reported = [], [], []
        for comp in components:
            if component_function(comp) is None:
                params = inspect.signature(REWARD_COMPONENTS[comp.name]).parameters
                needs = {k for k in params if k in SUPPLIED_ARGS}
                if not needs <= {"texts", "problems", "verifier"}:
                    self.skipped.append(comp.name)
                    continue
            self.reported.append(comp)
            if comp.weight != 0:
                self.components.append(comp)
        self.n_errors = 0
        correct = [
            _label(c)
            for name in CORRECTNESS_COMPONENTS
            for c in self.reported
            if c.name == name and not getattr(c, "function", None)
        ]
        self.correctness_key = f"reward/{correct[0]}" if correct else None
        weights = ", ".join(f"{_label(c)}={c.weight:g}" for c in self.components)
        self.headline_name = (
            f"correctness ({correct[0]})" if correct else f"reward (weighted sum: {weights})"
        )

    def score_batch(self, texts: list[str], rows: list) -> list[float]:
        """Weighted text-only reward of each completion (B floats)."""
        total, _ = score_components(
            self.components,
            {"texts": texts, "problems": rows, "verifier": self.verifier},
            where="held-out eval",
        )
        return total.tolist()

    def score_detail(self, texts: list[str], rows: list) -> dict[str, list[float]]:
        """{"reward": weighted sum, "reward/<label>": each reported component unweighted} of
        each completion (B floats each; a reward function's None is NaN)."""
        total, parts = score_components(
            self.reported,
            {"texts": texts, "problems": rows, "verifier": self.verifier},
            where="held-out eval",
        )
        return {"reward": total.tolist(), **{f"reward/{k}": v.tolist() for k, v in parts.items()}}

    def answer_key(self, text: str) -> str | None:
        """The final answer of `text` for majority voting: the content of its last
        `<answer>…</answer>` pair, else the task verifier's extraction (when one is set), else
        the stripped text; None when empty."""
        from rlhflab.rewards.functions import _ANSWER

        found = _ANSWER.findall(text)
        if found:
            return found[-1].strip() or None
        if self.verifier is not None:
            return self.verifier.extract(text)
        return text.strip() or None


def _label(comp) -> str:
    return getattr(comp, "label", None) or comp.name


def check_finite_reward(name: str, values: Tensor) -> None:
    """Raise NonFiniteError naming the reward component and the first row whose value is NaN or
    infinite (before any update uses it)."""
    bad = (~torch.isfinite(values)).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise NonFiniteError(
            f"reward component '{name}' returned {float(values[row])} for row {row} of the "
            "batch; rewards must be finite"
        )


def dense_step_rewards(dense: list, mask: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The weighted step rewards of a batch's dense components (`score_components`' `dense`),
    summed: (step_rewards (B, T) float32, 0 off the steps; steps (B, T) bool, the union of the
    components' step positions), or (None, None) when there are none. mask: the completion
    mask (B, T) they are aligned with (their device)."""
    if not dense:
        return None, None
    values = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    steps = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    for d in dense:
        values = values + d.values.to(values)
        steps = steps | d.steps.to(mask.device)
    return values, steps
