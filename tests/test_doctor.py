"""`rlhflab doctor`: rows, their one-line reasons, the JSON report and the exit status; the quick
run passes on this machine; a collective or a trainer broken on purpose (`RLHFLAB_FAULT`) fails
its row with the one-line reason and exit status 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlhflab.doctor import (
    QUICK_ROWS,
    CheckFailed,
    Row,
    exit_code,
    failure_line,
    one_line,
    run_check,
    run_child,
)


def test_a_row_is_one_line_and_has_a_known_status():
    row = Row("x", "fail", "first\n  second\tthird")
    assert row.reason == "first second third"
    assert row.to_dict() == {"name": "x", "status": "fail", "reason": "first second third",
                             "numbers": {}, "seconds": 0.0}  # fmt: skip
    with pytest.raises(ValueError, match="status 'ok'"):
        Row("x", "ok", "")
    assert one_line("a" * 400, limit=10) == "a" * 9 + "…"


def test_exit_status_is_1_on_any_fail_only():
    ok, skip, bad = Row("a", "pass", ""), Row("b", "skip", "why"), Row("c", "fail", "why")
    assert exit_code([ok, skip]) == 0
    assert exit_code([]) == 0
    assert exit_code([ok, bad, skip]) == 1


def test_failure_line_prefers_the_error_line_then_the_exception():
    err = "noise\nerror: step 1: train/loss is nan\nmore noise\n"
    assert failure_line("", err, 2) == "error: step 1: train/loss is nan (exit code 2)"
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\n    raise\nKeyError: 'k'\n"
    assert failure_line("out", tb, 1) == "KeyError: 'k' (exit code 1)"
    assert failure_line("last words\n", "", -9) == "last words (killed by signal 9)"
    assert failure_line("", "", 3) == "no output (exit code 3)"


def test_a_check_that_raises_or_hangs_is_a_failed_row_not_a_crash():
    def boom(ctx):
        raise KeyError("k")

    row = run_check("boom", boom, ctx=None)
    assert (row.status, row.reason) == ("fail", "KeyError: 'k'")
    with pytest.raises(CheckFailed, match=r"^timed out after 1 s \(killed\)$"):
        run_child([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1)
    with pytest.raises(CheckFailed, match=r"^error: bad \(exit code 2\)$"):
        run_child([sys.executable, "-c", "import sys; print('error: bad', file=sys.stderr); "
                   "sys.exit(2)"], timeout_s=60)  # fmt: skip


def test_unknown_only_row_is_one_line_exit_2(tmp_path, capsys):
    from rlhflab.cli import main

    assert main(["doctor", "--only", "colective", "--out", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --only: unknown row(s) colective (rows: versions, devices,")
    assert err.count("\n") == 1


def _doctor(tmp_path, *args, **env):
    out = tmp_path / "doctor.json"
    e = {k: v for k, v in os.environ.items() if not k.startswith("RLHFLAB_")}
    e.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **env)
    res = subprocess.run([sys.executable, "-m", "rlhflab", "doctor", "--out", str(out), *args],
                         env=e, capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    return res, json.loads(out.read_text())


@pytest.mark.slow
def test_quick_doctor_passes_here(tmp_path):
    res, report = _doctor(tmp_path, "--quick")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == list(QUICK_ROWS)
    for name, r in rows.items():
        assert r["status"] in ("pass", "skip"), (name, r["reason"])
        assert r["reason"] and "\n" not in r["reason"]
        assert f"doctor: {name}: {r['status']}" in res.stderr
        assert name in res.stdout  # the table
    assert report["failed"] == [] and report["exit_code"] == 0 and report["quick"]
    coll = rows["collective"]["numbers"]
    assert coll["world"] == 2 and coll["ok"] and coll["all_reduce_GBps"] > 0
    for family in ("sft", "policy_gradient", "direct_alignment", "reward_model", "distill"):
        assert rows[f"train/{family}"]["numbers"]["steps"] == 2
    assert rows["fsdp2/policy_gradient"]["numbers"]["world_size"] == 2
    sides = rows["engine"]["numbers"]["sides"]
    assert set(sides) == {"generate", "hf_eager", "hf_static"}
    assert all(v["tokens_per_s"] > 0 for v in sides.values())
    assert "all checks passed" in res.stdout


@pytest.mark.slow
def test_a_broken_collective_fails_its_row_with_the_reason(tmp_path):
    # rank 1 dies (SIGKILL) just before its first collective
    res, report = _doctor(
        tmp_path, "--only", "collective", RLHFLAB_FAULT="rank1:collective@1=sigkill"
    )
    assert res.returncode == 1, res.stderr[-3000:]
    (row,) = report["rows"]
    assert row["status"] == "fail"
    assert row["reason"] == "error: rank 1 was killed by SIGKILL (exit code 137)"
    assert "FAIL: collective" in res.stdout


@pytest.mark.slow
def test_a_broken_trainer_fails_its_row_with_the_reason(tmp_path):
    # the loss of step 1 becomes NaN: the trainer refuses it (train.nan_policy: raise)
    res, report = _doctor(tmp_path, "--only", "train/sft", RLHFLAB_FAULT="loss@1=nan")
    assert res.returncode == 1, res.stderr[-3000:]
    (row,) = report["rows"]
    assert (row["name"], row["status"]) == ("train/sft", "fail")
    assert row["reason"] == (
        "error: step 1: train/loss is nan; stopped before the optimizer step "
        "(train.nan_policy: raise) (exit code 2)"
    )


def test_rows_past_the_budget_are_skipped_saying_so(tmp_path):
    from rlhflab.doctor import run_doctor

    report = run_doctor(only=["versions"], budget_s=1, out=tmp_path / "d.json")
    assert report["rows"] == [{"name": "versions", "status": "skip", "numbers": {},
                               "reason": "not run: the --budget of 1 s was spent",
                               "seconds": 0.0}]  # fmt: skip
    assert report["exit_code"] == 0
    assert json.loads((tmp_path / "d.json").read_text())["rows"] == report["rows"]


def _sleeper(name: str, seconds: float):
    """Row `name`'s check: its child process sleeps `seconds` (passes if allowed to finish)."""
    from rlhflab.doctor import Row, run_child

    def check(ctx):
        run_child([sys.executable, "-c", f"import time; time.sleep({seconds})"], ctx.timeout_s)
        return Row(name, "pass", "slept")

    return check


def test_a_row_the_budget_cuts_short_is_a_skip_not_a_fail(tmp_path, monkeypatch):
    # issue: on a GPU, `doctor --budget` cut a launched row's timeout to the seconds left; the row
    # was then killed and would have been reported as a failure of the machine
    from rlhflab import doctor

    monkeypatch.setattr(
        doctor, "checks", lambda quick: {"a": _sleeper("a", 60), "b": _sleeper("b", 60)}
    )
    report = doctor.run_doctor(budget_s=7, timeout_s=30)
    a, b = report["rows"]
    assert a["status"] == "skip" and a["reason"].startswith(
        "not finished: the --budget of 7 s ran out "
    ), a
    assert a["reason"].endswith("s into this row (its timeout is 30 s)")
    assert 6 <= a["seconds"] < 30
    assert b == {"name": "b", "status": "skip", "numbers": {}, "seconds": 0.0,
                 "reason": "not run: the --budget of 7 s was spent"}  # fmt: skip
    assert report["exit_code"] == 0
    # the row's own timeout (not the budget's) stopping it is still a failure
    report = doctor.run_doctor(budget_s=100, timeout_s=2)
    assert [r["status"] for r in report["rows"]] == ["fail", "fail"]
    assert report["rows"][0]["reason"] == "timed out after 2 s (killed)"


def test_the_report_is_on_disk_after_every_row(tmp_path, monkeypatch):
    # issue: a doctor killed from outside (a job's time limit) left no report of the rows it ran
    from rlhflab import doctor

    monkeypatch.setattr(
        doctor, "checks", lambda quick: {"a": _sleeper("a", 0), "b": _sleeper("b", 0)}
    )
    seen = []
    out = tmp_path / "d.json"
    report = doctor.run_doctor(out=out, echo=lambda row: seen.append(
        json.loads(out.read_text()) if out.exists() else None))  # fmt: skip
    # when row a ends nothing is written yet; when b ends, a's row is on disk, incomplete
    assert seen[0] is None
    assert seen[1]["complete"] is False and [r["name"] for r in seen[1]["rows"]] == ["a"]
    assert seen[1]["rows"][0]["status"] == "pass"
    final = json.loads(out.read_text())
    assert final["complete"] is True and final["rows"] == report["rows"]
    assert [r["name"] for r in final["rows"]] == ["a", "b"]


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_the_launched_configs_split_over_any_number_of_ranks(ranks, tmp_path):
    # issue: 4 prompts per step (or 4 DPO pairs) do not split over 8 GPUs; every global batch is
    # the ranks times a per-rank share, loaded through the real config classes
    import yaml

    from rlhflab.config import load_config
    from rlhflab.doctor import FAMILIES, trainer_config

    for family in FAMILIES:
        raw = trainer_config(family, tmp_path, "m", cuda=False, teacher="t", ranks=ranks)
        path = tmp_path / f"{family}.yaml"
        path.write_text(yaml.safe_dump(raw))
        cfg = load_config(str(path), [])
        if family in ("policy_gradient", "distill"):
            assert cfg.rollout.prompts_per_step % ranks == 0
        else:
            assert cfg.train.batch_size % ranks == 0
        assert cfg.train.steps == 2


def test_a_gpu_that_torch_cannot_see_fails_the_devices_row(monkeypatch):
    # a CPU build of torch (or a driver mismatch) on a GPU box: the trainers would silently run on
    # the CPU; the doctor says so
    import torch

    import rlhflab.doctor as doctor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(doctor, "_nvidia_smi_gpus", lambda: ["GPU 0: NVIDIA H100 (UUID: x)"])
    row = run_check("devices", doctor.check_devices, ctx=None)
    assert row.status == "fail"
    assert row.reason.startswith(
        "nvidia-smi lists 1 GPU(s) (GPU 0: NVIDIA H100 (UUID: x)) but torch.cuda.is_available() "
        "is False: torch "
    )
