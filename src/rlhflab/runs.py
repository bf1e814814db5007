"""The run directory `<root>/<name>-<timestamp>/` and atomic writes of the small files in it.

Layout of a finished run:
    config.yaml          the resolved config (every default written out)
    metrics.jsonl        one JSON object per logged step
    samples.jsonl        prompts, completions and rewards every `tracking.samples_every` steps
    plots/*.png          the main curves
    final_results.json   headline numbers of the run
    model/               the final model and tokenizer in Hugging Face format
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from rlhflab.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


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
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1000):
        path = root / (f"{name}-{stamp}" + (f"-{i}" if i else ""))
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise ConfigError(f"run.root: cannot create a new run directory under {root}")


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync, then rename over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    """`write_text_atomic` of pretty JSON."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


class SampleWriter:
    """Appends rollout samples (prompt, completion, reward, ...) to `samples.jsonl`."""

    def __init__(self, run_dir: Path) -> None:
        self.file = (Path(run_dir) / "samples.jsonl").open("a")

    def write(self, step: int, rows: list[dict]) -> None:
        for row in rows:
            self.file.write(json.dumps({"step": step, **row}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
