"""`rlhflab train --nproc`'s exit code and line from torchrun's failures
(`rlhflab.distributed.launch.exit_status`): the worker's own exit code when it stopped by itself,
with the one line it recorded in its torchelastic error file (printed once for all ranks), one
line naming the rank for a crash or a signal."""

from __future__ import annotations

import json

import pytest

from rlhflab.distributed.launch import exit_status, record_error, recorded_line

CRASH_1 = "error: rank 1 failed with exit code 1 (its output is above)"


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        ({}, (0, None)),
        # rank 0 refused a user error; torchrun then stopped rank 1 (SIGTERM = -15)
        ({0: (2, 10.0, "error: x"), 1: (-15, 10.0, None)}, (2, "error: x")),
        # a rank that exited by itself is the root cause even if a signal was seen first
        ({0: (-15, 5.0, None), 1: (2, 10.0, "error: y")}, (2, "error: y")),
        # both ranks stopped by the same error: one line, the lowest rank's at the same second
        ({1: (2, 5.0, "rank 1: error: nan"), 0: (2, 5.0, "rank 0: error: nan")},
         (2, "rank 0: error: nan")),
        # rank 1 told of rank 0's refusal left first, recording nothing: rank 0's line
        ({1: (2, 4.0, None), 0: (2, 5.0, "error: locked")}, (2, "error: locked")),
        # rank 1 (told of the refusal) left first; torchrun stopped rank 0 after it had recorded
        # the line: still that line (the launcher printed nothing once, under load)
        ({1: (2, 4.0, None), 0: (-15, 5.0, "error: locked")}, (2, "error: locked")),
        ({0: (2, 4.0)}, (2, None)),  # nothing recorded (the worker printed its line)
        ({0: (143, 7.0, None), 1: (-15, 7.0, None)}, (143, None)),  # SIGTERM after a checkpoint
        ({0: (3, 7.0, None)}, (3, None)),  # a health stop
        ({1: (1, 5.0, None), 0: (2, 6.0, "error: z")}, (1, CRASH_1)),
        ({1: (-9, 3.0, None), 0: (-15, 4.0, None)}, (137, "error: rank 1 was killed by SIGKILL")),
        # rank 1 killed, rank 0 stopped by torchrun in the same poll (equal timestamps): rank 1
        ({0: (-15, 4.0, None), 1: (-9, 4.0, None)}, (137, "error: rank 1 was killed by SIGKILL")),
        ({0: (-15, 4.0, None), 1: (-15, 4.0, None)}, (143, "error: rank 0 was killed by SIGTERM")),
    ],
)  # fmt: skip
def test_exit_status(failures, expected):
    assert exit_status(failures) == expected


def test_record_error_writes_torchs_error_file_layout(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert record_error("error: x") is False
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert record_error("error: data.path: file not found: a.jsonl") is True
    data = json.loads(path.read_text())
    # torchrun's report prints message.extraInfo.py_callstack; ProcessFailure reads the timestamp
    assert (
        data["message"]["extraInfo"]["py_callstack"] == "error: data.path: file not found: a.jsonl"
    )
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    assert recorded_line(data) == "error: data.path: file not found: a.jsonl"
    assert recorded_line({"message": "Signal 15"}) is None and recorded_line({}) is None
