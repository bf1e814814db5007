"""Reward-model losses: Bradley–Terry preference loss, outcome (ORM) and process (PRM) supervision.

Pure tensor maths (torch only). Each function returns per-example or per-token losses plus a dict of
detached statistics; reducing to a scalar (with an explicit denominator) is the trainer's job, so
micro-batches stay exact.

    bradley_terry   −log σ(r_c − r_r − m) + η·(r_c + r_r)²        (B,)
    orm_bce         per-token BCE of every completion token against the outcome label   (B, T)
    orm_seq_bce     BCE of the final-token score against the outcome label              (B,)
    prm_step_ce     cross-entropy at step-separator tokens (binary or 3-class)         (B, T)
    prm_solution_score   min or product of per-step P(correct)                          (B,)
    implicit_process_rewards  PRIME: β·log π_φ/π_ref per token                          (B, T)
    implicit_prm_ce      PRIME: BCE of σ(Σ_t r_φ(y_t)) against the outcome label        (B,)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100

#: 3-class PRM labels {−1, 0, +1} are stored as class indices {0, 1, 2}; class 2 is "correct".
PRM_LABEL_TO_CLASS: dict[int, int] = {-1: 0, 0: 1, 1: 2}


def bradley_terry(
    r_chosen: Tensor,
    r_rejected: Tensor,
    *,
    margin: Tensor | float | None = None,
    center_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Bradley–Terry negative log-likelihood of the preference chosen ≻ rejected.

        P(y_c ≻ y_r | x) = σ(r(x, y_c) − r(x, y_r))              (Bradley & Terry 1952;
        loss_i = −log σ(r_c,i − r_r,i − m_i)                      Ouyang et al. 2022, arXiv
               + η · (r_c,i + r_r,i)²                              2203.02155, eq. 1)

    The optional margin m (Llama 2, arXiv 2307.09288, eq. 2) asks the chosen reward to exceed the
    rejected one by m. The centring term η·(r_c + r_r)² (Eisenstein et al. 2023, arXiv 2312.09244,
    §3, "reward centering" auxiliary loss) pins the otherwise free offset of the rewards near 0 so
    scores from different models/runs are comparable; with η = 0 it is absent.

    Args:
        r_chosen, r_rejected: (B,) scalar rewards.
        margin: None, a float, or (B,) per-pair margins m ≥ 0.
        center_coef: η ≥ 0.

    Returns:
        losses (B,), stats {"accuracy" (B,) 1.0 where r_c > r_r, "margin" (B,) r_c − r_r,
        "chosen" (B,), "rejected" (B,)} — all detached.

    Computed as softplus(−(r_c − r_r − m)), which equals −log σ(·) and is stable for large
    differences. d loss / d r_c = −σ(−(r_c − r_r − m)) + 2η(r_c + r_r).
    """
    if r_chosen.shape != r_rejected.shape:
        raise ValueError(
            f"r_chosen {tuple(r_chosen.shape)} and r_rejected {tuple(r_rejected.shape)} differ"
        )
    diff = r_chosen - r_rejected
    logits = diff if margin is None else diff - margin
    losses = F.softplus(-logits)
    if center_coef:
        losses = losses + center_coef * (r_chosen + r_rejected) ** 2
    stats = {
        "accuracy": (diff > 0).float().detach(),
        "margin": diff.detach(),
        "chosen": r_chosen.detach(),
        "rejected": r_rejected.detach(),
    }
    return losses, stats


def orm_bce(logits: Tensor, labels: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Outcome supervision on every completion token (Lightman et al. 2023, arXiv 2305.20050, §2.4:
    "we train ORMs ... predicting correctness at every token"; Cobbe et al. 2021, arXiv 2110.14168).

        loss_{i,t} = mask_{i,t} · BCE(σ(z_{i,t}), y_i)

    The sequence label y_i is broadcast over the completion tokens; at test time the ORM's score is
    the prediction at the final token (`rlhflab.models.reward.final_token_scores`).

    Args:
        logits: (B, T) per-token logits z over the completion positions.
        labels: (B,) outcome labels in [0, 1] (1 = correct), or (B, T) already broadcast.
        mask: (B, T) 1 on completion tokens.

    Returns:
        losses (B, T) (0 where mask is 0), stats {"accuracy" (B, T): 1.0 where (z > 0) == (y > 0.5)}.
    """
    if labels.dim() == 1:
        labels = labels[:, None].expand_as(logits)
    if labels.shape != logits.shape or mask.shape != logits.shape:
        raise ValueError(
            f"orm_bce: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}, "
            f"mask {tuple(mask.shape)} must agree"
        )
    labels = labels.to(logits.dtype)
    per_token = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
    m = mask.bool()
    losses = torch.where(m, per_token, torch.zeros_like(per_token))
    acc = ((logits > 0) == (labels > 0.5)).float() * m
    return losses, {"accuracy": acc.detach()}


def orm_seq_bce(scores: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Sequence-level outcome loss: BCE of the final-token logit s_i against the label y_i.

        loss_i = −[y_i log σ(s_i) + (1 − y_i) log(1 − σ(s_i))]

    Args:
        scores: (B,) final-token logits; labels: (B,) in [0, 1].

    Returns:
        losses (B,), stats {"accuracy" (B,)}.
    """
    if scores.shape != labels.shape:
        raise ValueError(
            f"orm_seq_bce: scores {tuple(scores.shape)} vs labels {tuple(labels.shape)}"
        )
    labels = labels.to(scores.dtype)
    losses = F.binary_cross_entropy_with_logits(scores, labels, reduction="none")
    return losses, {"accuracy": ((scores > 0) == (labels > 0.5)).float().detach()}


def prm_step_ce(logits: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Process supervision: cross-entropy at the step-separator tokens only (Lightman et al. 2023,
    arXiv 2305.20050, §2.5; Wang et al. 2023 "Math-Shepherd", arXiv 2312.08935, eq. 3).

        loss_{i,t} = −log softmax(z_{i,t})[c_{i,t}]   where labels_{i,t} = c_{i,t} ≠ −100, else 0

    Binary PRM: C = 2 classes {0 = incorrect, 1 = correct} (PRM800K's ratings −1/0 → 0, +1 → 1 is
    the caller's choice). 3-class PRM: C = 3, ratings {−1, 0, +1} as classes {0, 1, 2}
    (`PRM_LABEL_TO_CLASS`). Every non-separator token has label −100 and contributes nothing.

    Args:
        logits: (B, T, C) per-token class logits; labels: (B, T) long class ids or −100.

    Returns:
        losses (B, T) (0 off the separators), stats {"step_mask" (B, T) float, "accuracy" (B, T):
        1.0 at separators whose argmax class equals the label}.
    """
    if logits.dim() != 3 or logits.shape[:2] != labels.shape:
        raise ValueError(
            f"prm_step_ce: logits {tuple(logits.shape)} must be (B, T, C) over labels "
            f"{tuple(labels.shape)}"
        )
    step = labels != IGNORE_INDEX
    safe = torch.where(step, labels, torch.zeros_like(labels))
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, safe[..., None]).squeeze(-1)
    losses = torch.where(step, nll, torch.zeros_like(nll))
    acc = (logits.argmax(-1) == labels).float() * step
    return losses, {"step_mask": step.float(), "accuracy": acc.detach()}


def prm_step_correct_prob(logits: Tensor) -> Tensor:
    """P(step correct) from PRM logits (..., C): the last class ("+1" / "correct") probability."""
    return torch.softmax(logits.float(), dim=-1)[..., -1]


def prm_solution_score(step_probs: Tensor, step_mask: Tensor, *, reduce: str = "min") -> Tensor:
    """A solution's score from its per-step P(correct) p_{i,k}.

        min:  s_i = min_k p_{i,k}           (Wang et al. 2023, Math-Shepherd, §3.3)
        prod: s_i = Π_k p_{i,k}             (Lightman et al. 2023, §2.6: P(every step correct))

    Args:
        step_probs: (B, T) probabilities (any value off the steps); step_mask: (B, T) 1 at steps.
        reduce: "min" or "prod".

    Returns:
        (B,) scores; a solution with no step scores 1.0 (no evidence of an error) under both.
    """
    m = step_mask.bool()
    if reduce == "min":
        return torch.where(m, step_probs, torch.ones_like(step_probs)).amin(-1)
    if reduce == "prod":
        logs = torch.where(m, torch.log(step_probs.clamp_min(1e-12)), torch.zeros_like(step_probs))
        return logs.sum(-1).exp()
    raise ValueError(f"prm_solution_score: reduce must be 'min' or 'prod', got {reduce!r}")


RM_LOSSES = {
    "bradley_terry": bradley_terry,
    "orm_bce": orm_bce,
    "orm_seq_bce": orm_seq_bce,
    "prm_step_ce": prm_step_ce,
}
PRM_REDUCTIONS = ("min", "prod")


def implicit_process_rewards(
    logp_prm: Tensor, logp_ref: Tensor, mask: Tensor, *, beta: float
) -> Tensor:
    """PRIME's implicit process reward of every completion token: a β-scaled log-ratio.

        r_φ(y_t) = β · log [π_φ(y_t | y_<t) / π_ref(y_t | y_<t)]        (0 at padding)
    and the sequence's implicit outcome reward r_φ(y) = Σ_t r_φ(y_t) (= β·log π_φ(y)/π_ref(y)).
    π_φ is the implicit PRM (a causal LM, initialised from the policy or SFT model), π_ref its
    frozen reference. Gradients flow through logp_prm (the PRM's CE loss needs them); callers
    that want a reward detach.
    Shapes: logp_prm, logp_ref, mask (B, T), log-probs in nats of the completion tokens;
    returns (B, T) in the promoted float dtype.
    Source: Cui et al. 2025, "Process Reinforcement through Implicit Rewards" (PRIME), arXiv
    2502.01456, §3 (the implicit PRM of Yuan et al. 2024, arXiv 2412.01981: r_φ(y) :=
    β log π_φ(y)/π_ref(y), whose token-level reward is r_φ(y_t) := β log π_φ(y_t|y_<t)/π_ref(y_t|y_<t)).
    Departure of the PRIME code (not followed): its `compute_implicit_reward` hands the policy
    the unscaled log-ratio q (β enters only its CE loss); `PrimeConfig.coef` = 1/β reproduces it.
    Raises: ValueError if shapes differ or beta <= 0.
    """
    if logp_prm.shape != logp_ref.shape or mask.shape != logp_prm.shape or logp_prm.ndim != 2:
        raise ValueError(
            f"logp_prm, logp_ref and mask must share one (B, T) shape, got "
            f"{tuple(logp_prm.shape)}, {tuple(logp_ref.shape)}, {tuple(mask.shape)}"
        )
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    dtype = torch.promote_types(logp_prm.dtype, logp_ref.dtype)
    ratio = logp_prm.to(dtype) - logp_ref.to(dtype)
    return torch.where(mask.bool(), beta * ratio, torch.zeros_like(ratio))


def implicit_prm_ce(
    logp_prm: Tensor, logp_ref: Tensor, mask: Tensor, labels: Tensor, *, beta: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PRIME's online PRM loss: cross-entropy of σ(r_φ(y)) against the outcome label r_o.

        r_φ(y) = Σ_t β · log π_φ(y_t|y_<t)/π_ref(y_t|y_<t)                 (`implicit_process_rewards`)
        L_CE,i = −[ r_o,i · log σ(r_φ(y_i)) + (1 − r_o,i) · log(1 − σ(r_φ(y_i))) ]
    computed as binary_cross_entropy_with_logits (log σ(x) = −softplus(−x): finite for any x).
    The PRIME code (`compute_ce_dpo_loss_rm`: torch's binary_cross_entropy of sigmoid(β·Σq))
    gives the same number except where σ saturates (its log is clamped at −100).
    Shapes: logp_prm, logp_ref, mask (B, T) (nats, completion tokens); labels (B,) in [0, 1]
    (1 = correct). Returns losses (B,) (the mean over the batch is PRIME's loss; reducing is the
    caller's, with its denominator) and detached stats {"score" (B,): r_φ(y), "correct" (B,):
    1.0 where (r_φ(y) > 0) == (r_o > 0.5)}.
    Source: Cui et al. 2025, arXiv 2502.01456, §3 "the implicit PRM is updated online with the
    cross-entropy loss on outcome labels" (L_CE above; PRIME code: beta_train = 0.05).
    Raises: ValueError on bad shapes, labels outside [0, 1] or beta <= 0.
    """
    r_tok = implicit_process_rewards(logp_prm, logp_ref, mask, beta=beta)
    if labels.shape != r_tok.shape[:1]:
        raise ValueError(f"labels must have shape ({r_tok.shape[0]},), got {tuple(labels.shape)}")
    if ((labels < 0) | (labels > 1)).any():
        raise ValueError("labels (outcome r_o) must lie in [0, 1]")
    score = r_tok.sum(-1)  # r_φ(y)  (B,)
    y = labels.to(score.dtype)
    losses = F.binary_cross_entropy_with_logits(score, y, reduction="none")
    correct = ((score > 0) == (y > 0.5)).to(score.dtype)
    return losses, {"score": score.detach(), "correct": correct.detach()}


def implicit_prm_pair_accuracy(scores: Tensor, labels: Tensor, *, group_size: int) -> Tensor:
    """PRIME's PRM accuracy: within each group, the share of pairs with different outcome labels
    that the implicit rewards r_φ(y) order the same way, weighted by |Δr_o|; a group whose labels
    are all equal counts 0.5; the mean over groups.

        acc_g = Σ_{i<j} [sign(s_i − s_j) = sign(r_o,i − r_o,j)]·|r_o,i − r_o,j| / Σ_{i<j} |r_o,i − r_o,j|
    (a tie s_i = s_j counts as predicting r_o,j > r_o,i, as the code's `score_diff > 0`).
    Shapes: scores, labels (B,) group-contiguous; returns a 0-dim float tensor.
    Source: PRIME code, training/verl/trainer/ppo/core_algos.py `compute_dpo_accuracy`
    (logged as reward_model/dpo_acc_before).
    Raises: ValueError on bad shapes or group_size < 2.
    """
    if group_size < 2 or scores.ndim != 1 or labels.shape != scores.shape:
        raise ValueError(
            f"need scores, labels (B,) and group_size >= 2; got {tuple(scores.shape)}, "
            f"{tuple(labels.shape)}, {group_size}"
        )
    if scores.shape[0] % group_size:
        raise ValueError(f"B={scores.shape[0]} is not divisible by group_size={group_size}")
    s = scores.double().reshape(-1, group_size)
    y = labels.double().reshape(-1, group_size)
    ds = s[:, :, None] - s[:, None, :]  # s_i − s_j  (n, G, G)
    dy = y[:, :, None] - y[:, None, :]
    upper = torch.triu(torch.ones(group_size, group_size, dtype=torch.bool), diagonal=1)
    w = torch.where(upper, dy.abs(), 0.0)
    agree = ((ds > 0) == (dy > 0)).double()
    total = w.sum((1, 2))
    acc = torch.where(total > 0, (agree * w).sum((1, 2)) / total.clamp(min=1e-12), 0.5)
    return acc.mean()
