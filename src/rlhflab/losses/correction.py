"""Training–inference mismatch: diagnostics and truncated importance sampling (TIS).

The tokens of a rollout are drawn from the *sampler's* distribution π_sampler (an inference engine
such as vLLM, with its own kernels, precision and batching), but the policy-gradient loss treats
them as samples of the *trainer's* π_θold. The two differ by float arithmetic, and the gradient is
then that of an off-policy objective. Yao et al. 2025 ("Your efficient RL framework secretly brings
you off-policy RL training", https://fengyao.notion.site/off-policy-rl) correct it with a
truncated importance weight on the policy-gradient term:

    w_t = min( π_θold(o_t | ·) / π_sampler(o_t | ·), C )        (detached)
    loss_t ← w_t · loss_t

Tensors (shapes as in `rlhflab.losses.policy`):
    logp_old      (B, T) float   log π_θold of the sampled tokens, from the trainer's forward
    logp_sampler  (B, T) float   the sampler's log-probs of the same tokens (Rollout.logp)
    mask          (B, T) bool or 0/1 float, 1 on completion tokens

Pure functions: torch only, no config, no `.item()`.
"""

import math

import torch
from torch import Tensor

from rlhflab.losses.kl import k3

__all__ = [
    "CORRECTIONS",
    "IS_LEVELS",
    "REJECTION_LEVELS",
    "decoupled",
    "importance_weights",
    "mismatch_stats",
    "normalize_weights",
    "rejection_mask",
    "tis",
    "truncated_importance_weights",
]


def _check(logp_old: Tensor, logp_sampler: Tensor, mask: Tensor) -> Tensor:
    if logp_old.ndim != 2 or logp_sampler.shape != logp_old.shape or mask.shape != logp_old.shape:
        raise ValueError(
            "logp_old, logp_sampler and mask must share one (B, T) shape, got "
            f"{tuple(logp_old.shape)}, {tuple(logp_sampler.shape)}, {tuple(mask.shape)}"
        )
    return mask.bool()


def truncated_importance_weights(
    logp_old: Tensor, logp_sampler: Tensor, mask: Tensor, *, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token TIS weights w = min(exp(logp_old − logp_sampler), C), detached.

    Yao et al. 2025 (token-level TIS; the same weight as TRL's `vllm_importance_sampling_correction`
    with `vllm_importance_sampling_mode="token_truncate"` and no `vllm_importance_sampling_clip_min`,
    and as verl's `rollout_is: token` with `rollout_is_threshold` C, which also clamps the
    log-ratio to ±20 before the exp; verl's older name was `tis_imp_ratio_cap`). Only the upper
    side is truncated: a weight below 1 (the sampler over-weights the token) is kept as is. The
    weight uses π_θold, the trainer's policy at sampling time — not π_θ, whose ratio to π_θold the
    surrogate already handles — so it is constant across the update epochs of a batch.

    Args:
        logp_old, logp_sampler, mask: (B, T) as in the module docstring.
        cap: C > 0.

    Returns:
        w: (B, T) float, detached, 0 at padding;
        stats: {"capped": (B, T) float, 1.0 where min(·, C) binds (0 at padding)}.

    Raises:
        ValueError: mismatched shapes or cap <= 0.
    """
    if cap is None or not cap > 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    return importance_weights(logp_old, logp_sampler, mask, level="token", cap=cap)


def tis(
    loss: Tensor, logp_old: Tensor, logp_sampler: Tensor, mask: Tensor, *, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling of a per-token policy-gradient loss: loss_t · w_t.

    `loss` (B, T) is a surrogate's per-token loss (`rlhflab.losses.policy`), before any KL term is
    added — the KL is an expectation under π_θ, not under the sampler, so it is not reweighted
    (TRL and verl do the same). Where logp_sampler == logp_old every weight is exactly 1.0 and the
    loss is returned unchanged bit for bit. Returns (loss · w (B, T), stats of
    `truncated_importance_weights` plus "tis_weight": w). Raises ValueError as that function does
    and when `loss` has another shape.
    """
    if loss.shape != logp_old.shape:
        raise ValueError(f"loss has shape {tuple(loss.shape)}, expected {tuple(logp_old.shape)}")
    w, stats = truncated_importance_weights(logp_old, logp_sampler, mask, cap=cap)
    return loss * w.to(loss.dtype), {**stats, "tis_weight": w}


def mismatch_stats(logp: Tensor, logp_sampler: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per-token training–inference mismatch diagnostics on the sampled tokens, detached, 0 at padding.

    "logp_diff": |log π_θ − log π_sampler|;
    "sampler_kl": the k3 estimate of KL(π_sampler ‖ π_θ) from samples of π_sampler,
        (e^r − 1) − r with r = log π_θ − log π_sampler (Schulman's k3; non-negative per token;
        its masked mean estimates the per-token KL between sampler and trainer).
    Returns dict of (B, T) float tensors. Raises ValueError on mismatched shapes.
    """
    m = _check(logp, logp_sampler, mask)
    logp_s = torch.where(m, logp_sampler.detach(), 0.0)
    logp_t = torch.where(m, logp.detach(), 0.0)
    # KL(π_sampler ‖ π_θ) from samples of π_sampler: `losses.kl.k3` with the sampler in the role
    # of the sampled policy and π_θ in the role of the reference
    return {"logp_diff": (logp_t - logp_s).abs(), "sampler_kl": k3(logp_s, logp_t)}


def decoupled(
    loss: Tensor, logp_prox: Tensor, logp_behav: Tensor, mask: Tensor, *, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """The decoupled PPO objective for stale (asynchronous) rollouts: loss_t · min(π_prox / π_behav, C).

    Hilton, Cobbe, Schulman 2022, "Batch size-invariance for policy optimization" (arXiv
    2110.00641), their decoupled PPO objective, which AReaL uses for asynchronous RL (Fu et al.
    2025, arXiv 2505.24298; `use_decoupled_loss`). The cap differs from AReaL's
    `behav_imp_weight_cap`: AReaL *drops* a token whose weight exceeds its cap (weight 0, still
    counted in the token-mean's denominator; no cap by default), here the weight is truncated to C
    (as TIS does). Three policies: π_behav sampled the
    tokens (the behaviour policy, some updates old), π_prox is the *proximal* policy — the
    trainer's policy at the start of this update, against which the surrogate's ratio
    π_θ / π_prox is clipped — and π_θ carries the gradient. Per token, for a surrogate ℓ_t(π_θ,
    π_prox) (e.g. PPO-clip, −min(r·A, clip(r, 1−ε, 1+ε)·A) with r = π_θ/π_prox):

        J_t = w_t · ℓ_t(π_θ, π_prox),   w_t = min(π_prox(o_t|·) / π_behav(o_t|·), C)  (detached)

    The weight is the truncated importance ratio of `truncated_importance_weights` with π_prox
    in the role of π_θold and π_behav in the role of the sampler (Yao et al.'s TIS is the same
    correction for a lag of zero updates). With zero staleness (logp_behav == logp_prox) and
    C >= 1 every weight is exactly 1.0 and `loss` is returned unchanged bit for bit: the
    synchronous loss.

    Args:
        loss: (B, T) per-token surrogate loss computed against π_prox (rlhflab.losses.policy),
            before any KL term.
        logp_prox: (B, T) log π_prox of the sampled tokens (the trainer's, recomputed; detached).
        logp_behav: (B, T) log π_behav of the sampled tokens (Rollout.logp of the stale engine).
        mask: (B, T) bool or 0/1 float, 1 on completion tokens.
        cap: C > 0.

    Returns:
        (loss · w (B, T), stats): "behav_weight" w (B, T), "behav_ratio" the untruncated
        π_prox / π_behav (B, T, 0 at padding) and "behav_capped" (1.0 where min(·, C) binds).

    Raises:
        ValueError: mismatched shapes or cap <= 0.
    """
    if loss.shape != logp_prox.shape:
        raise ValueError(f"loss has shape {tuple(loss.shape)}, expected {tuple(logp_prox.shape)}")
    w, stats = truncated_importance_weights(logp_prox, logp_behav, mask, cap=cap)
    ratio, _ = importance_weights(logp_prox, logp_behav, mask, level="token", cap=None)
    out = {"behav_weight": w, "behav_ratio": ratio, "behav_capped": stats["capped"]}
    return loss * w.to(loss.dtype), out


def importance_weights(
    logp_old: Tensor, logp_sampler: Tensor, mask: Tensor, *, level: str, cap: float | None = 2.0
) -> tuple[Tensor, dict[str, Tensor]]:
    """Rollout importance weights π_θold / π_sampler, per token or per sequence, truncated at cap.

        level "token":     w_{i,t} = min(exp(log π_old − log π_sampler)_{i,t}, C)   (= TIS's weight)
        level "sequence":  w_i = min(exp(Σ_t (log π_old − log π_sampler)_{i,t}), C), on every token
    The sequence weight is the unbiased correction of a sequence-level objective (the likelihood
    ratio of the whole completion); the token weight is its per-token (biased, lower-variance)
    approximation. cap None: untruncated. Detached.
    Shapes: (B, T) as in the module docstring. Returns w (B, T) float, 0 at padding, and stats
    {"capped": (B, T) 1.0 where the cap binds}.
    Source: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training" (token TIS; the sequence-level variant and rejection in its follow-up "When speed
    kills stability", Liu et al. 2025); verl `rollout_corr` (rollout_is: token / sequence).
    Raises: ValueError for an unknown level, cap <= 0, or mismatched shapes.
    """
    if level not in IS_LEVELS:
        raise ValueError(
            f"unknown importance-sampling level {level!r}; valid: {', '.join(IS_LEVELS)}"
        )
    if cap is not None and not cap > 0:
        raise ValueError(f"cap must be > 0 or None, got {cap}")
    m = _check(logp_old, logp_sampler, mask)
    log_ratio = torch.where(m, logp_old.detach() - logp_sampler.detach(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    w = ratio if cap is None else torch.clamp(ratio, max=cap)
    capped = m & (ratio > cap) if cap is not None else torch.zeros_like(m)
    return torch.where(m, w, 0.0), {"capped": capped.to(w.dtype)}


def normalize_weights(
    w: Tensor, mask: Tensor, *, level: str, total: Tensor | None = None, count: Tensor | None = None
) -> Tensor:
    """Batch-normalised importance weights: w / mean(w), so the weights average to 1 over the batch.

    The mean is over valid tokens (level "token") or over sequences (level "sequence", one weight
    per row). `total` and `count` override the local sums (Σw and the number of tokens / rows):
    the trainer passes their all-reduced values, so the mean is that of the global batch.
    Self-normalised IS: biased but lower variance, and it keeps the loss's scale.
    Shapes: w, mask (B, T). Returns (B, T), 0 at padding. A zero mean leaves w unchanged.
    Source: verl `rollout_corr` (rollout_is_batch_normalize: the same means, token or sequence;
    verl skips the division when the mean is ≤ 1e-8); self-normalised importance sampling (e.g.
    Owen 2013, "Monte Carlo theory, methods and examples", §9.2).
    Raises: ValueError for an unknown level or mismatched shapes.
    """
    if level not in IS_LEVELS:
        raise ValueError(
            f"unknown importance-sampling level {level!r}; valid: {', '.join(IS_LEVELS)}"
        )
    if w.shape != mask.shape:
        raise ValueError(f"w has shape {tuple(w.shape)}, expected mask's {tuple(mask.shape)}")
    m = mask.bool()
    if total is None or count is None:
        total, count = _weight_sums(w, m, level)
    mean = total / torch.clamp(torch.as_tensor(count, dtype=w.dtype), min=1)
    out = torch.where(mean > 0, w / torch.where(mean > 0, mean, 1.0), w)
    return torch.where(m, out, 0.0)


def _weight_sums(w: Tensor, m: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """(Σ w, count) over valid tokens (token level) or rows with a valid token (sequence level)."""
    if level == "sequence":
        rows = m.any(-1)
        first = torch.where(m, w, 0.0).amax(-1)  # the row's weight (all its tokens share it)
        return torch.where(rows, first, 0.0).sum(), rows.sum().to(w.dtype)
    return torch.where(m, w, 0.0).sum(), m.sum().to(w.dtype)


def rejection_mask(
    logp_old: Tensor,
    logp_sampler: Tensor,
    mask: Tensor,
    *,
    level: str,
    low: float | None = None,
    high: float = 2.0,
) -> Tensor:
    """Which tokens to keep: 1 where the rollout ratio π_old/π_sampler is within [low, high].

        level "token":      ρ_{i,t} = exp(log π_old − log π_sampler)_{i,t}
        level "sequence":   ρ_i = exp(Σ_t ...)              (the whole row kept or rejected)
        level "geometric":  ρ_i = exp((1/|o_i|) Σ_t ...)    (length-normalised; the whole row)
    low None means 1/high (symmetric in log space). Rejected tokens keep their place in the
    aggregation's denominators (their loss counts as 0), so the step's scale does not change
    with the rejection rate (masked importance sampling).
    Shapes: (B, T). Returns (B, T) float 0/1, detached, 0 at padding.
    Source: Liu, Li, Yao et al. 2025, "When speed kills stability: demystifying RL collapse from
    the training-inference mismatch" (masked IS, sequence and geometric rejection). verl's
    `rollout_corr` calls these filters `rollout_rs` "token_k1", "seq_sum_k1" and "seq_mean_k1",
    with bounds on k1 = log(π_sampler/π_old) (the inverse ratio; the same sets when low = 1/high,
    our default), and removes rejected tokens from the response mask, so they also leave its
    loss denominators (here they stay in them).
    Raises: ValueError for an unknown level, high <= 0 or low outside (0, high].
    """
    if level not in REJECTION_LEVELS:
        raise ValueError(f"unknown rejection level {level!r}; valid: {', '.join(REJECTION_LEVELS)}")
    if not high > 0:
        raise ValueError(f"high must be > 0, got {high}")
    low = 1.0 / high if low is None else low
    if not 0 < low <= high:
        raise ValueError(f"low must be in (0, high], got {low}")
    m = _check(logp_old, logp_sampler, mask)
    log_ratio = torch.where(m, logp_old.detach() - logp_sampler.detach(), 0.0)
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level == "geometric":
        n = m.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
        log_ratio = (log_ratio.sum(-1, keepdim=True) / n).expand_as(log_ratio)
    keep = (log_ratio >= math.log(low)) & (log_ratio <= math.log(high)) & m
    return keep.to(logp_old.dtype)


IS_LEVELS = ("token", "sequence")
REJECTION_LEVELS = ("token", "sequence", "geometric")

CORRECTIONS = {
    "tis": tis,
    "decoupled": decoupled,
    "importance_weights": importance_weights,
    "rejection_mask": rejection_mask,
}
