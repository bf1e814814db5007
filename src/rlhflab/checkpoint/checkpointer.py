"""Atomic checkpoints, verified loading and exact resume.

A checkpoint is a directory `<run_dir>/checkpoints/step-<NNNNNNNN>/`:

    model.safetensors          weights of every trained module (`<name>.safetensors`); of a LoRA
                               model only its trainable tensors (adapters, a head), the frozen base
                               being rebuilt from the config (`rlhflab.models.lora`)
    optimizer.safetensors      optimizer tensors (`<name>.safetensors`: exp_avg, exp_avg_sq, step)
    rng.safetensors            torch CPU / CUDA RNG states and the trainer's torch.Generators
    state.json                 step, optimizer param groups, LR-scheduler state, python and numpy
                               RNG states, the trainer's data position and counters, byte offsets
                               of metrics.jsonl / samples.jsonl, the resolved config
    config.json                the model's transformers config (`architectures` names its class)
    generation_config.json     its generation config (models that generate)
    tokenizer files            tokenizer.json, tokenizer_config.json, ... (when the trainer has one)
    manifest.json              every file's size and sha256, library and torch versions, config hash
    COMMITTED                  written last: the sha256 of manifest.json

The module named "model" is written as `model.safetensors` with the state-dict names
`save_pretrained` uses, next to its config, generation config and tokenizer, so every step
directory is also a Hugging Face model directory: `AutoModelForCausalLM.from_pretrained(
"<run>/checkpoints/step-N")` loads a policy (SFT, policy-gradient, direct-alignment runs) and
`AutoModelForSequenceClassification.from_pretrained(...)` a reward model, without rlhflab. These
files are listed in the manifest like every other, so they are verified on load; resuming reads
only the safetensors and JSON state, never them.

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

Under torchrun (N data-parallel ranks) the same files, the same guarantees: every rank takes part
in a save, rank 0 alone writes. Model and optimizer state are *gathered full state dicts*
(`rlhflab.distributed.full_model_state` / `full_optimizer_state`), not sharded
torch.distributed.checkpoint (DCP) files: DCP's metadata file is a pickle, which would break the
promise that loading a checkpoint cannot execute code, and a full state dict is the same file
whatever the world size or strategy, so the manifest, the sha256 checks and the final HF model stay
as they are. The price is that rank 0 holds one full copy of the model and optimizer state in CPU
memory while it writes (16 bytes per parameter with AdamW in fp32). Each rank's RNG streams are
saved (`rng.safetensors` keys `rank<r>.` for r >= 1; python / numpy states in state.json); the data
position and counters are global (the same on every rank). Resuming with another world size is
refused with both sizes named: the per-rank RNG streams would not map onto the new ranks.
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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from safetensors.torch import load_file, load_model, save_file, save_model

from rlhflab import distributed, faults
from rlhflab.errors import CheckpointError, ConfigError, DiskFullError, Interrupted
from rlhflab.models.lora import is_lora, load_trainable_state, trainable_state
from rlhflab.serialize import (
    decode_nonfinite,
    encode_nonfinite,
    is_run_of,
    redact_json,
    redact_obj,
    write_json_atomic,
)

CHECKPOINTS = "checkpoints"
COMMITTED = "COMMITTED"
MANIFEST = "manifest.json"
STATE = "state.json"
FORMAT_VERSION = 1
_PREFIX = "step-"
_PT = {"format": "pt"}  # the safetensors metadata transformers' from_pretrained expects

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


def _optimizer_state(
    opt: torch.optim.Optimizer, full: dict | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, JSON) of an optimizer's state dict (`full`: one gathered from shards)."""
    sd = full if full is not None else opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                tensors[f"{idx}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _load_optimizer_state(
    opt: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    meta: dict,
    module: torch.nn.Module | None = None,
) -> None:
    """Inverse of `_optimizer_state`; `module` is the model the optimizer trains (needed when it
    is sharded: the full state is scattered to this rank's shards)."""
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
    if module is not None and distributed.is_sharded(module):
        distributed.load_full_optimizer_state(module, opt, {"state": state, "param_groups": groups})
        return
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
    state = check_state_schema(
        path, json.loads((path / STATE).read_text(), object_hook=decode_nonfinite)
    )
    return Checkpoint(path=path, step=int(state["step"]), state=state, manifest=manifest)


class _StateSchema(BaseModel):
    """What every state.json holds (a trainer's own keys live under `trainer`)."""

    model_config = ConfigDict(extra="forbid")

    step: StrictInt = Field(ge=0)
    trainer: dict[str, Any]
    optimizers: dict[str, dict[str, Any]]
    schedulers: dict[str, dict[str, Any]]
    python_rng: list[Any] = Field(min_length=3, max_length=3)
    numpy_rng: list[Any] = Field(min_length=5, max_length=5)
    stateful: dict[str, dict[str, Any]]
    file_offsets: dict[str, StrictInt]
    config: dict[str, Any]
    world_size: StrictInt = Field(1, ge=1)  # data-parallel ranks that wrote it
    rank_rngs: list[dict[str, Any]] = Field(default_factory=list)  # ranks 1.. (python, numpy)


def check_state_schema(path: Path, state: Any) -> dict:
    """`state` (a checkpoint's state.json) if it has the keys and types every checkpoint has.

    Raises:
        CheckpointError: naming the checkpoint, the key at fault and what is wrong.
    """
    try:
        _StateSchema.model_validate(state)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "top level"
        raise CheckpointError(f"checkpoint {path}: {STATE} {where}: {first['msg']}") from None
    return state


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
        tokenizer: saved beside the weights (with the config of the module named "model"), so
            that a checkpoint directory loads with transformers' `from_pretrained`.

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
        tokenizer: Any = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.tokenizer = tokenizer
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
        try:
            write(path)
            _fsync(path)
            self.files_written += 1
            faults.hit("checkpoint_file", self.files_written)
        except Exception as exc:  # safetensors reports a full disk as its own error type
            raise_if_disk_full(exc, path, self)
            raise

    def save(self, step: int, state: dict) -> Path:
        """Write a committed checkpoint of `step` with the trainer's JSON `state`; returns its path.

        Tracker files (metrics.jsonl, samples.jsonl) must be flushed before the call: their sizes
        are recorded so that a resumed run continues them from exactly this point.
        """
        final = self.root / f"{_PREFIX}{step:08d}"
        # Collectives first (every rank): sharded state gathered to rank 0, RNG states of all ranks.
        full_models = {k: distributed.full_model_state(m) for k, m in self.modules.items()}
        full_optims = {
            k: distributed.full_optimizer_state(self._module_of(k), o)
            for k, o in self.optimizers.items()
        }
        ranks = distributed.all_gather_object(self._rng_state())
        if not distributed.is_main():
            distributed.barrier()  # rank 0 commits
            self.last_saved = step
            return final
        try:
            self._save_main(step, state, final, full_models, full_optims, ranks)
        finally:
            distributed.barrier()
        self.last_saved = step
        self._retain(final)
        return final

    def _module_of(self, optimizer_name: str) -> torch.nn.Module | None:
        """The module whose parameters the named optimizer updates (None: none of them), needed
        to gather or scatter its state when the module is sharded."""
        params = {id(p) for g in self.optimizers[optimizer_name].param_groups for p in g["params"]}
        for module in self.modules.values():
            if any(id(p) in params for p in module.parameters()):
                return module
        return None

    def _rng_state(self) -> dict:
        """This rank's RNG streams: tensors and JSON."""
        tensors = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, st in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"torch_cuda_{i}"] = st
        for name, g in self.generators.items():
            tensors[f"generator.{name}"] = g.get_state()
        return {"tensors": tensors, "python": python_rng_state(), "numpy": _numpy_rng_state()}

    def _save_main(self, step, state, final, full_models, full_optims, ranks) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        try:
            for name, module in self.modules.items():
                full = full_models[name]
                if is_lora(module):  # the adapters (and a head trained beside them) only
                    tensors = trainable_state(module, full)
                    write = lambda p, t=tensors: save_file(t, str(p), metadata=_PT)  # noqa: E731
                elif full is None:
                    write = lambda p, m=module: save_model(m, str(p), metadata=_PT)  # noqa: E731
                else:
                    write = lambda p, t=full: save_file(t, str(p), metadata=_PT)  # noqa: E731
                self._write(tmp, f"{name}.safetensors", write)
            self._write_hf_files(tmp, full_models.get("model"))
            opt_meta = {}
            for name, opt in self.optimizers.items():
                tensors, opt_meta[name] = _optimizer_state(opt, full_optims[name])
                self._write(tmp, f"{name}.safetensors", lambda p, t=tensors: save_file(t, str(p)))
            rng = dict(ranks[0]["tensors"])
            for r, st in enumerate(ranks[1:], start=1):
                rng.update({f"rank{r}.{k}": v for k, v in st["tensors"].items()})
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
                "python_rng": ranks[0]["python"],
                "numpy_rng": ranks[0]["numpy"],
                "world_size": len(ranks),
                "rank_rngs": [{"python": r["python"], "numpy": r["numpy"]} for r in ranks[1:]],
                "stateful": {k: obj.state() for k, obj in self.stateful.items()},
                "file_offsets": offsets,
                "config": self.config,
            }
            # NaN / inf (a skipped step's loss) are tagged, not nulled: resuming restores them
            text = redact_json(encode_nonfinite(full_state))
            self._write(tmp, STATE, lambda p: p.write_text(text))
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

    def _write_hf_files(self, tmp: Path, full: dict[str, torch.Tensor] | None = None) -> None:
        """The files that make the checkpoint directory loadable without rlhflab, each written
        and fsynced like the tensors: for a full model, config.json, generation_config.json and
        the tokenizer's files (a `from_pretrained` directory); for a LoRA model, whose
        model.safetensors holds only the adapters, peft's adapter_config.json and
        adapter_model.safetensors and the tokenizer (a `PeftModel.from_pretrained(base, dir)`
        directory) — never a config.json that would load the base with missing weights.
        `full`: the model's gathered state dict under FSDP2 (None: the module's own)."""
        model = self.modules.get("model")
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "to_json_file"):
            return
        if is_lora(model):
            if self.tokenizer is not None:
                from rlhflab.models.lora import save_adapter

                self._write_dir(tmp, lambda d: save_adapter(model, self.tokenizer, d, full))
            return
        cls = type(model).__name__  # FSDP2 renames a sharded module's class FSDP<name>
        if distributed.is_sharded(model):
            cls = cls.removeprefix("FSDP")
        config.architectures = [cls]  # what save_pretrained records
        self._write(tmp, "config.json", lambda p: config.to_json_file(str(p)))
        gen = getattr(model, "generation_config", None)
        if gen is not None and model.can_generate():
            self._write(tmp, "generation_config.json", lambda p: gen.to_json_file(str(p)))
        if self.tokenizer is not None:
            self._write_dir(tmp, lambda d: self.tokenizer.save_pretrained(str(d)))

    def _write_dir(self, tmp: Path, fill) -> None:
        """Let `fill(directory)` write files (a library's save_pretrained) into a staging
        directory, then move each into the checkpoint through `_write` (fsynced, in the
        manifest)."""
        staging = self.root / f".tmp-staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            fill(staging)
            for f in sorted(staging.iterdir()):
                if f.is_file():
                    self._write(tmp, f.name, lambda p, src=f: shutil.move(str(src), str(p)))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def end_step(self, step: int, stop: StopSignals, state_fn, on_stop=(), halt=None) -> None:
        """The end of optimizer step `step`: a periodic checkpoint when due; after a stop signal
        a checkpoint, then `on_stop` callables (close the tracker...) and `Interrupted`. `halt`
        (an exception with a `checkpoint` attribute, e.g. a failed health check under
        `health.on_fail: stop`) is raised the same way, after a committed checkpoint."""
        saved = None
        # A signal may reach the ranks during different steps, and a health stop may be decided
        # on one rank only (checks of local shards): the ranks agree here, so every rank
        # checkpoints and stops after the same step.
        stop.requested = distributed.any_rank(stop.requested) or None
        if distributed.any_rank(halt is not None) and halt is None:
            from rlhflab.errors import HealthStop

            halt = HealthStop("on another rank", step, "another data-parallel rank stopped")
        if self.due(step) or stop.requested or halt is not None:
            saved = self.save(step, state_fn())
        if stop.requested or halt is not None:
            for close in on_stop:
                close()
            if stop.requested:
                raise Interrupted(stop.requested, step, saved)
            halt.checkpoint, halt.run_dir = saved, self.run_dir
            raise halt
        faults.hit("step_end", step)

    def finish(self, step: int, state: dict, *, stopped: bool = False) -> None:
        """The checkpoint at the end of training (skipped when `step` was just saved, and with
        `every` = 0: then only a stop signal, a health stop or `stopped` writes one). `stopped`:
        training ended before its last step (`train.max_seconds`), so the run will be resumed
        from here."""
        if step > 0 and (self.every or stopped) and self.last_saved != step:
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
        saved_world = ckpt.state.get("world_size", 1)
        if saved_world != distributed.world_size():
            raise CheckpointError(
                f"checkpoint {path}: written by {saved_world} rank(s), this run has "
                f"{distributed.world_size()}; resume with --nproc-per-node {saved_world}"
            )
        try:
            for name, module in self.modules.items():
                if is_lora(module):  # the base is rebuilt from the config; adapters load here
                    load_trainable_state(module, load_file(str(path / f"{name}.safetensors")))
                elif distributed.is_sharded(module):
                    full = load_file(str(path / f"{name}.safetensors"))
                    distributed.load_full_model_state(module, full)
                else:
                    load_model(module, str(path / f"{name}.safetensors"), strict=True)
            for name, opt in self.optimizers.items():
                tensors = load_file(str(path / f"{name}.safetensors"))
                _load_optimizer_state(
                    opt, tensors, ckpt.state["optimizers"][name], self._module_of(name)
                )
            for name, sched in self.schedulers.items():
                sched.load_state_dict(ckpt.state["schedulers"][name])
            rng = load_file(str(path / "rng.safetensors"))
        except (KeyError, RuntimeError, ValueError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(f"checkpoint {path}: does not fit this run: {msg}") from None
        r = distributed.rank()
        if r > 0:  # this rank's own streams
            prefix = f"rank{r}."
            rng = {k[len(prefix) :]: v for k, v in rng.items() if k.startswith(prefix)}
            py, npy = (
                ckpt.state["rank_rngs"][r - 1]["python"],
                ckpt.state["rank_rngs"][r - 1]["numpy"],
            )
        else:
            py, npy = ckpt.state["python_rng"], ckpt.state["numpy_rng"]
        torch.set_rng_state(rng["torch_cpu"])
        if torch.cuda.is_available():
            states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
            if states:
                torch.cuda.set_rng_state_all(states)
        for name, g in self.generators.items():
            g.set_state(rng[f"generator.{name}"])
        set_python_rng_state(py)
        _set_numpy_rng_state(npy)
        for name, obj in self.stateful.items():
            if name in ckpt.state["stateful"] or not getattr(obj, "state_optional", False):
                obj.load(ckpt.state["stateful"][name])
        if not distributed.is_main():  # rank 0 owns the run directory's files
            return ckpt.state["trainer"]
        drop_later_checkpoints(self.run_dir, ckpt.step)  # before the logs are cut back
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
        from rlhflab.rundir import record_config_change

        if distributed.is_main():
            record_config_change(self.run_dir, ckpt, self.config)
        note = version_note(ckpt)
        if note:
            warnings.warn(note, stacklevel=2)
            tracker.print(note)
        tracker.print(f"resumed from {ckpt.path} (step {ckpt.step} of {total_steps})")
        tracker.advance(ckpt.step, {})
        return state


def drop_later_checkpoints(run_dir: Path, step: int) -> list[Path]:
    """Delete the committed checkpoints of `run_dir` with a step after `step`: resuming from an
    older checkpoint abandons their timeline, and the logs no longer match them. Done on resume,
    before any new step, so a later plain `--resume` follows the resumed timeline. Returns the
    deleted paths."""
    later = [p for p in committed_checkpoints(run_dir) if _step_of(p) > step]
    for p in later:
        _remove(p)
    return later


def checkpoint_bytes(checkpointer: Checkpointer) -> int:
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


def raise_if_disk_full(exc: BaseException, path: Path, checkpointer: Checkpointer) -> None:
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
