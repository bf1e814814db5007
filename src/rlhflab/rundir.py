"""The run directory `<root>/<name>-<timestamp>/`: creating it, locking it, guarding it.

Layout of a finished run:
    config.yaml          the resolved config (every default written out)
    metrics.jsonl        one JSON object per logged step
    samples.jsonl        prompts, completions and rewards every `tracking.samples_every` steps
    plots/*.png          the main curves
    final_results.json   headline numbers of the run
    model/               the final model and tokenizer in Hugging Face format
    .lock                the lock of the process writing the run (`lock_run_dir`)
    run_id               the run's random id (written by its first process), which every
                         checkpoint of the run carries (`rlhflab.checkpoint`)
    checkpoints/         committed checkpoints (`rlhflab.checkpoint`)
    config_changes.jsonl resumes with a changed config (`rlhflab.checkpoint.config_diff`)

    create_run_dir(root, name)       a new `<root>/<name>-<YYYYmmdd-HHMMSS>` directory
    is_run_of(dirname, name)         whether a directory is a run of `name`
    SampleWriter(run_dir)            appends to samples.jsonl

    run_id(run_dir, create=False)    the run's id (a new one written with create=True)
    lock_run_dir(run_dir)            exclusive lock for the life of the process (or release_locks)
    take_lock(path, what, shared)    the same flock on any lock file (a sweep's campaign folder)
    check_no_symlinks(run_dir)       refuse a run directory holding symlinks before writing into it
    check_logs(run_dir, ckpt)        metrics.jsonl / samples.jsonl intact up to the checkpoint

The lock is an advisory `flock` on `<run_dir>/.lock`, which holds the PID of its holder. The
kernel drops the lock when its process ends, however it ends (SIGKILL included), so a lock file
left by a dead process is stale by construction and is simply taken over. `take_lock` is that
lock for other folders (`rlhflab.sweep` locks a campaign folder with it); a shared (`LOCK_SH`)
holder excludes exclusive ones but not other shared ones.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from rlhflab.errors import CheckpointError, ConfigError
from rlhflab.serialize import redact_json

LOCK = ".lock"
RUN_ID = "run_id"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

_held: dict[str, int] = {}  # real path of a run directory -> fd of its lock file


def is_run_of(dirname: str, name: str) -> bool:
    """Whether a directory name is a run directory of the run named `name` exactly:
    `<name>-<YYYYmmdd-HHMMSS>` with an optional `-<i>` suffix (so 'exp' never matches the runs
    of 'exp-b')."""
    return re.fullmatch(re.escape(name) + r"-\d{8}-\d{6}(-\d+)?", dirname) is not None


def newest_complete_run(parent: Path, name: str) -> tuple[Path, dict] | None:
    """The newest run directory of the run named `name` directly under `parent` (`is_run_of`)
    whose final_results.json says `status: complete`, with those results; None when there is
    none (or `parent` is not a directory). Unreadable results count as not complete. Used to
    skip finished stages and arms on `quickstart --resume` and `sweep --resume`."""
    if not parent.is_dir():
        return None
    done = []
    for d in parent.iterdir():
        if d.is_dir() and is_run_of(d.name, name):
            try:
                res = json.loads((d / "final_results.json").read_text())
            except (OSError, ValueError):
                continue
            if isinstance(res, dict) and res.get("status") == "complete":
                done.append((d, res))
    return max(done, key=lambda t: t[0].name) if done else None


def check_run_name(name: str) -> None:
    """Run names are one path component of letters, digits, '.', '_' and '-' (no '..')."""
    if not _NAME.match(name) or ".." in name:
        raise ValueError(
            f"run.name: '{name}' must be letters, digits, '.', '_' or '-' (no path separators)"
        )


def create_run_dir(root: str | Path, name: str) -> Path:
    """Create and return `<root>/<name>-<YYYYmmdd-HHMMSS>` (a numeric suffix if it exists)."""
    try:
        check_run_name(name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ConfigError(f"run.root: {root} exists and is not a directory")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        root.mkdir(parents=True, exist_ok=True)
        for i in range(1000):
            path = root / (f"{name}-{stamp}" + (f"-{i}" if i else ""))
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
    except OSError as exc:  # read-only file system, permissions, a file in the way
        raise ConfigError(f"run.root: cannot create a run directory under {root}: "
                          f"{exc.strerror or exc}") from None  # fmt: skip
    raise ConfigError(f"run.root: cannot create a new run directory under {root}")


def run_id(run_dir: Path, *, create: bool = False) -> str | None:
    """The id of the run in `run_dir`: the text of its `run_id` file (32 hex digits, a uuid4
    written when the run's first process made its first checkpointer). None when the file is
    missing (a run directory of a version before run ids) unless `create`, which writes a new
    one. Checkpoints carry it (`rlhflab.checkpoint`), so a checkpoint or a file copied from
    another run is refused on resume.

    Raises:
        CheckpointError: the file exists but does not hold an id (names the file).
    """
    path = Path(run_dir) / RUN_ID
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        if not create:
            return None
        from rlhflab.serialize import write_text_atomic

        text = uuid.uuid4().hex
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text + "\n")
        return text
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable run id ({exc})") from None
    if not re.fullmatch(r"[0-9a-f]{32}", text):
        raise CheckpointError(f"{path}: not a run id (32 hex digits): {text[:40]!r}")
    return text


def take_lock(path: Path, what: str, *, shared: bool = False) -> int:
    """Take the `flock` of the lock file `path` (created if missing) for this process and
    return its descriptor; closing it (or the end of the process, however it ends) releases
    the lock. Exclusive, or `shared` (`LOCK_SH`: held by many at once, excluding exclusive
    holders). The file holds the PID of the process that took it last.

    Raises:
        ConfigError: another live process holds the lock ("<what> is in use by process <pid>
            (lock <path>)"), or the lock file cannot be written.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:  # a read-only run root, permissions, a link in the way
        raise ConfigError(f"{what}: cannot write its lock {path}: "
                          f"{exc.strerror or exc}") from None  # fmt: skip
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"{what} is in use by process {holder} (lock {path}); "
            "wait for it to finish or stop it first"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


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
    _held[key] = take_lock(Path(run_dir) / LOCK, f"run directory {run_dir}")


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


class SampleWriter:
    """Appends rollout samples (prompt, completion, reward, ...) to `samples.jsonl`, and hands
    them to `tracker.log_samples` (a table in wandb / trackio) when a tracker is given.

    `enabled=False` (data-parallel ranks other than 0) writes nothing."""

    def __init__(self, run_dir: Path, enabled: bool = True, tracker: Any = None) -> None:
        self.file = (Path(run_dir) / "samples.jsonl").open("a") if enabled else None
        self.tracker = tracker

    def write(self, step: int, rows: list[dict]) -> None:
        """Append `rows`, each tagged with `step`."""
        if self.file is None:
            return
        for row in rows:
            self.file.write(redact_json({"step": step, **row}) + "\n")
        self.file.flush()
        if self.tracker is not None:
            self.tracker.log_samples(step, rows)

    def close(self) -> None:
        """Close the file."""
        if self.file is not None:
            self.file.close()
