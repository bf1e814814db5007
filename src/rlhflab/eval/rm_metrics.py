"""Reward-model metrics: preference accuracy and margins, AUC, calibration (ECE), PRM step accuracy
and first-error detection. Plain functions of lists/tensors of scores and labels.

    AUC  = P(s⁺ > s⁻) + ½ P(s⁺ = s⁻) over (positive, negative) pairs (Mann–Whitney U / (n⁺ n⁻))
    ECE  = Σ_b (n_b / n) · |mean label_b − mean prob_b| over `n_bins` equal-width bins of the prob
           (Guo et al. 2017, arXiv 1706.04599, eq. 3)
"""

from __future__ import annotations

import math

from rlhflab.stats import average_ranks


def auc(scores: list[float], labels: list[float]) -> float:
    """ROC AUC of `scores` for binary `labels` (ties count ½); NaN if one class is absent."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y > 0.5]
    neg = [s for s, y in zip(scores, labels, strict=True) if y <= 0.5]
    if not pos or not neg:
        return float("nan")
    ranks = average_ranks(scores)  # rank-based, O(n log n); ties share their mean rank
    rank_pos = sum(r for r, y in zip(ranks, labels, strict=True) if y > 0.5)
    n_pos, n_neg = len(pos), len(neg)
    return (rank_pos - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def ece(probs: list[float], labels: list[float], *, n_bins: int = 10) -> float:
    """Expected calibration error of probabilities `probs` for binary `labels`."""
    n = len(probs)
    if n == 0:
        return float("nan")
    total = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        idx = [i for i, p in enumerate(probs) if (lo <= p < hi) or (b == n_bins - 1 and p == 1.0)]
        if idx:
            conf = sum(probs[i] for i in idx) / len(idx)
            acc = sum(1.0 if labels[i] > 0.5 else 0.0 for i in idx) / len(idx)
            total += len(idx) / n * abs(acc - conf)
    return total


def preference_metrics(r_chosen: list[float], r_rejected: list[float]) -> dict[str, float]:
    """accuracy (r_c > r_r), margin mean, chosen/rejected means, and the BT-implied calibration
    (ECE of σ(r_c − r_r) against "chosen wins", symmetrised over both orders)."""
    n = len(r_chosen)
    diff = [c - r for c, r in zip(r_chosen, r_rejected, strict=True)]
    probs = [1 / (1 + math.exp(-d)) for d in diff]
    return {
        "accuracy": sum(d > 0 for d in diff) / n,
        "margin": sum(diff) / n,
        "chosen_mean": sum(r_chosen) / n,
        "rejected_mean": sum(r_rejected) / n,
        "ece": ece(probs + [1 - p for p in probs], [1.0] * n + [0.0] * n),
        "n": n,
    }


def outcome_metrics(probs: list[float], labels: list[float]) -> dict[str, float]:
    """ORM (or any P(correct) scorer): accuracy at 0.5, AUC, ECE, positive rate."""
    n = len(probs)
    return {
        "accuracy": sum((p > 0.5) == (y > 0.5) for p, y in zip(probs, labels, strict=True)) / n,
        "auc": auc(probs, labels),
        "ece": ece(probs, labels),
        "positive_frac": sum(y > 0.5 for y in labels) / n,
        "n": n,
    }


def prm_metrics(
    step_probs: list[list[float]], step_correct: list[list[bool]], *, threshold: float = 0.5
) -> dict[str, float]:
    """Step accuracy and first-error detection over solutions.

    Args:
        step_probs: per solution, P(step correct) of each step.
        step_correct: per solution, the true binary label of each step.

    Returns:
        step_accuracy: fraction of steps with (p > threshold) == label;
        first_error_acc: over solutions with an error, the fraction where the first step predicted
            wrong is exactly the first wrong step; clean_acc: over clean solutions, the fraction
            with no step predicted wrong; step_auc: AUC of p over all steps.
    """
    hits = total = 0
    fe_hit = fe_n = clean_hit = clean_n = 0
    flat_p, flat_y = [], []
    for probs, labels in zip(step_probs, step_correct, strict=True):
        pred = [p > threshold for p in probs]
        hits += sum(a == b for a, b in zip(pred, labels, strict=True))
        total += len(labels)
        flat_p += list(probs)
        flat_y += [1.0 if y else 0.0 for y in labels]
        first_pred = next((k for k, ok in enumerate(pred) if not ok), None)
        first_true = next((k for k, ok in enumerate(labels) if not ok), None)
        if first_true is None:
            clean_n += 1
            clean_hit += first_pred is None
        else:
            fe_n += 1
            fe_hit += first_pred == first_true
    nan = float("nan")
    return {
        "step_accuracy": hits / total if total else nan,
        "first_error_acc": fe_hit / fe_n if fe_n else nan,
        "clean_acc": clean_hit / clean_n if clean_n else nan,
        "step_auc": auc(flat_p, flat_y),
        "steps": total,
        "solutions": len(step_probs),
    }
