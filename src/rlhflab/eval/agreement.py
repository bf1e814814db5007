"""Agreement of a judge with labels (a verifier, human preferences) or with itself: pure functions
of label lists (standard library only).

    accuracy(pred, labels)                     fraction equal
    cohen_kappa(a, b)                          chance-corrected agreement (Cohen 1960)
    position_bias_rate(choices_ab, choices_ba) fraction of pairs whose choice flips with order
    judge_vs_verifier(scores, correct, threshold) a pointwise judge against a binary verifier

A None in an input is a failed parse (`rlhflab.rewards.judge.parse_score` / `parse_choice`): the
pair it belongs to is left out, and each function says how many pairs it used ("n").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

__all__ = ["accuracy", "cohen_kappa", "judge_vs_verifier", "position_bias_rate"]


def _pairs(a: Sequence, b: Sequence, what: str) -> list[tuple]:
    if len(a) != len(b):
        raise ValueError(f"{what}: the two label lists differ in length ({len(a)} vs {len(b)})")
    return [(x, y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]


def accuracy(pred: Sequence[Hashable | None], labels: Sequence[Hashable | None]) -> dict:
    """Fraction of items where the judge's label equals the reference label.

        acc = (1/n) Σ_i [pred_i = label_i]   over the n items where neither is None

    Args:
        pred: the judge's labels (B; e.g. 0/1 verdicts, "A"/"B" choices, None: parse failure).
        labels: the reference labels (B; the verifier's 0/1, a human's choice).
    Returns:
        {"accuracy": float (NaN when n = 0), "n": items used, "skipped": items with a None}.
    Raises:
        ValueError: the lists differ in length.
    """
    pairs = _pairs(pred, labels, "accuracy")
    n = len(pairs)
    acc = sum(x == y for x, y in pairs) / n if n else float("nan")
    return {"accuracy": acc, "n": n, "skipped": len(pred) - n}


def cohen_kappa(a: Sequence[Hashable | None], b: Sequence[Hashable | None]) -> dict:
    """Cohen's κ between two raters of the same items (e.g. judge vs verifier, judge vs human).

        p_o = (1/n) Σ_i [a_i = b_i]                     observed agreement
        p_e = Σ_k (n_a(k)/n) · (n_b(k)/n)               agreement expected by chance from each
                                                        rater's marginal frequencies n_·(k)
        κ  = (p_o − p_e) / (1 − p_e)

    κ = 1: perfect agreement; 0: chance level; < 0: below chance. When p_e = 1 (both raters
    give one and the same label to every item) κ is undefined: NaN, unless p_o = 1 too, which
    is reported as 1.0 by convention (the raters agree on every item).
    Source: J. Cohen, "A coefficient of agreement for nominal scales", Educational and
    Psychological Measurement 20(1), 1960, pp. 37–46 (eq. 1: κ = (p_o − p_c)/(1 − p_c)).

    Args:
        a, b: labels of the same n items (any hashable; None: a failed parse, pair left out).
    Returns:
        {"kappa", "p_o", "p_e" (floats; NaN when n = 0), "n": items used}.
    Raises:
        ValueError: the lists differ in length.
    """
    pairs = _pairs(a, b, "cohen_kappa")
    n = len(pairs)
    if n == 0:
        nan = float("nan")
        return {"kappa": nan, "p_o": nan, "p_e": nan, "n": 0}
    p_o = sum(x == y for x, y in pairs) / n
    ca, cb = Counter(x for x, _ in pairs), Counter(y for _, y in pairs)
    p_e = sum(ca[k] * cb[k] for k in ca) / (n * n)
    if p_e == 1.0:  # one label everywhere from both raters: 0/0
        return {"kappa": 1.0 if p_o == 1.0 else float("nan"), "p_o": p_o, "p_e": p_e, "n": n}
    kappa = (p_o - p_e) / (1.0 - p_e)
    return {"kappa": kappa, "p_o": p_o, "p_e": p_e, "n": n}


def position_bias_rate(choices_ab: Sequence[str | None], choices_ba: Sequence[str | None]) -> dict:
    """Fraction of pairs whose choice flips when the two completions swap places.

    For pair i the judge sees (y1, y2) as (A, B) and chooses c_i ∈ {A, B}, then sees them
    swapped, (y2, y1), and chooses c'_i. A position-consistent judge picks the same completion
    both times, i.e. c'_i is the other letter (c_i = A ⇔ c'_i = B). The pair is position-biased
    when it picks the same *letter* both times (c_i = c'_i: the completion at one position wins
    whatever it is):

        position_bias_rate = (1/n) Σ_i [c_i = c'_i]   over the n pairs with both choices parsed

    also split by the letter preferred ("first": c = c' = A, "second": c = c' = B).
    Source: the position bias of LLM judges, checked by swapping the two answers, documented by
    Zheng et al. 2023, Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena, arXiv 2306.05685
    (the section number and their exact consistency statistic not re-read here).

    Args:
        choices_ab: "A"/"B" (None: failed parse) with the completions in the original order (B).
        choices_ba: the same pairs' choices with the completions swapped (B).
    Returns:
        {"rate", "first", "second" (floats, NaN when n = 0), "n": pairs used}.
    Raises:
        ValueError: lists of different lengths, or a choice other than "A", "B" or None.
    """
    for c in (*choices_ab, *choices_ba):
        if c not in ("A", "B", None):
            raise ValueError(f"position_bias_rate: choices are 'A', 'B' or None, got {c!r}")
    pairs = _pairs(choices_ab, choices_ba, "position_bias_rate")
    n = len(pairs)
    if n == 0:
        nan = float("nan")
        return {"rate": nan, "first": nan, "second": nan, "n": 0}
    first = sum(x == y == "A" for x, y in pairs) / n
    second = sum(x == y == "B" for x, y in pairs) / n
    return {"rate": first + second, "first": first, "second": second, "n": n}


def judge_vs_verifier(scores: Sequence[int | None], correct: Sequence[bool], *,
                      threshold: float) -> dict:  # fmt: skip
    """A pointwise judge's scores of n completions against a binary verifier's verdicts on them.

    The judge's verdict on item i is "correct" when s_i ≥ threshold; with the verifier's c_i:

        accuracy = (1/n) Σ_i [(s_i ≥ threshold) = c_i]        (`accuracy`)
        kappa    = Cohen's κ of the two verdicts              (`cohen_kappa`)
        auc      = P(s_i > s_j) + ½ P(s_i = s_j), i correct, j wrong   (threshold-free)

    over the n items whose score parsed (a None is a parse failure, counted in "parse_failed").

    Args:
        scores: the judge's pointwise scores (n; None: failed parse).
        correct: the verifier's verdicts on the same completions (n bools).
        threshold: the lowest score read as "correct".
    Returns:
        {"n", "parse_failed", "score_mean" (NaN when no score parsed), "accuracy", "kappa",
        "auc" (NaN when the parsed items hold one class only), "threshold",
        "verifier_correct" (fraction of the n parsed items the verifier calls correct)}.
    Raises:
        ValueError: the lists differ in length.
    """
    from rlhflab.eval.rm_metrics import auc

    if len(scores) != len(correct):
        raise ValueError(f"judge_vs_verifier: {len(scores)} scores vs {len(correct)} verdicts")
    kept = [(float(s), bool(c)) for s, c in zip(scores, correct, strict=True) if s is not None]
    nan = float("nan")
    verdicts = [s >= threshold for s, _ in kept]
    truth = [c for _, c in kept]
    return {
        "n": len(kept),
        "parse_failed": len(scores) - len(kept),
        "score_mean": sum(s for s, _ in kept) / len(kept) if kept else nan,
        "accuracy": accuracy(verdicts, truth)["accuracy"],
        "kappa": cohen_kappa(verdicts, truth)["kappa"],
        "auc": auc([s for s, _ in kept], [float(c) for c in truth]) if kept else nan,
        "threshold": threshold,
        "verifier_correct": sum(truth) / len(kept) if kept else nan,
    }
