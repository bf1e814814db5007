"""Agreement metrics (`rlhflab.eval.agreement`) against hand arithmetic."""

from __future__ import annotations

import math

import pytest

from rlhflab.eval.agreement import accuracy, cohen_kappa, position_bias_rate


def test_accuracy_skips_failed_parses():
    got = accuracy([1, 0, None, 1, 1], [1, 1, 0, 1, 0])
    assert got == {"accuracy": 2 / 4, "n": 4, "skipped": 1}


def test_cohen_kappa_by_hand():
    # 10 items. a: 6×1, 4×0. b: 5×1, 5×0. Agree on 4 ones and 3 zeros → p_o = 7/10.
    a = [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    b = [1, 1, 1, 1, 0, 0, 0, 0, 0, 1]
    # p_e = (6/10)(5/10) + (4/10)(5/10) = 0.30 + 0.20 = 0.50; κ = (0.7 − 0.5) / 0.5 = 0.4
    got = cohen_kappa(a, b)
    assert got["p_o"] == pytest.approx(0.7) and got["p_e"] == pytest.approx(0.5)
    assert got["kappa"] == pytest.approx(0.4) and got["n"] == 10


def test_cohen_kappa_three_labels_and_edge_cases():
    # a = x x y z, b = x y y y: p_o = 2/4; p_e = (2/4)(1/4) + (1/4)(3/4) + (1/4)(0) = 5/16
    # κ = (8/16 − 5/16) / (11/16) = 3/11
    assert cohen_kappa(list("xxyz"), list("xyyy"))["kappa"] == pytest.approx(3 / 11)
    assert cohen_kappa([1, 0, 1], [1, 0, 1])["kappa"] == 1.0
    assert cohen_kappa([1, 0], [0, 1])["kappa"] == pytest.approx(-1.0)  # p_o 0, p_e 1/2
    assert cohen_kappa([1, 1], [1, 1])["kappa"] == 1.0  # p_e = 1 = p_o: agree by convention
    assert math.isnan(cohen_kappa([None], [1])["kappa"])
    with pytest.raises(ValueError, match="differ in length"):
        cohen_kappa([1], [1, 0])


def test_position_bias_rate_by_hand():
    # 5 pairs; the 4th has a failed parse. Consistent: (A, B), (B, A). Same letter: (A, A), (B, B).
    ab = ["A", "B", "A", None, "B", "A"]
    ba = ["B", "A", "A", "A", "B", "A"]
    # used: 5 pairs; same letter in pairs 3, 5, 6 → 3/5; of which A, A twice (first), B, B once
    got = position_bias_rate(ab, ba)
    assert got == {"rate": pytest.approx(3 / 5), "first": pytest.approx(2 / 5),
                   "second": pytest.approx(1 / 5), "n": 5}  # fmt: skip
    with pytest.raises(ValueError, match="'A', 'B' or None"):
        position_bias_rate(["a"], ["B"])


def test_judge_vs_verifier_by_hand():
    from rlhflab.eval.agreement import judge_vs_verifier

    r = judge_vs_verifier([9, 2, None, 7, 3], [True, False, True, False, False], threshold=5.5)
    # parsed: (9, T) (2, F) (7, F) (3, F); verdicts T F T F against T F F F
    assert r["n"] == 4 and r["parse_failed"] == 1 and r["threshold"] == 5.5
    assert r["accuracy"] == 0.75 and r["score_mean"] == 5.25 and r["verifier_correct"] == 0.25
    # p_o = 3/4; p_e = (2·1 + 2·3)/16 = 1/2; κ = (3/4 − 1/2)/(1/2)
    assert math.isclose(r["kappa"], 0.5)
    assert r["auc"] == 1.0  # the one correct item (9) outscores the three wrong ones
    tie = judge_vs_verifier([7, 7], [True, False], threshold=8)
    assert tie["auc"] == 0.5 and tie["accuracy"] == 0.5  # ties count ½; 7 < 8: both "wrong"
    with pytest.raises(ValueError, match="2 scores vs 1 verdicts"):
        judge_vs_verifier([1, 2], [True], threshold=1)
