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
    manifest.json              every file's size and sha256, library and torch versions, config
                               hash, the run's id and the step
    COMMITTED                  written last: the sha256 of manifest.json

The module named "model" is written as `model.safetensors` with the state-dict names
`save_pretrained` uses, next to its config, generation config and tokenizer, so every step
directory (of one process or DDP ranks; FSDP2's are sharded, see below) is also a Hugging Face
model directory: `AutoModelForCausalLM.from_pretrained(
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

Provenance: a recomputed manifest does not make a foreign file pass. The run's id
(`<run_dir>/run_id`, `rlhflab.rundir.run_id`) and the step are in the manifest, in every sharded
index and in the safetensors metadata of every tensor file (`rlhflab.run_id`, `rlhflab.step`);
loading refuses a file whose run or step is not the checkpoint's, and a shard file whose
header (tensor names, shapes, dtypes) is not what its index records; resuming refuses a
checkpoint whose run id is not its run directory's (`check_run`). Checkpoints of format 1
(before run ids) are resumed with a one-line warning, their files checked for everything but
their run and step.

Retention (`keep_last`) runs only after a commit and never deletes the newest committed checkpoint
nor the one this run resumed from. After resuming from an older checkpoint, the first commit also
removes the checkpoints of later steps (an abandoned timeline). A deleted checkpoint loses its COMMITTED marker first, so a
half-deleted directory is never taken for a complete one.

Resume exactness: restoring model, optimizer, scheduler, every RNG stream, data position and
counters makes the continuation of a run compute bit for bit what the uninterrupted run computes
(CPU, fp32, same thread count) — tested by killing runs with SIGKILL at chosen steps.

Under torchrun (N data-parallel ranks) the same guarantees. Every rank takes part in a save.
With `parallel.strategy: ddp` (and for a LoRA model's adapters) rank 0 alone writes the same
files as one process. With `fsdp2` each rank writes only its own shards and rank 0 never holds
the full state: a module's (and its optimizer's) tensors go to per-rank safetensors files
`<name>-rank<r>-of-<N>.safetensors` plus a JSON index `<name>.shards.json` recording each
tensor's global shape and dtype and each piece's global offsets and lengths (what
torch.distributed.checkpoint records; DCP's own metadata file is a pickle, which would break the
promise that loading a checkpoint cannot execute code). Each rank hashes its own files; the
manifest lists them all, and rank 0 commits the directory as above (`rlhflab.checkpoint.sharded`
describes the format). On restore each rank reads, from the files the index names, only the
slices that overlap its own shard. The run directory must be on a file system every rank sees.
Such a step directory is not a `from_pretrained` directory by itself (config and tokenizer are
there, the weights sharded): `read_tensors(step_dir, "model")` consolidates them; the final
model (`<run>/model/`) is gathered once and written as usual.
Each rank's RNG streams are saved (`rng.safetensors` keys `rank<r>.` for r >= 1; python / numpy
states in state.json); the data position and counters are global (the same on every rank).
Resuming with another world size (2 ranks -> 1, 1 -> 2, from sharded or full files) reads each
tensor's slices for the new layout and gives every rank rank 0's RNG streams (the trainers'
generators are seeded alike and advance in step on every rank): the next step computes what the
uninterrupted run computes, to float64 rounding (summation order differs with the layout).

The package, one module per concern (imports run downward, top to bottom):

    checkpointer.py   Checkpointer: save (atomic, every rank), retention, restore, resume
    resume.py         find_resume_checkpoint (`run.resume`), version_note
    disk.py           a full disk during a save: one line with the space needed
    config_diff.py    config_hash, changed_keys, check_config_change, record_config_change
    hf_files.py       config.json, generation config, tokenizer: a from_pretrained directory
    format.py         the files, manifest and COMMITTED marker; load_checkpoint (verified)
    state.py          optimizer and RNG state as (tensors, JSON); the schema of state.json
    sharded.py        per-rank shard files and their JSON index (fsdp2); TensorReader, read_tensors
    signals.py        StopSignals (SIGTERM / SIGINT: finish the step, checkpoint, stop)

They import `rlhflab.rundir` and `rlhflab.serialize`, which never import this package.
"""

from rlhflab.checkpoint.checkpointer import Checkpointer
from rlhflab.checkpoint.config_diff import (
    CONFIG_CHANGES,
    HARMLESS_KEYS,
    changed_keys,
    check_config_change,
    config_hash,
    flatten_config,
    record_config_change,
)
from rlhflab.checkpoint.disk import (
    checkpoint_bytes,
    is_disk_full,
    raise_if_disk_full,
)
from rlhflab.checkpoint.format import (
    CHECKPOINTS,
    COMMITTED,
    FORMAT_VERSION,
    MANIFEST,
    Checkpoint,
    committed_checkpoints,
    drop_later_checkpoints,
    load_checkpoint,
    sha256_file,
)
from rlhflab.checkpoint.resume import (
    check_run,
    find_resume_checkpoint,
    provenance_note,
    version_note,
)
from rlhflab.checkpoint.sharded import TensorReader, read_tensors
from rlhflab.checkpoint.signals import StopSignals
from rlhflab.checkpoint.state import (
    STATE,
    check_state_schema,
    python_rng_state,
    set_python_rng_state,
)

__all__ = [
    "CHECKPOINTS",
    "COMMITTED",
    "CONFIG_CHANGES",
    "FORMAT_VERSION",
    "HARMLESS_KEYS",
    "MANIFEST",
    "STATE",
    "Checkpoint",
    "Checkpointer",
    "StopSignals",
    "TensorReader",
    "changed_keys",
    "check_config_change",
    "check_run",
    "check_state_schema",
    "checkpoint_bytes",
    "committed_checkpoints",
    "config_hash",
    "drop_later_checkpoints",
    "find_resume_checkpoint",
    "flatten_config",
    "is_disk_full",
    "load_checkpoint",
    "provenance_note",
    "python_rng_state",
    "raise_if_disk_full",
    "read_tensors",
    "record_config_change",
    "set_python_rng_state",
    "sha256_file",
    "version_note",
]
