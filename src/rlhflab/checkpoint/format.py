"""The checkpoint directory on disk: its files, manifest and COMMITTED marker, verified loading.

    committed_checkpoints(run_dir)   step directories carrying a COMMITTED marker, oldest first
    load_checkpoint(path)            verify COMMITTED, manifest and every file's sha256; read state
    drop_later_checkpoints(...)      delete the checkpoints of later steps (abandoned timeline)

The layout and the guarantees are described in `rlhflab.checkpoint`. Writing is
`rlhflab.checkpoint.checkpointer.Checkpointer`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhflab.checkpoint.state import STATE, check_state_schema
from rlhflab.errors import CheckpointError
from rlhflab.serialize import decode_nonfinite

CHECKPOINTS = "checkpoints"
COMMITTED = "COMMITTED"
MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_PREFIX = "step-"
_PT = {"format": "pt"}  # the safetensors metadata transformers' from_pretrained expects


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _versions() -> dict[str, str]:
    import transformers

    from rlhflab import __version__

    return {
        "rlhflab": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


@dataclass
class Checkpoint:
    """A verified, committed checkpoint: its directory, step, JSON state and manifest."""

    path: Path
    step: int
    state: dict
    manifest: dict

    @property
    def run_dir(self) -> Path:
        """The run directory the checkpoint belongs to (`<run_dir>/checkpoints/step-N`)."""
        return self.path.parent.parent


def step_of(path: Path) -> int | None:
    """The optimizer step of a checkpoint directory named `step-<n>` (e.g. `step-000120` → 120);
    None for any other name. Reads only the name, never the directory."""
    name = path.name
    if not name.startswith(_PREFIX):
        return None
    try:
        return int(name[len(_PREFIX) :])
    except ValueError:
        return None


def committed_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run that carry a COMMITTED marker, oldest step first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and (p / COMMITTED).is_file()]
    return sorted(found, key=lambda p: step_of(p))


def load_checkpoint(path: Path) -> Checkpoint:
    """Verify and read a checkpoint directory.

    Checks, in order: the directory and its COMMITTED marker exist; COMMITTED holds the sha256 of
    manifest.json; every file listed in the manifest exists with the listed size and sha256; no
    unlisted file is present. Tensors are not loaded here (see `Checkpointer.restore`).

    Raises:
        CheckpointError: naming the checkpoint and the file at fault.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a directory")
    marker = path / COMMITTED
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path}: no {COMMITTED} marker (incomplete write)")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path}: missing file {MANIFEST}")
    if marker.read_text().strip() != sha256_file(manifest_path):
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not match its {COMMITTED} hash")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} unreadable: {exc}") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: format_version {manifest.get('format_version')} "
            f"!= {FORMAT_VERSION}"
        )
    listed = manifest["files"]
    for name, info in listed.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path}: missing file {name}")
        if f.stat().st_size != info["size"]:
            raise CheckpointError(
                f"checkpoint {path}: file {name} has {f.stat().st_size} bytes, "
                f"manifest says {info['size']} (truncated or modified)"
            )
        if sha256_file(f) != info["sha256"]:
            raise CheckpointError(f"checkpoint {path}: file {name} fails its sha256 check")
    extra = {p.name for p in path.iterdir()} - set(listed) - {MANIFEST, COMMITTED}
    if extra:
        raise CheckpointError(f"checkpoint {path}: unexpected file(s) {sorted(extra)}")
    state = check_state_schema(
        path, json.loads((path / STATE).read_text(), object_hook=decode_nonfinite)
    )
    return Checkpoint(path=path, step=int(state["step"]), state=state, manifest=manifest)


def drop_later_checkpoints(run_dir: Path, step: int) -> list[Path]:
    """Delete the committed checkpoints of `run_dir` with a step after `step`: resuming from an
    older checkpoint abandons their timeline, and the logs no longer match them. Done on resume,
    before any new step, so a later plain `--resume` follows the resumed timeline. Returns the
    deleted paths."""
    later = [p for p in committed_checkpoints(run_dir) if step_of(p) > step]
    for p in later:
        _remove(p)
    return later


def _remove(path: Path) -> None:
    """Delete a checkpoint directory: its COMMITTED marker first, so that a half-deleted
    directory is never taken for a complete checkpoint."""
    (path / COMMITTED).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)
