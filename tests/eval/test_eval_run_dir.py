"""`rlhflab eval RUN_DIR --passk --checkpoints`: the initial, checkpointed and final models of a
GRPO run re-evaluated on the run's own held-out set (issue #27)."""

import json
from pathlib import Path

import pytest
from factories import tiny_pg, tiny_sft

from rlhflab.cli import main
from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config


@pytest.mark.slow
def test_passk_and_checkpoint_curve_of_a_run(tmp_path, capsys):
    sft = run_config(config_from_dict(tiny_sft(tmp_path / "sft", precision={"threads": 1})))
    cfg = tiny_pg(
        tmp_path / "pg", sft["model_dir"], train={"steps": 4, "micro_batch_size": 16},
        eval={"n": 6, "max_new_tokens": 6}, checkpoint={"every": 2, "keep_last": None},
        precision={"threads": 1},
    )  # fmt: skip
    res = run_config(config_from_dict(cfg))
    run_dir = Path(res["run_dir"])
    argv = ["eval", str(run_dir), "--passk", "--k", "1,2,4", "--checkpoints", "--threads", "1"]
    argv.append("--json")  # the results object on stdout
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    head = res["headline"]
    # greedy decoding of the same weights on the same held-out set: the run's own numbers
    curve = out["checkpoints"]["points"]
    assert [p["step"] for p in curve] == [0, 2, 4]
    assert curve[0]["headline"] == head["before"] and curve[-1]["headline"] == head["value"]
    passk = out["passk"]
    assert passk["before"]["headline"] == head["before"]
    assert passk["after"]["headline"] == head["value"]
    for when in ("before", "after"):
        r = passk[when]
        assert r["n_samples"] == 4 and r["n"] == 6
        assert 0.0 <= r["pass@1"] <= r["pass@2"] <= r["pass@4"] <= 1.0  # pass@k grows with k
        assert {"maj@1", "maj@2", "maj@4", "pass@4_stderr"} <= set(r)
    for name in ("passk.json", "passk.png", "checkpoints.json", "checkpoints.png"):
        assert (run_dir / "eval" / name).is_file()
    # not a run directory: one line
    assert main(["eval", str(tmp_path), "--passk"]) == 2
    assert "take a run directory" in capsys.readouterr().err


@pytest.mark.slow
def test_checkpoint_curve_says_which_checkpoints_were_deleted_and_draws_the_logged_evals(
    tmp_path, capsys
):
    """issue #36: `checkpoint.keep_last` deletes checkpoints during the run, so the curve had 3
    points on the quickstart without saying why. The deleted steps are named (printed, in the
    JSON and on the plot) and the run's own evaluations from metrics.jsonl are drawn beside."""
    from rlhflab.tracking import read_metrics

    sft = run_config(config_from_dict(tiny_sft(tmp_path / "sft", precision={"threads": 1})))
    cfg = tiny_pg(
        tmp_path / "pg", sft["model_dir"], train={"steps": 4, "micro_batch_size": 16},
        eval={"n": 4, "max_new_tokens": 6, "every": 1}, checkpoint={"every": 1, "keep_last": 1},
        precision={"threads": 1},
    )  # fmt: skip
    res = run_config(config_from_dict(cfg))
    run_dir = Path(res["run_dir"])
    assert main(["eval", str(run_dir), "--checkpoints", "--threads", "1", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)["checkpoints"]
    # every step wrote a checkpoint (every 1) and only the newest stayed (keep_last 1): steps 1-3
    # were deleted; the initial model and the final model (step 4) are evaluated
    assert [p["step"] for p in out["points"]] == [0, 4]
    assert out["pruned_steps"] == [1, 2, 3]
    assert "3 checkpoints (steps 1, 2, 3) were deleted during the run" in out["note"]
    assert f"note: {out['note']}" in captured.err
    # the logged evaluations: every eval row of metrics.jsonl, read back independently
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/headline" in r]
    assert [(r["step"], r["headline"]) for r in out["logged"]] == [
        (r["step"], r["eval/headline"]) for r in rows
    ]
    assert [r["step"] for r in out["logged"]] == [0, 1, 2, 3, 4]
    # where both exist they are the same measurement (same weights, rows, greedy decoding)
    logged = {r["step"]: r["headline"] for r in out["logged"]}
    assert all(p["headline"] == logged[p["step"]] for p in out["points"])
    assert (run_dir / "eval" / "checkpoints.png").is_file()
