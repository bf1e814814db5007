"""Which checkpoint a run resumes from (`run.resume`): verified, of the run directory it sits in,
and whether it was written by this version.

A checkpoint carries its run's id (`rlhflab.rundir.run_id`); resuming one whose id is not its run
directory's (a checkpoint copied from another run) is refused. A checkpoint of format 1 (written
before run ids) is resumed with a one-line warning (`provenance_note`): its files are verified
by sha256 and shape as before, but nothing says they belong to this run; the checkpoints the
resumed run writes carry the id.
"""

from __future__ import annotations

from pathlib import Path

from rlhflab.checkpoint.format import (
    CHECKPOINTS,
    Checkpoint,
    _versions,
    committed_checkpoints,
    load_checkpoint,
    step_of,
)
from rlhflab.errors import CheckpointError, ConfigError
from rlhflab.rundir import RUN_ID, is_run_of, run_id


def version_note(ckpt: Checkpoint) -> str | None:
    """A one-line warning when the checkpoint was written by another rlhflab or torch version
    than this process runs (None when they match)."""
    saved, now = ckpt.manifest.get("versions", {}), _versions()
    differ = [k for k in ("rlhflab", "torch") if saved.get(k) != now[k]]
    if not differ:
        return None
    pairs = ", ".join(f"{k} {saved.get(k)} (now {now[k]})" for k in differ)
    return f"warning: checkpoint {ckpt.path.name} was written by {pairs}; resume may not be exact"


def provenance_note(ckpt: Checkpoint) -> str | None:
    """A one-line warning when the checkpoint predates run ids (format 1), None otherwise."""
    if ckpt.run_id is not None:
        return None
    return (
        f"warning: checkpoint {ckpt.path.name} predates run ids (checkpoint format 1): resumed "
        "without checking that its files belong to this run"
    )


def check_run(ckpt: Checkpoint) -> Checkpoint:
    """`ckpt`, after checking that it belongs to the run directory it sits in: its run id is
    the one in `<run_dir>/run_id`. A format-1 checkpoint (no run id) passes (`provenance_note`).

    Raises:
        CheckpointError: the ids differ (a checkpoint copied from another run), or the run
            directory has lost its run_id file (one line saying how to proceed).
    """
    if ckpt.run_id is None:
        return ckpt
    mine = run_id(ckpt.run_dir)
    if mine is None:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: of run {ckpt.run_id}, but {ckpt.run_dir} has no {RUN_ID} "
            f"file; if this is that run's directory, write {ckpt.run_id} into "
            f"{ckpt.run_dir / RUN_ID} to resume it"
        )
    if mine != ckpt.run_id:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: of run {ckpt.run_id}, not of the run in {ckpt.run_dir} "
            f"({RUN_ID} {mine}): a checkpoint copied from another run is not resumed"
        )
    return ckpt


def _inside(path: Path, root: Path, field: str) -> Path:
    """`path` with symlinks resolved; a ConfigError when it is not under `root`."""
    real, real_root = path.resolve(), root.resolve()
    if real != real_root and real_root not in real.parents:
        raise ConfigError(
            f"{field}: {path} is outside the runs root {root} (after resolving links)"
        )
    return real


def find_resume_checkpoint(resume: str | None, root: str, name: str) -> Checkpoint | None:
    """The checkpoint to resume from, verified; None to start fresh.

    `resume`: None (fresh run); "auto" (the newest committed checkpoint among the run
    directories `<root>/<name>-*`; a fresh run when there is none: for jobs that are restarted
    by a scheduler); "latest" (the same, but an error when there is none: `--resume` without a
    path); a run directory (its newest committed checkpoint) or a checkpoint directory. A request
    that finds no committed checkpoint is an error, never a silent fresh start (except "auto");
    so is a path outside the runs root.

    Raises:
        ConfigError: the path does not exist, escapes `root`, or holds no committed checkpoint.
        CheckpointError: the chosen checkpoint fails verification (names the file), or is not
            its run directory's (`check_run`).
    """
    if resume is None:
        return None
    root_p = Path(root)
    if resume in ("auto", "latest"):
        candidates = []
        if root_p.is_dir():
            for run in root_p.iterdir():
                if run.is_dir() and is_run_of(run.name, name):
                    _inside(run, root_p, "run.resume")
                    for ck in committed_checkpoints(run):
                        candidates.append((ck.stat().st_mtime, step_of(ck), ck))
        if not candidates:
            if resume == "latest":
                raise ConfigError(
                    f"run.resume: no committed checkpoint of a run named '{name}' under {root}"
                )
            return None
        return check_run(load_checkpoint(max(candidates, key=lambda c: (c[0], c[1]))[2]))
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"run.resume: {resume} does not exist")
    path = _inside(path, root_p, "run.resume")
    if step_of(path) is not None and path.parent.name == CHECKPOINTS:
        return check_run(load_checkpoint(path))
    found = committed_checkpoints(path)
    if not found:
        raise ConfigError(f"run.resume: {resume} holds no committed checkpoint")
    return check_run(load_checkpoint(found[-1]))
