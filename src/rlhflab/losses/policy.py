"""Policy-gradient surrogates: per-token losses for REINFORCE, PPO-clip, GSPO and CISPO.

Every surrogate has the same signature, so a trainer composes it with any advantage and aggregation:

    fn(logp, logp_old, adv, mask, *, <hyperparameters>) -> (loss, stats)

    logp      (B, T) float   log π_θ of the sampled tokens (carries the gradient)
    logp_old  (B, T) float   log π_old of the same tokens (the sampling policy; no gradient used)
    adv       (B,) or (B, T) advantages; a (B,) advantage is broadcast over the tokens of its row
    mask      (B, T) bool or 0/1 float, 1 on completion tokens
    loss      (B, T)         per-token loss to be *minimised*, 0 at padding; reduce it with
                             `rlhflab.losses.aggregate.aggregate` (never reduced here)
    stats     dict of detached (B, T) float tensors, 0 at padding, to be averaged by the trainer with
              the same mask: "ratio" (π_θ/π_old, or the loss's own IS ratio), "clipped_low",
              "clipped_high" (1.0 where that clip bound changes this token's gradient).

Padding positions are neutralised before any exp (the log-ratio is set to 0 there), so garbage in
padded log-probs can produce neither inf/NaN values nor NaN gradients.
"""

import torch
from torch import Tensor

from rlhflab.ops import masked_mean

__all__ = ["POLICY_LOSSES", "cispo", "gspo", "ppo_clip", "reinforce"]


def _check_inputs(
    logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Validate shapes; return (bool mask (B,T), adv broadcastable to (B,T))."""
    if logp.ndim != 2:
        raise ValueError(f"logp must have shape (B, T), got {tuple(logp.shape)}")
    if logp_old.shape != logp.shape:
        raise ValueError(
            f"logp_old has shape {tuple(logp_old.shape)}, expected logp's {tuple(logp.shape)}"
        )
    if mask.shape != logp.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected logp's {tuple(logp.shape)}")
    b = logp.shape[0]
    if adv.shape == (b,):
        adv = adv[:, None]
    elif adv.shape != logp.shape:
        raise ValueError(
            f"adv has shape {tuple(adv.shape)}, expected (B,) or (B, T) with B={b}, T={logp.shape[1]}"
        )
    return mask.bool(), adv.to(logp.dtype)


def _check_eps(eps_low: float | None, eps_high: float) -> None:
    if eps_low is not None and not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")


def _log_ratio(logp: Tensor, logp_old: Tensor, m: Tensor) -> Tensor:
    """log π_θ − log π_old at valid tokens, 0 at padding (so exp never sees padding garbage)."""
    return torch.where(m, logp - logp_old.detach(), 0.0)  # (B, T)


def _stats(
    ratio: Tensor, clipped_low: Tensor, clipped_high: Tensor, m: Tensor
) -> dict[str, Tensor]:
    dt = ratio.dtype
    return {
        "ratio": torch.where(m, ratio.detach(), 0.0),
        "clipped_low": (clipped_low & m).to(dt),
        "clipped_high": (clipped_high & m).to(dt),
    }


def reinforce(
    logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE: loss_{i,t} = −A_{i,t} · log π_θ(o_{i,t}).

    Gradient: −A·∇log π_θ, the score-function estimator. `logp_old` is used only for the "ratio"
    stat (exp(logp − logp_old)); the estimator is unbiased only on-policy, i.e. for the first update
    on a batch. No clipping: "clipped_low"/"clipped_high" are 0.
    Shapes: logp, logp_old, mask (B, T); adv (B,) or (B, T). Returns loss (B, T) in logp's dtype
    (0 at padding) and stats of (B, T) float tensors.
    Source: Williams 1992, "Simple statistical gradient-following algorithms for connectionist
    reinforcement learning" (REINFORCE); the per-token form for LMs as in RLOO (Ahmadian et al.
    2024, arXiv 2402.14740).
    Raises: ValueError on mismatched shapes.
    """
    m, a = _check_inputs(logp, logp_old, adv, mask)
    ratio = torch.exp(_log_ratio(logp, logp_old, m)).detach()
    loss = torch.where(m, -a * logp, 0.0)
    zeros = torch.zeros_like(m)
    return loss, _stats(ratio, zeros, zeros, m)


def ppo_clip(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate: loss = −min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A), r = π_θ/π_old.

    r_{i,t} = exp(logp − logp_old). The gradient is −A·r·∇log π_θ except where the clip is active on
    the flat side, where it is 0: "clipped_low" = (A < 0 and r < 1 − eps_low), "clipped_high" =
    (A > 0 and r > 1 + eps_high). With eps_low = eps_high this is the PPO paper's ε.
    Shapes: logp, logp_old, mask (B, T); adv (B,) or (B, T). Returns loss (B, T) (0 at padding) and
    stats {"ratio", "clipped_low", "clipped_high"} (B, T).
    Source: Schulman et al. 2017, PPO, arXiv 1707.06347, eq. 7 (L^CLIP), per token as in GRPO
    (Shao et al. 2024, arXiv 2402.03300, eq. 3). Asymmetric bounds are DAPO's "clip-higher"
    (Yu et al. 2025, arXiv 2503.14476, §3.1; eps_high = 0.28 there).
    Raises: ValueError on mismatched shapes, eps_low outside [0, 1) or eps_high < 0.
    """
    _check_eps(eps_low, eps_high)
    m, a = _check_inputs(logp, logp_old, adv, mask)
    ratio = torch.exp(_log_ratio(logp, logp_old, m))
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.where(m, -torch.minimum(ratio * a, clipped * a), 0.0)
    r = ratio.detach()
    return loss, _stats(r, (a < 0) & (r < 1.0 - eps_low), (a > 0) & (r > 1.0 + eps_high), m)


def gspo(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO-style clipping of a length-normalised *sequence* importance ratio.

    Sequence ratio: s_i = (π_θ(o_i)/π_old(o_i))^(1/|o_i|) = exp( (1/|o_i|) Σ_t (logp − logp_old) ),
    the masked mean over the row's valid tokens. Written in the paper's GSPO-token form:
        s_{i,t} = sg[s_i] · exp(logp_{i,t} − sg[logp_{i,t}])        (value s_i, ∂/∂logp_{i,t} = s_i)
        loss_{i,t} = −min(s_{i,t}·A_{i,t}, clip(s_{i,t}, 1 − eps_low, 1 + eps_high)·A_{i,t})
    With a per-sequence A_i and the "seq_mean_token_mean" aggregation ((1/G)Σ_i (1/|o_i|)Σ_t) the
    gradient equals that of the GSPO sequence objective −(1/G)Σ_i min(s_i A_i, clip(s_i) A_i), since
    ∇s_i = s_i·(1/|o_i|)Σ_t ∇logp_{i,t}. A (B, T) adv gives GSPO-token with per-token advantages
    (identical to GSPO when adv is constant along T). Clipping is decided per sequence:
    "clipped_low" = (A < 0 and s_i < 1 − eps_low), "clipped_high" = (A > 0 and s_i > 1 + eps_high).
    Shapes: logp, logp_old, mask (B, T); adv (B,) (or (B, T)). Returns loss (B, T) (0 at padding)
    and stats; stats["ratio"] is s_i broadcast over the row's tokens. An empty row has s_i = 1.
    Source: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071, §4.1 (s_i
    and the GSPO objective), §4.3 (GSPO-token); default bounds 3e-4 / 4e-4 are the paper's (§5.1).
    Raises: ValueError on mismatched shapes, eps_low outside [0, 1) or eps_high < 0.
    """
    _check_eps(eps_low, eps_high)
    m, a = _check_inputs(logp, logp_old, adv, mask)
    seq_log_ratio = masked_mean(_log_ratio(logp, logp_old, m), m, dim=-1)  # (B,)
    s = torch.exp(seq_log_ratio.detach())[:, None]  # (B, 1) sg[s_i]
    token_logp = torch.where(m, logp, 0.0)
    s_tok = s * torch.exp(token_logp - token_logp.detach())  # (B, T), value s_i
    clipped = torch.clamp(s_tok, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.where(m, -torch.minimum(s_tok * a, clipped * a), 0.0)
    s_full = s.expand_as(logp)
    return loss, _stats(
        s_full, (a < 0) & (s_full < 1.0 - eps_low), (a > 0) & (s_full > 1.0 + eps_high), m
    )


def cispo(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float | None = None,
    eps_high: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio.

    loss_{i,t} = −sg[clip(r_{i,t}, 1 − eps_low, 1 + eps_high)] · A_{i,t} · log π_θ(o_{i,t}),
    r = exp(logp − logp_old). Gradient: −clip(r)·A·∇log π_θ, never zero for a token with A ≠ 0
    (unlike PPO, clipping caps the weight instead of dropping the token). With eps_low=None there is
    no lower bound (weight clipped to (0, 1 + eps_high]). The loss *value* is a surrogate for the
    gradient only; it is not the objective's value. "clipped_high" = r > 1 + eps_high and
    "clipped_low" = r < 1 − eps_low (always 0 when eps_low is None), for either sign of A, since the
    capped weight changes the gradient whatever the sign.
    Shapes: logp, logp_old, mask (B, T); adv (B,) or (B, T). Returns loss (B, T) (0 at padding) and
    stats {"ratio", "clipped_low", "clipped_high"} (B, T).
    Source: MiniMax 2025, "MiniMax-M1", arXiv 2506.13585, §3.1, eq. 4-5 (the paper applies the
    token-level normaliser 1/Σ|o_i|: use aggregation "token_mean"). Defaults: the paper imposes no
    lower bound ("setting ε_low^IS to a large value") and tunes ε_high^IS without publishing its
    value; eps_high = 2.0 (weight capped at 3) is our choice, not the paper's — set it in the preset.
    Raises: ValueError on mismatched shapes, eps_low outside [0, 1) or eps_high < 0.
    """
    _check_eps(eps_low, eps_high)
    m, a = _check_inputs(logp, logp_old, adv, mask)
    ratio = torch.exp(_log_ratio(logp, logp_old, m)).detach()
    lower = 0.0 if eps_low is None else 1.0 - eps_low
    weight = torch.clamp(ratio, lower, 1.0 + eps_high)
    loss = torch.where(m, -weight * a * logp, 0.0)
    low = torch.zeros_like(m) if eps_low is None else ratio < 1.0 - eps_low
    return loss, _stats(ratio, low, ratio > 1.0 + eps_high, m)


POLICY_LOSSES = {
    "reinforce": reinforce,
    "ppo_clip": ppo_clip,
    "gspo": gspo,
    "cispo": cispo,
}
