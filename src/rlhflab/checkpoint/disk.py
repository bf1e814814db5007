"""A full disk during a checkpoint write: detected, and reported as one line with the space needed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Protocol

import torch

from rlhflab.checkpoint.format import committed_checkpoints
from rlhflab.errors import DiskFullError


class _Saved(Protocol):
    """What a disk-full report reads of a `Checkpointer` (this module sits below it)."""

    run_dir: Path
    modules: dict[str, torch.nn.Module]
    optimizers: dict[str, torch.optim.Optimizer]


def checkpoint_bytes(checkpointer: _Saved) -> int:
    """Bytes a checkpoint of `checkpointer` needs: the size of the newest committed checkpoint
    of the run, or (none yet) the bytes of its modules' and optimizers' tensors."""
    committed = committed_checkpoints(checkpointer.run_dir)
    if committed:
        return sum(f.stat().st_size for f in committed[-1].iterdir() if f.is_file())
    n = 0
    for m in checkpointer.modules.values():
        n += sum(t.numel() * t.element_size() for t in m.state_dict().values())
    for opt in checkpointer.optimizers.values():
        for st in opt.state.values():
            n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` reports a full disk or quota: an OSError with ENOSPC / EDQUOT, or another
    library's error carrying the OS message (safetensors: "... (os error 28)")."""
    import errno

    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    text = str(exc)
    return any(
        m in text
        for m in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT), f"os error {errno.ENOSPC}")
    )


def raise_if_disk_full(exc: BaseException, path: Path, checkpointer: _Saved) -> None:
    """Turn a disk-full error (`is_disk_full`) during a checkpoint write into a one-line
    `DiskFullError` naming the file, the free space and the space a checkpoint needs; other
    errors pass through (the caller re-raises them)."""
    if not is_disk_full(exc):
        return
    partial = sum(f.stat().st_size for f in path.parent.iterdir() if f.is_file())
    free = shutil.disk_usage(path.parent).free + partial  # once the partial write is removed
    need = checkpoint_bytes(checkpointer)
    raise DiskFullError(
        f"disk full writing checkpoint file {path}: {free} bytes free, a checkpoint needs about "
        f"{need} bytes; free space and resume with --resume (the last committed checkpoint is "
        "intact)"
    ) from None
