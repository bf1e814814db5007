"""Pre-registered verdicts of the replications: the criterion in code, the statistics, verdict.json.

A replication states, as a module-level `CRITERION`, the paper's claim and how it is judged before
anything runs: a list of `Check`s, each a named estimate with its 95% interval and a rule on that
interval (e.g. "the lower end is above 0"). After the run, the replication computes each estimate
and interval from its measurements (never typed) and `judge` applies the rules:

    CRITERION = Criterion(
        claim="RL raises held-out correctness and response length together (DeepSeek-R1 §2.2)",
        checks=(
            Check("correctness_gain", "held-out correctness, last − first checkpoint, mean over "
                  "seeds (paired t interval)", above=0.0),
            Check("length_gain", "mean response length (tokens), last − first", above=0.0),
        ),
    )
    verdict = judge("r1-zero", CRITERION, {"correctness_gain": t_interval(diffs), ...}, seeds)

`reproduced` is true when every check holds. A check with no interval (one seed) does not hold.
`write_verdict` writes `verdict.json`: {"name", "claim", "criterion", "estimate", "ci95", "seeds",
"reproduced", "checks": [...]}, where `estimate` / `ci95` are those of the first check (the
headline) and `checks` holds every one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The t statistics live in rlhflab.stats (shared with `rlhflab sweep`); re-exported here.
from rlhflab.stats import (  # noqa: F401
    Interval,
    bootstrap_interval,
    t_cdf,
    t_interval,
    t_quantile,
)


@dataclass(frozen=True)
class Check:
    """One pre-registered part of a criterion: estimate `key` (described by `what`, with units)
    holds when its 95% interval lies wholly above `above` and/or wholly below `below`, or, for a
    yes/no finding (`flag=True`), when its estimate is 1 (the interval is then the estimate's own
    uncertainty, reported but not judged)."""

    key: str
    what: str
    above: float | None = None
    below: float | None = None
    flag: bool = False

    def __post_init__(self) -> None:
        if self.flag == (self.above is not None or self.below is not None):
            raise ValueError(f"check {self.key}: give above= and/or below=, or flag=True")

    @property
    def rule(self) -> str:
        """The rule in words, e.g. "95% CI above 0"."""
        if self.flag:
            return "holds (1) by its definition"
        parts = []
        if self.above is not None:
            parts.append(f"95% CI above {self.above:g}")
        if self.below is not None:
            parts.append(f"95% CI below {self.below:g}")
        return " and ".join(parts)

    def holds(self, value: Interval) -> bool:
        est, lo, hi = value
        if self.flag:
            return est == 1
        if self.above is not None and (lo is None or not lo > self.above):
            return False
        return self.below is None or (hi is not None and hi < self.below)


@dataclass(frozen=True)
class Criterion:
    """A replication's claim (the paper's, with its section) and the checks that judge it; the
    first check is the headline estimate."""

    claim: str
    checks: tuple[Check, ...]

    @property
    def text(self) -> str:
        """The criterion in words: every check and its rule, joined by "; and "."""
        return "; and ".join(f"{c.what}: {c.rule}" for c in self.checks)


def judge(
    name: str,
    criterion: Criterion,
    estimates: dict[str, Interval],
    seeds: Sequence[int],
    *,
    secondary: Criterion | None = None,
) -> dict:
    """The verdict: every check's estimate, interval and whether it holds; `reproduced` when all do.
    A `secondary` criterion (a second claim the paper makes, pre-registered the same way, e.g. the
    RL half of Gao et al. beside best-of-n) is judged into `verdict["secondary"]` ({"claim",
    "criterion", "holds", "checks"}) and does not enter `reproduced`.

    Raises:
        ValueError: an estimate of either criterion is missing (names it).
    """
    checks = _judge_checks(name, criterion, estimates)
    verdict = {
        "name": name,
        "claim": criterion.claim,
        "criterion": criterion.text,
        "estimate": checks[0]["estimate"],
        "ci95": checks[0]["ci95"],
        "seeds": list(seeds),
        "reproduced": all(c["holds"] for c in checks),
        "checks": checks,
    }
    if secondary is not None:
        more = _judge_checks(name, secondary, estimates)
        verdict["secondary"] = {"claim": secondary.claim, "criterion": secondary.text,
                                "holds": all(c["holds"] for c in more), "checks": more}  # fmt: skip
    return verdict


def _judge_checks(name: str, criterion: Criterion, estimates: dict[str, Interval]) -> list[dict]:
    missing = [c.key for c in criterion.checks if c.key not in estimates]
    if missing:
        raise ValueError(f"{name}: the criterion's estimate(s) {missing} were not computed")
    checks = []
    for c in criterion.checks:
        est, lo, hi = estimates[c.key]
        ci = None if lo is None else [float(lo), float(hi)]
        checks.append(
            {
                "key": c.key,
                "what": c.what,
                "rule": c.rule,
                "estimate": float(est),
                "ci95": ci,
                "holds": c.holds((est, lo, hi)),
            }
        )
    return checks


def format_interval(value: Interval, *, fmt: str = "+.3f", none: str = " (no CI)") -> str:
    """An estimate and its 95% interval as text, "est [lo, hi]" with each number formatted by
    `fmt`; without an interval (one seed) the estimate followed by `none`."""
    est, lo, hi = value
    if lo is None:
        return f"{est:{fmt}}{none}"
    return f"{est:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def _check_rows(checks: list[dict]) -> list[str]:
    rows = ["| estimate | value (95% CI) | rule | holds |", "|---|---|---|---|"]
    for c in checks:
        ci = "no CI" if c["ci95"] is None else f"[{c['ci95'][0]:.3g}, {c['ci95'][1]:.3g}]"
        rows.append(f"| {c['what']} | {c['estimate']:.3g} {ci} | {c['rule']} | "
                    f"{'yes' if c['holds'] else 'no'} |")  # fmt: skip
    return rows


def verdict_table(verdict: dict) -> str:
    """The checks as a markdown table (what | estimate (95% CI) | rule | holds) and the verdict;
    the secondary criterion, when judged, as a second table after it."""
    word = "reproduced" if verdict["reproduced"] else "not reproduced"
    rows = [*_check_rows(verdict["checks"]), "",
            f"**Verdict: {word}** (seeds {verdict['seeds']})."]  # fmt: skip
    if "secondary" in verdict:
        sec = verdict["secondary"]
        rows += ["", f"Secondary claim (not part of the verdict): {sec['claim']}", "",
                 *_check_rows(sec["checks"]), "",
                 f"Secondary: {'holds' if sec['holds'] else 'does not hold'}."]  # fmt: skip
    return "\n".join(rows)


def write_verdict(out: Path, verdict: dict) -> Path:
    """Write `out/verdict.json` atomically; returns its path."""
    from rlhflab.serialize import write_json_atomic

    path = Path(out) / "verdict.json"
    write_json_atomic(path, verdict)
    return path


def summary_table(verdicts: list[tuple[dict, str]]) -> str:
    """docs/replications.md's lead table, one row per (verdict, link to its report):
    paper claim | our criterion | estimate (95% CI) | verdict. Generated from the verdict.json
    files, never typed (a test compares the docs with them)."""
    rows = ["| paper claim | our criterion | estimate (95% CI) | verdict |", "|---|---|---|---|"]
    for v, link in verdicts:
        ci = "no CI" if v["ci95"] is None else f"[{v['ci95'][0]:.3g}, {v['ci95'][1]:.3g}]"
        held = sum(c["holds"] for c in v["checks"])
        word = "reproduced" if v["reproduced"] else "not reproduced"
        rows.append(
            f"| {v['claim']} | {v['criterion']} | {v['estimate']:.3g} {ci} | "
            f"[**{word}**]({link}) ({held}/{len(v['checks'])} checks, {len(v['seeds'])} seeds) |"
        )
    return "\n".join(rows)
