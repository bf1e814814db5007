"""Samples a trainer draws outside its training loop's sampler: direct alignment's pairs sampled
from the policy and labelled (verifiable pairs, online DPO's rounds), and its in-loop greedy
samples. Part of `rlhflab.experience`."""

from __future__ import annotations

import torch

from rlhflab import distributed
from rlhflab.data.formatting import encode_prompt, format_completion
from rlhflab.data.preference import pairs_from_scored_samples
from rlhflab.data.prompts import render_row
from rlhflab.rewards.shaping import score_components
from rlhflab.rollout.engines import SamplingParams, make_engine, sample_chunks

__all__ = ["verifiable_pairs", "write_greedy_samples"]


def verifiable_pairs(
    model, tokenizer, problems, verifier, vcfg, task, *, generator, rng, chunk, autocast_dtype,
    system=None, instruction=None,
):  # fmt: skip
    """Sample K completions per prompt row from `model`, score them (the task's verifier, or
    `vcfg.reward` components: reward functions, a reward model), pair best with worst. Prompts
    carry `system` and the answer-format `instruction` (`render_row`).

    Returns (pairs, counts): `pairs_from_scored_samples`' counts plus the mean label of the
    sampled completions under one of three names: `sample_accuracy` (binary verifier: the
    fraction correct), `sample_verifier_score_mean` (partial-credit verifier) or
    `sample_reward_mean` (the weighted sum of the `verifiable.reward` components, e.g. a reward
    model's score: never an accuracy)."""
    prompts = [render_row(tokenizer, p, system=system, instruction=instruction) for p in problems]
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    K = vcfg.samples_per_prompt
    texts: list[str] = []
    scores: list[float] = []
    flat = [p for p in ids for _ in range(K)]
    rows = [p for p in problems for _ in range(K)]
    # Every data-parallel rank samples every prompt with the same draws (the generators are in
    # step), so all ranks build the same pairs; under FSDP2 the parameters are gathered once.
    # Through the hf rollout engine; a group's repeated prompt is prefilled once (prefix sharing).
    engine = make_engine(None, model, tokenizer, autocast_dtype=autocast_dtype)
    params = SamplingParams(max_new_tokens=vcfg.max_new_tokens, temperature=vcfg.temperature)
    desc = f"sampling pairs ({len(problems)} prompts x {K})"
    with distributed.gathered(model):
        chunks = sample_chunks(model, engine, tokenizer, flat, params, chunk=chunk,
                               generator=generator, desc=desc)  # fmt: skip
        for s, ro, chunk_texts in chunks:
            texts.extend(chunk_texts)
            if vcfg.reward is not None:  # labelled by reward components, as in policy gradients
                total, _ = score_components(
                    vcfg.reward,
                    {
                        "texts": chunk_texts,
                        "problems": rows[s : s + chunk],
                        "verifier": verifier,
                        "lengths": ro.lengths.cpu(),
                        "truncated": ro.truncated.cpu(),
                        "max_new_tokens": vcfg.max_new_tokens,
                        "rollout": ro,
                    },
                    where="pair sampling",
                )
                scores.extend(total.tolist())
    if vcfg.reward is None:
        scores = verifier.score_batch(texts, rows)
    samples = [texts[i * K : (i + 1) * K] for i in range(len(problems))]
    score_rows = [scores[i * K : (i + 1) * K] for i in range(len(problems))]
    gold = [
        None
        if p.answer is None or getattr(p, "problem", True) is None  # dataset rows: no gold
        else format_completion(p.answer, answer_format=task.answer_format)
        for p in problems
    ]
    pairs, counts = pairs_from_scored_samples(
        prompts, samples, score_rows, gold=gold, chosen_source=vcfg.chosen, rng=rng
    )
    # The mean label of the sampled completions, named for what it is: an accuracy only when it
    # is the fraction a binary verifier marks correct; a partial-credit verifier gives a mean
    # score, reward components (functions, a reward model) a mean weighted-sum reward.
    mean = sum(scores) / max(1, len(scores))
    if vcfg.reward is not None:
        counts["sample_reward_mean"] = mean
    elif getattr(verifier, "reward", "binary") == "binary":
        counts["sample_accuracy"] = mean
    else:
        counts["sample_verifier_score_mean"] = mean
    return pairs, counts


@torch.no_grad()
def write_greedy_samples(
    writer, step, model, tokenizer, problems, scorer, cfg, autocast_dtype, system=None,
    instruction=None,
) -> None:  # fmt: skip
    """Greedy completions of the first held-out prompts (in-loop samples), with their scores."""
    problems = problems[: cfg.tracking.samples_per_step]
    if not problems:
        return
    prompts = [
        encode_prompt(tokenizer, render_row(tokenizer, p, system=system, instruction=instruction))
        for p in problems
    ]
    engine = make_engine(None, model, tokenizer, autocast_dtype=autocast_dtype)
    greedy = SamplingParams(max_new_tokens=cfg.eval.max_new_tokens, greedy=True)
    with distributed.gathered(model):
        [(_, _, texts)] = sample_chunks(model, engine, tokenizer, prompts, greedy)
    scores = scorer.score_batch(texts, problems)
    writer.write(
        step,
        [
            {"prompt": p.question, "completion": c, "reward": r, "answer": p.answer}
            for p, c, r in zip(problems, texts, scores, strict=True)
        ],
    )
