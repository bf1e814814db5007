"""Progress bars of long preparation phases: drawn only on a terminal (never into logs or a
captured stream), joined to a running trainer's display, and removed when the phase ends."""

import io

from rich.console import Console

from rlhflab import tracking
from rlhflab.tracking import Tracker, phase, progress


def _terminal(monkeypatch) -> io.StringIO:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    monkeypatch.setattr(tracking, "console", console)
    monkeypatch.delenv("RLHFLAB_PROGRESS", raising=False)
    return out


def test_nothing_is_drawn_off_a_terminal(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(tracking, "console", Console(file=out, force_terminal=False))
    assert not tracking.progress_wanted()
    assert list(progress(range(5), "items")) == [0, 1, 2, 3, 4]
    with phase("tokenizer") as bar:
        bar.advance()
    assert out.getvalue() == ""


def test_environment_switch_turns_bars_off(monkeypatch):
    _terminal(monkeypatch)
    assert tracking.progress_wanted()
    monkeypatch.setenv("RLHFLAB_PROGRESS", "0")
    assert not tracking.progress_wanted()


def test_bar_counts_items_on_a_terminal(monkeypatch):
    out = _terminal(monkeypatch)
    assert list(progress(range(3), "eval (3 problems)")) == [0, 1, 2]
    assert "eval (3 problems)" in out.getvalue()


def test_phase_joins_the_trainer_display_and_leaves_it(monkeypatch, tmp_path):
    _terminal(monkeypatch)
    tracker = Tracker(tmp_path, total_steps=4, description="train")
    host = tracker.progress
    assert tracking._LIVE[-1] is host
    with phase("sampling pairs", 6) as bar:
        (task,) = [t for t in host.tasks if t.description == "sampling pairs"]
        bar.advance(4)
        assert task.completed == 4 and task.total == 6
    assert [t.description for t in host.tasks] == ["train"]
    tracker.close()
    assert host not in tracking._LIVE


def test_off_a_terminal_each_logged_step_prints_a_plain_line_at_once(monkeypatch, tmp_path):
    # CI, nohup, a pipe: no live bar (it would print only at the end), one line per log call.
    out = io.StringIO()
    monkeypatch.setattr(tracking, "console", Console(file=out, force_terminal=False))
    tracker = Tracker(tmp_path, total_steps=10, headline=("train/loss",), description="sft")
    assert tracker.progress is None
    tracker.log(5, {"train/loss": 0.123456, "optim/lr": 1e-3})
    line = out.getvalue()
    assert line.startswith("sft step 5/10  train/loss=0.1235  elapsed 0:00:0")
    assert line.endswith("\n") and line.count("\n") == 1 and "eta 0:00:0" in line
    tracker.log(6, {"optim/lr": 1e-3})  # no headline metric: no line
    tracker.print("run directory: x")
    tracker.close()
    assert out.getvalue().splitlines()[1:] == ["run directory: x"]


def test_plain_line_format():
    line = tracking.plain_line("grpo", 50, 200, {"rollout/reward_mean": 0.5}, ("rollout/reward_mean", "policy/kl"), 75.0)  # fmt: skip
    # ETA: 75 s for 50 steps, 150 steps left -> 225 s
    assert line == "grpo step 50/200  rollout/reward_mean=0.5  elapsed 0:01:15  eta 0:03:45"
    assert tracking.plain_line("sft", 0, 10, {"eval/accuracy": 0.25}, ("eval/accuracy",), 3.0) == (
        "sft step 0/10  eval/accuracy=0.25  elapsed 0:00:03"
    )


def test_a_disabled_tracker_prints_nothing(monkeypatch, tmp_path):
    # data-parallel ranks other than 0 hold a disabled tracker: print / log / close are no-ops
    out = io.StringIO()
    monkeypatch.setattr(tracking, "console", Console(file=out, force_terminal=False))
    tracker = Tracker(tmp_path, total_steps=2, headline=("train/loss",), enabled=False)
    tracker.print("run directory: x")
    tracker.log(1, {"train/loss": 1.0})
    tracker.close()
    assert out.getvalue() == "" and not (tmp_path / "metrics.jsonl").exists()
