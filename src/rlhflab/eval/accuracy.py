"""Held-out evaluation: greedy accuracy and sampled pass@k, with standard errors.

Accuracy is the mean verifier reward of the greedy completion (binary reward: the fraction of
problems solved). Its standard error is the sample standard deviation of the per-problem scores
over sqrt(n) (for binary scores, sqrt(p(1 − p)/(n − 1))). pass@k uses the unbiased estimator of
Chen et al. 2021 (arXiv 2107.03374, eq. 1) from n_samples >= k samples per problem.
"""

from __future__ import annotations

import math

import torch

from rlhflab.data.formatting import encode_prompt
from rlhflab.data.prompts import render_row
from rlhflab.rollout.engines import SamplingParams, make_engine
from rlhflab.rollout.sampler import decode_completions
from rlhflab.tracking import progress


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 − C(n − c, k) / C(n, k) for c correct among n samples (k <= n)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 < k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_and_stderr(values: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample std with Bessel's correction over sqrt(n))."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    if n == 1:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    problems: list,
    verifier,
    *,
    batch_size: int = 256,
    max_new_tokens: int = 32,
    k: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    system: str | None = None,
    instruction: str | None = None,
    autocast_dtype: torch.dtype | None = None,
    return_completions: bool = False,
    return_scores: bool = False,
    engine=None,
) -> dict:
    """Greedy accuracy (and pass@k when k > 0) of `model` on `problems`.

    Args:
        problems: held-out task `Problem`s or prompt rows (`rlhflab.data.prompts.PromptRow`).
        verifier: a `Verifier` (its reward mode decides binary/partial) or any object with
            `score_batch(texts, rows) -> list[float]` (a prompt dataset's `TextRewardScorer`;
            "accuracy" is then the mean held-out reward).
        k: samples per problem at `temperature` for pass@1 / pass@k; 0 skips sampling.
        system, instruction: the system turn and the answer-format instruction rendered into
            every prompt (`rlhflab.data.prompts.render_row`), as in training.
        engine: the rollout engine to sample with (`rlhflab.rollout.engines`); default the `hf`
            engine on `model`.

    Returns:
        {"accuracy", "accuracy_stderr", "n"} plus {"pass@1", "pass@k", "k"} when k > 0, and
        "completions" (greedy texts) when return_completions; the per-problem lists "scores",
        "pass@1_scores", "pass@k_scores" when return_scores (to combine shards of a problem set).
    """
    was_training = model.training
    model.eval()
    prompts = [
        encode_prompt(tokenizer, render_row(tokenizer, p, system=system, instruction=instruction))
        for p in problems
    ]
    _check_context(model, prompts, max_new_tokens)
    # Sampling goes through a rollout engine (default: the hf engine on `model`).
    engine = engine or make_engine(None, model, tokenizer, autocast_dtype=autocast_dtype)
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    scores: list[float] = []
    texts: list[str] = []
    batches = range(0, len(prompts), batch_size)
    for start in progress(batches, f"eval ({len(prompts)} problems)"):
        chunk = prompts[start : start + batch_size]
        ro = engine.generate(chunk, greedy)
        decoded = decode_completions(tokenizer, ro, engine.stop_token_ids)
        texts.extend(decoded)
        scores.extend(verifier.score_batch(decoded, problems[start : start + batch_size]))
    acc, se = mean_and_stderr(scores)
    result = {"accuracy": acc, "accuracy_stderr": se, "n": len(problems)}
    if k > 0:
        gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        per_prompt = max(1, batch_size // k)
        p1, pk = [], []
        batches = range(0, len(prompts), per_prompt)
        for start in progress(batches, f"pass@{k} ({len(prompts)} problems x {k})"):
            chunk_problems = problems[start : start + per_prompt]
            chunk = prompts[start : start + per_prompt]
            params = SamplingParams(n=k, max_new_tokens=max_new_tokens, temperature=temperature)
            ro = engine.generate(chunk, params, generator=gen)
            decoded = decode_completions(tokenizer, ro, engine.stop_token_ids)
            sampled = verifier.score_batch(decoded, [p for p in chunk_problems for _ in range(k)])
            for i in range(len(chunk_problems)):
                row = sampled[i * k : (i + 1) * k]
                correct = sum(1 for s in row if s == 1.0)
                p1.append(sum(row) / k)
                pk.append(pass_at_k(k, correct, k))
        result["pass@1"], result["pass@1_stderr"] = mean_and_stderr(p1)
        result["pass@k"], result["pass@k_stderr"] = mean_and_stderr(pk)
        result["k"] = k
    if return_completions:
        result["completions"] = texts
    if return_scores:
        result["scores"] = scores
        if k > 0:
            result["pass@1_scores"], result["pass@k_scores"] = p1, pk
    model.train(was_training)
    return result


def majority_baseline(train: list, heldout: list, verifier) -> dict:
    """The accuracy of answering every held-out problem with the most common training answer.

    An SFT model that learnt only the majority answer scores this much (79% of letter_counting
    answers are "1"): print it beside every accuracy. The answer is scored by `verifier` as the
    bare answer text, so partial credit and answer formats are treated like a model's.

    Args:
        train: Problems whose answers define the majority (the training split).
        heldout: Problems to score it on.
    Returns:
        {"majority_answer": str | None, "majority_accuracy": float, "majority_accuracy_stderr":
        float}; accuracy 0 with answer None when no training answer exists.
    """
    from collections import Counter

    answers = Counter(str(p.answer).strip() for p in train if p.answer is not None)
    if not answers or not heldout:
        return {"majority_answer": None, "majority_accuracy": 0.0, "majority_accuracy_stderr": 0.0}
    answer = answers.most_common(1)[0][0]
    n_scored, n_errors, n_no = verifier.n_scored, verifier.n_errors, verifier.n_no_answer
    scores = [float(verifier.score_answer(answer, p)) for p in heldout]
    verifier.n_scored, verifier.n_errors, verifier.n_no_answer = n_scored, n_errors, n_no
    acc, se = mean_and_stderr(scores)
    return {"majority_answer": answer, "majority_accuracy": acc, "majority_accuracy_stderr": se}


def majority_results(baseline: dict | None) -> dict:
    """A `majority_baseline` result as final_results.json keys: heldout_majority_answer,
    heldout_majority_baseline, heldout_majority_baseline_stderr (all None without a baseline:
    held-out scores that are not a task's verifier accuracy)."""
    baseline = baseline or {}
    return {
        "heldout_majority_answer": baseline.get("majority_answer"),
        "heldout_majority_baseline": baseline.get("majority_accuracy"),
        "heldout_majority_baseline_stderr": baseline.get("majority_accuracy_stderr"),
    }


def _check_context(model, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Raise DataError naming the first held-out problem whose prompt plus `max_new_tokens` does
    not fit the model's context (a model with learned positions would fail deep inside torch)."""
    from rlhflab.errors import DataError
    from rlhflab.models.loading import context_length

    context = context_length(getattr(model, "module", model))
    for i, ids in enumerate(prompts):
        if len(ids) + max_new_tokens > context:
            raise DataError(
                f"held-out problem {i}: its prompt has {len(ids)} tokens, which with "
                f"max_new_tokens {max_new_tokens} exceeds the model's context length {context} "
                "(shorten the prompt, e.g. task.instruction none, or lower max_new_tokens)"
            )
