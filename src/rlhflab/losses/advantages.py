"""Advantage estimators: group baselines (GRPO, Dr. GRPO, RLOO), batch baseline, none, and GAE.

Group estimators take one scalar reward per completion, rewards (B,) with B = n_groups·group_size,
laid out group-contiguous: [g0s0, g0s1, ..., g0s(G−1), g1s0, ...] (the G samples of a prompt are
adjacent). They return adv (B,), which the policy losses broadcast over a completion's tokens.
Integer or bool rewards are promoted to float32; float rewards keep their dtype.
A group whose rewards are all equal gets an advantage of exactly 0 (no learning signal), never the
rounding noise of r − mean(r).

`ADVANTAGES` maps each name to an `Advantage`: the function and what it declares it needs, which
the config checks and the trainer read (never the function's signature): `needs_groups` (the
trainer passes `group_size`; rollout.group_size must be >= 2), `needs_values` (a critic: the
function takes per-token rewards, values and mask and returns (adv, returns)) and `per_token`
(the advantage is (B, T), so the KL may enter the reward per token). `ADVANTAGE_ALIASES` maps the
names other libraries give the same estimator to ours.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.ops import masked_whiten

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_ALIASES",
    "Advantage",
    "batch_mean",
    "gae",
    "group_mean",
    "group_zscore",
    "no_baseline",
    "rloo",
    "whiten",
]


def _as_float(rewards: Tensor) -> Tensor:
    return rewards if rewards.is_floating_point() else rewards.float()


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """Validate and view rewards (B,) as (n_groups, G)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"rewards has B={rewards.shape[0]} entries, not divisible by group_size={group_size}"
        )
    return _as_float(rewards).reshape(-1, group_size)


def _zero_if_constant(adv: Tensor, r: Tensor) -> Tensor:
    """adv (n, G): exactly 0 in groups whose rewards are all equal."""
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)  # (n, 1)
    return torch.where(constant, 0.0, adv)


def group_zscore(
    rewards: Tensor, *, group_size: int, eps: float = 1e-6, unbiased: bool = True
) -> Tensor:
    """GRPO's group-normalised advantage: A_i = (r_i − mean_g(r)) / (std_g(r) + eps).

    mean_g and std_g are over the G samples of the prompt that produced completion i.
    Std convention (pinned): `unbiased=True` uses the sample std with Bessel's correction,
    sqrt(Σ(r − r̄)²/(G − 1)), as torch.std and TRL do; `unbiased=False` divides by G. DeepSeekMath
    writes only "std" and does not say which. Example G=2, r=[1, 0]: unbiased std = 0.7071, so
    A = ±0.7071; with unbiased=False std = 0.5 and A = ±1.
    eps guards a near-constant group (TRL uses 1e-4); an exactly constant group gives A = 0.
    Shapes: rewards (B,) float, B = n_groups·group_size, group-contiguous. Returns adv (B,).
    Source: Shao et al. 2024, DeepSeekMath (GRPO), arXiv 2402.03300, §4.1.2 (outcome supervision).
    Raises: ValueError if group_size < 2, rewards is not 1-D, B % group_size != 0, or eps < 0.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = _groups(rewards, group_size)  # (n, G)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, correction=1 if unbiased else 0)
    adv = _zero_if_constant((r - mean) / (std + eps), r)
    return adv.reshape(-1)


def group_mean(rewards: Tensor, *, group_size: int) -> Tensor:
    """Dr. GRPO's advantage: A_i = r_i − mean_g(r), the group mean without std normalisation.

    Dropping the division by std removes GRPO's question-difficulty bias (groups with small reward
    spread were up-weighted).
    Shapes: rewards (B,) float, B = n_groups·group_size, group-contiguous. Returns adv (B,).
    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (Dr. GRPO), arXiv 2503.20783, §3.2.
    Raises: ValueError if group_size < 2, rewards is not 1-D, or B % group_size != 0.
    """
    r = _groups(rewards, group_size)
    adv = _zero_if_constant(r - r.mean(dim=1, keepdim=True), r)
    return adv.reshape(-1)


def rloo(rewards: Tensor, *, group_size: int) -> Tensor:
    """REINFORCE Leave-One-Out: A_i = r_i − (1/(G − 1)) Σ_{j≠i} r_j (same group).

    Equals G/(G − 1)·(r_i − mean_g(r)). Example G=4, r=[1, 0, 0, 1]: A_0 = 1 − (0+0+1)/3 = 2/3.
    Shapes: rewards (B,) float, B = n_groups·group_size, group-contiguous. Returns adv (B,).
    Source: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs", arXiv 2402.14740 (RLOO estimator; Kool et al. 2019).
    Raises: ValueError if group_size < 2, rewards is not 1-D, or B % group_size != 0.
    """
    r = _groups(rewards, group_size)
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return _zero_if_constant(r - others, r).reshape(-1)


def batch_mean(rewards: Tensor) -> Tensor:
    """REINFORCE with a batch-mean baseline: A_i = r_i − mean_batch(r).

    Shapes: rewards (B,) float. Returns adv (B,).
    Source: Williams 1992, "Simple statistical gradient-following algorithms for connectionist
    reinforcement learning" (reinforcement baseline b).
    Raises: ValueError if rewards is not 1-D and non-empty.
    """
    if rewards.ndim != 1 or rewards.shape[0] == 0:
        raise ValueError(f"rewards must have shape (B,) with B >= 1, got {tuple(rewards.shape)}")
    r = _as_float(rewards)
    return r - r.mean()


def no_baseline(rewards: Tensor) -> Tensor:
    """Plain REINFORCE: A_i = r_i (no baseline; unbiased, highest variance).

    Shapes: rewards (B,) float. Returns adv (B,): rewards itself when float (no copy).
    Source: Williams 1992 (REINFORCE).
    Raises: ValueError if rewards is not 1-D.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    return _as_float(rewards)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over token positions; returns (adv, returns).

    δ_t = r_t + γ·V_{t+1} − V_t, with V_{t+1} = 0 after the last valid token (terminal);
    A_t = Σ_{l≥0} (γλ)^l δ_{t+l} = δ_t + γλ·A_{t+1}  (A = 0 beyond the last valid token);
    returns_t = A_t + V_t (the λ-return, the value target).
    Computed with one reverse loop over T, vectorised over B. Inputs are detached: advantages and
    returns are targets and carry no gradient.
    Shapes: rewards, values, mask (B, T); rewards are per token (usually the scalar reward at the
    last valid token plus per-token KL penalties). Masked positions are skipped: t+1 above is the
    next *valid* position, so a multi-turn trajectory (mask 0 on tool / environment tokens between
    the model's turns, rlhflab.rollout.trajectory) gets the GAE of its model tokens alone; for a
    right-padded mask (contiguous 1s then 0s) this is the usual recursion. Returns adv, returns
    (B, T) in the promoted dtype of rewards/values, 0 at masked positions.
    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation", arXiv 1506.02438, eq. 16; used with PPO (Schulman et al. 2017, arXiv 1707.06347,
    eq. 11-12) and for LMs by Ziegler et al. 2019 (arXiv 1909.08593).
    Raises: ValueError if shapes differ or are not 2-D, or gamma/lam are outside [0, 1].
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must have shape (B, T), got {tuple(rewards.shape)}")
    if values.shape != rewards.shape:
        raise ValueError(f"values has shape {tuple(values.shape)}, expected {tuple(rewards.shape)}")
    if mask.shape != rewards.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(rewards.shape)}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    dtype = torch.promote_types(_as_float(rewards).dtype, _as_float(values).dtype)
    m = mask.bool()
    r = torch.where(m, rewards.detach().to(dtype), 0.0)  # padding garbage never enters
    v = torch.where(m, values.detach().to(dtype), 0.0)
    adv = torch.zeros_like(r)
    last = torch.zeros_like(r[:, 0])  # A_{t+1}  (B,)
    next_v = torch.zeros_like(r[:, 0])  # V_{t+1}, 0 after the last valid token
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_v - v[:, t]
        # a masked position passes A_{t+1} and V_{t+1} of the next valid token through
        last = torch.where(m[:, t], delta + gamma * lam * last, last)
        adv[:, t] = torch.where(m[:, t], last, 0.0)
        next_v = torch.where(m[:, t], v[:, t], next_v)
    returns = torch.where(m, adv + v, 0.0)
    return adv, returns


def whiten(adv: Tensor, mask: Tensor | None = None, *, shift_mean: bool = True) -> Tensor:
    """Whiten advantages: (A − mean)/sqrt(var + 1e-8) over all valid elements (see ops.masked_whiten).

    With shift_mean=False the mean is kept (rescale only). Population variance, as in
    lm-human-preferences (Ziegler et al. 2019, arXiv 1909.08593) and PPO implementations.
    Shapes: adv (B,) or (B, T); mask same shape or None (all valid). Returns adv's shape; 0 at
    padding.
    Raises: ValueError if mask's shape differs from adv's.
    """
    adv = _as_float(adv)
    if mask is None:
        mask = torch.ones_like(adv, dtype=torch.bool)
    return masked_whiten(adv, mask, shift_mean=shift_mean)


@dataclass(frozen=True)
class Advantage:
    """A registry entry: an advantage estimator and the capabilities it declares.

    needs_groups: takes `group_size` (rewards laid out group-contiguous, G >= 2); the trainer
        passes rollout.group_size.
    needs_values: takes (rewards (B, T), values (B, T), mask (B, T)) and returns (adv, returns),
        both (B, T); the run needs a critic (a `value:` section). Otherwise it takes rewards (B,).
    per_token: returns a per-token advantage (B, T) (so kl.placement "reward_token" fits).
    Calling the entry calls `fn`.
    """

    fn: Callable
    needs_groups: bool = False
    needs_values: bool = False
    per_token: bool = False

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


ADVANTAGES: dict[str, Advantage] = {
    "group_zscore": Advantage(group_zscore, needs_groups=True),
    "group_mean": Advantage(group_mean, needs_groups=True),
    "rloo": Advantage(rloo, needs_groups=True),
    "batch_mean": Advantage(batch_mean),
    "none": Advantage(no_baseline),
    "gae": Advantage(gae, needs_values=True, per_token=True),
}

# Other libraries' names for the same estimators (config values that resolve to ours): verl's
# `algorithm.adv_estimator` "grpo" is group_zscore (sample std, eps 1e-6; its
# norm_adv_by_std_in_grpo=False is group_mean); "rloo" and "gae" are ours already. verl's
# reinforce_plus_plus(_baseline), remax, opo and grpo_passk have no counterpart here.
ADVANTAGE_ALIASES: dict[str, str] = {"grpo": "group_zscore"}
