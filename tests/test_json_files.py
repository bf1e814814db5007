"""No JSON file written by rlhflab holds NaN or Infinity (they are not JSON): non-finite values are
written as null with a `<key>_note` beside them saying why; checkpoint state keeps them exactly."""

import json
import math
import re
from pathlib import Path

import pytest
from test_checkpoint_resume import sft_raw

from rlhflab.config import config_from_dict
from rlhflab.runs import NONFINITE_NOTES, decode_nonfinite, encode_nonfinite, finite_json, to_json
from rlhflab.trainers import run_config

SRC = Path(__file__).parents[1] / "src" / "rlhflab"


def _strict(text: str):
    """json.loads that refuses the NaN / Infinity tokens Python's json accepts."""

    def refuse(token):
        raise ValueError(f"non-JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_finite_json_writes_null_and_a_note():
    obj = {"auc": float("nan"), "n": 3, "hi": float("inf"), "xs": [0.5, float("-inf")], "ok": 1.5}
    out = finite_json(obj)
    assert out == {
        "auc": None,
        "n": 3,
        "hi": None,
        "xs": [0.5, None],
        "ok": 1.5,
        "auc_note": NONFINITE_NOTES["nan"],
        "hi_note": NONFINITE_NOTES["inf"],
        "xs_note": "null entries: " + NONFINITE_NOTES["-inf"],
    }
    # a writer that knows why keeps its own note
    assert finite_json({"a": float("nan"), "a_note": "one class absent"}) == {
        "a": None,
        "a_note": "one class absent",
    }
    assert obj["auc"] != obj["auc"]  # the input is not modified
    assert _strict(to_json({"nested": {"x": float("nan")}})) == {
        "nested": {"x": None, "x_note": NONFINITE_NOTES["nan"]}
    }


def test_checkpoint_encoding_round_trips_non_finite_floats():
    state = {"last_loss": float("nan"), "evals": [[1, 0.5, float("inf")]], "k": -math.inf}
    back = json.loads(to_json(encode_nonfinite(state)), object_hook=decode_nonfinite)
    assert math.isnan(back["last_loss"]) and back["evals"] == [[1, 0.5, math.inf]]
    assert back["k"] == -math.inf


def test_no_module_writes_json_around_the_helper():
    # Every JSON file goes through rlhflab.runs.to_json (json.dumps only for hashing / keys).
    offenders = []
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        if re.search(r"json\.dump\(|\.write\(json\.dumps", text):
            offenders.append(str(path.relative_to(SRC)))
    assert offenders == []


def test_nan_loss_is_null_with_a_note_in_every_file_and_resumes_as_nan(tmp_path, monkeypatch):
    # The last step's loss is NaN (skipped by nan_policy skip): metrics.jsonl, final_results.json
    # and the checkpoint's files are strict JSON; the checkpoint restores the NaN itself.
    monkeypatch.setenv("RLHFLAB_FAULT", "loss@4=nan")
    raw = sft_raw(tmp_path, steps=4, nan_policy="skip")
    raw["checkpoint"] = {"every": 4, "keep_last": None}
    res = run_config(config_from_dict(raw))
    assert math.isnan(res["final_loss"])
    run = Path(res["run_dir"])
    final = _strict((run / "final_results.json").read_text())
    assert final["final_loss"] is None
    assert final["final_loss_note"] == NONFINITE_NOTES["nan"]
    rows = [_strict(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (row4,) = [r for r in rows if r["step"] == 4 and "train/loss" in r]
    assert row4["train/loss"] is None and row4["train/loss_note"] == NONFINITE_NOTES["nan"]
    for f in run.rglob("*.json*"):
        for line in [f.read_text()] if f.suffix == ".json" else f.read_text().splitlines():
            _strict(line)
    (state_file,) = run.glob("checkpoints/*/state.json")
    state = json.loads(state_file.read_text(), object_hook=decode_nonfinite)
    assert math.isnan(state["trainer"]["last_loss"])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_cli_stdout_is_strict_json(value):
    from rlhflab.cli import _dumps

    assert _strict(_dumps({"x": value}))["x"] is None
