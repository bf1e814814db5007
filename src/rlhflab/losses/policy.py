"""Policy-gradient surrogates: per-token losses for REINFORCE, PPO-clip (and dual-clip), GSPO,
CISPO, SAPO, GMPO, Clip-Cov and KL-Cov.

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

`POLICY_LOSSES` maps each name to a `PolicyLoss`: the function and what it declares. Clip-Cov and
KL-Cov choose tokens by a covariance over the whole minibatch (`select`); the trainer runs that
choice once per optimizer step on the global minibatch and passes it as `selected`, so the result
does not depend on ranks or micro-batches. `POLICY_LOSS_ALIASES` maps verl's names to ours.

Padding positions are neutralised before any exp (the log-ratio is set to 0 there), so garbage in
padded log-probs can produce neither inf/NaN values nor NaN gradients.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.ops import masked_mean

__all__ = [
    "POLICY_LOSSES",
    "POLICY_LOSS_ALIASES",
    "PolicyLoss",
    "cispo",
    "clip_cov",
    "clip_cov_selection",
    "gmpo",
    "gspo",
    "kl_cov",
    "kl_cov_selection",
    "ppo_clip",
    "ppo_dual_clip",
    "reinforce",
    "sapo",
]


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


def ppo_dual_clip(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    clip_c: float = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO: PPO-clip with a lower bound c·A on the objective of negative advantages.

        L^CLIP = min(r·A, clip(r, 1 − eps_low, 1 + eps_high)·A)
        loss = −max(L^CLIP, c·A)  where A < 0;   −L^CLIP  where A >= 0
    For A < 0 and a large ratio r > c, PPO's objective r·A is unbounded below; dual clip caps it at
    c·A (gradient 0 there). "clipped_low" adds those tokens (A < 0 and r > c) to PPO's lower clip.
    Shapes: as `ppo_clip`. Returns loss (B, T) (0 at padding) and stats.
    Source: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning", arXiv 1912.09729, §3 (the dual-clip objective; c = 3 in their experiments; verl's clip_ratio_c = 3).
    Raises: ValueError on mismatched shapes, bad eps, or clip_c <= 1.
    """
    if not clip_c > 1.0:
        raise ValueError(f"clip_c must be > 1, got {clip_c}")
    loss, stats = ppo_clip(logp, logp_old, adv, mask, eps_low=eps_low, eps_high=eps_high)
    m, a = _check_inputs(logp, logp_old, adv, mask)
    # −max(L^CLIP, c·A) = min(−L^CLIP, −c·A) on the valid tokens with A < 0
    loss = torch.where(m & (a < 0), torch.minimum(loss, -(clip_c * a)), loss)
    dual = (a < 0) & (stats["ratio"] > clip_c) & m
    stats["clipped_low"] = torch.maximum(stats["clipped_low"], dual.to(stats["ratio"].dtype))
    return loss, stats


def sapo(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a soft, temperature-controlled sigmoid gate on the ratio instead of a hard clip.

        f_τ(r) = σ(τ·(r − 1))·4/τ,   τ = tau_pos where A > 0, tau_neg where A <= 0
        loss_{i,t} = −f_τ(r_{i,t})·A_{i,t},   r = π_θ/π_old
    ∂f/∂log π = 4·σ(1 − σ)·r: the gradient weight is 1 at r = 1 (on-policy, the same as PPO's)
    and decays smoothly as the ratio moves away (never exactly 0, never a discontinuity);
    tau_neg > tau_pos makes the gate fall faster for negative advantages. The loss value at
    r = 1 is −2A/τ (a constant offset; only the gradient matters). "clipped_low"/"clipped_high"
    are 0 (nothing is clipped); the ratio is in stats["ratio"].
    Shapes: as `ppo_clip`. Returns loss (B, T) (0 at padding) and stats.
    Source: Gao et al. (Qwen team) 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347,
    §3 (the soft gate σ(τ(r − 1))·4/τ, τ by the sign of A); defaults τ_pos = 1.0, τ_neg = 1.05,
    verl's defaults (actor.yaml) and the values the paper recommends as secondary sources report
    them (its PDF not checked here).
    Raises: ValueError on mismatched shapes or non-positive temperatures.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    m, a = _check_inputs(logp, logp_old, adv, mask)
    ratio = torch.exp(_log_ratio(logp, logp_old, m))
    pos = torch.full_like(ratio, tau_pos)  # in the loss's dtype (a scalar where() is float32)
    tau = torch.where(a > 0, pos, torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    loss = torch.where(m, -gate * a, 0.0)
    zeros = torch.zeros_like(m)
    return loss, _stats(ratio.detach(), zeros, zeros, m)


def gmpo(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: the geometric mean of token ratios per sequence, clipped per token in log space.

        ℓ_{i,t} = log r_{i,t} clipped to [−eps_low, eps_high] on the side that would increase the
                  objective: sgn(A)·min(sgn(A)·ℓ, sgn(A)·clip(ℓ, −eps_low, eps_high))
        ρ_i = exp( (1/|o_i|) Σ_t ℓ_{i,t} )        (geometric mean of the clipped ratios)
        loss_{i,t} = −A_i·ρ_i       (the same value on every valid token of row i)
    With aggregation "seq_mean_token_mean" the step loss is −(1/G)Σ_i A_i·ρ_i, the paper's
    objective; with other aggregations each row's value is weighted by its token count.
    The eps are in log space: the ratio range is (e^−0.4, e^0.4) by default (the paper's
    "clipping wider" range). "clipped_low"/"clipped_high": tokens whose clip binds (ℓ replaced by
    −eps_low with Ā < 0 / by eps_high with Ā > 0: those tokens get no gradient); a token outside
    the range on the side the objective does not push is not clipped and not counted (verl's
    clipfrac counts every token outside the range). stats["ratio"] is ρ_i broadcast.
    Shapes: logp, logp_old, mask (B, T); adv (B,) (a (B, T) adv is replaced by its row mean Ā_i
    over valid tokens, in the objective and in the clip side). Returns loss (B, T) (0 at padding)
    and stats. An empty row gives 0.
    verl's `geo_mean` (compute_policy_loss_geo_mean) gives the same values for a (B,) advantage
    (with `seq_mean_token_mean`, its fixed reduction). With a (B, T) advantage it also puts the
    row mean Ā_i in the objective, but picks each token's clip side by the sign of that token's
    A_{i,t}, and counts clipped tokens by it: a token whose sign differs from its row's is clipped
    on the other side there. Here the side follows sgn(Ā_i), the sign of the objective −Ā_i·ρ_i
    that is optimised (the paper defines GMPO for a sequence advantage only).
    Source: Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673, §3 (the
    geometric-mean objective) and §3.3 (token-level clipping in log space, range (e^−0.4, e^0.4)).
    Raises: ValueError on mismatched shapes or eps < 0.
    """
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"eps_low and eps_high must be >= 0, got {eps_low}, {eps_high}")
    m, a = _check_inputs(logp, logp_old, adv, mask)
    a_seq = masked_mean(a.expand_as(logp), m, dim=-1)[:, None]  # (B, 1)
    lr = _log_ratio(logp, logp_old, m)
    sgn = torch.sign(a_seq)
    lr_clip = torch.clamp(lr, -eps_low, eps_high)
    lr_min = sgn * torch.minimum(sgn * lr, sgn * lr_clip)
    rho = torch.exp(masked_mean(lr_min, m, dim=-1))[:, None]  # (B, 1)
    loss = torch.where(m, -(a_seq * rho).expand_as(logp), 0.0)
    clipped = (lr_min.detach() != lr.detach()) & m  # the clipped value was chosen
    return loss, _stats(
        rho.detach().expand_as(logp), clipped & (a_seq < 0), clipped & (a_seq > 0), m
    )


def _cov(logp_old: Tensor, adv: Tensor, m: Tensor) -> Tensor:
    """Per-token centred product (A − mean A)·(log π_old − mean log π_old), means over valid tokens."""
    a = adv.expand_as(logp_old).to(logp_old.dtype)
    lp = logp_old.detach()
    return torch.where(
        m, (a - masked_mean(a, m)) * (lp - masked_mean(torch.where(m, lp, 0.0), m)), 0.0
    )


def _selected_tokens(selected: Tensor, logp: Tensor, m: Tensor) -> Tensor:
    """`selected` (B, T) as a bool mask restricted to the valid tokens `m`; ValueError if its
    shape is not logp's."""
    if selected.shape != logp.shape:
        raise ValueError(
            f"selected has shape {tuple(selected.shape)}, expected {tuple(logp.shape)}"
        )
    return selected.bool() & m


def clip_cov_selection(
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    cov_ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
    **_: object,
) -> Tensor:
    """Clip-Cov's choice: a random cov_ratio share of the valid tokens whose covariance term
    (A − Ā)(log π − mean log π) lies in (cov_lb, cov_ub) — at least one token when any qualify.

    Over every valid token of `mask` (the trainer passes the whole minibatch, all ranks). The
    log-probs are π_old's (see `clip_cov`). Returns (B, T) bool. Source: Cui et al. 2025,
    arXiv 2505.22617, §4 (Clip-Cov; defaults r = 2e-4, ω_low = 1, ω_high = 5 as in the paper).
    Raises: ValueError if cov_ratio is not in (0, 1] or cov_lb >= cov_ub.
    """
    if not 0 < cov_ratio <= 1:
        raise ValueError(f"cov_ratio must be in (0, 1], got {cov_ratio}")
    if not cov_lb < cov_ub:
        raise ValueError(f"cov_lb must be < cov_ub, got {cov_lb}, {cov_ub}")
    m = mask.bool()
    cov = _cov(logp_old, adv if adv.ndim == 2 else adv[:, None], m)
    cand = torch.nonzero(((cov > cov_lb) & (cov < cov_ub) & m).reshape(-1)).reshape(-1)
    k = min(max(int(cov_ratio * int(m.sum())), 1), cand.numel())
    chosen = cand[torch.randperm(cand.numel(), generator=generator)[:k].to(cand.device)]
    out = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    out[chosen] = True
    return out.reshape(m.shape)


def kl_cov_selection(
    logp_old: Tensor, adv: Tensor, mask: Tensor, *, cov_ratio: float = 2e-3, **_: object
) -> Tensor:
    """KL-Cov's choice: the top cov_ratio share (at least one) of valid tokens by covariance term.

    Ties at the k-th value are broken by position (first in row-major order). Returns (B, T)
    bool. Source: Cui et al. 2025, arXiv 2505.22617, §4 (KL-Cov; k = 2e-3 in the paper for
    Qwen2.5-7B). Raises: ValueError if cov_ratio is not in (0, 1].
    """
    if not 0 < cov_ratio <= 1:
        raise ValueError(f"cov_ratio must be in (0, 1], got {cov_ratio}")
    m = mask.bool()
    cov = _cov(logp_old, adv if adv.ndim == 2 else adv[:, None], m).reshape(-1)
    valid = torch.nonzero(m.reshape(-1)).reshape(-1)
    out = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    if valid.numel():
        k = max(int(cov_ratio * valid.numel()), 1)
        vals = cov[valid]
        # stable descending order: ties keep row-major order on every device
        order = torch.sort(vals, descending=True, stable=True).indices
        out[valid[order[:k]]] = True
    return out.reshape(m.shape)


def clip_cov(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    cov_ratio: float = 2e-4,
    cov_lb: float = 1.0,
    cov_ub: float = 5.0,
    selected: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO-clip whose gradient is cut on a few tokens of high covariance.

        Cov_{i,t} = (A_{i,t} − Ā)·(log π(o_{i,t}) − mean log π)    over the minibatch's tokens
        I = a random share cov_ratio of the tokens with cov_lb < Cov < cov_ub
        loss = ppo_clip loss, detached (no gradient) on the tokens of I
    Tokens whose log-prob and advantage move together drive the entropy collapse (the paper's
    Theorem); removing their gradient keeps entropy up. `selected` (B, T) bool is I as chosen by
    `clip_cov_selection` over the whole minibatch (the trainer passes it); None chooses it here
    from this call's tokens (with torch's global RNG).
    "clipped_high"/"clipped_low" are PPO's plus the tokens of I (by the sign of A).
    Departures: the covariance uses π_old's log-probs (the rollout policy), which equal π_θ's on
    the first optimizer step of a batch; the paper (and verl) use the current ones, and verl
    chooses per micro-batch and excludes tokens already clipped by PPO from the draw.
    Shapes: as `ppo_clip`. Returns loss (B, T) and stats.
    Source: Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv 2505.22617, §4 (Clip-Cov; r = 2e-4, ω = (1, 5)).
    Raises: ValueError as `ppo_clip` and `clip_cov_selection`, or a `selected` of another shape.
    """
    m, a = _check_inputs(logp, logp_old, adv, mask)
    if selected is None:
        selected = clip_cov_selection(
            logp_old, a, m, cov_ratio=cov_ratio, cov_lb=cov_lb, cov_ub=cov_ub
        )
    sel = _selected_tokens(selected, logp, m)
    loss, stats = ppo_clip(logp, logp_old, adv, mask, eps_low=eps_low, eps_high=eps_high)
    loss = torch.where(sel, loss.detach(), loss)
    dt = stats["ratio"].dtype
    stats["clipped_low"] = torch.maximum(stats["clipped_low"], (sel & (a < 0)).to(dt))
    stats["clipped_high"] = torch.maximum(stats["clipped_high"], (sel & (a >= 0)).to(dt))
    stats["cov_selected"] = sel.to(dt)
    return loss, stats


def kl_cov(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    kl_coef: float = 1.0,
    cov_ratio: float = 2e-3,
    selected: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: the unclipped ratio surrogate plus a KL penalty on the tokens of highest covariance.

        loss_{i,t} = −r·A + kl_coef·|log r|  on the top cov_ratio share of tokens by Cov;
        loss_{i,t} = −r·A                    elsewhere          (r = π_θ/π_old)
    `selected` is that top share chosen over the whole minibatch by `kl_cov_selection` (the
    trainer passes it); None chooses it from this call's tokens. "clipped_*" are 0;
    stats["cov_selected"] marks the penalised tokens.
    Departure: the covariance uses π_old's log-probs (equal to π_θ's on the first optimizer step);
    the paper and verl use the current ones, verl per micro-batch.
    Shapes: as `ppo_clip`. Returns loss (B, T) and stats.
    Source: Cui et al. 2025, arXiv 2505.22617, §4 (KL-Cov; β = 1, k = 2e-3).
    Raises: ValueError on mismatched shapes, kl_coef < 0, or a `selected` of another shape.
    """
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    m, a = _check_inputs(logp, logp_old, adv, mask)
    if selected is None:
        selected = kl_cov_selection(logp_old, a, m, cov_ratio=cov_ratio)
    sel = _selected_tokens(selected, logp, m)
    lr = _log_ratio(logp, logp_old, m)
    ratio = torch.exp(lr)
    loss = -ratio * a + torch.where(sel, kl_coef * lr.abs(), 0.0)
    loss = torch.where(m, loss, 0.0)
    zeros = torch.zeros_like(m)
    stats = _stats(ratio.detach(), zeros, zeros, m)
    stats["cov_selected"] = sel.to(stats["ratio"].dtype)
    return loss, stats


@dataclass(frozen=True)
class PolicyLoss:
    """A registry entry: a surrogate and what it declares.

    select: None, or a function (logp_old, adv, mask, *, generator, **surrogate_args) -> (B, T)
        bool that chooses tokens from statistics of the whole minibatch; the trainer calls it
        once per optimizer step on the global minibatch (all ranks' rows) and passes the rows'
        part as `selected`; it needs π_old's log-probs of every row before the update.
    Calling the entry calls `fn`.
    """

    fn: Callable
    select: Callable | None = None

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "reinforce": PolicyLoss(reinforce),
    "ppo_clip": PolicyLoss(ppo_clip),
    "ppo_dual_clip": PolicyLoss(ppo_dual_clip),
    "gspo": PolicyLoss(gspo),
    "cispo": PolicyLoss(cispo),
    "sapo": PolicyLoss(sapo),
    "gmpo": PolicyLoss(gmpo),
    "clip_cov": PolicyLoss(clip_cov, select=clip_cov_selection),
    "kl_cov": PolicyLoss(kl_cov, select=kl_cov_selection),
}

# verl's `actor.policy_loss.loss_mode` names for the same surrogates (checked against
# verl/trainer/ppo/core_algos.py): "vanilla" is PPO-clip with dual clip (clip_ratio_c = 3; verl
# also clamps log r to ±20, which changes nothing while |log r| ≤ 20); "gpg" is −A·log π, our
# reinforce; "geo_mean" is GMPO (the same for a per-sequence advantage; with a per-token one verl
# picks the clip side by each token's sign, ours by the row mean's: see `gmpo`). "clip_cov",
# "kl_cov", "gspo", "sapo" are ours already, with these differences in verl: clip_cov/kl_cov
# choose per micro-batch from the current log-probs (see their docstrings); verl's gspo and sapo
# always reduce with "seq-mean-token-mean" whatever loss_agg_mode says (ours follow
# loss.aggregation) and clamp the log-ratio (gspo's sequence log-ratio at 10, sapo's at ±20).
POLICY_LOSS_ALIASES: dict[str, str] = {
    "vanilla": "ppo_dual_clip",
    "gpg": "reinforce",
    "geo_mean": "gmpo",
}
