"""`rlhflab.trainers.loop.Run`: the harness a step at a time is the same run as `run(cfg, make)`
(the benchmarks drive the trainers through it)."""

from pathlib import Path

import pytest
from factories import tiny_sft
from test_checkpoint_resume import assert_same_run, metrics, run_dir_of

from rlhflab.checkpoint import committed_checkpoints
from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config, sft
from rlhflab.trainers.loop import Run


def _raw(root, name):
    r = tiny_sft(root, eval={"n": 4, "every": 2, "max_new_tokens": 4})
    r["run"]["name"] = name
    r["checkpoint"] = {"every": 4, "keep_last": None}
    return r


@pytest.mark.slow
def test_stepping_a_run_is_the_run(tmp_path):
    whole = run_config(config_from_dict(_raw(tmp_path, "whole")))
    cfg = config_from_dict(_raw(tmp_path, "stepped"))
    session = Run(cfg, sft.SFT)
    assert session.steps_done == 0 and session.trainer.model is not None
    returned = []
    with session:
        while (m := session.step()) is not None:
            returned.append(m)
    assert session.step() is None  # over: nothing more is done
    results = session.finish()
    a, b = Path(whole["run_dir"]), run_dir_of(tmp_path, "stepped")
    assert Path(results["run_dir"]) == b
    assert_same_run(a, b)  # the same metrics, samples and final weights as `run`
    drop = ("wall_s", "run_dir", "model_dir")
    assert {k: v for k, v in results.items() if k not in drop} == {
        k: v for k, v in whole.items() if k not in drop
    }
    # `step()` returned each step's logged metrics (plus its periodic evaluation's), step by step.
    logged = [r for r in metrics(b) if "train/loss" in r]
    assert len(returned) == cfg.train.steps == len(logged)
    for row, m in zip(logged, returned, strict=True):
        assert m["train/loss"] == pytest.approx(row["train/loss"], rel=0, abs=0)
        assert "perf/step_s" in m
    # The same checkpoint policy: the same committed checkpoints.
    assert [p.name for p in committed_checkpoints(b)] == [p.name for p in committed_checkpoints(a)]
    assert committed_checkpoints(b)
