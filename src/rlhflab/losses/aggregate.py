"""Reduce a per-token loss (B, T) to the scalar that is back-propagated, with explicit denominators.

Denominators (num_tokens, num_seqs, max_len) are counted once per optimizer step over *all*
micro-batches (and all data-parallel ranks), then passed to every micro-batch's call. Each mode is
then a plain sum over the micro-batch divided by a step constant, so the sum of aggregate() over k
micro-batches equals aggregate() on the whole step's batch, and so do the gradients. Counting the
denominator per micro-batch instead (the classic gradient-accumulation bug) weights tokens of short
micro-batches more.

Every mode: loss (B, T) float, mask (B, T) bool or 0/1 float; returns a 0-d tensor in loss's dtype.
Denominators are Python numbers or 0-d tensors (e.g. after an all-reduce); a Python number must be
> 0 (tensors are not checked, to avoid a host sync).
"""

from torch import Tensor

from rlhflab.ops import masked_mean, masked_sum

__all__ = [
    "AGGREGATIONS",
    "AGGREGATION_ALIASES",
    "AGGREGATION_NEAR_MISSES",
    "DENOMINATORS",
    "aggregate",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
]

Denominator = int | float | Tensor


def _check(loss: Tensor, mask: Tensor, denominators: dict[str, Denominator | None]) -> None:
    if loss.ndim != 2:
        raise ValueError(f"loss must have shape (B, T), got {tuple(loss.shape)}")
    if mask.shape != loss.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected loss's {tuple(loss.shape)}")
    for name, value in denominators.items():
        if value is None:
            raise ValueError(f"{name} is required by this aggregation and was None")
        if not isinstance(value, Tensor) and not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def token_mean(loss: Tensor, mask: Tensor, *, num_tokens: Denominator) -> Tensor:
    """Token-level mean over the step: Σ_{i,t} loss·mask / num_tokens.

    num_tokens = Σ |o_i| over the whole optimizer step. Every token weighs the same, so long
    completions are not down-weighted.
    Source: DAPO (Yu et al. 2025, arXiv 2503.14476), §3.3 "Token-Level Policy Gradient Loss", eq. 8;
    also MiniMax-M1's CISPO (arXiv 2506.13585, eq. 4).
    Raises: ValueError on shape mismatch or a non-positive / None num_tokens.
    """
    _check(loss, mask, {"num_tokens": num_tokens})
    return masked_sum(loss, mask) / num_tokens


def seq_mean_token_mean(loss: Tensor, mask: Tensor, *, num_seqs: Denominator) -> Tensor:
    """Sequence mean of per-sequence token means: Σ_i (Σ_t loss·mask / |o_i|) / num_seqs.

    |o_i| is row i's own number of valid tokens (an empty row contributes 0); num_seqs = number of
    completions in the whole optimizer step. Each completion weighs the same, so tokens of long
    completions weigh less (the length bias Dr. GRPO and DAPO point out).
    Source: original GRPO, Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, eq. 3; GSPO's
    (1/G)Σ_i (1/|o_i|)Σ_t form (arXiv 2507.18071, §4.3).
    Raises: ValueError on shape mismatch or a non-positive / None num_seqs.
    """
    _check(loss, mask, {"num_seqs": num_seqs})
    return masked_mean(loss, mask, dim=-1).sum() / num_seqs


def seq_mean_token_sum(loss: Tensor, mask: Tensor, *, num_seqs: Denominator) -> Tensor:
    """Sum over tokens, mean over sequences: Σ_{i,t} loss·mask / num_seqs.

    The REINFORCE sequence objective: each completion contributes its summed token loss, so the
    scale grows with completion length.
    Source: REINFORCE / RLOO with a sequence log-probability (Ahmadian et al. 2024, arXiv
    2402.14740); Dr. GRPO's objective without its constant (arXiv 2503.20783, §3.2).
    Raises: ValueError on shape mismatch or a non-positive / None num_seqs.
    """
    _check(loss, mask, {"num_seqs": num_seqs})
    return masked_sum(loss, mask) / num_seqs


def seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, *, num_seqs: Denominator, max_len: Denominator
) -> Tensor:
    """Token sum normalised by a constant: Σ_{i,t} loss·mask / (num_seqs · max_len).

    max_len is the generation budget (max new tokens), a constant that does not depend on the
    sampled lengths, so there is no length bias and the scale stays that of a mean.
    Source: Dr. GRPO, Liu et al. 2025, arXiv 2503.20783, §3.2: the paper's objective drops GRPO's
    1/|o_i|; its code divides the token sum by the generation budget (MAX_TOKENS) instead.
    Raises: ValueError on shape mismatch or a non-positive / None num_seqs or max_len.
    """
    _check(loss, mask, {"num_seqs": num_seqs, "max_len": max_len})
    return masked_sum(loss, mask) / (num_seqs * max_len)


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: Denominator | None = None,
    num_seqs: Denominator | None = None,
    max_len: Denominator | None = None,
) -> Tensor:
    """Reduce a per-token loss (B, T) to a scalar with the named mode (a key of AGGREGATIONS).

    Modes and the denominators they need (the others are ignored, so a trainer may pass all):
        "token_mean"               Σ loss·mask / num_tokens                    (DAPO)
        "seq_mean_token_mean"      Σ_i (Σ_t loss·mask / |o_i|) / num_seqs      (GRPO)
        "seq_mean_token_sum"       Σ loss·mask / num_seqs                      (REINFORCE)
        "seq_mean_token_sum_norm"  Σ loss·mask / (num_seqs · max_len)          (Dr. GRPO)
    Dispatch goes through AGGREGATIONS (the function) and DENOMINATORS (the denominators each
    mode takes). Denominators are per optimizer step (all micro-batches, all ranks), so summing
    aggregate() over micro-batches gives exactly the full batch's loss and gradient.
    Shapes: loss (B, T) float; mask (B, T). Returns a 0-d tensor in loss's dtype.
    Raises: ValueError for an unknown mode (listing the valid ones), a needed denominator that is
    None or not > 0, or mismatched shapes.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid: {', '.join(AGGREGATIONS)}")
    given = {"num_tokens": num_tokens, "num_seqs": num_seqs, "max_len": max_len}
    return AGGREGATIONS[mode](loss, mask, **{name: given[name] for name in DENOMINATORS[mode]})


AGGREGATIONS = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum": seq_mean_token_sum,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}

# The per-step denominators each mode takes (keyword arguments of its function).
DENOMINATORS: dict[str, tuple[str, ...]] = {
    "token_mean": ("num_tokens",),
    "seq_mean_token_mean": ("num_seqs",),
    "seq_mean_token_sum": ("num_seqs",),
    "seq_mean_token_sum_norm": ("num_seqs", "max_len"),
}

# Other libraries' names for the same reductions (config values that resolve to ours):
# - verl's `actor.loss_agg_mode`: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
#   "seq-mean-token-sum-norm" (verl divides the last by its padded response length and not by the
#   number of sequences; ours by num_seqs · max_len, Dr. GRPO's constant). verl's seq-mean modes,
#   when they count the sequences themselves, count only those with a valid token; ours count
#   every completion of the step (the same unless a completion is empty);
# - TRL's GRPOConfig `loss_type` (a reduction): "grpo" (per-sequence token mean), "dr_grpo"
#   (Σ / (B · max_completion_length)), "dapo" (Σ / the tokens of the whole accumulated batch);
#   TRL's "grpo" and "dr_grpo" average over each device's micro-batch and divide by the
#   accumulation steps, the same as ours when the micro-batches have equal sizes.
#   TRL's "bnpo" normalises by the tokens of each local micro-batch: no counterpart here.
AGGREGATION_ALIASES: dict[str, str] = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
    "grpo": "seq_mean_token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "dapo": "token_mean",
}

# Other libraries' names that look like ours but compute something else: refused with the
# difference, never resolved silently (a loss must match its definition and its peers').
AGGREGATION_NEAR_MISSES: dict[str, str] = {
    "seq-mean-token-sum-norm": (
        "verl's 'seq-mean-token-sum-norm' is Σ_i Σ_t loss / max_len (no mean over sequences); "
        "ours, 'seq_mean_token_sum_norm', is Σ_i Σ_t loss / (num_seqs · max_len) (Dr. GRPO)"
    ),
}
