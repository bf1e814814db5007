"""Statistics of paired experiments: Student t intervals over seeds, paired and unpaired
differences of two arms, and the seeds a paired design needs to resolve a difference.

Pure Python (no SciPy): Student's t CDF from the regularised incomplete beta function (continued
fraction, Numerical Recipes §6.4), its quantiles by bisection. Used by `rlhflab sweep` (paired
differences against a baseline arm) and the replications' verdicts.

Two arms run with the same seeds are paired: seed i of each sees the same data order, initial
weights and sampling noise until their policies diverge, so their per-seed difference removes
what the seeds share. Its interval, mean ± t_{0.975, n−1} · s_d / √n over the n paired seeds, is
narrower than the unpaired (Welch) interval of the two means whenever the arms' results are
positively correlated across seeds.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Sequence

#: (estimate, lower, upper) of a 95% interval; (estimate, None, None) when there is none.
Interval = tuple[float, float | None, float | None]


@functools.lru_cache(maxsize=256)
def t_quantile(q: float, df: float) -> float:
    """Quantile `q` (0.5 < q < 1) of Student's t with `df` ≥ 1 degrees of freedom (real: Welch's
    are not whole), by bisection on the CDF (regularised incomplete beta, continued fraction as
    Numerical Recipes §6.4)."""
    if not (0.5 < q < 1) or df < 1:
        raise ValueError(f"t_quantile: need 0.5 < q < 1 and df >= 1 (got q={q}, df={df})")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
    return (lo + hi) / 2


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with `df` degrees of freedom."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2, 0.5, x)
    return 1 - tail if t > 0 else tail


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def _betacf(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def t_interval(values: Sequence[float]) -> Interval:
    """Mean of `values` (e.g. one paired difference per seed) with its two-sided 95% Student t
    interval, mean ± t_{0.975, n−1} · s / √n; no interval (None, None) for one value.

    Raises:
        ValueError: no values, or a non-finite one.
    """
    xs = [float(v) for v in values]
    if not xs or not all(math.isfinite(v) for v in xs):
        raise ValueError(f"t_interval: need finite values (got {xs})")
    n = len(xs)
    mean = math.fsum(xs) / n
    if n == 1:
        return mean, None, None
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in xs) / (n - 1))
    half = t_quantile(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def paired_difference(arm: Sequence[float], base: Sequence[float]) -> dict:
    """The paired difference arm − base over seeds: {"diffs", "mean", "lo", "hi", "sd", "n"},
    the mean of the per-seed differences with its 95% t interval (`t_interval`); sd is their
    sample standard deviation (None below 2 pairs). `arm[i]` and `base[i]` are seed i's.

    Raises:
        ValueError: lengths differ, no pairs, or a non-finite value.
    """
    if len(arm) != len(base):
        raise ValueError(f"paired_difference: {len(arm)} arm values against {len(base)} base")
    diffs = [float(a) - float(b) for a, b in zip(arm, base, strict=True)]
    mean, lo, hi = t_interval(diffs)
    n = len(diffs)
    sd = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)) if n > 1 else None
    return {"diffs": diffs, "mean": mean, "lo": lo, "hi": hi, "sd": sd, "n": n}


def welch_interval(arm: Sequence[float], base: Sequence[float]) -> Interval:
    """mean(arm) − mean(base) with its 95% Welch interval (unpaired: each arm's own variance,
    Welch–Satterthwaite degrees of freedom), as if the arms had been run with unrelated seeds.
    (None, None) for the interval below 2 values an arm or with both variances 0.

    Raises:
        ValueError: an empty arm or a non-finite value.
    """
    a, b = [float(x) for x in arm], [float(x) for x in base]
    if not a or not b or not all(math.isfinite(x) for x in (*a, *b)):
        raise ValueError("welch_interval: need finite values in both arms")
    ma, mb = math.fsum(a) / len(a), math.fsum(b) / len(b)
    diff = ma - mb
    if len(a) < 2 or len(b) < 2:
        return diff, None, None
    va = math.fsum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = math.fsum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    if va + vb == 0:
        return diff, None, None
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(0.975, df) * math.sqrt(va + vb)
    return diff, diff - half, diff + half


def paired_power(n: int, sd: float, delta: float) -> float:
    """Probability that the 95% paired t interval over n seeds excludes 0 when the true mean
    difference is `delta` and the per-seed differences are normal with standard deviation `sd`.

    Exact up to quadrature: the t statistic is (Z + λ) / S with λ = |δ|·√n / sd, Z standard
    normal and S = √(χ²_ν / ν), ν = n − 1, so with c = t_{0.975, ν}
    power = ∫ f_S(s) [Φ(λ − c·s) + Φ(−λ − c·s)] ds (the noncentral t's two tails), integrated by
    Simpson's rule over S's density (checked against a simulation in tests/test_stats.py).

    Raises:
        ValueError: n < 2 or sd <= 0.
    """
    if n < 2 or not sd > 0:
        raise ValueError(f"paired_power: need n >= 2 and sd > 0 (got n={n}, sd={sd})")
    nu = n - 1
    lam = abs(delta) * math.sqrt(n) / sd
    c = t_quantile(0.975, nu)
    # S's density: ν^{ν/2} s^{ν−1} exp(−ν s²/2) / (2^{ν/2−1} Γ(ν/2)), concentrated near 1
    log_k = (nu / 2) * math.log(nu) - (nu / 2 - 1) * math.log(2) - math.lgamma(nu / 2)
    w = 1 / math.sqrt(2 * nu)
    lo, hi = (0.0, 12.0) if nu < 20 else (max(0.0, 1 - 12 * w), 1 + 12 * w)
    steps = 2000

    def integrand(s: float) -> float:
        if s <= 0:
            return 0.0
        dens = math.exp(log_k + (nu - 1) * math.log(s) - nu * s * s / 2)
        return dens * (_phi(lam - c * s) + _phi(-lam - c * s))

    h = (hi - lo) / steps
    total = integrand(lo) + integrand(hi)
    total += sum((4 if k % 2 else 2) * integrand(lo + k * h) for k in range(1, steps))
    return min(1.0, max(0.0, total * h / 3))


def _phi(x: float) -> float:
    """The standard normal CDF."""
    return 0.5 * math.erfc(-x / math.sqrt(2))


def seeds_needed(sd: float, delta: float, *, power: float = 0.8, max_n: int = 10_000) -> int | None:
    """The fewest paired seeds (≥ 2) whose 95% interval excludes 0 with probability ≥ `power`
    when the true difference is `delta` and the per-seed differences have sd `sd`
    (`paired_power`); None when `delta` is 0 or more than `max_n` would be needed.

    Raises:
        ValueError: sd <= 0 or power outside (0, 1).
    """
    if not sd > 0 or not 0 < power < 1:
        raise ValueError(f"seeds_needed: need sd > 0 and 0 < power < 1 (got {sd}, {power})")
    if delta == 0:
        return None
    n = 2
    while n <= max_n:
        if paired_power(n, sd, delta) >= power:
            return n
        n += 1
    return None


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of `values`, ties sharing their mean rank (as Spearman's ρ and the
    Mann–Whitney AUC count them)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (`average_ranks`).
    Returns a float in [−1, 1].

    Raises:
        ValueError: fewer than 2 values, lengths differ, or either list is constant.
    """
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("spearman: need two lists of one length >= 2")
    rx, ry = average_ranks(xs), average_ranks(ys)
    mx, my = math.fsum(rx) / len(rx), math.fsum(ry) / len(ry)
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = math.fsum((a - mx) ** 2 for a in rx), math.fsum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        raise ValueError("spearman: a constant list has no rank correlation")
    return sxy / math.sqrt(sxx * syy)


def bootstrap_interval(
    statistic: Callable[[list[int]], float], n: int, *, n_boot: int = 1000, seed: int = 0
) -> Interval:
    """`statistic(range(n))` with its 95% percentile-bootstrap interval: `statistic` is called on
    `n_boot` resamples of the item indices 0..n−1 drawn with replacement (e.g. problems; with
    several seeds, resample problems and keep every seed of each). Deterministic given `seed`.

    Raises:
        ValueError: n < 2 or n_boot < 100.
    """
    if n < 2 or n_boot < 100:
        raise ValueError(
            f"bootstrap_interval: need n >= 2 items and n_boot >= 100 (got {n}, {n_boot})"
        )
    rng = random.Random(seed)
    est = float(statistic(list(range(n))))
    stats = sorted(float(statistic([rng.randrange(n) for _ in range(n)])) for _ in range(n_boot))
    return est, _quantile(stats, 0.025), _quantile(stats, 0.975)


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    i = int(pos)
    j = min(i + 1, len(sorted_values) - 1)
    return sorted_values[i] + (pos - i) * (sorted_values[j] - sorted_values[i])


def paired_bootstrap(arm: Sequence[float], base: Sequence[float], *, n_boot: int = 2000,
                     seed: int = 0) -> Interval:  # fmt: skip
    """The mean paired difference arm − base with its 95% percentile-bootstrap interval over the
    pairs (seeds resampled with replacement, `bootstrap_interval`); deterministic given `seed`.
    Few pairs make a percentile interval too narrow (it cannot be wider than the spread of the
    differences): prefer `paired_difference`'s t interval below ~10 pairs.

    Raises:
        ValueError: lengths differ or fewer than 2 pairs.
    """
    if len(arm) != len(base):
        raise ValueError(f"paired_bootstrap: {len(arm)} arm values against {len(base)} base")
    diffs = [float(a) - float(b) for a, b in zip(arm, base, strict=True)]
    return bootstrap_interval(lambda idx: math.fsum(diffs[i] for i in idx) / len(idx), len(diffs),
                              n_boot=n_boot, seed=seed)  # fmt: skip
