"""rlhflab.stats: paired and unpaired intervals from hand arithmetic and tables, the power formula
against a simulation."""

from __future__ import annotations

import math
import random

import pytest

from rlhflab.stats import (
    paired_difference,
    paired_power,
    seeds_needed,
    spearman,
    t_interval,
    t_quantile,
    welch_interval,
)

T975_DF4 = 2.7764451051977987  # Student t, 97.5% quantile, 4 degrees of freedom (tables)


def test_paired_difference_is_the_t_interval_of_the_per_seed_differences():
    arm = [0.62, 0.58, 0.71, 0.66, 0.60]
    base = [0.55, 0.54, 0.60, 0.61, 0.57]
    got = paired_difference(arm, base)
    # differences 0.07, 0.04, 0.11, 0.05, 0.03: mean 0.06; deviations .01 −.02 .05 −.01 −.03,
    # squares sum 0.004, s² = 0.001; half-width t_{.975,4} · sqrt(0.001) / sqrt(5)
    assert got["diffs"] == pytest.approx([0.07, 0.04, 0.11, 0.05, 0.03], abs=1e-12)
    half = T975_DF4 * math.sqrt(0.001) / math.sqrt(5)
    assert (got["mean"], got["lo"], got["hi"]) == pytest.approx(
        (0.06, 0.06 - half, 0.06 + half), abs=1e-12
    )
    assert got["sd"] == pytest.approx(math.sqrt(0.001), abs=1e-12) and got["n"] == 5
    assert t_quantile(0.975, 4) == pytest.approx(T975_DF4, abs=1e-9)
    with pytest.raises(ValueError, match="5 arm values against 4"):
        paired_difference(arm, base[:4])


def test_identical_arms_differ_by_exactly_zero():
    xs = [0.1234, 0.5, 0.77]
    got = paired_difference(xs, list(xs))
    assert got["diffs"] == [0.0, 0.0, 0.0] and (got["mean"], got["lo"], got["hi"]) == (0, 0, 0)


def test_welch_interval_with_equal_variances_uses_their_pooled_degrees_of_freedom():
    # means 2 and 3; each variance of the mean (1/3)/... : s² = 1 each, s²/n = 1/3; Welch's df =
    # (2/3)² / ((1/3)²/2 + (1/3)²/2) = 4; half-width t_{.975,4} · sqrt(2/3)
    d, lo, hi = welch_interval([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    half = T975_DF4 * math.sqrt(2 / 3)
    assert (d, lo, hi) == pytest.approx((-1.0, -1.0 - half, -1.0 + half), abs=1e-9)
    assert welch_interval([1.0], [2.0, 3.0])[1:] == (None, None)


def test_pairing_narrows_the_interval_when_seeds_move_both_arms():
    # a seed effect shared by both arms (large) plus a small arm effect: the paired interval is
    # far narrower than the unpaired one of the same numbers
    seed_effect = [0.0, 0.3, -0.2, 0.5, -0.4]
    base = [0.5 + e for e in seed_effect]
    arm = [0.55 + e + 0.01 * (-1) ** i for i, e in enumerate(seed_effect)]
    p = paired_difference(arm, base)
    _, lo, hi = welch_interval(arm, base)
    assert (p["hi"] - p["lo"]) < 0.2 * (hi - lo)


def test_power_formula_matches_a_simulation_of_paired_experiments():
    sd, delta = 1.0, 0.8
    n = seeds_needed(sd, delta, power=0.8)
    assert n is not None and paired_power(n, sd, delta) >= 0.8 > paired_power(n - 1, sd, delta)
    rng = random.Random(0)
    trials = 4000
    # the formula against the fraction of simulated intervals that exclude 0
    for m in (3, 5, n):
        hits = 0
        for _ in range(trials):
            _, lo, hi = t_interval([rng.gauss(delta, sd) for _ in range(m)])
            hits += lo > 0 or hi < 0
        # Monte-Carlo s.e. ≤ 0.008 at 4000 trials: 3 s.e.
        assert hits / trials == pytest.approx(paired_power(m, sd, delta), abs=0.025)
    # no difference: the interval excludes 0 in 5% of experiments (the test's size)
    assert paired_power(5, sd, 0.0) == pytest.approx(0.05, abs=1e-6)
    assert seeds_needed(sd, 0.0) is None
    with pytest.raises(ValueError, match="sd > 0"):
        seeds_needed(0.0, 1.0)


def test_spearman_is_the_correlation_of_ranks_with_tied_values_sharing_their_mean_rank():
    assert spearman([0.01, 0.1, 1.0], [9.0, 4.0, 1.0]) == pytest.approx(-1.0, abs=1e-12)
    assert spearman([1, 2, 3, 4, 5], [2.0, 1.0, 4.0, 3.0, 5.0]) == pytest.approx(0.8, abs=1e-12)
    # 1 - 6 Σd²/(n(n²-1)) with d = (1, -1, 1, -1, 0): 1 - 24/120 = 0.8 (no ties)
    # ties: ys ranks (1.5, 1.5, 3, 4); xs ranks (1, 2, 3, 4): centred (-1.5, -.5, .5, 1.5) and
    # (-1, -1, .5, 1.5) → Σxy = 1.5 + .5 + .25 + 2.25 = 4.5, Σx² = 5, Σy² = 4.5 → 4.5/sqrt(22.5)
    assert spearman([1, 2, 3, 4], [7.0, 7.0, 8.0, 9.0]) == pytest.approx(4.5 / math.sqrt(22.5))
    with pytest.raises(ValueError, match="constant"):
        spearman([1, 2, 3], [5.0, 5.0, 5.0])
    with pytest.raises(ValueError, match="one length"):
        spearman([1, 2], [1.0])


def test_paired_bootstrap_resamples_the_per_seed_differences():
    from rlhflab.stats import paired_bootstrap

    arm, base = [0.62, 0.58, 0.71, 0.66, 0.60], [0.55, 0.54, 0.60, 0.61, 0.57]
    m, lo, hi = paired_bootstrap(arm, base, n_boot=2000, seed=3)
    # the estimate is the mean difference; a percentile interval of resampled means lies inside
    # the differences' range (0.03 .. 0.11) and around the mean
    assert m == pytest.approx(0.06, abs=1e-12) and 0.03 <= lo < 0.06 < hi <= 0.11
    assert paired_bootstrap(arm, base, n_boot=2000, seed=3) == (m, lo, hi)  # deterministic
    assert paired_bootstrap(arm, list(arm)) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="5 arm values against 4"):
        paired_bootstrap(arm, base[:4])
