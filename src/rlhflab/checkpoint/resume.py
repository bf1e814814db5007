"""Which checkpoint a run resumes from (`run.resume`), and whether it was written by this version."""

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
from rlhflab.errors import ConfigError
from rlhflab.rundir import is_run_of


def version_note(ckpt: Checkpoint) -> str | None:
    """A one-line warning when the checkpoint was written by another rlhflab or torch version
    than this process runs (None when they match)."""
    saved, now = ckpt.manifest.get("versions", {}), _versions()
    differ = [k for k in ("rlhflab", "torch") if saved.get(k) != now[k]]
    if not differ:
        return None
    pairs = ", ".join(f"{k} {saved.get(k)} (now {now[k]})" for k in differ)
    return f"warning: checkpoint {ckpt.path.name} was written by {pairs}; resume may not be exact"


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
        CheckpointError: the chosen checkpoint fails verification (names the file).
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
        return load_checkpoint(max(candidates, key=lambda c: (c[0], c[1]))[2])
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"run.resume: {resume} does not exist")
    path = _inside(path, root_p, "run.resume")
    if step_of(path) is not None and path.parent.name == CHECKPOINTS:
        return load_checkpoint(path)
    found = committed_checkpoints(path)
    if not found:
        raise ConfigError(f"run.resume: {resume} holds no committed checkpoint")
    return load_checkpoint(found[-1])
