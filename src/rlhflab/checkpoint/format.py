"""The checkpoint directory on disk: its files, manifest and COMMITTED marker, verified loading.

    committed_checkpoints(run_dir)   step directories carrying a COMMITTED marker, oldest first
    load_checkpoint(path)            verify COMMITTED, manifest and every file's sha256, the run
                                     id and step every file carries, shard headers; read state
    stamp(run_id, step)              the safetensors metadata naming a file's run and step
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
FORMAT_VERSION = 2
#: Formats read. 1 (before run ids): accepted on resume with a warning
#: (`rlhflab.checkpoint.resume.provenance_note`); its files' run and step are not checked.
READ_FORMATS = (1, 2)
#: safetensors metadata keys of the run id and step every tensor file of a checkpoint carries.
RUN_ID_KEY, STEP_KEY = "rlhflab.run_id", "rlhflab.step"
#: safetensors files a resume never reads, written by another library (peft's copy of a LoRA
#: model's adapters, which model.safetensors holds too): not stamped.
_NOT_STAMPED = frozenset({"adapter_model.safetensors"})
_PREFIX = "step-"
_PT = {"format": "pt"}  # the safetensors metadata transformers' from_pretrained expects


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def stamp(run_id: str, step: int) -> dict[str, str]:
    """The safetensors metadata of a checkpoint file of run `run_id` at optimizer step `step`
    (checked by `load_checkpoint`)."""
    return {RUN_ID_KEY: run_id, STEP_KEY: str(step)}


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
    def run_id(self) -> str | None:
        """The id of the run that wrote it (None: format 1, before run ids)."""
        return self.manifest.get("run_id")

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
    unlisted file is present; state.json's step is the manifest's and the directory name's;
    every tensor file carries (safetensors metadata `stamp`) the manifest's run id and step, and
    every sharded index too, whose files' headers hold exactly the tensors, shapes and dtypes it
    places in them (`rlhflab.checkpoint.sharded.check_shard_files`). Headers only: tensors are
    not loaded here (see `Checkpointer.restore`). A recomputed manifest therefore does not let a
    file of another run, another step or another model shape through. Format 1 (before run
    ids): everything but the run id and step of the files is checked.

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
    if manifest.get("format_version") not in READ_FORMATS:
        raise CheckpointError(
            f"checkpoint {path}: format_version {manifest.get('format_version')} is not one "
            f"this version reads ({', '.join(map(str, READ_FORMATS))})"
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
    _check_provenance(path, manifest, int(state["step"]))
    return Checkpoint(path=path, step=int(state["step"]), state=state, manifest=manifest)


def _check_provenance(path: Path, manifest: dict, step: int) -> None:
    """The step of state.json, the manifest and the directory name agree; every tensor file and
    shard index carries the manifest's run id and step; shard headers match their index.
    CheckpointError naming the file otherwise."""
    from rlhflab.checkpoint.sharded import check_shard_files, read_index

    where = f"checkpoint {path}"
    if manifest.get("step") != step:
        raise CheckpointError(f"{where}: {MANIFEST} says step {manifest.get('step')}, "
                              f"{STATE} step {step}")  # fmt: skip
    named = step_of(path)
    if named is not None and named != step:
        raise CheckpointError(f"{where}: {STATE} says step {step}, the directory name {named}")
    run_id = manifest.get("run_id")
    if manifest["format_version"] >= 2 and (not isinstance(run_id, str) or not run_id):
        raise CheckpointError(f"{where}: {MANIFEST} has no run_id (format 2 carries one)")
    files = manifest["files"]
    # Shard headers against their index first (a file of another model shape), then the run
    # id and step of every file (a file of another run or step).
    for name in sorted(f for f in files if f.endswith(".shards.json")):
        check_shard_files(path, name, set(files))
        index = read_index(path / name)
        if run_id is not None and (index.get("run_id"), index.get("step")) != (run_id, step):
            raise CheckpointError(
                f"{where}: {name} is of run {index.get('run_id')} step {index.get('step')}, "
                f"the checkpoint of run {run_id} step {step}"
            )
    for name in sorted(files):
        if name.endswith(".safetensors") and name not in _NOT_STAMPED:
            _check_stamp(path, name, run_id, step)


def _check_stamp(path: Path, name: str, run_id: str | None, step: int) -> None:
    """The run id and step in the safetensors header of file `name` are the checkpoint's."""
    from safetensors import safe_open

    try:
        with safe_open(str(path / name), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as exc:  # safetensors' own error type for a malformed header
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"checkpoint {path}: file {name} unreadable: {msg}") from None
    got_id, got_step = meta.get(RUN_ID_KEY), meta.get(STEP_KEY)
    if run_id is None:  # format 1: no run ids; a newer file carrying one was put in
        if got_id is not None:
            raise CheckpointError(
                f"checkpoint {path}: file {name} is of run {got_id} step {got_step}, in a "
                "checkpoint without run id (format 1): it comes from another checkpoint"
            )
        return
    if got_id != run_id:
        raise CheckpointError(
            f"checkpoint {path}: file {name} is of run {got_id or '(none recorded)'}, the "
            f"checkpoint of run {run_id}: it comes from another run"
        )
    if got_step != str(step):
        raise CheckpointError(
            f"checkpoint {path}: file {name} is of step {got_step}, the checkpoint of step "
            f"{step}: it comes from another checkpoint"
        )


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
