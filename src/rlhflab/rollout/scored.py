"""Sample K completions per problem from a policy and score each with a verifier: the raw material
of reward-model training data (`rlhflab.data.reward_data` turns a `ScoredSamples` into pairs, ORM
and PRM items) and of best-of-N evaluation. Sampling lives here, not in `data/`: data only reads
and shapes rows."""

from __future__ import annotations

import torch

from rlhflab.data.formatting import encode_prompt
from rlhflab.data.prompts import render_row
from rlhflab.data.reward_data import ScoredSamples
from rlhflab.rollout.engines import SamplingParams, make_engine, sample_chunks


@torch.no_grad()
def sample_and_score(
    model,
    tokenizer,
    problems: list,
    verifier,
    *,
    k: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    batch_size: int = 256,
    seed: int = 0,
    system: str | None = None,
    autocast_dtype: torch.dtype | None = None,
    instruction: str | None = None,
) -> ScoredSamples:
    """Sample `k` completions for each problem (task Problem or prompt row) and score them with
    `verifier` (anything with `score_batch(texts, rows)`); prompts carry `system` and the
    answer-format `instruction` (`render_row`)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    prompts = [
        encode_prompt(tokenizer, render_row(tokenizer, p, system=system, instruction=instruction))
        for p in problems
    ]
    per_chunk = max(1, batch_size // k)
    engine = make_engine(None, model, tokenizer, autocast_dtype=autocast_dtype)  # hf
    params = SamplingParams(n=k, max_new_tokens=max_new_tokens, temperature=temperature)
    comp_ids: list[list[list[int]]] = []
    texts: list[list[str]] = []
    scores: list[list[float]] = []
    for start, ro, decoded in sample_chunks(model, engine, tokenizer, prompts, params,
                                            chunk=per_chunk, generator=gen):  # fmt: skip
        chunk_p = problems[start : start + per_chunk]
        sc = verifier.score_batch(decoded, [p for p in chunk_p for _ in range(k)])
        ids = [
            [t for t, m in zip(row, mrow, strict=True) if m]
            for row, mrow in zip(ro.completion_ids.tolist(), ro.mask.tolist(), strict=True)
        ]
        for i in range(len(chunk_p)):
            comp_ids.append(ids[i * k : (i + 1) * k])
            texts.append(decoded[i * k : (i + 1) * k])
            scores.append(sc[i * k : (i + 1) * k])
    return ScoredSamples(list(problems), prompts, comp_ids, texts, scores)
