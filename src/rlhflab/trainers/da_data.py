"""Direct alignment's data side (rlhflab.trainers.direct_alignment): training rows from
tokenized pairs (paired, or KTO's unpaired rows with their mismatched completions), the cached
reference pass, pairs sampled from the policy and labelled (verifiable / online DPO), the held-out
margins and the in-loop samples.

Rows are dicts of token-id lists: paired {prompt, chosen, rejected} (+ `ref_chosen`,
`ref_rejected` once the reference pass ran), unpaired {prompt, completion, label, kl_completion}
(+ `ref`, `ref_kl`).
"""

from __future__ import annotations

import random

import torch

from rlhflab import distributed
from rlhflab.data.formatting import encode_prompt, format_completion
from rlhflab.data.preference import (
    PreferencePair,
    TokenizedPair,
    pairs_from_scored_samples,
    tokenize_pairs,
)
from rlhflab.data.prompts import render_row
from rlhflab.errors import DataError
from rlhflab.ops import upcast
from rlhflab.rewards.shaping import score_components
from rlhflab.rollout.engines import SamplingParams, make_engine
from rlhflab.rollout.sampler import completion_logps, decode_completions, pack
from rlhflab.tracking import progress


def sequence_logps(model, prompts, completions, pad_id, *, autocast_dtype=None):
    """Summed completion log-probs (N,) and completion lengths (N,) of N (prompt, completion)
    token lists, in one forward (dynamic padding to the longest row)."""
    device = next(model.parameters()).device
    batch = pack(prompts, completions, pad_id).to(device)
    logp, _ = completion_logps(model, batch, autocast_dtype=autocast_dtype)
    return logp.sum(1), batch.mask.sum(1)


@torch.no_grad()
def reference_logps(model, prompts, completions, pad_id, *, chunk: int, autocast_dtype=None):
    """log π(y|x) summed over tokens for every row, in eval mode without gradients → list[float]."""
    was_training = model.training
    model.eval()
    out: list[float] = []
    for s in range(0, len(prompts), chunk):
        lp, _ = sequence_logps(
            model,
            prompts[s : s + chunk],
            completions[s : s + chunk],
            pad_id,
            autocast_dtype=autocast_dtype,
        )
        out.extend(upcast(lp).cpu().tolist())
    model.train(was_training)
    return out


def paired_rows(tokenized: list[TokenizedPair]) -> list[dict]:
    """Tokenized pairs as row dicts {prompt, chosen, rejected} of token ids (the trainer's data rows)."""
    return [
        {"prompt": t.prompt_ids, "chosen": t.chosen_ids, "rejected": t.rejected_ids}
        for t in tokenized
    ]


def unpaired_rows(tokenized: list[TokenizedPair], rng: random.Random) -> list[dict]:
    """KTO rows from pairs: (x, y_w, desirable) and (x, y_l, undesirable), each with a fixed
    mismatched completion y' of another prompt for the z₀ estimate (KTO paper §4.1)."""
    rows = []
    for t in tokenized:
        rows.append({"prompt": t.prompt_ids, "completion": t.chosen_ids, "label": True})
        rows.append({"prompt": t.prompt_ids, "completion": t.rejected_ids, "label": False})
    return with_mismatched(rows, rng)


def with_mismatched(rows: list[dict], rng: random.Random) -> list[dict]:
    """Give every unpaired row (in place; returned) a `kl_completion`: the completion of another
    row with another prompt, by one cyclic shift drawn from `rng` (KTO's z₀ estimate).

    Raises:
        DataError: fewer than 2 rows.
    """
    n = len(rows)
    if n < 2:
        raise DataError("data: KTO needs at least 2 examples to form mismatched pairs")
    shift = rng.randrange(1, n)
    for i, row in enumerate(rows):  # a cyclic shift never pairs a row with itself
        j = (i + shift) % n
        k = 1
        while rows[j]["prompt"] == row["prompt"] and k < n:
            j = (i + shift + k) % n
            k += 1
        row["kl_completion"] = rows[j]["completion"]
    return rows


def cache_reference(model, rows, pad_id, *, unpaired, chunk, autocast_dtype) -> None:
    """Add cached reference log-probs to every row (`ref_chosen`/`ref_rejected`, KTO: `ref`/`ref_kl`)."""
    keys = (
        (("completion", "ref"), ("kl_completion", "ref_kl"))
        if unpaired
        else (
            ("chosen", "ref_chosen"),
            ("rejected", "ref_rejected"),
        )
    )
    # Each data-parallel rank scores a contiguous share of the rows; the values are gathered so
    # that every rank holds the whole cache (its rows change from step to step).
    mine = distributed.shard(rows, even=False)
    for src, dst in keys:
        with distributed.gathered(model):
            values = reference_logps(
                model,
                [r["prompt"] for r in mine],
                [r[src] for r in mine],
                pad_id,
                chunk=chunk,
                autocast_dtype=autocast_dtype,
            )
        values = [v for part in distributed.all_gather_object(values) for v in part]
        for r, v in zip(rows, values, strict=True):
            r[dst] = v


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
    was_training = model.training
    model.eval()
    # Every data-parallel rank samples every prompt with the same draws (the generators are in
    # step), so all ranks build the same pairs; under FSDP2 the parameters are gathered once.
    # Through the hf rollout engine; a group's repeated prompt is prefilled once (prefix sharing).
    engine = make_engine(None, model, tokenizer, autocast_dtype=autocast_dtype)
    params = SamplingParams(max_new_tokens=vcfg.max_new_tokens, temperature=vcfg.temperature)
    with distributed.gathered(model):
        pieces = range(0, len(flat), chunk)
        for s in progress(pieces, f"sampling pairs ({len(problems)} prompts x {K})"):
            ro = engine.generate(flat[s : s + chunk], params, generator=generator)
            chunk_texts = decode_completions(tokenizer, ro, engine.stop_token_ids)
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
    model.train(was_training)
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
def heldout_margins(model, held_rows, cfg, pad, use_ref, autocast_dtype) -> list[torch.Tensor]:
    """Implicit-reward margins of the held-out pairs: (log π − log π_ref)(y_w) − (same)(y_l), or
    the length-normalised log-prob margin for reference-free losses; one tensor per micro-batch."""
    margins = []
    for s in range(0, len(held_rows), cfg.train.micro_batch_size):
        b = held_rows[s : s + cfg.train.micro_batch_size]
        n = len(b)
        lp, ln = sequence_logps(
            model, [r["prompt"] for r in b] * 2,
            [r["chosen"] for r in b] + [r["rejected"] for r in b], pad,
            autocast_dtype=autocast_dtype,
        )  # fmt: skip
        lp = upcast(lp).cpu()
        if use_ref:
            rc = torch.tensor([r["ref_chosen"] for r in b], dtype=lp.dtype)
            rr = torch.tensor([r["ref_rejected"] for r in b], dtype=lp.dtype)
            margins.append((lp[:n] - rc) - (lp[n:] - rr))
        else:
            ln = ln.cpu()
            margins.append(lp[:n] / ln[:n] - lp[n:] / ln[n:])
    return margins


def tokenize_unpaired(tokenizer, examples, tok_kw) -> tuple[list[dict], dict]:
    """KTO rows from UnpairedExamples (the completion is tokenized as a pair's chosen side)."""
    pseudo = [PreferencePair(e.prompt, e.completion, e.completion) for e in examples]
    tokenized, counts = tokenize_pairs(tokenizer, pseudo, **tok_kw)
    counts["completion_truncated"] //= 2  # each completion was counted twice
    rows = [
        {"prompt": tp.prompt_ids, "completion": tp.chosen_ids, "label": e.label}
        for tp, e in zip(tokenized, examples, strict=True)
    ]
    return rows, counts


@torch.no_grad()
def write_greedy_samples(
    writer, step, model, tokenizer, problems, scorer, cfg, autocast_dtype, system=None,
    instruction=None,
) -> None:  # fmt: skip
    """Greedy completions of the first held-out prompts (in-loop samples), with their scores."""
    problems = problems[: cfg.tracking.samples_per_step]
    if not problems:
        return
    was_training = model.training
    model.eval()
    prompts = [
        encode_prompt(tokenizer, render_row(tokenizer, p, system=system, instruction=instruction))
        for p in problems
    ]
    engine = make_engine(None, model, tokenizer, autocast_dtype=autocast_dtype)
    with distributed.gathered(model):
        ro = engine.generate(
            prompts, SamplingParams(max_new_tokens=cfg.eval.max_new_tokens, greedy=True)
        )
    model.train(was_training)
    texts = decode_completions(tokenizer, ro, engine.stop_token_ids)
    scores = scorer.score_batch(texts, problems)
    writer.write(
        step,
        [
            {"prompt": p.question, "completion": c, "reward": r, "answer": p.answer}
            for p, c, r in zip(problems, texts, scores, strict=True)
        ],
    )
