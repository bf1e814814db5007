"""`rlhflab sweep`: grid parsing and its one-line errors, the mean ± s.e. table from hand
arithmetic, resume (finished runs skipped, an interrupted run continued from its checkpoint), and
a changed campaign refused."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from factories import tiny_sft

from rlhflab.cli import main
from rlhflab.errors import ConfigError, Interrupted
from rlhflab.rundir import newest_complete_run
from rlhflab.sweep import cell_name, grid_points, parse_grid, parse_only, run_sweep

ROOT = Path(__file__).resolve().parents[1]
GRPO = str(ROOT / "configs/pg/quickstart_grpo.yaml")


def test_grid_values_split_on_top_level_commas_and_make_a_product():
    grid = parse_grid(["kl.coef=0, 0.05", "task.config={a: 1, b: 2},{a: 3}"], GRPO)
    assert grid == {"kl.coef": ["0", "0.05"], "task.config": ["{a: 1, b: 2}", "{a: 3}"]}
    points = grid_points(grid)
    assert len(points) == 4 and points[1] == {"kl.coef": "0", "task.config": "{a: 3}"}
    assert cell_name(1, points[1], 2) == "p01-coef0_config-a-3-s2"
    assert parse_only("2/8") == (2, 8)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--grid", "kl.cof=0,0.1"], "unknown config key 'kl.cof' (did you mean 'coef'?)"),
        (["--grid", "rollout.grop_size=4,8"], "(did you mean 'group_size'?)"),
        (["--grid", "kl.coef"], "expected key.path=v1,v2"),
        (["--grid", "kl.coef=0,,1"], "non-empty values"),
        (["--grid", "kl.coef=0,0"], "a value is repeated"),
        (["--grid", "seed=0,1"], "'seed' is set by --seeds"),
        (["--grid", "kl.coef=0", "--only", "4/4"], "--only '4/4'"),
        ([], "give at least one --grid"),
    ],
)
def test_bad_grid_is_one_line_naming_the_item(argv, expected, tmp_path, capsys):
    root = tmp_path / "exp"
    code = main(["sweep", GRPO, *argv, "--root", str(root)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: sweep") and expected in err[0], err
    assert not root.exists()


def _fake_run(runs: Path, name: str, acc: float, before: float, kls: list[float], wall: float,
              headline: dict | None = None, kl_refs: list[float] | None = None):  # fmt: skip
    d = runs / f"{name}-20260101-000000"
    d.mkdir(parents=True)
    res = {"status": "complete", "steps": len(kls), "heldout_accuracy": acc,
           "heldout_accuracy_before": before, "heldout_metric": "accuracy", "wall_s": wall}  # fmt: skip
    if headline is not None:
        res["headline"] = headline
    (d / "final_results.json").write_text(json.dumps(res))
    rows = [{"step": i + 1, "time_s": float(i), "policy/kl": k} for i, k in enumerate(kls)]
    for row, k in zip(rows, kl_refs or [], strict=False):
        row["policy/kl_ref"] = k
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_table_is_mean_and_standard_error_over_seeds(tmp_path):
    # Three finished seeds at kl.coef=0.1, one at kl.coef=0 (its mean alone, no s.e.).
    slug = "hand"
    out = tmp_path / f"2026-01-01-{slug}"
    accs, walls = [0.5, 0.6, 0.8], [10.0, 20.0, 60.0]
    kls = [[0.3, 0.1], [0.2, 0.2], [0.1, 0.3]]  # mean of each run's logged KL: 0.2 each
    points = grid_points({"kl.coef": ["0", "0.1"]})
    for s in range(3):
        _fake_run(out / "runs", cell_name(1, points[1], s), accs[s], 0.4, kls[s], walls[s])
    _fake_run(out / "runs", cell_name(0, points[0], 0), 0.45, 0.4, [0.0], 5.0)
    res = run_sweep(GRPO, grid_items=["kl.coef=0,0.1"], seeds=3, root=str(tmp_path), slug=slug,
                    report_only=True, print_fn=lambda _: None)  # fmt: skip
    assert res["out_dir"] == str(out) and res["ran"] == []
    # By hand: mean 1.9/3; sample variance Σ(x − x̄)²/2; s.e. = sqrt(var/3).
    mean = (0.5 + 0.6 + 0.8) / 3
    var = ((0.5 - mean) ** 2 + (0.6 - mean) ** 2 + (0.8 - mean) ** 2) / 2
    se = math.sqrt(var / 3)
    got = json.loads((out / "results.json").read_text())["points"]
    assert got[1]["metric"]["mean"] == pytest.approx(mean, abs=1e-12)
    assert got[1]["metric"]["se"] == pytest.approx(se, abs=1e-12)
    assert got[1]["wall_s"]["mean"] == pytest.approx(30.0)
    assert got[1]["kl_last10"]["se"] == pytest.approx(0.0, abs=1e-12)
    assert got[0]["metric"] == {"mean": 0.45, "se": None, "n": 1}
    readme = (out / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| kl.coef=0.1 "))
    assert f"| {mean:.3f} ± {se:.3f} (3) |" in row and "| 3/3 |" in row
    assert "| kl.coef=0 | 0.450 (1) |" in readme and "| 1/3 |" in readme
    assert "Conclusion:" in readme and "Question:" in readme
    assert (out / "metric_vs_grid.png").stat().st_size > 0 and (out / "curves.png").is_file()


def test_table_uses_the_named_headline_and_kl_ref(tmp_path):
    # Runs with final_results.json's named headline (correctness 0.2, 0.4; before 0.1) beside a
    # heldout_accuracy that is something else (a weighted reward sum, 0.9): the table is the
    # headline, named in the header; the KL column is policy/kl_ref (logged with β = 0 too),
    # not policy/kl. By hand: mean 0.3, s.e. sqrt(((0.1² + 0.1²) / 1) / 2) = 0.1.
    slug = "named"
    out = tmp_path / f"2026-01-01-{slug}"
    points = grid_points({"kl.coef": ["0"]})
    name = "correctness (task verifier)"
    for s, v in enumerate([0.2, 0.4]):
        _fake_run(out / "runs", cell_name(0, points[0], s), 0.9, 0.8, [5.0, 5.0], 1.0,
                  headline={"name": name, "value": v, "before": 0.1},
                  kl_refs=[0.01, 0.03])  # fmt: skip
    run_sweep(GRPO, grid_items=["kl.coef=0"], seeds=2, root=str(tmp_path), slug=slug,
              report_only=True, print_fn=lambda _: None)  # fmt: skip
    res = json.loads((out / "results.json").read_text())
    assert res["metric"] == "headline" and res["metric_name"] == name
    pt = res["points"][0]
    assert pt["metric"]["mean"] == pytest.approx(0.3, abs=1e-12)
    assert pt["metric"]["se"] == pytest.approx(0.1, abs=1e-12)
    assert pt["metric_before"]["mean"] == pytest.approx(0.1, abs=1e-12)
    assert pt["kl_last10"]["mean"] == pytest.approx(0.02, abs=1e-12)  # mean of 0.01, 0.03
    readme = (out / "README.md").read_text()
    assert f"| grid point | {name} (final) | {name}, before | policy/kl_ref (per token)" in readme
    assert "| kl.coef=0 | 0.300 ± 0.100 (2) | 0.100 ± 0.000 (2) | 0.0200 ± 0.0000 (2) |" in readme


def _tiny_config(tmp_path: Path) -> str:
    raw = tiny_sft(tmp_path / "unused", train={"steps": 6, "batch_size": 4, "micro_batch_size": 4,
                                               "max_len": 32}, checkpoint={"every": 2})  # fmt: skip
    raw["model"]["build"]["tokenizer_texts"] = 100
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.slow
def test_resume_skips_finished_runs_and_continues_an_interrupted_one(tmp_path, monkeypatch):
    config = _tiny_config(tmp_path)
    kw = {"grid_items": ["optim.lr=1e-3,2e-3"], "seeds": 1, "root": str(tmp_path / "exp"),
          "slug": "t", "metric": "steps", "print_fn": lambda _: None}  # fmt: skip
    first = run_sweep(config, **kw, only="0/2")  # one job of two: the first cell only
    assert first["ran"] == ["p00-lr1e-3-s0"] and first["readme"] is None
    # The second cell is interrupted by SIGTERM at the end of step 3 (a stop signal writes a
    # checkpoint), as a cluster pre-emption would.
    with monkeypatch.context() as m:
        m.setenv("RLHFLAB_FAULT", "step_end@3=sigterm")
        with pytest.raises(Interrupted):
            run_sweep(config, **kw)  # the first cell is skipped, the second interrupted
    runs = next((tmp_path / "exp").glob("*-t")) / "runs"
    (second,) = runs.glob("p01-*")
    assert not (second / "final_results.json").exists()
    again = run_sweep(config, **kw)
    assert again["skipped"] == ["p00-lr1e-3-s0"] and again["ran"] == ["p01-lr2e-3-s0"]
    assert [p.name for p in runs.glob("p01-*")] == [second.name]  # continued in its own directory
    rows = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # resumed mid-way, no step run twice
    last = run_sweep(config, **kw)
    assert last["ran"] == [] and len(last["skipped"]) == 2
    # A changed grid refuses in one line naming it; nothing is trained.
    with pytest.raises(ConfigError, match=r"other settings \(grid\.optim\.lr: .*\["):
        run_sweep(config, **{**kw, "grid_items": ["optim.lr=1e-3,5e-3"]})
    with pytest.raises(ConfigError, match=r"other settings \(train\.steps: 6 before, 5 now\)"):
        run_sweep(_changed(config, steps=5), **kw)


def _changed(config: str, *, steps: int) -> str:
    raw = yaml.safe_load(Path(config).read_text())
    raw["train"]["steps"] = steps
    Path(config).write_text(yaml.safe_dump(raw))
    return config


def _sweep_cmd(config: str, root: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rlhflab", "sweep", config, "--grid", "optim.lr=1e-3",
            "--seeds", "1", "--root", str(root), "--slug", "lock", "--metric", "steps", *extra]  # fmt: skip


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (state T in /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"


@pytest.mark.slow
def test_a_second_sweep_into_a_locked_campaign_is_refused_then_resume_after_a_crash(tmp_path):
    """Two real processes: the first sweep stops itself (SIGSTOP) in its first cell's first step,
    before any checkpoint, holding the campaign's lock; a second sweep into the same folder exits
    2 with one line naming the folder and the first's PID, and trains nothing (without the lock
    it trained the cell a second time, in a run directory of its own). The first is then killed
    (SIGKILL, as a crash): its lock is stale, and `sweep --resume` trains the cell."""
    config = _tiny_config(tmp_path)
    root = tmp_path / "exp"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "RLHFLAB_FAULT": "step_mid@1=sigstop"}  # fmt: skip
    first = subprocess.Popen(_sweep_cmd(config, root), env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300  # a bound on a hang, not a timing
        while first.poll() is None and not _stopped(first.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None and _stopped(first.pid), first.stderr.read()[-2000:]
        (out,) = root.glob("*-lock")
        env.pop("RLHFLAB_FAULT")
        second = subprocess.run(_sweep_cmd(config, root), env=env, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2, second.stderr[-2000:]
        assert lines == [
            f"error: campaign folder {out} is in use by process {first.pid} (lock {out / '.lock'}); "
            "wait for it to finish or stop it first"
        ]
        assert [p.name for p in (out / "runs").iterdir()] == [
            p.name for p in (out / "runs").glob("p00-lr1e-3-s0-*")
        ] and len(list((out / "runs").iterdir())) == 1  # no second run of the cell
    finally:
        first.kill()
        first.wait()
    res = subprocess.run(_sweep_cmd(config, root, "--resume"), env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    run, _ = newest_complete_run(out / "runs", "p00-lr1e-3-s0")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4, 5, 6]


def test_sweep_shares_run_together_but_not_beside_a_whole_sweep(tmp_path):
    """`--only` shares hold the folder's lock shared (two shares at once), their own share
    exclusively (the same share twice is refused); a whole sweep is refused while a share runs."""
    from rlhflab.sweep import lock_campaign

    lock = lambda share: lock_campaign(tmp_path, share, report_only=False)  # noqa: E731
    with lock((0, 2)), lock((1, 2)):
        with (
            pytest.raises(ConfigError, match=r"in use by process \d+ \(lock .*only-0-of-2"),
            lock((0, 2)),
        ):
            pass
        with pytest.raises(ConfigError, match=rf"campaign folder {tmp_path} is in use"), lock(None):
            pass
    with lock(None):  # released: taken again
        pass


T975_DF2 = 4.302652729911275  # Student t, 97.5% quantile, 2 degrees of freedom (tables)


def test_every_point_is_compared_with_the_baseline_paired_by_seed(tmp_path):
    # kl.coef=0 (baseline) and 0.1, three seeds each; seed effects shared by both points
    slug = "paired"
    out = tmp_path / f"2026-01-01-{slug}"
    points = grid_points({"kl.coef": ["0", "0.1"]})
    base, arm = [0.50, 0.70, 0.60], [0.56, 0.74, 0.68]  # differences 0.06, 0.04, 0.08
    for s in range(3):
        _fake_run(out / "runs", cell_name(0, points[0], s), base[s], 0.4, [0.0], 5.0)
        _fake_run(out / "runs", cell_name(1, points[1], s), arm[s], 0.4, [0.1], 5.0)
    kw = {"grid_items": ["kl.coef=0,0.1"], "seeds": 3, "root": str(tmp_path), "slug": slug,
          "report_only": True, "print_fn": lambda _: None}  # fmt: skip
    res = run_sweep(GRPO, **kw, question="Does a KL term change held-out accuracy?")
    (c,) = res["comparisons"]
    # by hand: mean 0.06, s = 0.02 (deviations 0, −0.02, 0.02: Σ = 0.0008, /2), t_{.975,2}·s/√3
    half = T975_DF2 * 0.02 / math.sqrt(3)
    assert (c["mean"], c["lo"], c["hi"]) == pytest.approx((0.06, 0.06 - half, 0.06 + half),
                                                         abs=1e-9)  # fmt: skip
    assert c["seeds"] == [0, 1, 2] and res["baseline"] == "kl.coef=0"
    # the unpaired interval of the same numbers is wider: the seeds' shared effect stays in it
    assert c["unpaired_hi"] - c["unpaired_lo"] > 3 * (c["hi"] - c["lo"]) and c["width_ratio"] < 0.33
    assert res["conclusion"].startswith("At 95% (paired by seed): kl.coef=0.1 is higher than "
                                        "kl.coef=0 (+0.060 [")  # fmt: skip
    readme = (out / "README.md").read_text()
    assert "Question: Does a KL term change held-out accuracy?" in readme
    assert "## Against kl.coef=0, paired by seed" in readme and res["conclusion"] in readme
    # the other point as the baseline: the same difference with its sign turned
    other = run_sweep(GRPO, **kw, baseline="kl.coef=0.1")
    assert other["comparisons"][0]["mean"] == pytest.approx(-0.06, abs=1e-12)
    assert "kl.coef=0 is lower than kl.coef=0.1" in other["conclusion"]
    # the question stays with the campaign (sweep.json) when a later report does not repeat it
    assert "Question: Does a KL term change held-out accuracy?" in (out / "README.md").read_text()
    # a percentile bootstrap over the seeds instead of the t interval, when asked
    from rlhflab.stats import paired_bootstrap

    boot = run_sweep(GRPO, **kw, ci="bootstrap")
    _, lo, hi = paired_bootstrap(arm, base)
    assert (boot["comparisons"][0]["lo"], boot["comparisons"][0]["hi"]) == (lo, hi)
    assert "percentile-bootstrap interval" in (out / "README.md").read_text()
    with pytest.raises(ConfigError, match=r"--baseline 'kl.coef=1' is not a grid point; the "
                                          r"points are 'kl.coef=0', 'kl.coef=0.1'"):  # fmt: skip
        run_sweep(GRPO, **kw, baseline="kl.coef=1")


@pytest.mark.slow
def test_identical_arms_differ_by_exactly_zero_and_seeds_can_be_added(tmp_path):
    # Two grid points that change nothing a run computes (the console switch), two seeds: every
    # paired difference is exactly 0. Then --until-ci-width adds a third seed to the campaign.
    config = _tiny_config(tmp_path)
    kw = {"grid_items": ["tracking.console=false,true"], "root": str(tmp_path / "exp"),
          "slug": "same", "metric": "final_loss", "print_fn": lambda _: None}  # fmt: skip
    res = run_sweep(config, seeds=2, **kw)
    (c,) = res["comparisons"]
    assert c["seeds"] == [0, 1] and c["mean"] == 0.0 and (c["lo"], c["hi"]) == (0.0, 0.0)
    assert "not told apart from tracking.console=false" in res["conclusion"]
    # two learning rates do differ: no interval is 1e-9 wide, so seeds are added up to the cap
    kw.update(grid_items=["optim.lr=1e-3,2e-3"], slug="lr")
    first = run_sweep(config, seeds=2, until_ci_width=1e-9, max_seeds=3, **kw)
    assert first["until"] == {"ci_width": 1e-9, "max_seeds": 3, "seeds": 3, "reached": False}
    assert first["comparisons"][0]["seeds"] == [0, 1, 2] and first["comparisons"][0]["sd"] > 0
    assert first["cells"] == 6
