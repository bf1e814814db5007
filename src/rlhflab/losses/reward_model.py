"""Reward-model losses: Bradley–Terry preference loss, outcome (ORM) and process (PRM) supervision.

Pure tensor maths (torch only). Each function returns per-example or per-token losses plus a dict of
detached statistics; reducing to a scalar (with an explicit denominator) is the trainer's job, so
micro-batches stay exact.

    bradley_terry   −log σ(r_c − r_r − m) + η·(r_c + r_r)²        (B,)
    orm_bce         per-token BCE of every completion token against the outcome label   (B, T)
    orm_seq_bce     BCE of the final-token score against the outcome label              (B,)
    prm_step_ce     cross-entropy at step-separator tokens (binary or 3-class)         (B, T)
    prm_solution_score   min or product of per-step P(correct)                          (B,)
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
