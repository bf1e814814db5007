"""`Checkpointer`: writes a trainer's state as an atomic checkpoint and restores it for an exact
resume (the format is `rlhflab.checkpoint.format`'s; see `rlhflab.checkpoint` for the guarantees).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from rlhflab import distributed, faults
from rlhflab.checkpoint.config_diff import config_hash, record_config_change
from rlhflab.checkpoint.disk import raise_if_disk_full
from rlhflab.checkpoint.format import (
    _PREFIX,
    _PT,
    CHECKPOINTS,
    COMMITTED,
    FORMAT_VERSION,
    MANIFEST,
    STATE,
    Checkpoint,
    _fsync,
    _remove,
    _versions,
    committed_checkpoints,
    drop_later_checkpoints,
    sha256_file,
    stamp,
    step_of,
)
from rlhflab.checkpoint.hf_files import write_hf_files
from rlhflab.checkpoint.resume import provenance_note, version_note
from rlhflab.checkpoint.sharded import (
    TensorReader,
    index_name,
    load_module,
    merge_index,
    module_pieces,
    optimizer_pieces,
    optimizer_tensors,
    shard_file_name,
    write_rank_file,
)
from rlhflab.checkpoint.signals import StopSignals
from rlhflab.checkpoint.state import (
    _json_safe,
    _load_optimizer_state,
    _optimizer_state,
    decode_tensors,
    encode_tensors,
    rng_state,
    set_rng_state,
)
from rlhflab.errors import CheckpointError, Interrupted
from rlhflab.models.lora import is_lora, load_trainable_state, trainable_state
from rlhflab.rundir import run_id
from rlhflab.serialize import encode_nonfinite, match_umask, redact_json, write_json_atomic


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
    Every file carries the run's id (`rlhflab.rundir.run_id`, written on construction when the
    run directory has none) and the step (`rlhflab.checkpoint.format.stamp`). A collective
    under torchrun: every rank constructs it.
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
        self.run_id: str = distributed.main_then_share(lambda: run_id(self.run_dir, create=True))

    def due(self, step: int) -> bool:
        """A periodic checkpoint is due after optimizer step `step`."""
        return bool(self.every) and step % self.every == 0

    # -- save ---------------------------------------------------------------------------------
    def _write(self, tmp: Path, name: str, write) -> None:
        path = tmp / name
        try:
            write(path)
            match_umask(path)  # safetensors writes 0600; the group reads checkpoints too
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
        # Collectives first (every rank): LoRA adapters gathered to rank 0, RNG states of all
        # ranks; FSDP2-sharded modules and their optimizers: each rank writes its own shards.
        split = {k for k, m in self.modules.items() if _split(m)}
        split_opts = {k for k in self.optimizers if _split(self._module_of(k))}
        full_models = {
            k: distributed.full_model_state(m) for k, m in self.modules.items() if k not in split
        }
        full_optims = {
            k: distributed.full_optimizer_state(self._module_of(k), o)
            for k, o in self.optimizers.items()
            if k not in split_opts
        }
        ranks = distributed.all_gather_object(rng_state(self.generators))
        tmp, shards = None, None
        if split or split_opts:
            tmp, shards = self._save_shards(final, split, split_opts, step)
        if not distributed.is_main():
            distributed.barrier()  # rank 0 commits
            self.last_saved = step
            return final
        try:
            self._save_main(step, state, final, full_models, full_optims, ranks, tmp, shards)
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

    def _new_tmp(self, final: Path) -> Path:
        """Rank 0: a fresh temporary directory for the checkpoint `final`, stale ones removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        tmp.mkdir()
        return tmp

    def _save_shards(self, final: Path, split: set[str], split_opts: set[str], step: int):
        """Every rank writes its own shards of the sharded modules (`split`) and of their
        optimizers' state into the temporary directory rank 0 made (`rlhflab.checkpoint.sharded`
        files), fsynced and hashed by the rank that wrote them. A collective. Returns (the
        temporary directory, {name: (optimizer JSON or None, [per-rank {"entries", "files"}])}).
        A rank's failure reaches every rank: the rank raises its error, the others a
        CheckpointError naming it, and rank 0 removes the directory."""
        tmp = Path(distributed.main_then_share(lambda: str(self._new_tmp(final))))
        r, w = distributed.rank(), distributed.world_size()
        report, error = {}, None
        try:
            for name in sorted(split | split_opts):
                meta = None
                if name in split:
                    pieces = module_pieces(self.modules[name])
                else:
                    pieces, meta = optimizer_pieces(self.optimizers[name])
                fname = shard_file_name(name, r, w)
                entries = {}

                def fill(p, pieces=pieces, entries=entries):
                    entries.update(write_rank_file(p, pieces, stamp(self.run_id, step)))

                self._write(tmp, fname, fill)
                f = tmp / fname
                files = {fname: {"size": f.stat().st_size, "sha256": sha256_file(f)}}
                report[name] = (meta, {"entries": entries, "files": files})
        except Exception as exc:  # every rank learns it before the next collective
            error = exc
        outcome = ("error", f"{type(error).__name__}: {error}") if error else ("ok", report)
        outcomes = distributed.all_gather_object(outcome)
        failed = [(i, o[1]) for i, o in enumerate(outcomes) if o[0] == "error"]
        if failed:
            if distributed.is_main():
                shutil.rmtree(tmp, ignore_errors=True)
            if error is not None:
                raise error
            i, msg = failed[0]
            raise CheckpointError(f"checkpoint {final}: rank {i} failed writing its shards: {msg}")
        shards = {name: (report[name][0], [o[1][name][1] for o in outcomes]) for name in report}
        for name, (meta, _) in shards.items():  # rank-local state: every rank's description
            if meta is not None and "rank_local" in meta:
                meta["quantized"] = {k: v for o in outcomes for k, v in
                                     o[1][name][0]["quantized"].items()}  # fmt: skip
        return tmp, shards

    def _save_main(
        self, step, state, final, full_models, full_optims, ranks, tmp=None, shards=None
    ) -> None:
        if tmp is None:
            tmp = self._new_tmp(final)
        shards = shards or {}
        meta = stamp(self.run_id, step)  # every tensor file's header: run id and step
        pt = {**_PT, **meta}
        hashed = {}  # the shard files, hashed by the ranks that wrote them
        try:
            w = distributed.world_size()
            for name, (_, parts) in shards.items():
                index = merge_index(
                    name, w, [p["entries"] for p in parts], run_id=self.run_id, step=step
                )
                text = json.dumps(index, indent=1)
                self._write(tmp, index_name(name), lambda p, t=text: p.write_text(t))
                for part in parts:
                    hashed.update(part["files"])
            unseen = sorted(f for f in hashed if not (tmp / f).is_file())
            if unseen:  # written by a rank on another node, to a directory rank 0 cannot see
                raise CheckpointError(
                    f"checkpoint {final}: {unseen[0]} written by another rank is not visible "
                    "to rank 0: put run.root on a file system every node shares"
                )
            for name, module in self.modules.items():
                if name in shards:
                    continue
                full = full_models[name]
                if is_lora(module):  # the adapters (and a head trained beside them) only
                    tensors = trainable_state(module, full)
                    write = lambda p, t=tensors: save_file(t, str(p), metadata=pt)  # noqa: E731
                elif full is None:
                    write = lambda p, m=module: save_model(m, str(p), metadata=pt)  # noqa: E731
                else:
                    write = lambda p, t=full: save_file(t, str(p), metadata=pt)  # noqa: E731
                self._write(tmp, f"{name}.safetensors", write)
            write_hf_files(
                self.modules.get("model"),
                self.tokenizer,
                lambda name, fn: self._write(tmp, name, fn),
                self.root / f".tmp-staging-{os.getpid()}",
                full_models.get("model"),
            )
            opt_meta = {}
            for name, opt in self.optimizers.items():
                if name in shards:
                    opt_meta[name] = shards[name][0]
                    continue
                tensors, opt_meta[name] = _optimizer_state(opt, full_optims[name])
                self._write(
                    tmp, f"{name}.safetensors", lambda p, t=tensors: save_file(t, str(p), meta)
                )
            rng = dict(ranks[0]["tensors"])
            for r, st in enumerate(ranks[1:], start=1):
                rng.update({f"rank{r}.{k}": v for k, v in st["tensors"].items()})
            self._write(tmp, "rng.safetensors", lambda p: save_file(rng, str(p), meta))
            offsets = {
                f.name: f.stat().st_size
                for f in (self.run_dir / "metrics.jsonl", self.run_dir / "samples.jsonl")
                if f.exists()
            }
            full_state = {
                "step": step,
                "trainer": state,
                "optimizers": opt_meta,
                "schedulers": {
                    k: _json_safe(encode_tensors(s.state_dict()))
                    for k, s in self.schedulers.items()
                },
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
                p.name: hashed.get(p.name) or {"size": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(tmp.iterdir())
            }
            manifest = {
                "format_version": FORMAT_VERSION,
                "run_id": self.run_id,
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

    def end_step(self, step: int, stop: StopSignals, state_fn, on_stop=(), halt=None) -> None:
        """The end of optimizer step `step`: a periodic checkpoint when due; after a stop signal
        a checkpoint, then `on_stop` callables (close the tracker...) and `Interrupted`. `halt`
        (an exception with a `checkpoint` attribute, e.g. a failed health check under
        `health.on_fail: stop`) is raised the same way, after a committed checkpoint."""
        saved = None
        # A signal may reach the ranks during different steps, and a health stop may be decided
        # on one rank only (checks of local shards): the ranks agree here, so every rank
        # checkpoints and stops after the same step.
        # Every rank acts on `signal` (the same on all). A signal that reaches this rank while
        # the collective runs is recorded by the handler in `stop.requested` after the flag was
        # read: it is never overwritten with the stale answer, so the next step's agreement sees
        # it (overwriting it lost a SIGTERM that torchrun forwarded, and the workers trained on).
        signal = distributed.any_rank(stop.requested)
        if signal:
            stop.requested = signal
        if distributed.any_rank(halt is not None) and halt is None:
            from rlhflab.errors import HealthStop

            halt = HealthStop("on another rank", step, "another data-parallel rank stopped")
        if self.due(step) or signal or halt is not None:
            saved = self.save(step, state_fn())
        if signal or halt is not None:
            for close in on_stop:
                close()
            if signal:
                raise Interrupted(signal, step, saved)
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
        stale = [p for p in committed if step_of(p) > step_of(newest)]
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
        # Another world size: model and optimizer state are read as slices of the saved global
        # tensors whatever the layout; the random streams of rank 0 go to every rank (the
        # trainers' generators are seeded alike and advance in step on every rank).
        same_world = ckpt.state.get("world_size", 1) == distributed.world_size()
        try:
            for name, module in self.modules.items():
                if is_lora(module):  # the base is rebuilt from the config; adapters load here
                    load_trainable_state(module, load_file(str(path / f"{name}.safetensors")))
                elif _split(module) or (path / index_name(name)).is_file():
                    with TensorReader(path, name) as reader:  # this rank's slices only
                        load_module(module, reader)
                else:
                    load_model(module, str(path / f"{name}.safetensors"), strict=True)
            for name, opt in self.optimizers.items():
                meta = ckpt.state["optimizers"][name]
                if _split(self._module_of(name)) or (path / index_name(name)).is_file():
                    with TensorReader(path, name) as reader:
                        _load_optimizer_state(opt, optimizer_tensors(opt, reader), meta)
                    continue
                tensors = load_file(str(path / f"{name}.safetensors"))
                _load_optimizer_state(opt, tensors, meta, self._module_of(name))
            for name, sched in self.schedulers.items():
                sched.load_state_dict(decode_tensors(ckpt.state["schedulers"][name]))
            rng = load_file(str(path / "rng.safetensors"))
        except (KeyError, IndexError, RuntimeError, ValueError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(f"checkpoint {path}: does not fit this run: {msg}") from None
        r = distributed.rank() if same_world else 0
        if r > 0:  # this rank's own streams
            prefix = f"rank{r}."
            rng = {k[len(prefix) :]: v for k, v in rng.items() if k.startswith(prefix)}
            py, npy = (
                ckpt.state["rank_rngs"][r - 1]["python"],
                ckpt.state["rank_rngs"][r - 1]["numpy"],
            )
        else:
            py, npy = ckpt.state["python_rng"], ckpt.state["numpy_rng"]
        set_rng_state(rng, self.generators, py, npy)
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
        if distributed.is_main():
            record_config_change(self.run_dir, ckpt, self.config)
        saved_world = ckpt.state.get("world_size", 1)
        if saved_world != distributed.world_size():
            tracker.print(
                f"resuming a checkpoint of {saved_world} rank(s) with "
                f"{distributed.world_size()}: every rank starts from rank 0's random streams"
            )
        for note in (version_note(ckpt), provenance_note(ckpt)):
            if note:
                warnings.warn(note, stacklevel=2)
                tracker.print(note)
        tracker.print(f"resumed from {ckpt.path} (step {ckpt.step} of {total_steps})")
        tracker.advance(ckpt.step, {})
        return state


def _split(module: torch.nn.Module | None) -> bool:
    """Checkpointed as per-rank shards: an FSDP2-sharded module other than a LoRA model (whose
    checkpoint, the adapters alone, is small and stays gathered on rank 0, a peft directory)."""
    return module is not None and distributed.is_sharded(module) and not is_lora(module)
