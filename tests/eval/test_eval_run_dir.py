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
