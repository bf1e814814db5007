"""`train.max_seconds`: a budget per invocation, at its boundaries (expiring during an
evaluation, during a checkpoint write, right after the last step), made to expire by the
`expire` fault action (rlhflab/faults.py) instead of sleeping."""

import json
import types
from pathlib import Path

import pytest
from test_checkpoint_resume import (
    assert_same_run,
    dpo_raw,
    grpo_raw,
    metrics,
    rm_raw,
    run_dir_of,
    sft_raw,
)

from rlhflab.checkpoint import committed_checkpoints, load_checkpoint
from rlhflab.config import config_from_dict
from rlhflab.trainers import loop, run_config

BIG = 1e6  # seconds: the real clock never runs out in these tests; the fault rule does


def raw(root, resume=None, every=5, **train):
    r = sft_raw(root, max_seconds=BIG, **train)
    r["eval"]["every"] = 3
    r["checkpoint"] = {"every": every, "keep_last": None}
    if resume is not None:
        r["run"]["resume"] = str(resume)
    return r


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same 12-step run, never stopped."""
    root = tmp_path_factory.mktemp("budget_ref")
    return run_config(config_from_dict(raw(root)))["run_dir"]


def test_budget_is_per_invocation_and_never_stops_after_the_last_step(monkeypatch):
    now = {"t": 100.0}
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: now["t"]))
    budget = loop.TimeBudget(10.0, total_steps=5, start=100.0)
    now["t"] = 109.0
    assert not budget.expired(1) and budget.status == "complete"
    now["t"] = 111.0
    assert budget.expired(2) and budget.status == "stopped_by_max_seconds"
    last = loop.TimeBudget(10.0, total_steps=5, start=100.0)
    assert not last.expired(5) and last.status == "complete"  # out of time, but done
    # A resumed invocation counts from its own start, not from the first invocation's.
    resumed = loop.TimeBudget(10.0, total_steps=5, start=now["t"])
    now["t"] += 9.0
    assert not resumed.expired(3)
    assert not loop.TimeBudget(None, 5, start=0.0).expired(1)  # no budget


def test_budget_expiring_during_evaluation_stops_with_a_checkpoint_and_resumes(
    tmp_path, monkeypatch, reference
):
    # checkpoint.every 0: the stop by the budget still writes the checkpoint that resume needs.
    monkeypatch.setenv("RLHFLAB_FAULT", "eval@6=expire")
    res = run_config(config_from_dict(raw(tmp_path, every=0)))
    assert (res["steps"], res["status"]) == (6, "stopped_by_max_seconds")
    run = run_dir_of(tmp_path, "sft")
    assert [p.name for p in committed_checkpoints(run)] == ["step-00000006"]
    final = json.loads((run / "final_results.json").read_text())
    assert final["status"] == "stopped_by_max_seconds" and final["steps"] == 6
    monkeypatch.delenv("RLHFLAB_FAULT")
    res = run_config(config_from_dict(raw(tmp_path, resume="latest", every=0)))
    assert (res["steps"], res["status"]) == (12, "complete")  # a fresh budget: to the end
    assert_same_run(reference, run)


def test_budget_expiring_during_a_checkpoint_write_stops_after_that_checkpoint(
    tmp_path, monkeypatch, reference
):
    monkeypatch.setenv("RLHFLAB_FAULT", "checkpoint_file@2=expire")  # inside step 5's save
    res = run_config(config_from_dict(raw(tmp_path)))
    assert (res["steps"], res["status"]) == (5, "stopped_by_max_seconds")
    run = run_dir_of(tmp_path, "sft")
    ckpts = committed_checkpoints(run)
    assert [p.name for p in ckpts] == ["step-00000005"]
    assert load_checkpoint(ckpts[-1]).step == 5  # committed and verified
    monkeypatch.delenv("RLHFLAB_FAULT")
    res = run_config(config_from_dict(raw(tmp_path, resume="latest")))
    assert (res["steps"], res["status"]) == (12, "complete")
    assert_same_run(reference, run)


def test_budget_expiring_in_the_last_step_is_complete_and_resume_does_nothing(
    tmp_path, monkeypatch, reference, capsys
):
    monkeypatch.setenv("RLHFLAB_FAULT", "step_mid@12=expire")
    res = run_config(config_from_dict(raw(tmp_path)))
    assert (res["steps"], res["status"]) == (12, "complete")
    run = run_dir_of(tmp_path, "sft")
    assert_same_run(reference, run)
    monkeypatch.delenv("RLHFLAB_FAULT")
    files = {
        p: (p.stat().st_mtime_ns, p.read_bytes())
        for p in run.rglob("*")
        if p.is_file() and p.name != ".lock"  # (the lock is taken, then dropped)
    }
    capsys.readouterr()
    again = run_config(config_from_dict(raw(tmp_path, resume="latest")))
    assert again == json.loads((run / "final_results.json").read_text())
    assert "is complete (step 12)" in capsys.readouterr().err
    after = {
        p: (p.stat().st_mtime_ns, p.read_bytes())
        for p in run.rglob("*")
        if p.is_file() and p.name != ".lock"
    }
    assert after == files  # nothing re-evaluated, re-saved or rewritten
    assert [r["step"] for r in metrics(run)] == [r["step"] for r in metrics(reference)]
    assert Path(again["run_dir"]) == run


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget_base")
    return run_config(config_from_dict(sft_raw(root, steps=2)))["model_dir"]


@pytest.mark.parametrize("family", ["grpo", "dpo", "rm"])
def test_every_trainer_stops_the_same_way(tmp_path, monkeypatch, base_model, family):
    """The budget rule is the same in every trainer: stop after the step where it runs out,
    checkpoint there (even with checkpoint.every 0), status stopped_by_max_seconds."""
    if family == "rm":
        pairs = tmp_path / "pairs.jsonl"
        rows = [{"prompt": f"{i} + 1 =", "chosen": str(i + 1), "rejected": str(i + 3)}
                for i in range(20)]  # fmt: skip
        pairs.write_text("\n".join(json.dumps(r) for r in rows))
        r = rm_raw(tmp_path, base_model, pairs)
    else:
        r = {"grpo": grpo_raw, "dpo": dpo_raw}[family](tmp_path, base_model)
    r["train"]["max_seconds"] = BIG
    r["checkpoint"] = {"every": 0, "keep_last": None}
    monkeypatch.setenv("RLHFLAB_FAULT", "step_mid@2=expire")
    res = run_config(config_from_dict(r))
    assert (res["steps"], res["status"]) == (2, "stopped_by_max_seconds")
    run = Path(res["run_dir"])
    assert [p.name for p in committed_checkpoints(run)] == ["step-00000002"]
