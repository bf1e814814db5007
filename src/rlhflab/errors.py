"""Errors that reach the user as one line.

Every error raised for bad input (config, data, paths, models) is an `RlhfLabError`. The CLI prints
`error: <message>` and exits with code 2; no traceback from deep inside a library reaches the user.
Messages name the field, file or row at fault.
"""

from __future__ import annotations

import signal
from pathlib import Path


class RlhfLabError(Exception):
    """Base class: a user-facing problem that is explained in one line."""


class ConfigError(RlhfLabError):
    """A config key, value or override is invalid (message names the dotted key)."""


class DataError(RlhfLabError):
    """A dataset, file or row is invalid (message names the file/dataset, row and field)."""


class RewardError(RlhfLabError):
    """A reward function raised, returned the wrong length, or returned NaN (message names the
    function and the batch)."""


class ModelError(RlhfLabError):
    """A model or tokenizer cannot be loaded or does not fit the request."""


class CheckpointError(RlhfLabError):
    """A checkpoint is incomplete, corrupted or does not fit the run (message names the file)."""


class DiskFullError(RlhfLabError):
    """No space left while writing (message names the file, the free and the needed space)."""


class NonFiniteError(RlhfLabError):
    """A loss or gradient became NaN/inf (message names the step and the metric)."""


class PeerRefused(RlhfLabError):
    """Under torchrun: rank 0 refused to start (a locked run directory, a file it alone writes)
    and told this rank why (`rlhflab.distributed.main_then_share`). Rank 0 prints the reason;
    this rank exits quietly with the same exit code (2)."""


class Interrupted(Exception):
    """Training stopped on SIGTERM / SIGINT after writing a committed checkpoint.

    The CLI exits with `128 + signum` (130 for SIGINT, 143 for SIGTERM), as a shell reports a
    process ended by that signal; `--resume` continues from `checkpoint`.
    """

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} after step {step}; checkpoint {checkpoint}")

    @property
    def exit_code(self) -> int:
        """128 + the signal number (130 SIGINT, 143 SIGTERM)."""
        return 128 + self.signum


EXIT_HEALTH = 3  # exit code of `rlhflab` when a health check failed under health.on_fail: stop


class HealthStop(Exception):
    """A health check failed under `health.on_fail: stop` (rlhflab.health); raised after the
    step's committed checkpoint (`checkpoint`). The CLI exits with EXIT_HEALTH (3); `--resume`
    continues from the checkpoint (with the check fixed, skipped or `on_fail: warn`)."""

    exit_code = EXIT_HEALTH

    def __init__(self, name: str, step: int, detail: str) -> None:
        self.name, self.step, self.detail = name, step, detail
        self.checkpoint: Path | None = None
        self.run_dir: Path | None = None  # set with `checkpoint`, by the checkpointer
        self.health: dict | None = None  # the monitor's summary when it stopped the run
        self.results: dict | None = None  # what final_results.json got (rank 0)
        super().__init__(f"health check '{name}' failed at step {step}: {detail}")
