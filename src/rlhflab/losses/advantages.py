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

from rlhflab.ops import masked_mean, masked_var, masked_whiten

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_ALIASES",
    "Advantage",
    "batch_mean",
    "gae",
    "gpg",
    "group_mean",
    "group_zscore",
    "no_baseline",
    "opo",
    "optimal_token_baseline",
    "pass_k",
    "prime_rloo",
    "process_group_zscore",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "token_rewards",
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


def _token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards (B, T): (B, T) as given, or a (B,) sequence reward at the last valid token."""
    if mask.ndim != 2:
        raise ValueError(f"mask must have shape (B, T), got {tuple(mask.shape)}")
    m = mask.bool()
    if rewards.shape == mask.shape:
        return torch.where(m, _as_float(rewards), 0.0)
    if rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"rewards must have shape (B,) or (B, T) = {tuple(mask.shape)}, "
            f"got {tuple(rewards.shape)}"
        )
    last = (m.long().cumsum(-1) == m.long().sum(-1, keepdim=True)) & m
    return torch.where(last, _as_float(rewards)[:, None], 0.0)


def _whiten_tokens(x: Tensor, m: Tensor) -> Tensor:
    """verl's `masked_whiten` (verl/utils/torch_functional.py) over every valid token:
    (x − μ)·rsqrt(σ² + 1e-8), μ the masked mean, σ² the masked variance with Bessel's correction
    (Σ(x − μ)²/(n − 1), n valid tokens); 0 at padding. Departures: verl raises for n = 1 (here the
    one token gets 0), and verl's means divide by n + 1e-8 (the same number in float32)."""
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    return torch.where(m, (x - mean) * torch.rsqrt(var + 1e-8), 0.0)


def reinforce_pp(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """REINFORCE++: discounted return-to-go per token, whitened over all valid tokens of the batch.

        G_{i,t} = Σ_{s≥t} γ^{s−t} r_{i,s}          (r_{i,s}: per-token reward, e.g. −β·KL_s plus the
                                                     outcome reward at the last token)
        A_{i,t} = (G_{i,t} − mean(G)) / sqrt(var(G) + 1e-8)   mean/var over every valid token
    var is the unbiased variance, Σ(G − mean)²/(n − 1) over the n valid tokens, as in verl's
    `reinforce_plus_plus` (compute_reinforce_plus_plus_outcome_advantage, `verl_F.masked_whiten`
    with Bessel's correction); this estimator gives verl's values (tested against its code,
    re-typed). OpenRLHF's REINFORCE++ (advantage estimator "reinforce") whitens the same returns
    with the population variance, clamped: rsqrt(max(var, 1e-8)); the two differ by a factor
    √((n − 1)/n), negligible over a batch of tokens. The paper writes only "std".
    The normalisation is *global* (the whole batch, every rank): the trainer calls this estimator
    on the gathered batch (registry flag `batch_stats`), so N ranks × k micro-batches give the
    one-batch advantages.
    Shapes: rewards (B, T) per-token or (B,) outcome rewards (placed at the last valid token); mask
    (B, T), right-padded. Returns adv (B, T) float, 0 at padding.
    Source: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", arXiv 2501.03262, §3 (the token-level KL penalty in the reward, the return, and
    the global advantage normalisation equation; numbers not checked against the PDF).
    Raises: ValueError on bad shapes or gamma outside [0, 1].
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    r = _token_rewards(rewards, mask)
    m = mask.bool()
    ret = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, 0.0)
        ret[:, t] = running
    return _whiten_tokens(ret, m)


def reinforce_pp_baseline(rewards: Tensor, mask: Tensor, *, group_size: int) -> Tensor:
    """REINFORCE++-baseline: group-mean baseline, then global normalisation over the batch.

        A'_i = r_i − mean_g(r)            (the G samples of the same prompt)
        A_{i,t} = (A'_i − mean(A')) / sqrt(var(A') + 1e-8)   over every valid token of the batch
    (A'_i broadcast over its completion's tokens, so long completions weigh more in the batch
    statistics, as the token-level normalisation of verl's and OpenRLHF's code does.) var is the
    unbiased variance over the valid tokens, as in verl's `reinforce_plus_plus_baseline`
    (compute_reinforce_plus_plus_baseline_outcome_advantage: group mean, then
    `verl_F.masked_whiten`), whose values this gives (tested against its code, re-typed);
    OpenRLHF's "reinforce_baseline" uses the population variance, clamped at 1e-8 (see
    `reinforce_pp`). Departures from verl: groups whose rewards are all equal have A' = 0 exactly
    (verl: r − mean, which can be rounding noise for non-dyadic rewards, then amplified by the
    whitening), and a group of one sample is refused (verl uses the baseline 0). The KL term
    belongs in the loss (k3, kl.placement "loss"), as the paper recommends for this variant.
    Batch statistics: called on the gathered batch (registry flag `batch_stats`).
    Shapes: rewards (B,) group-contiguous, mask (B, T). Returns adv (B, T), 0 at padding.
    Source: Hu 2025, arXiv 2501.03262 (v3+), §3 "REINFORCE++-baseline" (group-mean subtraction,
    then global normalisation).
    Raises: ValueError on bad shapes or group_size < 2.
    """
    a = group_mean(rewards, group_size=group_size)  # (B,), exactly 0 in constant groups
    if mask.shape[:1] != a.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected ({a.shape[0]}, T)")
    m = mask.bool()
    return _whiten_tokens(torch.where(m, a[:, None], 0.0), m)


def token_rewards(
    step_rewards: Tensor | None,
    steps: Tensor | None,
    rewards: Tensor,
    mask: Tensor,
    *,
    outcome: bool,
) -> tuple[Tensor, Tensor]:
    """Per-token rewards of dense (process) credit, and where a reward is given.

        r_{i,t} = step_rewards_{i,t} + [t = last valid token of i]·rewards_i
        given_{i,t} = steps_{i,t} or (outcome and t = last valid token of i)
    step_rewards holds each step's reward at that step's last token (the step-separator
    position, 0 elsewhere), steps marks those positions; rewards (B,) is the sequence-level
    (outcome) reward, placed at the last valid token as `kl_in_reward` places it. With
    outcome=False (no weighted sequence-level component) the last token is a reward position
    only where it ends a step. A step ending at the last token and the outcome share one
    position: their sum is one reward there. step_rewards and steps None: no dense rewards (the
    outcome alone).
    Shapes: step_rewards (B, T) float or None, steps (B, T) bool or None, rewards (B,) float,
    mask (B, T) right-padded. Returns (rewards (B, T) float, 0 at padding; given (B, T) bool).
    Source: the reward layout of Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, §4.1.3
    (r_i^{index(j)}: a step's reward at its end token) and §4.1.2 (the outcome at the end).
    Raises: ValueError on shapes that do not match mask, or a step outside mask.
    """
    if mask.ndim != 2 or rewards.shape != mask.shape[:1]:
        raise ValueError(
            f"need rewards (B,) and mask (B, T); got {tuple(rewards.shape)}, {tuple(mask.shape)}"
        )
    m = mask.bool()
    r = _token_rewards(rewards, mask)  # outcome at the last valid token
    last = (m.long().cumsum(-1) == m.long().sum(-1, keepdim=True)) & m
    given = last if outcome else torch.zeros_like(m)
    if (step_rewards is None) != (steps is None):
        raise ValueError("step_rewards and steps must both be given or both be None")
    if step_rewards is not None:
        if step_rewards.shape != mask.shape or steps.shape != mask.shape:
            raise ValueError(
                f"step_rewards and steps must have mask's shape {tuple(mask.shape)}, got "
                f"{tuple(step_rewards.shape)}, {tuple(steps.shape)}"
            )
        s = steps.bool()
        if (s & ~m).any():
            raise ValueError("steps marks a position outside mask (a step must end on a token)")
        r = r + torch.where(s, _as_float(step_rewards).to(r.dtype), 0.0)
        given = given | s
    return r, given


def process_group_zscore(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_size: int,
    steps: Tensor,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> Tensor:
    """GRPO with process supervision: step rewards z-scored over the whole group, and a token's
    advantage the sum of the normalised rewards of the steps that end at or after it.

    DeepSeekMath §4.1.3: "a process reward model is used to score each step of the outputs,
    yielding corresponding rewards: R = {{r_1^{index(1)}, ..., r_1^{index(K_1)}}, ...,
    {r_G^{index(1)}, ..., r_G^{index(K_G)}}}, where index(j) is the end token index of the j-th
    step, and K_i is the total number of steps in the i-th output. We also normalize these
    rewards with the average and the standard deviation, i.e.,
    r̃_i^{index(j)} = (r_i^{index(j)} − mean(R)) / std(R). Subsequently, the process supervision
    calculates the advantage of each token as the sum of the normalized rewards from the
    following steps, i.e., Â_{i,t} = Σ_{index(j) ≥ t} r̃_i^{index(j)}".

        R_g = {rewards_{i,t} : i in group g, steps_{i,t}}        (every step of the G outputs)
        r̃_{i,t} = (rewards_{i,t} − mean(R_g)) / (std(R_g) + eps)   at steps_{i,t}, 0 elsewhere
        A_{i,t} = Σ_{s ≥ t} r̃_{i,s} · mask_{i,t}
    Departures, stated: std is the sample std with Bessel's correction (as `group_zscore`;
    `unbiased=False` divides by |R_g|), plus eps; a group whose step rewards are all equal, or
    that has a single step reward, gets A = 0 exactly (no signal, never 0/0); a completion with
    no reward position gets A = 0 at every token and adds nothing to R_g; a group without any
    gets A = 0. The paper's process GRPO has no outcome reward: `token_rewards` (the trainer's
    one place where per-token rewards are built) adds a weighted outcome as the reward of one
    more position, the last token, normalised in the same pool R_g; with only that position
    per output this estimator equals `group_zscore` broadcast over the completion's tokens.
    Shapes: rewards (B, T) float per-token (the step rewards at their positions), mask (B, T)
    right-padded, steps (B, T) bool (the positions carrying a reward, within mask); B =
    n_groups·group_size, group-contiguous. Returns adv (B, T) in rewards' float dtype, 0 at
    padding.
    Source: Shao et al. 2024, DeepSeekMath, arXiv 2402.03300, §4.1.3 (process supervision RL
    with GRPO).
    Raises: ValueError on bad shapes, steps outside mask, group_size < 2 or eps < 0.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rewards.ndim != 2 or mask.shape != rewards.shape or steps.shape != rewards.shape:
        raise ValueError(
            f"rewards, mask and steps must share one (B, T) shape, got {tuple(rewards.shape)}, "
            f"{tuple(mask.shape)}, {tuple(steps.shape)}"
        )
    _groups(rewards[:, 0], group_size)  # validates group_size and B % G
    m, s = mask.bool(), steps.bool()
    if (s & ~m).any():
        raise ValueError("steps marks a position outside mask (a step must end on a token)")
    r = _as_float(rewards)
    n, t = r.shape[0] // group_size, r.shape[1]
    rg = torch.where(s, r, 0.0).reshape(n, group_size * t)  # (n, G·T)
    sg = s.reshape(n, group_size * t)
    count = sg.sum(-1, keepdim=True).to(r.dtype)  # |R_g|  (n, 1)
    mean = rg.sum(-1, keepdim=True) / count.clamp(min=1)
    sq = torch.where(sg, (rg - mean) ** 2, 0.0).sum(-1, keepdim=True)
    dof = count - 1 if unbiased else count
    std = torch.sqrt(sq / dof.clamp(min=1))
    first = torch.gather(rg, 1, sg.to(torch.long).argmax(-1, keepdim=True))  # one step's reward
    constant = (torch.where(sg, rg == first, True)).all(-1, keepdim=True)  # also |R_g| <= 1
    normed = torch.where(sg & ~constant, (rg - mean) / (std + eps), 0.0).reshape(-1, t)
    adv = normed.flip(-1).cumsum(-1).flip(-1)  # Σ_{s ≥ t} r̃_s
    return torch.where(m, adv, 0.0)


def prime_rloo(
    rewards: Tensor, mask: Tensor, *, group_size: int, outcome: Tensor, gamma: float = 1.0
) -> Tensor:
    """PRIME's advantage: RLOO per reward type, the process part as a return over future tokens.

    PRIME README (github.com/PRIME-RL/PRIME): "we first calculate the return of outcome rewards
    and implicit process rewards separately: For ground truth outcome rewards, we directly adopt
    RLOO without any modification. For implicit process rewards, we perform a three-step process
    to calculate return: (1) Use the averaged implicit process rewards to calculate the
    leave-one-out baseline (2) Normalize the process reward at step t by subtracting the
    baseline; (3) Calculate the discounted return for each response. Finally, advantage is set
    to the combination of both returns." As an equation (paper §3, the RLOO advantage with
    implicit process rewards):

        b_i   = 1/(G − 1) · Σ_{j≠i, same group} (Σ_s r_{j,s}) / |y_j|        (mean process reward)
        P_{i,t} = Σ_{s≥t} γ^{s−t} · (r_{i,s} − b_i)                          (valid s only)
        O_i   = r_o,i − 1/(G − 1) · Σ_{j≠i} r_o,j                             (`rloo`)
        A_{i,t} = (P_{i,t} + O_i) · mask_{i,t}
    The outcome term is not discounted (the paper's equation; the PRIME code discounts it from
    the last token with its own verifier_gamma, the same number at γ = 1, its preset).
    Departures, stated: (a) the PRIME code (core_algos.py `compute_rloo_returns`) computes the
    process baseline as r_{i,t}·G/(G − 1) − Σ_j mean_j/(G − 1), which equals r_{i,t} − b_i +
    (r_{i,t} − mean_i)/(G − 1): it also scales each token's deviation from its own sequence's
    mean by G/(G − 1); here the paper/README form (subtract the leave-one-out baseline). (b) the
    code then whitens the returns over the batch's tokens (verl `masked_whiten`); here that is
    `loss.whiten_advantages: true`, set in the preset. (c) a completion with no valid token has
    mean 0 (the code divides 0 by 0). A group whose outcome rewards are all equal has O = 0
    exactly (`rloo`).
    Shapes: rewards (B, T) float per-token process rewards (the implicit PRM's r_φ(y_t), or any
    dense reward; the trainer passes `token_rewards`' dense part, without the outcome), mask
    (B, T) right-padded, outcome (B,) the sequence-level reward r_o; B = n_groups·group_size,
    group-contiguous. Returns adv (B, T) float, 0 at padding.
    Source: Cui et al. 2025, "Process Reinforcement through Implicit Rewards", arXiv 2502.01456,
    §3 (RLOO with implicit process rewards; equation as recalled, its number not re-read) and
    the PRIME repository's README and core_algos.py (quoted above, read).
    Raises: ValueError on bad shapes, group_size < 2 or gamma outside [0, 1].
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if rewards.ndim != 2 or mask.shape != rewards.shape:
        raise ValueError(
            f"rewards and mask must share one (B, T) shape, got {tuple(rewards.shape)}, "
            f"{tuple(mask.shape)}"
        )
    if outcome.shape != rewards.shape[:1]:
        raise ValueError(
            f"outcome must have shape ({rewards.shape[0]},), got {tuple(outcome.shape)}"
        )
    o_adv = rloo(outcome, group_size=group_size)  # validates group_size, B % G
    m = mask.bool()
    r = torch.where(m, _as_float(rewards), 0.0)
    dtype = torch.promote_types(r.dtype, o_adv.dtype)
    r = r.to(dtype)
    n_tok = m.sum(-1).to(dtype)  # |y_i|
    means = (r.sum(-1) / n_tok.clamp(min=1)).reshape(-1, group_size)  # (n, G)
    b = ((means.sum(1, keepdim=True) - means) / (group_size - 1)).reshape(-1)  # (B,)
    centred = torch.where(m, r - b[:, None], 0.0)
    ret = torch.zeros_like(centred)
    running = torch.zeros_like(centred[:, 0])
    for t in reversed(range(r.shape[1])):  # masked positions pass the return through
        running = torch.where(m[:, t], centred[:, t] + gamma * running, running)
        ret[:, t] = running
    return torch.where(m, ret + o_adv.to(dtype)[:, None], 0.0)


def remax(rewards: Tensor, *, baseline: Tensor) -> Tensor:
    """ReMax: REINFORCE with the reward of the greedy completion of the same prompt as baseline.

        A_i = r(x_i, y_i) − r(x_i, ŷ_i),   ŷ_i = argmax decoding of π_θ for prompt x_i
    The trainer samples ŷ once per prompt with the rollout engine (greedy, same budget) and
    scores it with the same reward components (registry flag `needs_greedy`); `baseline` holds
    its reward repeated for every sample of the prompt. Cost logged as perf/remax_greedy_s and
    perf/remax_greedy_tokens. verl's `remax` subtracts the same baseline from the return-to-go of
    per-token rewards, the same number when the reward is the outcome alone; a per-token KL in the
    reward enters its return from token t on, here (sequence placement) the whole sum.
    Shapes: rewards, baseline (B,) float. Returns adv (B,).
    Source: Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning
    Method for Aligning Large Language Models", arXiv 2310.10505, Algorithm 1 (the greedy baseline r(x, ŷ)).
    Raises: ValueError if shapes differ or are not 1-D.
    """
    if rewards.ndim != 1 or baseline.shape != rewards.shape:
        raise ValueError(
            f"rewards and baseline must share one (B,) shape, got {tuple(rewards.shape)}, "
            f"{tuple(baseline.shape)}"
        )
    return _as_float(rewards) - _as_float(baseline).to(_as_float(rewards).dtype)


def opo(rewards: Tensor, mask: Tensor, *, group_size: int) -> Tensor:
    """OPO's optimal baseline: the length-weighted mean reward of the group.

        b_g = Σ_{j∈g} |o_j|·r_j / Σ_{j∈g} |o_j|,     A_i = r_i − b_g
    the variance-minimising baseline when the squared gradient norm of a completion is taken as
    proportional to its length. A constant group gets exactly 0; a group of empty completions
    (Σ|o| = 0) falls back to the plain mean.
    Shapes: rewards (B,) group-contiguous, mask (B, T) (|o_i| = Σ_t mask). Returns adv (B,).
    Source: Hao et al. 2025, "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585,
    §3 (the length-weighted optimal baseline b* = Σ|o|r / Σ|o|); verl's `opo` computes the same
    baseline (its group of empty completions divides 0 by 0).
    Raises: ValueError on bad shapes or group_size < 2.
    """
    r = _groups(rewards, group_size)
    if mask.ndim != 2 or mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"mask must have shape ({rewards.shape[0]}, T), got {tuple(mask.shape)}")
    lengths = mask.to(r.dtype).sum(-1).reshape(r.shape)  # (n, G)
    total = lengths.sum(dim=1, keepdim=True)
    weighted = (lengths * r).sum(dim=1, keepdim=True) / total.clamp(min=1)
    b = torch.where(total > 0, weighted, r.mean(dim=1, keepdim=True))
    return _zero_if_constant(r - b, r).reshape(-1)


def gpg(rewards: Tensor, *, group_size: int, std_norm: bool = False, eps: float = 1e-6) -> Tensor:
    """GPG's advantage: group-mean baseline rescaled by the share of samples that carry a gradient.

        Â_i = α·(r_i − mean_g(r)) / F_norm,    α = B / (B − M)
    M = number of samples in groups whose rewards are all equal (their advantage is 0: no
    gradient), B the batch size; α corrects the shrinking of the batch-mean gradient by those
    samples. F_norm = 1 (default) or, with std_norm, std_g(r) + eps (Bessel). α = 1 when every
    group is constant (nothing to scale). Batch statistics (M over the whole batch): the trainer
    calls it on the gathered batch (registry flag `batch_stats`).
    Shapes: rewards (B,) group-contiguous. Returns adv (B,).
    Source: Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv 2504.02546, §3 (the GPG objective with α = B/(B − M) and F_norm). Departure of verl's
    `gpg` (not followed): it counts M as the samples whose *reward* is zero (α = B / #nonzero
    rewards), not those without a gradient.
    Raises: ValueError on bad shapes, group_size < 2 or eps < 0.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = _groups(rewards, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if std_norm:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)  # (n, 1)
    n_total = r.numel()
    n_valid = (~constant).sum() * group_size
    alpha = n_total / n_valid.clamp(min=1).to(r.dtype)
    alpha = torch.where(n_valid > 0, alpha, torch.ones_like(alpha))
    return _zero_if_constant(alpha * adv, r).reshape(-1)


def pass_k(rewards: Tensor, *, group_size: int, std_norm: bool = True, eps: float = 1e-6) -> Tensor:
    """Pass@k advantage: only the best sample of each group learns, with r_max − r_second.

        A_{i*} = (r_max − r_2nd) / F,   i* = argmax_g r (the first maximiser);   A_i = 0 otherwise
    F = std_g(r) + eps (Bessel) when std_norm (verl's default, norm_adv_by_std_in_grpo), else 1.
    With binary rewards a group with exactly one correct sample gives it A = 1/F; groups with
    two or more correct samples, or none, give 0 (r_max = r_2nd).
    Shapes: rewards (B,) group-contiguous. Returns adv (B,).
    Source: as verl's `grpo_passk` (compute_grpo_passk_outcome_advantage), which cites arXiv
    2503.19595 for pass@k-targeted training; the paper optimises pass@k in general, this
    estimator is verl's specific form and is documented as such.
    Raises: ValueError on bad shapes, group_size < 2 or eps < 0.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = _groups(rewards, group_size)
    top2 = torch.topk(r, 2, dim=1)
    gap = top2.values[:, 0] - top2.values[:, 1]  # (n,)
    if std_norm:
        gap = gap / (r.std(dim=1) + eps)
    first_max = torch.argmax((r == top2.values[:, :1]).to(r.dtype), dim=1)  # first maximiser
    adv = torch.zeros_like(r)
    adv[torch.arange(r.shape[0]), first_max] = gap
    return adv.reshape(-1)


def sum_pi_squared(logits: Tensor) -> Tensor:
    """Σ_v π(v)² of π = softmax(logits) over the last dimension, computed as
    exp(logsumexp(2·z) − 2·logsumexp(z)), stable for large logits (no softmax formed).

    Shapes: logits (..., V) float; returns (...) in logits' dtype, in (0, 1]. The Σπ² term of
    `optimal_token_baseline`'s realised energy (its source).
    """
    return torch.exp(torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1))


def optimal_token_baseline(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_size: int,
    logp: Tensor,
    sum_pi_squared: Tensor,
    eps: float = 1e-8,
) -> Tensor:
    """Optimal token baseline (OTB): a per-token group baseline weighted by realised energy.

        G_{i,t} = Σ_{s≥t} r_{i,s}                     (return-to-go; outcome reward at the end)
        W_{i,t} = Σ_{s≤t} (1 − 2·π_{i,s} + Σ_v π_{i,s}(v)²)   π_{i,s} = prob. of the sampled token
        b_{g,t} = Σ_{j∈g} W_{j,t}·G_{j,t} / (Σ_{j∈g} W_{j,t} + eps)   (over the group's valid tokens)
        A_{i,t} = (G_{i,t} − b_{g,t})·mask_{i,t}
    W is the logit-gradient proxy of ‖∇ log π(o_{≤t})‖²: 1 − 2π + Σπ² = ‖e_o − π‖², the squared
    norm of the gradient of log softmax w.r.t. the logits; summed over the prefix.
    Shapes: rewards (B,) or (B, T); mask, logp, sum_pi_squared (B, T) (logp and Σπ² of the
    sampling policy, no gradient). Returns adv (B, T).
    Source: verl `optimal_token_baseline` (Li et al. 2026, arXiv 2602.07078; docs/algo/otb.md):
    B*_t = Σ_i G_t W_t / (Σ_i W_t + ε). Where verl's code differs: with rollout correction on it
    scales each token's energy by the squared importance weight ρ̄², and `handle_zero_tail`
    (off by default) zeroes the baseline past the second-longest completion; neither is done here.
    Raises: ValueError on bad shapes or group_size < 2.
    """
    if logp.shape != mask.shape or sum_pi_squared.shape != mask.shape:
        raise ValueError(
            f"logp and sum_pi_squared must have mask's shape {tuple(mask.shape)}, got "
            f"{tuple(logp.shape)}, {tuple(sum_pi_squared.shape)}"
        )
    r = _token_rewards(rewards, mask)
    _groups(r[:, 0], group_size)  # validates B % G
    m = mask.bool()
    g = r.flip(-1).cumsum(-1).flip(-1)
    g = torch.where(m, g, 0.0)
    pi = torch.exp(logp.detach().to(r.dtype))
    energy = torch.where(m, 1.0 - 2.0 * pi + sum_pi_squared.detach().to(r.dtype), 0.0)
    w = energy.cumsum(-1) * m
    n, t = r.shape[0] // group_size, r.shape[1]
    num = (w * g).reshape(n, group_size, t).sum(1, keepdim=True)
    den = w.reshape(n, group_size, t).sum(1, keepdim=True)
    b = (num / (den + eps)).expand(n, group_size, t).reshape(-1, t)
    return torch.where(m, g - b, 0.0)


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

    With shift_mean=False the mean is kept (rescale only). Population variance, as
    lm-human-preferences' `whiten` (Ziegler et al. 2019, arXiv 1909.08593: tf.nn.moments); TRL's
    PPO and verl's `masked_whiten` use the unbiased variance (a factor √((n − 1)/n) apart).
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
    needs_mask: takes the completion mask (B, T) as its second positional argument (lengths,
        per-token returns); rewards may then be per token (B, T) when per_token is also set.
    batch_stats: uses statistics of the whole batch (normalisation, counts): the trainer calls
        it on the global batch (all ranks' rows gathered) and keeps this rank's rows, so the
        result does not depend on the number of ranks or micro-batches.
    needs_greedy: takes `baseline` (B,), the reward of a greedy completion of each row's prompt
        (ReMax); the trainer samples it with the rollout engine.
    needs_token_probs: takes `logp` and `sum_pi_squared` (B, T) of the sampling policy (OTB);
        the trainer computes them in its no-grad pass.
    needs_steps: takes per-token rewards (B, T) and `steps` (B, T) bool, the positions where a
        reward is given (process supervision: the ends of the steps, the last token for an
        outcome); the trainer builds both with `token_rewards`.
    needs_outcome: takes the dense (process) per-token rewards (B, T) without the outcome and
        `outcome` (B,), the sequence-level reward, apart (PRIME: a baseline per reward type).
    Calling the entry calls `fn`.
    """

    fn: Callable
    needs_groups: bool = False
    needs_values: bool = False
    per_token: bool = False
    needs_mask: bool = False
    batch_stats: bool = False
    needs_greedy: bool = False
    needs_token_probs: bool = False
    needs_steps: bool = False
    needs_outcome: bool = False

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


ADVANTAGES: dict[str, Advantage] = {
    "group_zscore": Advantage(group_zscore, needs_groups=True),
    "group_mean": Advantage(group_mean, needs_groups=True),
    "rloo": Advantage(rloo, needs_groups=True),
    "batch_mean": Advantage(batch_mean, batch_stats=True),
    "none": Advantage(no_baseline),
    "gae": Advantage(gae, needs_values=True, per_token=True),
    "reinforce_pp": Advantage(reinforce_pp, per_token=True, needs_mask=True, batch_stats=True),
    "reinforce_pp_baseline": Advantage(
        reinforce_pp_baseline, needs_groups=True, needs_mask=True, batch_stats=True
    ),
    "remax": Advantage(remax, needs_greedy=True),
    "opo": Advantage(opo, needs_groups=True, needs_mask=True),
    "gpg": Advantage(gpg, needs_groups=True, batch_stats=True),
    "pass_k": Advantage(pass_k, needs_groups=True),
    "process_group_zscore": Advantage(
        process_group_zscore, needs_groups=True, needs_mask=True, per_token=True, needs_steps=True
    ),
    "prime_rloo": Advantage(
        prime_rloo, needs_groups=True, needs_mask=True, per_token=True, needs_outcome=True
    ),
    "optimal_token_baseline": Advantage(
        optimal_token_baseline,
        needs_groups=True,
        needs_mask=True,
        needs_token_probs=True,
        per_token=True,
    ),
}

# Other libraries' names for the same estimators (config values that resolve to ours), checked
# against verl's code (verl/trainer/ppo/core_algos.py): verl's `algorithm.adv_estimator` "grpo"
# is group_zscore (torch.std with Bessel's correction, eps 1e-6; its norm_adv_by_std_in_grpo=False
# is group_mean); "reinforce_plus_plus(_baseline)" are reinforce_pp(_baseline) (unbiased token
# whitening, verl's `masked_whiten`); "grpo_passk" is pass_k; "rloo", "gae", "remax", "opo",
# "optimal_token_baseline" are ours already. Where they differ, for every name: verl gives a
# group of one sample the baseline 0 (and std 1), ours refuse group_size < 2; a group whose
# rewards are all equal gets exactly 0 here, r − mean (possibly rounding noise) in verl. verl's
# "gpg" counts M differently (see `gpg`): not an alias.
ADVANTAGE_ALIASES: dict[str, str] = {
    "grpo": "group_zscore",
    "reinforce_plus_plus": "reinforce_pp",
    "reinforce_plus_plus_baseline": "reinforce_pp_baseline",
    "grpo_passk": "pass_k",
}
