"""Per-token estimators of KL(π_θ ‖ π_ref) from samples of π_θ.

Source: J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html.
With x ~ π_θ and r = π_ref(x)/π_θ(x), i.e. log r = logp_ref − logp:
    k1 = −log r                   unbiased, high variance, can be negative
    k2 = (log r)² / 2             biased (≈ KL to second order for close policies), always ≥ 0
    k3 = (r − 1) − log r          unbiased, always ≥ 0 (log r ≤ r − 1), low variance
E_{π_θ}[k1] = E_{π_θ}[k3] = KL(π_θ ‖ π_ref) exactly.

Direction: the samples come from π_θ (the policy being trained), so r is π_ref/π_θ. The rlhf-book's
code (code/policy_gradients/loss.py, `approx_kl1` / `approx_kl3`) puts r' = π_θ/π_ref in their
place: its k1 = −log r' has expectation −KL(π_θ ‖ π_ref) (the sign flipped) and its
k3 = (r' − 1) − log r' is not an unbiased estimate of either KL under samples of π_θ (its k2 is
the same as ours, the square does not see the sign); not repeated.

As a reward penalty (PPO, RLOO: reward −= coef·k per token) any estimator works. As a loss term
(GRPO's β·D_KL) note what the gradient is when the samples are held fixed: ∇k1 = ∇logp has zero
expectation under π_θ (k1 in the loss does nothing on average), and E_{π_θ}[∇k3] = ∇KL(π_ref ‖ π_θ),
the *reverse* direction; k2's gradient, log r·(−∇logp), matches ∇KL(π_θ ‖ π_ref) in expectation.

Every estimator is elementwise: logp and logp_ref of the same shape (any), result of that shape in
their dtype. Mask and reduce with `rlhflab.losses.aggregate` or `rlhflab.ops.masked_mean`.
"""

import torch
from torch import Tensor

__all__ = [
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "KL_ESTIMATOR_ALIASES",
    "KL_ESTIMATOR_NEAR_MISSES",
    "KLController",
    "abs_kl",
    "adaptive_kl_coef",
    "k1",
    "k2",
    "k3",
    "kl_in_reward",
    "kl_penalty",
    "straight_through",
]


def _log_r(logp: Tensor, logp_ref: Tensor) -> Tensor:
    if logp.shape != logp_ref.shape:
        raise ValueError(
            f"logp_ref has shape {tuple(logp_ref.shape)}, expected logp's {tuple(logp.shape)}"
        )
    return logp_ref - logp


def k1(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k1 = −log r = logp − logp_ref: the naive unbiased estimator of KL(π_θ ‖ π_ref).

    Shapes: logp, logp_ref (...) float, same shape. Returns (...) same dtype.
    Source: Schulman 2020, "Approximating KL Divergence", joschu.net/blog/kl-approx.html.
    Raises: ValueError if shapes differ.
    """
    return -_log_r(logp, logp_ref)


def k2(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k2 = (log r)²/2 with log r = logp_ref − logp: biased, low-variance, non-negative.

    E_{π_θ}[k2] = KL(π_θ ‖ π_ref) + O(δ³) for π_ref = π_θ·(1 + δ) (an f-divergence with the same
    second-order expansion as KL).
    Shapes: logp, logp_ref (...) float, same shape. Returns (...) same dtype.
    Source: Schulman 2020, "Approximating KL Divergence", joschu.net/blog/kl-approx.html.
    Raises: ValueError if shapes differ.
    """
    return 0.5 * _log_r(logp, logp_ref) ** 2


def k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """k3 = (r − 1) − log r with log r = logp_ref − logp: unbiased and non-negative.

    Computed as expm1(log r) − log r for accuracy near r = 1. Used by GRPO (DeepSeekMath, arXiv
    2402.03300, eq. 4) as the KL term of its loss.
    Shapes: logp, logp_ref (...) float, same shape. Returns (...) same dtype.
    Source: Schulman 2020, "Approximating KL Divergence", joschu.net/blog/kl-approx.html.
    Raises: ValueError if shapes differ.
    """
    log_r = _log_r(logp, logp_ref)
    return torch.expm1(log_r) - log_r


def abs_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """|log r| = |logp − logp_ref|: the absolute log-ratio, a non-negative proxy of the KL.

    Not an unbiased estimator of KL(π_θ ‖ π_ref) (E|log r| ≥ |E log r|); kept for parity with
    verl's "abs" penalty. Its gradient is sign(logp − logp_ref)·∇logp.
    Shapes: logp, logp_ref (...) float, same shape. Returns (...) same dtype.
    Source: verl `kl_penalty(..., "abs")` (core_algos.py); Schulman 2020 for the k-estimators.
    Raises: ValueError if shapes differ.
    """
    return _log_r(logp, logp_ref).abs()


def straight_through(value_fn):
    """An estimator whose *value* is `value_fn`'s and whose *gradient* is k2's.

        kl_st = k2 + sg(value − k2)      (value: k1, k3 or abs)
    As a loss term, k2's gradient (logp − logp_ref)·∇logp is the one whose expectation under
    π_θ is ∇KL(π_θ ‖ π_ref) (see the module docstring); the value is the chosen estimator's, so
    the logged KL is unchanged. Returns the elementwise function (logp, logp_ref) -> (...).
    Source: verl's documented "+" suffix of `kl_loss_type` ("k1+", "k3+", "abs+"; docs/algo/ppo.md)
    and the straight-through line of its `kl_penalty` (k2 − sg(k2) + sg(value)); in the verl code
    read (core_algos.py, early 2026) `kl_penalty_forward` does not strip the "+", so verl itself
    raises NotImplementedError for every "+" name.
    """

    def fn(logp: Tensor, logp_ref: Tensor) -> Tensor:
        grad_part = k2(logp, logp_ref)
        return grad_part + (value_fn(logp, logp_ref) - grad_part).detach()

    fn.__name__ = f"{value_fn.__name__}_straight_through"
    fn.__doc__ = (
        f"Value of {value_fn.__name__}, gradient of k2 (`straight_through`). Shapes: logp, "
        "logp_ref (...) same shape; returns (...). Raises ValueError if shapes differ."
    )
    return fn


def kl_penalty(logp: Tensor, logp_ref: Tensor, estimator: str) -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate by name: one of KL_ESTIMATORS ("k1", "k2", "k3", "abs",
    and the straight-through "k1+", "k3+", "abs+": that value with k2's gradient).

    Shapes: logp, logp_ref (...) float, same shape. Returns (...) same dtype.
    Raises: ValueError for an unknown estimator name (the message lists the valid ones) or if
    shapes differ.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logp, logp_ref)


def kl_in_reward(
    rewards: Tensor, kl: Tensor, mask: Tensor, *, coef: float, per_token: bool
) -> Tensor:
    """Put the KL penalty into the reward (RLHF's regularised reward r − β·KL).

    per_token=False: sequence placement, r'_i = r_i − β·Σ_t kl_{i,t}·mask_{i,t}  -> (B,)
        (RLOO / REINFORCE: the penalty is part of the sequence's return; with k1 the sum is
        β·log π_θ(o)/π_ref(o)).
    per_token=True: token placement, r'_{i,t} = −β·kl_{i,t}, plus r_i at the last valid token  -> (B, T)
        (PPO / InstructGPT; the input to GAE). Per-token rewards r (B, T) (dense credit,
        `advantages.token_rewards`) are added as they are: r'_{i,t} = r_{i,t} − β·kl_{i,t}.
    kl is treated as data (detached): the penalty shapes the reward, it is not differentiated.
    Shapes: rewards (B,) (or (B, T) with per_token=True), kl (B, T), mask (B, T) right-padded.
    Returns (B,) or (B, T) float, 0 at padding.
    Source: Ziegler et al. 2019, arXiv 1909.08593, eq. 2 (R = r − β·log π/ρ); Ouyang et al. 2022
    (InstructGPT), arXiv 2203.02155, eq. 2; per-token form as in lm-human-preferences / TRL PPO;
    sequence form as in Ahmadian et al. 2024 (RLOO), arXiv 2402.14740, §2.
    Raises: ValueError on shape mismatch or coef < 0.
    """
    if coef < 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    dense = per_token and rewards.ndim == 2
    if kl.shape != mask.shape or kl.ndim != 2 or rewards.shape != kl.shape[: rewards.ndim]:
        raise ValueError(
            f"need rewards (B,) (or (B, T) per token), kl and mask (B, T); got "
            f"{tuple(rewards.shape)}, {tuple(kl.shape)}, {tuple(mask.shape)}"
        )
    if rewards.ndim == 2 and not per_token:
        raise ValueError("per-token rewards (B, T) need per_token=True (token placement)")
    m = mask.bool()
    penalty = torch.where(m, -coef * kl.detach(), 0.0)  # (B, T)
    if dense:
        return penalty + torch.where(m, rewards.to(penalty.dtype), 0.0)
    if not per_token:
        return rewards + penalty.sum(-1)
    last = (m.long().cumsum(-1) == m.long().sum(-1, keepdim=True)) & m  # last valid token
    return penalty + torch.where(last, rewards[:, None].to(penalty.dtype), 0.0)


def adaptive_kl_coef(coef: float, kl: float, *, target: float, horizon: int, n_steps: int) -> float:
    """Ziegler et al.'s adaptive KL controller: one proportional update of β.

        e = clip(KL / KL_target − 1, −0.2, 0.2);   β ← β·(1 + e·n_steps / horizon)
    KL is the measured KL per completion (summed over tokens, mean over the batch), n_steps the
    number of completions in the batch. β grows when KL is above target and shrinks below it.
    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv
    1909.08593, §2.2 (K_β = 0.1 folded into the clip of ±0.2 as in lm-human-preferences).
    Raises: ValueError if target <= 0 or horizon < 1.
    """
    if not target > 0:
        raise ValueError(f"target must be > 0, got {target}")
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1, got {horizon}")
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * n_steps / horizon)


class KLController:
    """The KL coefficient β across steps, and its share of a checkpoint.

    controller "fixed": β stays `coef`. "adaptive": after each step, `update(kl_seq, n_steps)`
    applies Ziegler et al.'s proportional update (`adaptive_kl_coef`) towards `target`, with
    horizon `horizon` completions. `coef` is the β of the next step.
    `state()` is {"kl_coef": β} (the key the trainers' checkpoints have always used, so older
    checkpoints load); `load(state)` restores it exactly.
    Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv
    1909.08593, §2.2.
    Raises: ValueError for an unknown controller, coef < 0, or (adaptive) target <= 0 / None,
    horizon < 1 or coef <= 0.
    """

    def __init__(
        self,
        coef: float,
        *,
        controller: str = "fixed",
        target: float | None = None,
        horizon: int = 10000,
    ) -> None:
        if controller not in KL_CONTROLLERS:
            raise ValueError(
                f"unknown KL controller {controller!r}; valid: {', '.join(KL_CONTROLLERS)}"
            )
        if coef < 0:
            raise ValueError(f"coef must be >= 0, got {coef}")
        if controller == "adaptive":
            if target is None or not target > 0:
                raise ValueError(f"target must be > 0 for the adaptive controller, got {target}")
            if horizon < 1:
                raise ValueError(f"horizon must be >= 1, got {horizon}")
            if not coef > 0:
                raise ValueError(f"the adaptive controller needs an initial coef > 0, got {coef}")
        self.coef, self.controller = coef, controller
        self.target, self.horizon = target, horizon

    def update(self, kl_seq: float | None, n_steps: int) -> float:
        """After a step whose measured KL per completion (summed over tokens, mean over the
        batch) was `kl_seq` over `n_steps` completions: the adaptive controller moves β (a
        `kl_seq` of None, no KL measured, leaves it); the fixed one keeps it. Returns β."""
        if self.controller == "adaptive" and kl_seq is not None:
            self.coef = adaptive_kl_coef(
                self.coef, kl_seq, target=self.target, horizon=self.horizon, n_steps=n_steps
            )
        return self.coef

    def state(self) -> dict:
        """{"kl_coef": β}: JSON-serialisable, the checkpoint key of earlier versions."""
        return {"kl_coef": self.coef}

    def load(self, state: dict) -> None:
        """Continue from `state()` of a checkpoint (any dict with "kl_coef")."""
        self.coef = state["kl_coef"]


KL_CONTROLLERS = ("fixed", "adaptive")

KL_ESTIMATORS = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
    "abs": abs_kl,
    "k1+": straight_through(k1),
    "k3+": straight_through(k3),
    "abs+": straight_through(abs_kl),
}

# Other libraries' names for the same estimators (config values that resolve to ours): verl's
# `kl_loss_type` / `kl_penalty` "kl" is k1, "mse" is k2 ("mse+" is k2 itself), "kl+" is k1+
# (verl's "+" names as documented; see `straight_through`). verl's own "k3" is its clamped
# "low_var_kl": our "k3" is the unclamped estimator (the same name, values differ beyond ±10).
KL_ESTIMATOR_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "mse+": "k2", "kl+": "k1+"}

# Names that look like ours but compute something else: refused with the difference.
KL_ESTIMATOR_NEAR_MISSES: dict[str, str] = {
    "low_var_kl": "verl's 'low_var_kl' is k3 clamped to [-10, 10]; ours, 'k3', is not clamped",
    "low_var_kl+": "verl's 'low_var_kl+' is k3 clamped to [-10, 10] (value); ours, 'k3+', is "
    "not clamped",
}
