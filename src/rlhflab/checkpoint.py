"""Atomic checkpoints, verified loading and exact resume.

A checkpoint is a directory `<run_dir>/checkpoints/step-<NNNNNNNN>/`:

    model.safetensors          weights of every trained module (`<name>.safetensors`)
    optimizer.safetensors      optimizer tensors (`<name>.safetensors`: exp_avg, exp_avg_sq, step)
    rng.safetensors            torch CPU / CUDA RNG states and the trainer's torch.Generators
    state.json                 step, optimizer param groups, LR-scheduler state, python and numpy
                               RNG states, the trainer's data position and counters, byte offsets
                               of metrics.jsonl / samples.jsonl, the resolved config
    manifest.json              every file's size and sha256, library and torch versions, config hash
    COMMITTED                  written last: the sha256 of manifest.json

Writing: everything goes into `checkpoints/.tmp-step-<N>-<pid>/`, each file fsynced, the directory
renamed to `step-<N>` only after `COMMITTED` is on disk. A crash at any moment leaves either the
complete checkpoint or a `.tmp-*` directory that loading ignores (and the next save removes).
Tensors are safetensors; everything else is JSON. There is no pickle anywhere, so loading a
checkpoint cannot execute code.

Loading (`load_checkpoint`) verifies COMMITTED, the manifest's hash, and every file's size and
sha256 before anything is restored; any mismatch is a `CheckpointError` naming the file.

Retention (`keep_last`) runs only after a commit and never deletes the newest committed checkpoint
nor the one this run resumed from. After resuming from an older checkpoint, the first commit also
removes the checkpoints of later steps (an abandoned timeline). A deleted checkpoint loses its COMMITTED marker first, so a
half-deleted directory is never taken for a complete one.

Resume exactness: restoring model, optimizer, scheduler, every RNG stream, data position and
counters makes the continuation of a run compute bit for bit what the uninterrupted run computes
(CPU, fp32, same thread count) — tested by killing runs with SIGKILL at chosen steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from rlhflab import faults
from rlhflab.errors import CheckpointError, ConfigError, Interrupted
from rlhflab.runs import redact, write_json_atomic

CHECKPOINTS = "checkpoints"
COMMITTED = "COMMITTED"
MANIFEST = "manifest.json"
STATE = "state.json"
FORMAT_VERSION = 1
_PREFIX = "step-"

#: Config keys whose change does not alter what training computes: allowed on resume.
HARMLESS_KEYS = (
    "tracking.",
    "health.",
    "eval.",
    "checkpoint.",
    "run.resume",
    "run.allow_config_change",
    "run.save_model",
    "run.root",
    "precision.threads",
    "train.max_seconds",
)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


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


def _versions() -> dict[str, str]:
    import transformers

    from rlhflab import __version__

    return {
        "rlhflab": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


# ---------------------------------------------------------------------------------------------
# State of optimizers, schedulers and RNGs as (tensors, JSON)
# ---------------------------------------------------------------------------------------------


def _optimizer_state(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _load_optimizer_state(
    opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict
) -> None:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    for key, v in meta["scalars"].items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    opt.load_state_dict({"state": state, "param_groups": groups})


def _json_safe(value: Any) -> Any:
    """Scheduler state dicts hold numbers, bools, lists and None; reject anything else."""
    json.dumps(value)
    return value


def python_rng_state(rng: random.Random | None = None) -> list:
    """`random.getstate()` (of `rng`, or the global generator) as JSON."""
    version, internal, gauss = (rng or random).getstate()
    return [version, list(internal), gauss]


def set_python_rng_state(state: list, rng: random.Random | None = None) -> None:
    """Inverse of `python_rng_state`: restore `rng` (or the global generator) from its JSON."""
    version, internal, gauss = state
    (rng or random).setstate((version, tuple(internal), gauss))


def _numpy_rng_state() -> list:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def _set_numpy_rng_state(state: list) -> None:
    name, keys, pos, has_gauss, cached = state
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


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


def _step_of(path: Path) -> int | None:
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
    found = [p for p in root.iterdir() if _step_of(p) is not None and (p / COMMITTED).is_file()]
    return sorted(found, key=lambda p: _step_of(p))


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
    state = json.loads((path / STATE).read_text())
    return Checkpoint(path=path, step=int(state["step"]), state=state, manifest=manifest)


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
                if run.is_dir() and run.name.startswith(f"{name}-"):
                    _inside(run, root_p, "run.resume")
                    for ck in committed_checkpoints(run):
                        candidates.append((ck.stat().st_mtime, _step_of(ck), ck))
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
    if _step_of(path) is not None and path.parent.name == CHECKPOINTS:
        return load_checkpoint(path)
    found = committed_checkpoints(path)
    if not found:
        raise ConfigError(f"run.resume: {resume} holds no committed checkpoint")
    return load_checkpoint(found[-1])


def check_config_change(ckpt: Checkpoint, config: dict, *, allow: bool) -> list[str]:
    """Keys that matter and changed since the checkpoint; a ConfigError listing them unless
    `allow`."""
    keys = changed_keys(ckpt.state["config"], json.loads(redact(json.dumps(config))))
    if keys and not allow:
        raise ConfigError(
            f"run.resume: config differs from the checkpoint's in {', '.join(keys)} "
            "(pass --allow-config-change to resume anyway)"
        )
    return keys


# ---------------------------------------------------------------------------------------------
# Saving and restoring a trainer's state
# ---------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves and restores everything a trainer's continuation depends on.

    Args:
        run_dir: the run directory (checkpoints go to `<run_dir>/checkpoints/`).
        config: the resolved config as a dict (saved; compared on resume).
        modules / optimizers / schedulers: named objects whose state is saved and restored.
        generators: named `torch.Generator`s (sampling, shuffling streams).
        stateful: named objects with `state() -> dict` (JSON) and `load(dict)`: the data
            stream's position, the NaN guard's counters.
        every: save every N optimizer steps and at the end (0: only on a stop signal).
        keep_last: committed checkpoints kept (the newest and the resumed-from one always are).
        resumed_from: the checkpoint this run resumed from (protected from retention).

    Global RNG streams (python `random`, numpy, torch CPU and CUDA) are always included.
    """

    def __init__(
        self,
        run_dir: Path,
        config: dict,
        *,
        modules: dict[str, torch.nn.Module],
        optimizers: dict[str, torch.optim.Optimizer],
        schedulers: dict[str, Any],
        generators: dict[str, torch.Generator] | None = None,
        stateful: dict[str, Any] | None = None,
        every: int = 0,
        keep_last: int | None = None,
        resumed_from: Checkpoint | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / CHECKPOINTS
        self.config = config
        self.modules = {k: v for k, v in modules.items() if v is not None}
        self.optimizers = {k: v for k, v in optimizers.items() if v is not None}
        self.schedulers = {k: v for k, v in schedulers.items() if v is not None}
        self.generators = generators or {}
        self.stateful = stateful or {}
        self.every = every
        self.keep_last = keep_last
        self.protected = resumed_from.path.name if resumed_from is not None else None
        self.files_written = 0  # counter for the checkpoint_file fault point
        self.last_saved: int | None = None

    def due(self, step: int) -> bool:
        """A periodic checkpoint is due after optimizer step `step`."""
        return bool(self.every) and step % self.every == 0

    # -- save ---------------------------------------------------------------------------------
    def _write(self, tmp: Path, name: str, write) -> None:
        path = tmp / name
        write(path)
        _fsync(path)
        self.files_written += 1
        faults.hit("checkpoint_file", self.files_written)

    def save(self, step: int, state: dict) -> Path:
        """Write a committed checkpoint of `step` with the trainer's JSON `state`; returns its path.

        Tracker files (metrics.jsonl, samples.jsonl) must be flushed before the call: their sizes
        are recorded so that a resumed run continues them from exactly this point.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        final = self.root / f"{_PREFIX}{step:08d}"
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            for name, module in self.modules.items():
                self._write(tmp, f"{name}.safetensors", lambda p, m=module: save_model(m, str(p)))
            opt_meta = {}
            for name, opt in self.optimizers.items():
                tensors, opt_meta[name] = _optimizer_state(opt)
                self._write(tmp, f"{name}.safetensors", lambda p, t=tensors: save_file(t, str(p)))
            rng = {"torch_cpu": torch.get_rng_state()}
            if torch.cuda.is_available():
                for i, s in enumerate(torch.cuda.get_rng_state_all()):
                    rng[f"torch_cuda_{i}"] = s
            for name, g in self.generators.items():
                rng[f"generator.{name}"] = g.get_state()
            self._write(tmp, "rng.safetensors", lambda p: save_file(rng, str(p)))
            offsets = {
                f.name: f.stat().st_size
                for f in (self.run_dir / "metrics.jsonl", self.run_dir / "samples.jsonl")
                if f.exists()
            }
            full_state = {
                "step": step,
                "trainer": state,
                "optimizers": opt_meta,
                "schedulers": {k: _json_safe(s.state_dict()) for k, s in self.schedulers.items()},
                "python_rng": python_rng_state(),
                "numpy_rng": _numpy_rng_state(),
                "stateful": {k: obj.state() for k, obj in self.stateful.items()},
                "file_offsets": offsets,
                "config": self.config,
            }
            self._write(tmp, STATE, lambda p: p.write_text(redact(json.dumps(full_state))))
            files = {
                p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(tmp.iterdir())
            }
            manifest = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "files": files,
                "versions": _versions(),
                "config_hash": config_hash(self.config),
            }
            self._write(tmp, MANIFEST, lambda p: write_json_atomic(p, manifest))
            digest = sha256_file(tmp / MANIFEST)
            self._write(tmp, COMMITTED, lambda p: p.write_text(digest + "\n"))
            _fsync(tmp)
            if final.exists():  # a step re-done after resuming from an older checkpoint
                _remove(final)
            os.rename(tmp, final)
            _fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.last_saved = step
        self._retain(final)
        return final

    def end_step(self, step: int, stop: StopSignals, state_fn, on_stop=(), halt=None) -> None:
        """The end of optimizer step `step`: a periodic checkpoint when due; after a stop signal
        a checkpoint, then `on_stop` callables (close the tracker...) and `Interrupted`. `halt`
        (an exception with a `checkpoint` attribute, e.g. a failed health check under
        `health.on_fail: stop`) is raised the same way, after a committed checkpoint."""
        saved = None
        if self.due(step) or stop.requested or halt is not None:
            saved = self.save(step, state_fn())
        if stop.requested or halt is not None:
            for close in on_stop:
                close()
            if stop.requested:
                raise Interrupted(stop.requested, step, saved)
            halt.checkpoint = saved
            raise halt
        faults.hit("step_end", step)

    def finish(self, step: int, state: dict) -> None:
        """The checkpoint at the end of training (skipped when `step` was just saved, and with
        `every` = 0: then only a stop signal or a health stop writes one)."""
        if step > 0 and self.every and self.last_saved != step:
            self.save(step, state)

    def _retain(self, newest: Path) -> None:
        committed = committed_checkpoints(self.run_dir)
        # Checkpoints of later steps than the one just written belong to a timeline abandoned by
        # resuming from an older checkpoint: metrics.jsonl no longer matches them.
        stale = [p for p in committed if _step_of(p) > _step_of(newest)]
        for p in stale:
            _remove(p)
        committed = [p for p in committed if p not in stale]
        if not self.keep_last:
            return
        keep = {p.name for p in committed[-self.keep_last :]} | {newest.name}
        if self.protected:
            keep.add(self.protected)
        for p in committed:
            if p.name not in keep:
                _remove(p)

    # -- restore ------------------------------------------------------------------------------
    def restore(self, ckpt: Checkpoint) -> dict:
        """Load every module, optimizer, scheduler and RNG stream from a verified checkpoint;
        truncate metrics.jsonl / samples.jsonl to their sizes at that step. Returns the
        trainer's JSON state."""
        path = ckpt.path
        try:
            for name, module in self.modules.items():
                load_model(module, str(path / f"{name}.safetensors"), strict=True)
            for name, opt in self.optimizers.items():
                tensors = load_file(str(path / f"{name}.safetensors"))
                _load_optimizer_state(opt, tensors, ckpt.state["optimizers"][name])
            for name, sched in self.schedulers.items():
                sched.load_state_dict(ckpt.state["schedulers"][name])
            rng = load_file(str(path / "rng.safetensors"))
        except (KeyError, RuntimeError, ValueError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(f"checkpoint {path}: does not fit this run: {msg}") from None
        torch.set_rng_state(rng["torch_cpu"])
        if torch.cuda.is_available():
            states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
            if states:
                torch.cuda.set_rng_state_all(states)
        for name, g in self.generators.items():
            g.set_state(rng[f"generator.{name}"])
        set_python_rng_state(ckpt.state["python_rng"])
        _set_numpy_rng_state(ckpt.state["numpy_rng"])
        for name, obj in self.stateful.items():
            if name in ckpt.state["stateful"] or not getattr(obj, "state_optional", False):
                obj.load(ckpt.state["stateful"][name])
        for fname, size in ckpt.state["file_offsets"].items():
            f = self.run_dir / fname
            if f.exists() and f.stat().st_size > size:
                with f.open("r+b") as fh:
                    fh.truncate(size)
        for fname in ("metrics.jsonl", "samples.jsonl"):  # written after the checkpoint only
            if fname not in ckpt.state["file_offsets"] and (self.run_dir / fname).exists():
                (self.run_dir / fname).unlink()
        return ckpt.state["trainer"]

    def resume(self, ckpt: Checkpoint, tracker, total_steps: int) -> dict:
        """`restore`, then say so on the console and move the progress bar to the step."""
        state = self.restore(ckpt)
        tracker.print(f"resumed from {ckpt.path} (step {ckpt.step} of {total_steps})")
        tracker.advance(ckpt.step, {})
        return state


def _remove(path: Path) -> None:
    """Delete a checkpoint directory: its COMMITTED marker first, so that a half-deleted
    directory is never taken for a complete checkpoint."""
    (path / COMMITTED).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Stop signals
# ---------------------------------------------------------------------------------------------


class StopSignals:
    """Context manager: SIGTERM and SIGINT set `requested` (the signal number) instead of killing
    the process, so the trainer can finish the current step and write a checkpoint. A second
    signal while the first is handled raises KeyboardInterrupt (abandon at once). Handlers are only
    installed in the main thread; the previous handlers are restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum

    def __enter__(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
