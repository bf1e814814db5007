"""Agreement of a judge with labels (a verifier, human preferences) or with itself: pure functions
of label lists (standard library only).

    accuracy(pred, labels)                     fraction equal
    cohen_kappa(a, b)                          chance-corrected agreement (Cohen 1960)
    position_bias_rate(choices_ab, choices_ba) fraction of pairs whose choice flips with order

A None in an input is a failed parse (`rlhflab.rewards.judge.parse_score` / `parse_choice`): the
pair it belongs to is left out, and each function says how many pairs it used ("n").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

__all__ = ["accuracy", "cohen_kappa", "position_bias_rate"]


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
