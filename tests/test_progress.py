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
