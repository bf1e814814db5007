"""Held-out evaluation: greedy accuracy and sampled pass@k, with standard errors.

Accuracy is the mean verifier reward of the greedy completion (binary reward: the fraction of
problems solved). Its standard error is the sample standard deviation of the per-problem scores
over sqrt(n) (for binary scores, sqrt(p(1 − p)/(n − 1))). pass@k uses the unbiased estimator of
Chen et al. 2021 (arXiv 2107.03374, eq. 1) from n_samples >= k samples per problem, maj@k
self-consistency voting (Wang et al. 2022); both in `rlhflab.eval.passk`.

The headline of an evaluation is named (`headline_name`): "correctness (task verifier)" for a
task, "correctness (<reward>)" for a prompt dataset with a verifier-like reward (math_verify,
exact_match, correctness), else "reward (weighted sum: ...)". A weighted sum of rewards is never
reported as "accuracy": `accuracy` is present only when it is a correctness.
"""

from __future__ import annotations

import math

import torch

from rlhflab.data.formatting import encode_prompt
from rlhflab.data.prompts import render_row
from rlhflab.eval.passk import maj_at_k, pass_at_k
from rlhflab.rollout.engines import SamplingParams, make_engine, sample_chunks


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


def _summary(values: list[float]) -> tuple[float, float]:
    """`mean_and_stderr` of the non-NaN values (a reward function's None is NaN)."""
    return mean_and_stderr([v for v in values if v == v])


def summarize_scores(per_problem: dict[str, list[float]]) -> dict:
    """{key: mean, key_stderr: standard error} of per-problem score lists (NaN left out)."""
    out = {}
    for key, values in per_problem.items():
        out[key], out[f"{key}_stderr"] = _summary(values)
    return out


def headline(result: dict) -> tuple[str, float | None, float | None]:
    """(name, value, stderr) of an evaluation's headline: its `accuracy` (a correctness) when
    present, else its mean weighted `reward`; value None when the result has neither."""
    name = result.get("headline_name") or "correctness (task verifier)"
    for key in ("accuracy", "reward"):
        if result.get(key) is not None:
            return name, result[key], result.get(f"{key}_stderr")
    return name, None, None


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    problems: list,
    verifier,
    *,
    batch_size: int = 256,
    max_new_tokens: int = 32,
    k: int | list[int] = 0,
    n_samples: int = 0,
    temperature: float = 1.0,
    seed: int = 0,
    system: str | None = None,
    instruction: str | None = None,
    autocast_dtype: torch.dtype | None = None,
    return_completions: bool = False,
    return_scores: bool = False,
    engine=None,
) -> dict:
    """Greedy accuracy (and pass@k / maj@k when k is set) of `model` on `problems`.

    Args:
        problems: held-out task `Problem`s or prompt rows (`rlhflab.data.prompts.PromptRow`).
        verifier: a `Verifier` (its reward mode decides binary/partial) or any object with
            `score_batch(texts, rows) -> list[float]`. A scorer with `score_detail` (a prompt
            dataset's `TextRewardScorer`) reports its weighted sum as `reward` and every
            component as `reward/<name>`; its `accuracy` is its correctness component, if any.
        k: an int keeps the old meaning (k samples per problem, keys pass@1, pass@k, k); a list
            of ints asks for pass@k and maj@k at each k from `n_samples` samples per problem.
        n_samples: samples per problem at `temperature` (0: max(k)); 0 with k 0 skips sampling.
        system, instruction: the system turn and the answer-format instruction rendered into
            every prompt (`rlhflab.data.prompts.render_row`), as in training.
        engine: the rollout engine to sample with (`rlhflab.rollout.engines`); default the `hf`
            engine on `model`.

    Returns:
        "n", "headline_name", "headline", "headline_stderr"; "accuracy", "accuracy_stderr" when
        the headline is a correctness; "reward", "reward_stderr", "reward/<name>" for scorers
        with components; with sampling "pass@1" (mean sample score), "pass@<k>", "maj@<k>" (each
        with "_stderr" over problems), "n_samples" (and "pass@k", "k" for an int k);
        "completions" (greedy texts) when return_completions; "per_problem" ({key: per-problem
        list}, to combine shards of a problem set) when return_scores.
    Raises:
        ValueError: a k < 1 in the list, or n_samples below max(k).
    """
    ks = ([k] if k > 0 else []) if isinstance(k, int) else sorted(set(k))
    if any(x < 1 for x in ks):
        raise ValueError(f"every k must be >= 1 (got {ks})")
    n_samples = n_samples or (max(ks) if ks else 0)
    if ks and n_samples < max(ks):
        raise ValueError(f"n_samples {n_samples} is below the largest k {max(ks)}")
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
    per: dict[str, list[float]] = {}
    texts: list[str] = []
    for start, _, decoded in sample_chunks(model, engine, tokenizer, prompts, greedy,
                                           chunk=batch_size, desc=f"eval ({len(prompts)} problems)"):  # fmt: skip
        texts.extend(decoded)
        for key, vals in _score(verifier, decoded, problems[start : start + batch_size]).items():
            per.setdefault(key, []).extend(vals)
    if n_samples > 0:
        gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        per_prompt = max(1, batch_size // n_samples)
        extract = getattr(verifier, "extract", None) or getattr(verifier, "answer_key", None)
        per["pass@1"] = []
        for kk in ks:
            if kk != 1:  # pass@1 is the mean sample score (c / n for binary scores)
                per[f"pass@{kk}"] = []
            if extract is not None:
                per[f"maj@{kk}"] = []
        params = SamplingParams(n=n_samples, max_new_tokens=max_new_tokens, temperature=temperature)
        desc = f"pass@k ({len(prompts)} problems x {n_samples})"
        for start, _, decoded in sample_chunks(model, engine, tokenizer, prompts, params,
                                               chunk=per_prompt, generator=gen, desc=desc):  # fmt: skip
            chunk_problems = problems[start : start + per_prompt]
            rows = [p for p in chunk_problems for _ in range(n_samples)]
            sampled = _score(verifier, decoded, rows)
            sampled = sampled.get("accuracy", sampled.get("reward"))
            for i in range(len(chunk_problems)):
                row = sampled[i * n_samples : (i + 1) * n_samples]
                row = [0.0 if s != s else s for s in row]  # no reward (NaN): not solved
                correct = sum(1 for s in row if s == 1.0)
                per["pass@1"].append(sum(row) / n_samples)
                texts_i = decoded[i * n_samples : (i + 1) * n_samples]
                answers = [_answer_key(extract, t) for t in texts_i] if extract else None
                for kk in ks:
                    if kk != 1:
                        per[f"pass@{kk}"].append(pass_at_k(n_samples, correct, kk))
                    if answers is not None:
                        per[f"maj@{kk}"].append(maj_at_k(answers, row, kk))
    result: dict = {"n": len(problems)}
    result.update(summarize_scores(per))
    result["headline_name"] = headline_name(verifier)
    result["headline"], result["headline_stderr"] = headline(result)[1:]
    if n_samples > 0:
        result["n_samples"] = n_samples
        if isinstance(k, int):  # the old single-k keys
            result["pass@k"] = result[f"pass@{k}"]
            result["pass@k_stderr"] = result[f"pass@{k}_stderr"]
            result["k"] = k
    if return_completions:
        result["completions"] = texts
    if return_scores:
        result["per_problem"] = per
    model.train(was_training)
    return result


def headline_name(scorer) -> str:
    """The name of an evaluation's headline for `scorer`: "correctness (task verifier)" for a
    task `Verifier`, the scorer's own `headline_name` otherwise (a `TextRewardScorer`)."""
    return getattr(scorer, "headline_name", None) or "correctness (task verifier)"


def _score(scorer, texts: list[str], rows: list) -> dict[str, list[float]]:
    """Per-text scores by metric key: {"accuracy": ...} for a plain scorer; for a scorer with
    `score_detail`, its {"reward": ..., "reward/<name>": ...} plus "accuracy" (its
    correctness component, when it has one: `correctness_key`)."""
    detail = getattr(scorer, "score_detail", None)
    if detail is None:
        return {"accuracy": list(scorer.score_batch(texts, rows))}
    out = detail(texts, rows)
    key = getattr(scorer, "correctness_key", None)
    if key is not None:
        out = {"accuracy": list(out[key]), **out}
    return out


def _answer_key(extract, text: str):
    """The extracted final answer of `text` as a vote (stripped string), None when none."""
    answer = extract(text)
    if answer is None:
        return None
    answer = str(answer).strip()
    return answer or None


def heldout_results(initial_eval: dict, final_eval: dict) -> dict:
    """The held-out entries of final_results.json from the step-0 and final evaluations.

    Returns:
        "headline": {"name", "value", "stderr", "before", "n"} (None without an evaluation):
        the correctness when the task has one ("correctness (task verifier)", "correctness
        (math_verify)"), else the named weighted reward; "heldout_accuracy_before",
        "heldout_accuracy", "heldout_accuracy_stderr" (a correctness only, else None);
        "heldout_reward_before", "heldout_reward", "heldout_reward_stderr" (a prompt dataset's
        weighted reward, else None); "heldout_rewards" ({component: final mean}) and
        "heldout_rewards_before"; "heldout_sampling" ({"before", "after"}: pass@k / maj@k means,
        when sampled); "heldout_n"; "heldout_metric" ("accuracy" or "reward").
    """
    initial_eval, final_eval = initial_eval or {}, final_eval or {}
    name, value, se = headline(final_eval)
    before = headline(initial_eval)[1]

    def components(ev: dict) -> dict:
        return {
            k.removeprefix("reward/"): v
            for k, v in ev.items()
            if k.startswith("reward/") and not k.endswith("_stderr")
        }

    def sampling(ev: dict) -> dict:
        return {k: v for k, v in ev.items() if k.startswith(("pass@", "maj@")) and k != "pass@k"}

    out = {
        "headline": (
            {
                "name": name,
                "value": value,
                "stderr": se,
                "before": before,
                "n": final_eval.get("n", 0),
            }
            if value is not None
            else None
        ),
        "heldout_accuracy_before": initial_eval.get("accuracy"),
        "heldout_accuracy": final_eval.get("accuracy"),
        "heldout_accuracy_stderr": final_eval.get("accuracy_stderr"),
        "heldout_reward_before": initial_eval.get("reward"),
        "heldout_reward": final_eval.get("reward"),
        "heldout_reward_stderr": final_eval.get("reward_stderr"),
        "heldout_rewards": components(final_eval),
        "heldout_rewards_before": components(initial_eval),
        "heldout_n": final_eval.get("n", 0),
        "heldout_metric": "reward"
        if value is not None and name.startswith("reward")
        else "accuracy",
    }
    if sampling(final_eval) or sampling(initial_eval):
        out["heldout_sampling"] = {"before": sampling(initial_eval), "after": sampling(final_eval)}
    return out


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
