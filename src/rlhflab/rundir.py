"""Guards of a run directory: one writer at a time, no symlinks, intact logs, a record of config
changes.

    lock_run_dir(run_dir)            exclusive lock for the life of the process (or release_locks)
    check_no_symlinks(run_dir)       refuse a run directory holding symlinks before writing into it
    check_logs(run_dir, ckpt)        metrics.jsonl / samples.jsonl intact up to the checkpoint
    record_config_change(...)        append resumed-with-changes to config_changes.jsonl

The lock is an advisory `flock` on `<run_dir>/.lock`, which holds the PID of its holder. The
kernel drops the lock when its process ends, however it ends (SIGKILL included), so a lock file
left by a dead process is stale by construction and is simply taken over.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from rlhflab.errors import CheckpointError, ConfigError

LOCK = ".lock"
CONFIG_CHANGES = "config_changes.jsonl"
#: Keys that differ on every resume and are not a change of the run.
_RESUME_KEYS = ("run.resume", "run.allow_config_change")

_held: dict[str, int] = {}  # real path of a run directory -> fd of its lock file


def lock_run_dir(run_dir: Path) -> None:
    """Take the exclusive lock of a run directory for this process (a no-op when this process
    already holds it). Held until `release_locks` or the end of the process.

    Raises:
        ConfigError: another live process holds the lock (names its PID and the lock file), or
            the lock file cannot be written (read-only run root).
    """
    key = str(Path(run_dir).resolve())
    if key in _held:
        return
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:  # a read-only run root, permissions, a link in the way
        raise ConfigError(f"run directory {run_dir}: cannot write its lock {path}: "
                          f"{exc.strerror or exc}") from None  # fmt: skip
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"run directory {run_dir} is in use by process {holder} (lock {path}); "
            "wait for it to finish or stop it first"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held[key] = fd


def release_locks() -> None:
    """Release every run-directory lock this process holds."""
    while _held:
        _, fd = _held.popitem()
        os.close(fd)  # closing the descriptor drops the flock


def check_no_symlinks(run_dir: Path) -> None:
    """Refuse a run directory that contains a symbolic link anywhere below it: writes into a run
    directory never follow links out of it (metrics.jsonl, checkpoints/, ...).

    Raises:
        ConfigError: naming the first link found and its target.
    """
    for top, dirs, files in os.walk(run_dir):
        for name in sorted(dirs + files):
            p = Path(top) / name
            if p.is_symlink():
                raise ConfigError(
                    f"run directory {run_dir}: {p.relative_to(run_dir)} is a symlink "
                    f"(to {os.readlink(p)}); refusing to write through links"
                )


def check_logs(run_dir: Path, ckpt) -> None:
    """Check that the run's metrics.jsonl / samples.jsonl hold, up to the sizes the checkpoint
    recorded, complete lines of valid JSON. What follows those sizes was written after the
    checkpoint and is cut off on resume.

    Raises:
        CheckpointError: a file is missing or shorter than recorded (lines lost), or a line before
            the checkpoint's offset is not JSON (names the file and line number).
    """
    for fname, size in ckpt.state["file_offsets"].items():
        f = Path(run_dir) / fname
        if not f.is_file():
            raise CheckpointError(
                f"{f}: missing, but checkpoint {ckpt.path.name} recorded {size} bytes of it"
            )
        actual = f.stat().st_size
        if actual < size:
            raise CheckpointError(
                f"{f}: {actual} bytes, but checkpoint {ckpt.path.name} recorded {size}: "
                "lines were lost after the checkpoint was written"
            )
        with f.open("rb") as fh:
            head = fh.read(size)
        if head and not head.endswith(b"\n"):
            raise CheckpointError(f"{f}: the line at byte {size} is cut (file modified)")
        for i, line in enumerate(head.splitlines(), start=1):
            try:
                json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"{f} line {i}: not valid JSON (file damaged)") from None


def record_config_change(run_dir: Path, ckpt, config: dict) -> dict:
    """Compare the resolved `config` (secrets redacted) with the checkpoint's; when they differ,
    append `{"step", "time", "from_checkpoint", "changes": {key: [old, new]}}` to
    config_changes.jsonl and rewrite config.yaml with the new config. Returns the changes."""
    from rlhflab.checkpoint import flatten_config
    from rlhflab.serialize import redact_obj, to_json, write_yaml_atomic

    config = redact_obj(config)
    old, new = flatten_config(ckpt.state["config"]), flatten_config(config)
    changes = {
        k: [old.get(k), new.get(k)]
        for k in sorted(set(old) | set(new))
        if k not in _RESUME_KEYS and old.get(k) != new.get(k)
    }
    if changes:
        row = {
            "step": ckpt.step,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "from_checkpoint": ckpt.path.name,
            "changes": changes,
        }
        with (Path(run_dir) / CONFIG_CHANGES).open("a") as f:
            f.write(to_json(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        write_yaml_atomic(Path(run_dir) / "config.yaml", config)
    return changes
