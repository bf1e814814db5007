"""Reward-model training data at the token level, from a policy's own samples and a verifier.

`rlhflab.rollout.scored.sample_and_score` samples K completions per problem from a policy (one
batched call per chunk, the same sampler RL uses) and labels each with the verifier; this module
only shapes what it returns (it samples nothing). From one `ScoredSamples` come:

* preference pairs (`pairs_from_samples`): correct ≻ incorrect completions of the same prompt,
  every (correct, incorrect) combination up to `max_pairs_per_prompt`;
* ORM data (`orm_from_samples`): each completion with its outcome label (1 correct, 0 not);
* PRM data (`prm_from_samples`): each completion split into steps at the separator token, the
  steps rated by `rlhflab.data.prm.label_steps` against the problem's expression.

Everything stays token ids: the sampler's ids are what the RM is trained on and later scores, so
nothing is decoded and re-tokenised. `truncate_items` cuts to a length budget and drops pairs whose
two sides become identical, counting them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlhflab.data.preference import TokenizedPair
from rlhflab.data.prm import IGNORE_INDEX, label_steps, step_label_ids


@dataclass
class LabelledCompletion:
    """ORM item: prompt ids, completion ids (ending in eos unless truncated), label in [0, 1]."""

    prompt_ids: list[int]
    completion_ids: list[int]
    label: float


@dataclass
class StepLabelledCompletion:
    """PRM item: `labels` aligned with `completion_ids`, a class id at separators, −100 elsewhere."""

    prompt_ids: list[int]
    completion_ids: list[int]
    labels: list[int]


@dataclass
class ScoredSamples:
    """K sampled completions per problem and their verifier scores."""

    problems: list
    prompt_ids: list[list[int]]  # one per problem
    completion_ids: list[list[list[int]]]  # [problem][k] generated ids incl. eos
    texts: list[list[str]]
    scores: list[list[float]]


def pairs_from_samples(
    ss: ScoredSamples, *, max_pairs_per_prompt: int = 4, seed: int = 0
) -> tuple[list[TokenizedPair], dict[str, int]]:
    """Correct ≻ incorrect pairs of the same prompt (score 1.0 vs < 1.0), distinct token ids.

    Returns (pairs, {"prompts", "prompts_with_contrast", "pairs", "identical_dropped"}).
    """
    rng = random.Random(seed)
    pairs: list[TokenizedPair] = []
    counts = {
        "prompts": len(ss.problems),
        "prompts_with_contrast": 0,
        "pairs": 0,
        "identical_dropped": 0,
    }
    for i in range(len(ss.problems)):
        good = [c for c, s in zip(ss.completion_ids[i], ss.scores[i], strict=True) if s >= 1.0]
        bad = [c for c, s in zip(ss.completion_ids[i], ss.scores[i], strict=True) if s < 1.0]
        combos = [(g, b) for g in good for b in bad]
        if not combos:
            continue
        counts["prompts_with_contrast"] += 1
        rng.shuffle(combos)
        for g, b in combos[:max_pairs_per_prompt]:
            if g == b:
                counts["identical_dropped"] += 1
                continue
            pairs.append(TokenizedPair(list(ss.prompt_ids[i]), list(g), list(b)))
    counts["pairs"] = len(pairs)
    return pairs, counts


def orm_from_samples(ss: ScoredSamples) -> list[LabelledCompletion]:
    """Every sampled completion with its outcome label (1.0 iff the verifier gave 1.0)."""
    return [
        LabelledCompletion(list(ss.prompt_ids[i]), list(c), 1.0 if s >= 1.0 else 0.0)
        for i in range(len(ss.problems))
        for c, s in zip(ss.completion_ids[i], ss.scores[i], strict=True)
    ]


def split_at_separator(completion_ids: list[int], sep_id: int, eos_id: int | None):
    """(step id lists, positions of the separators) of a completion; text after the last separator
    is not a step."""
    steps, positions, cur = [], [], []
    for pos, t in enumerate(completion_ids):
        if t == sep_id:
            steps.append(cur)
            positions.append(pos)
            cur = []
        elif t != eos_id:
            cur.append(t)
    return steps, positions


def prm_from_samples(
    ss: ScoredSamples, tokenizer, *, sep_id: int, num_classes: int = 2
) -> tuple[list[StepLabelledCompletion], dict[str, int]]:
    """Sampled solutions with per-step labels from `label_steps` on the problem's expression.

    Completions with no separator (no steps) are kept only if they are wrong answers: they then get
    no step label and carry no PRM loss, so they are dropped and counted as "no_steps".
    """
    out: list[StepLabelledCompletion] = []
    counts = {"no_steps": 0, "no_expression": 0, "steps": 0}
    for i, problem in enumerate(ss.problems):
        expression = (problem.entry.get("metadata") or {}).get("expression")
        if expression is None:
            counts["no_expression"] += len(ss.completion_ids[i])
            continue
        for c in ss.completion_ids[i]:
            step_ids, positions = split_at_separator(c, sep_id, tokenizer.eos_token_id)
            if not positions:
                counts["no_steps"] += 1
                continue
            texts = tokenizer.batch_decode(step_ids, skip_special_tokens=True)
            try:
                ratings = label_steps(expression, texts)
            except ValueError:
                counts["no_expression"] += 1
                continue
            labels = [IGNORE_INDEX] * len(c)
            for pos, cls in zip(positions, step_label_ids(ratings, num_classes), strict=True):
                labels[pos] = cls
            counts["steps"] += len(positions)
            out.append(StepLabelledCompletion(list(ss.prompt_ids[i]), list(c), labels))
    return out, counts


def truncate_items(items: list, max_len: int) -> tuple[list, dict[str, int]]:
    """Cut completions so prompt + completion ≤ max_len; drop pairs identical after the cut and
    items whose prompt leaves no room. Returns (items, {"truncated", "identical_after_truncation",
    "prompt_too_long"})."""
    counts = {"truncated": 0, "identical_after_truncation": 0, "prompt_too_long": 0}
    out = []
    for it in items:
        room = max_len - len(it.prompt_ids)
        if room < 1:
            counts["prompt_too_long"] += 1
            continue
        if isinstance(it, TokenizedPair):
            c, r = it.chosen_ids[:room], it.rejected_ids[:room]
            counts["truncated"] += len(c) < len(it.chosen_ids) or len(r) < len(it.rejected_ids)
            if c == r:
                counts["identical_after_truncation"] += 1
                continue
            out.append(TokenizedPair(it.prompt_ids, c, r))
        elif isinstance(it, StepLabelledCompletion):
            counts["truncated"] += len(it.completion_ids) > room
            out.append(
                StepLabelledCompletion(it.prompt_ids, it.completion_ids[:room], it.labels[:room])
            )
        else:
            counts["truncated"] += len(it.completion_ids) > room
            out.append(LabelledCompletion(it.prompt_ids, it.completion_ids[:room], it.label))
    return out, counts
