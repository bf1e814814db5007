"""The pre-registered verdict (statistics from their definitions) and the cell runner (`--only i/N`,
`--report`, resume, a changed config refused)."""

import json
import math
import random
import sys
import time
import types

import pytest

from rlhflab.errors import ConfigError
from rlhflab.replications.cells import run_cells
from rlhflab.replications.verdict import (
    Check,
    Criterion,
    bootstrap_interval,
    judge,
    t_cdf,
    t_interval,
    t_quantile,
)


def _t_density(x: float, df: int) -> float:
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    return c * (1 + x * x / df) ** (-(df + 1) / 2)


@pytest.mark.parametrize("df", [1, 2, 3, 7, 30])
def test_t_quantile_matches_the_integral_of_the_density(df):
    q = t_quantile(0.975, df)
    # P(0 < T < q) by Simpson's rule on the density: must be 0.475
    n = 20000
    h = q / n
    s = _t_density(0, df) + _t_density(q, df)
    s += sum((4 if i % 2 else 2) * _t_density(i * h, df) for i in range(1, n))
    assert s * h / 3 == pytest.approx(0.475, abs=1e-7)
    assert t_cdf(-q, df) == pytest.approx(0.025, abs=1e-9)


def test_t_interval_by_hand():
    # values 1, 2, 3: mean 2, s = 1, half-width t_{.975,2} / sqrt(3)
    est, lo, hi = t_interval([1.0, 2.0, 3.0])
    half = t_quantile(0.975, 2) / math.sqrt(3)
    assert (est, lo, hi) == pytest.approx((2.0, 2.0 - half, 2.0 + half))
    assert t_interval([0.5]) == (0.5, None, None)
    with pytest.raises(ValueError, match="finite"):
        t_interval([1.0, float("nan")])


def test_t_interval_covers_the_mean_95_percent_of_the_time():
    rng = random.Random(0)
    hits = 0
    for _ in range(4000):
        _, lo, hi = t_interval([rng.gauss(1.0, 2.0) for _ in range(3)])
        hits += lo < 1.0 < hi
    assert 0.935 < hits / 4000 < 0.965


def test_bootstrap_interval_of_a_mean_is_near_the_normal_one_and_deterministic():
    rng = random.Random(1)
    xs = [rng.random() for _ in range(400)]
    stat = lambda idx: sum(xs[i] for i in idx) / len(idx)  # noqa: E731
    est, lo, hi = bootstrap_interval(stat, len(xs), n_boot=2000, seed=3)
    mean = sum(xs) / len(xs)
    se = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1) / len(xs))
    assert est == pytest.approx(mean)
    assert lo == pytest.approx(mean - 1.96 * se, abs=0.25 * se)
    assert hi == pytest.approx(mean + 1.96 * se, abs=0.25 * se)
    assert bootstrap_interval(stat, len(xs), n_boot=2000, seed=3) == (est, lo, hi)


def test_judge_applies_each_rule_to_the_interval():
    crit = Criterion(
        claim="c",
        checks=(
            Check("gain", "gain", above=0.0),
            Check("drop", "drop", below=0.0),
            Check("peak_inside", "peak inside", flag=True),
        ),
    )
    v = judge("x", crit, {"gain": (0.2, 0.01, 0.4), "drop": (-1, -2, -0.5),
                          "peak_inside": (1, None, None)}, seeds=[0, 1, 2])  # fmt: skip
    assert v["reproduced"] is True and v["estimate"] == 0.2 and v["ci95"] == [0.01, 0.4]
    assert set(v) >= {"name", "claim", "criterion", "estimate", "ci95", "seeds", "reproduced"}
    v = judge("x", crit, {"gain": (0.2, -0.01, 0.4), "drop": (-1, -2, -0.5),
                          "peak_inside": (1, None, None)}, seeds=[0])  # fmt: skip
    assert v["reproduced"] is False and [c["holds"] for c in v["checks"]] == [False, True, True]
    # one seed: no interval, so an interval rule cannot hold
    v = judge("x", crit, {"gain": (0.2, None, None), "drop": (-1, -2, -0.5),
                          "peak_inside": (0, None, None)}, seeds=[0])  # fmt: skip
    assert [c["holds"] for c in v["checks"]] == [False, True, False]
    with pytest.raises(ValueError, match="drop"):
        judge("x", crit, {"gain": (0.2, 0.1, 0.3)}, seeds=[0])


def _toy_module(log: list):
    """A cell-protocol replication whose cells return their index squared."""
    mod = types.ModuleType("rlhflab_toy_replication")

    def cells(spec, source):
        return [f"seed{i}" for i in range(spec["experiment"]["n"])]

    def prepare(spec, out, source):
        log.append("prepare")
        (out / "shared.txt").write_text("base")

    def run_cell(spec, cell, out, source):
        log.append(cell)
        assert (out / "shared.txt").read_text() == "base"
        return {"value": int(cell[4:]) ** 2}

    def report(spec, cells, out, source):
        values = [cells[c]["value"] for c in sorted(cells)]
        crit = Criterion("sum is positive", (Check("total", "sum of values", above=0),))
        verdict = judge("toy", crit, {"total": (sum(values), sum(values), sum(values))}, [0])
        return {"values": values, "verdict": verdict, "report": f"# toy\n{values}\n"}

    mod.cells, mod.prepare, mod.run_cell, mod.report = cells, prepare, run_cell, report
    sys.modules[mod.__name__] = mod
    return mod


def test_shares_then_report_equal_one_whole_run(tmp_path):
    log: list = []
    mod = _toy_module(log)
    spec = {"experiment": {"n": 5}}
    quiet = lambda line: None  # noqa: E731
    whole = run_cells("toy", mod, spec, tmp_path / "whole", "toy.yaml", print_fn=quiet)
    assert log == ["prepare", "seed0", "seed1", "seed2", "seed3", "seed4"]
    assert whole["values"] == [0, 1, 4, 9, 16] and whole["verdict"]["reproduced"]
    assert json.loads((tmp_path / "whole/verdict.json").read_text()) == whole["verdict"]
    assert (tmp_path / "whole/report.md").read_text().startswith("# toy")

    log.clear()
    split = tmp_path / "split"
    with pytest.raises(ConfigError, match=r"5 of 5 cells not finished.*seed0"):
        run_cells("toy", mod, spec, split, "toy.yaml", report_only=True, print_fn=quiet)
    share = run_cells("toy", mod, spec, split, "toy.yaml", only="1/2", print_fn=quiet)
    assert share["ran"] == ["seed1", "seed3"] and not (split / "verdict.json").exists()
    with pytest.raises(ConfigError, match=r"3 of 5 cells not finished.*seed0, seed2, seed4"):
        run_cells("toy", mod, spec, split, "toy.yaml", report_only=True, print_fn=quiet)
    run_cells("toy", mod, spec, split, "toy.yaml", only="0/2", print_fn=quiet)
    assert log == ["prepare", "seed1", "seed3", "seed0", "seed2", "seed4"]  # prepared once
    merged = run_cells("toy", mod, spec, split, "toy.yaml", report_only=True, print_fn=quiet)
    assert merged["values"] == whole["values"] and merged["verdict"] == whole["verdict"]

    # a re-run keeps finished cells; another config in the same directory is refused
    log.clear()
    run_cells("toy", mod, spec, split, "toy.yaml", print_fn=quiet)
    assert log == []
    with pytest.raises(ConfigError, match=r"another config \(experiment.n differs\)"):
        run_cells("toy", mod, {"experiment": {"n": 6}}, split, "toy.yaml", print_fn=quiet)
    with pytest.raises(ConfigError, match=r"^replicate toy --only '2/2': expected i/N"):
        run_cells("toy", mod, spec, split, "toy.yaml", only="2/2", print_fn=quiet)


def test_a_secondary_criterion_is_judged_but_not_part_of_the_verdict():
    main = Criterion("a", (Check("x", "x", above=0),))
    sec = Criterion("b", (Check("y", "y", above=0),))
    v = judge("n", main, {"x": (1, 0.5, 1.5), "y": (-1, -2, 0)}, [0, 1, 2], secondary=sec)
    assert v["reproduced"] is True and v["secondary"]["holds"] is False
    assert v["secondary"]["checks"][0]["ci95"] == [-2.0, 0.0]
    from rlhflab.replications.verdict import verdict_table

    table = verdict_table(v)
    assert "**Verdict: reproduced**" in table and "Secondary: does not hold" in table


def test_the_docs_verdict_table_is_generated_from_the_committed_verdicts():
    # docs/replications.md's lead table equals summary_table of the committed runs' verdict.json
    # (regenerate: python -c "from tests.test_replication_verdict import docs_table; print(docs_table())")
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs/replications.md").read_text()
    begin, end = "<!-- verdicts:begin -->\n", "<!-- verdicts:end -->"
    assert doc[doc.index(begin) + len(begin) : doc.index(end)].strip() == docs_table().strip()


def docs_table() -> str:
    from pathlib import Path

    from rlhflab.replications import REPLICATIONS
    from rlhflab.replications.verdict import summary_table

    root = Path(__file__).resolve().parents[1]
    runs = "experiments/2026-11-28-replications"
    rows = []
    for name in ("r1-zero", "rm-overopt", "dpo-overopt", "prm-orm"):
        assert name in REPLICATIONS
        verdict = json.loads((root / runs / name / "verdict.json").read_text())
        assert verdict["name"] == name
        rows.append((verdict, f"../{runs}/{name}/report.md"))
    return summary_table(rows)


def test_replicate_summary_lines_say_the_verdict_or_the_share():
    from rlhflab.summary import replicate_lines

    crit = Criterion("claim c", (Check("gain", "the gain", above=0.0),))
    v = judge("toy", crit, {"gain": (0.2, 0.05, 0.35)}, [0, 1, 2])
    lines = replicate_lines("toy", {"verdict": v, "compute_s": 61, "files": ["a", "b"]}, "x.json")
    assert lines[0].startswith("replicate toy: REPRODUCED (1/1 checks hold; seeds [0, 1, 2])")
    assert lines[2] == "headline: the gain = 0.2 (95% CI [0.05, 0.35])"
    assert lines[3] == "results: a, b"
    share = {"share": "1/4", "ran": ["c1"], "skipped": [], "cells": ["c0", "c1"], "wall_s": 3}
    assert "share 1/4: ran 1 cell(s), 0 already finished" in replicate_lines("toy", share, "x")[0]


def test_format_interval_by_hand():
    from rlhflab.replications.verdict import format_interval

    assert format_interval((0.5, 0.1, 0.9)) == "+0.500 [+0.100, +0.900]"
    assert format_interval((0.5, None, None)) == "+0.500 (no CI)"
    assert format_interval((0.25, -0.125, 1.5), fmt=".3g", none="") == "0.25 [-0.125, 1.5]"


def test_jobs_run_cells_in_other_processes_with_the_results_of_one_at_a_time(tmp_path):
    import os

    import toy_cells

    quiet = lambda line: None  # noqa: E731
    spec = {"experiment": {"n": 5, "sleep_s": 0.3}}
    serial = run_cells("toy", toy_cells, spec, tmp_path / "serial", "toy.yaml", print_fn=quiet)
    par = run_cells("toy", toy_cells, spec, tmp_path / "par", "toy.yaml", jobs=2, print_fn=quiet)
    assert par["values"] == serial["values"] == [0, 1, 4, 9, 16]
    assert par["verdict"] == serial["verdict"]

    def pids(run):
        return {json.loads((tmp_path / run / "cells" / f"seed{i}.json").read_text())["pid"]
                for i in range(5)}  # fmt: skip

    assert len(pids("par")) == 2 and os.getpid() not in pids("par")
    assert pids("serial") == {os.getpid()}

    # each cell's file and line come when it ends, not when the last one does
    said = []
    slow = {"experiment": {"n": 2, "sleep_s": {"seed1": 2.0}}}
    run_cells("toy", toy_cells, slow, tmp_path / "slow", "toy.yaml", jobs=2,
              print_fn=lambda line: said.append((time.perf_counter(), line,
                                                 (tmp_path / "slow/cells/seed0.json").exists())))  # fmt: skip
    ends = {c: (t, seen) for t, line, seen in said for c in ("seed0", "seed1")
            if line.startswith(f"replicate toy: cell '{c}' done")}  # fmt: skip
    assert ends["seed0"][0] + 1.0 < ends["seed1"][0] and ends["seed0"][1]

    # a failing cell: its one-line error, raised here; the cells that finished keep their files
    bad = {"experiment": {"n": 4, "fail": "seed1"}}
    with pytest.raises(ConfigError, match=r"^toy: cell seed1 failed$"):
        run_cells("toy", toy_cells, bad, tmp_path / "bad", "toy.yaml", jobs=2, print_fn=quiet)
    assert not (tmp_path / "bad/cells/seed1.json").exists()
    dead = {"experiment": {"n": 2, "die": "seed0"}}
    with pytest.raises(RuntimeError, match=r"^replicate toy: the process running cell 'seed\d' "
                       r"died before it ended"):  # fmt: skip
        run_cells("toy", toy_cells, dead, tmp_path / "dead", "toy.yaml", jobs=2, print_fn=quiet)
    with pytest.raises(ConfigError, match=r"^replicate toy --jobs 0: must be at least 1"):
        run_cells("toy", toy_cells, spec, tmp_path / "zero", "toy.yaml", jobs=0, print_fn=quiet)


def test_auto_jobs_is_cores_over_threads_and_one_without_threads(monkeypatch):
    import os

    from rlhflab.replications.cells import auto_jobs

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4}, raising=False)
    assert auto_jobs({"experiment": {"threads": 1}}) == 5
    assert auto_jobs({"experiment": {"threads": 2}}) == 2
    assert auto_jobs({"experiment": {"threads": 8}}) == 1
    assert auto_jobs({"experiment": {"threads": None}}) == 1
    assert auto_jobs({}) == 1
