"""Config hashing and diffing on resume: which keys matter, what changed, the record of changes.

A resume compares the resolved config with the one in the checkpoint's state.json:

    config_hash(config)                  sha256 of the keys that matter (written in the manifest)
    changed_keys(saved, current)         keys that matter and differ
    check_config_change(ckpt, config)    refuse a resume whose config differs (unless allowed)
    record_config_change(run_dir, ...)   append resumed-with-changes to config_changes.jsonl
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhflab.errors import ConfigError
from rlhflab.serialize import redact_obj, to_json, write_yaml_atomic

if TYPE_CHECKING:
    from rlhflab.checkpoint.format import Checkpoint

#: Config keys whose change does not alter what training computes: allowed on resume.
HARMLESS_KEYS = (
    "tracking.",
    "health.",
    "eval.",
    "checkpoint.",
    "run.resume",
    "run.allow_config_change",
    "run.save_model",
    "model.lora.save",
    "run.root",
    "precision.threads",
    "train.max_seconds",
    "parallel.timeout_s",
    "data.made_by",
    "teacher.allow_same_as_student",  # whether a run starts, not what it computes
)

CONFIG_CHANGES = "config_changes.jsonl"
#: Keys that differ on every resume and are not a change of the run.
_RESUME_KEYS = ("run.resume", "run.allow_config_change")


def flatten_config(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1} (lists and scalars are leaves)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten_config(v, key + "."))
        else:
            out[key] = v
    return out


def _harmless(key: str) -> bool:
    return any(key == h or key.startswith(h) for h in HARMLESS_KEYS)


def config_hash(config: dict) -> str:
    """sha256 of the config keys that matter for what training computes (not HARMLESS_KEYS)."""
    flat = {k: v for k, v in flatten_config(config).items() if not _harmless(k)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


def changed_keys(saved: dict, current: dict) -> list[str]:
    """Dotted keys that matter and differ between two resolved configs."""
    a, b = flatten_config(saved), flatten_config(current)
    return sorted(k for k in set(a) | set(b) if not _harmless(k) and a.get(k) != b.get(k))


def check_config_change(ckpt: Checkpoint, config: dict, *, allow: bool) -> list[str]:
    """Keys that matter and changed since the checkpoint; a ConfigError listing them unless
    `allow`."""
    saved_trainer, trainer = ckpt.state["config"].get("trainer"), config.get("trainer")
    if saved_trainer != trainer:  # not even --allow-config-change: the state does not fit
        raise ConfigError(
            f"run.resume: {ckpt.path} is a checkpoint of a '{saved_trainer}' run; this config "
            f"is a '{trainer}' run (a checkpoint resumes only the trainer that wrote it)"
        )
    keys = changed_keys(ckpt.state["config"], redact_obj(config))
    if keys and not allow:
        raise ConfigError(
            f"run.resume: config differs from the checkpoint's in {', '.join(keys)} "
            "(pass --allow-config-change to resume anyway)"
        )
    return keys


def record_config_change(run_dir: Path, ckpt: Checkpoint, config: dict) -> dict:
    """Compare the resolved `config` (secrets redacted) with the checkpoint's; when they differ,
    append `{"step", "time", "from_checkpoint", "changes": {key: [old, new]}}` to
    config_changes.jsonl and rewrite config.yaml with the new config. Returns the changes."""
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
