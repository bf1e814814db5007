"""The files that make a checkpoint directory a Hugging Face model directory (config.json,
generation_config.json, tokenizer files; peft adapter files for a LoRA model)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhflab import distributed
from rlhflab.models.lora import is_lora

#: `write(name, fill)`: `fill(path)` writes the checkpoint file `name`, which is then fsynced
#: and counted like every other file of the checkpoint (`Checkpointer._write`).
Write = Callable[[str, Callable[[Path], Any]], None]


def write_hf_files(
    model: torch.nn.Module | None,
    tokenizer: Any,
    write: Write,
    staging: Path,
    full: dict[str, torch.Tensor] | None = None,
) -> None:
    """The files that make the checkpoint directory loadable without rlhflab, each written
    and fsynced like the tensors: for a full model, config.json, generation_config.json and
    the tokenizer's files (a `from_pretrained` directory); for a LoRA model, whose
    model.safetensors holds only the adapters, peft's adapter_config.json and
    adapter_model.safetensors and the tokenizer (a `PeftModel.from_pretrained(base, dir)`
    directory) — never a config.json that would load the base with missing weights.
    Nothing is written for a model without a transformers config (or None).

    Args:
        model: the module named "model".
        tokenizer: saved beside it when not None.
        write: writes one file into the checkpoint (see `Write`).
        staging: a scratch directory for a library's `save_pretrained` (removed after).
        full: the model's gathered state dict under FSDP2 (None: the module's own).
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        return
    if is_lora(model):
        if tokenizer is not None:
            from rlhflab.models.lora import save_adapter

            _write_dir(write, staging, lambda d: save_adapter(model, tokenizer, d, full))
        return
    cls = type(model).__name__  # FSDP2 renames a sharded module's class FSDP<name>
    if distributed.is_sharded(model):
        cls = cls.removeprefix("FSDP")
    config.architectures = [cls]  # what save_pretrained records
    write("config.json", lambda p: config.to_json_file(str(p)))
    gen = getattr(model, "generation_config", None)
    if gen is not None and model.can_generate():
        write("generation_config.json", lambda p: gen.to_json_file(str(p)))
    if tokenizer is not None:
        _write_dir(write, staging, lambda d: tokenizer.save_pretrained(str(d)))


def _write_dir(write: Write, staging: Path, fill: Callable[[Path], Any]) -> None:
    """Let `fill(directory)` write files (a library's save_pretrained) into a staging
    directory, then move each into the checkpoint through `write` (fsynced, in the
    manifest)."""
    shutil.rmtree(staging, ignore_errors=True)
    try:
        fill(staging)
        for f in sorted(staging.iterdir()):
            if f.is_file():
                write(f.name, lambda p, src=f: shutil.move(str(src), str(p)))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
