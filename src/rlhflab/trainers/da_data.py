"""Direct alignment's data side (rlhflab.trainers.direct_alignment): training rows from
tokenized pairs (paired, or KTO's unpaired rows with their mismatched completions), the cached
reference pass and the held-out margins. Pairs sampled from the policy (verifiable / online
DPO) and the in-loop samples are drawn in `rlhflab.experience.pairs`.

Rows are dicts of token-id lists: paired {prompt, chosen, rejected} (+ `ref_chosen`,
`ref_rejected` once the reference pass ran), unpaired {prompt, completion, label, kl_completion}
(+ `ref`, `ref_kl`).
"""

from __future__ import annotations

import random

import torch

from rlhflab import distributed
from rlhflab.data.preference import (
    PreferencePair,
    TokenizedPair,
    tokenize_pairs,
)
from rlhflab.errors import DataError
from rlhflab.ops import upcast
from rlhflab.rollout.sampler import completion_logps, pack


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
