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
#: Environment variables whose values are secrets (WANDB_API_KEY, HF_TOKEN, OPENAI_API_KEY, ...).
_SECRET_NAME = re.compile(r"(TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
REDACTED = "***"


def secret_values() -> list[str]:
    """Values of environment variables named like secrets (8+ characters), longest first."""
    values = {v for k, v in os.environ.items() if _SECRET_NAME.search(k) and v and len(v) >= 8}
    return sorted(values, key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with every secret environment value replaced by '***'.

    Everything written into a run directory (config, metrics, samples, results, checkpoint
    state) goes through this, so a token that reached a config value, a prompt or an error
    message never lands on disk.
    """
    for secret in secret_values():
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


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
    """Write `text` (secrets redacted) to a temporary file beside `path`, fsync, then rename
    over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(redact(text))
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
    """Appends rollout samples (prompt, completion, reward, ...) to `samples.jsonl`.

    `enabled=False` (data-parallel ranks other than 0) writes nothing."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.file = (Path(run_dir) / "samples.jsonl").open("a") if enabled else None

    def write(self, step: int, rows: list[dict]) -> None:
        """Append `rows`, each tagged with `step`."""
        if self.file is None:
            return
        for row in rows:
            self.file.write(redact(json.dumps({"step": step, **row})) + "\n")
        self.file.flush()

    def close(self) -> None:
        """Close the file."""
        if self.file is not None:
            self.file.close()
