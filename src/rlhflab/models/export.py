"""The final Hugging Face export streamed tensor by tensor (issue #25).

`save_pretrained_streamed` writes what `rlhflab.models.build.save_pretrained` writes (weights,
config.json, generation_config.json, tokenizer, model card) without ever holding the full state
dict: each tensor is gathered (under FSDP2, a collective every rank runs in the same order,
`rlhflab.distributed.stream_model_state`), its bytes appended to its safetensors file by rank 0,
and dropped. A safetensors file is an 8-byte little-endian header length, a JSON header (names,
dtypes, shapes, byte offsets) and the tensors' bytes; the header is computed in advance from the
shapes and dtypes, so rank 0's peak host memory is one tensor. The files are split into shards
as `save_pretrained` splits them (huggingface_hub's `split_torch_state_dict_into_shards`, run on
meta tensors): one `model.safetensors` for a small model, or `model-0000i-of-0000N.safetensors`
and `model.safetensors.index.json` (`weight_map`) when it exceeds `max_shard_size`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

from rlhflab import distributed
from rlhflab.errors import ModelError

# save_pretrained's default is "50GB"; the Hub's convention (and what 8B models ship as) is 5 GB
MAX_SHARD_SIZE = 5 * 10**9  # bytes, as huggingface_hub parses "5GB"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def shard_files(specs: Specs, max_shard_size: int = MAX_SHARD_SIZE) -> dict[str, list[str]]:
    """File name -> tensor names (in `specs` order) as `save_pretrained` splits a state dict
    with these shapes/dtypes: `{"model.safetensors": all}` when it fits in `max_shard_size`
    bytes, else `model-0000i-of-0000N.safetensors` (a tensor larger than the limit alone in
    its own shard)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    meta = {n: torch.empty(shape, dtype=dt, device="meta") for n, (shape, dt) in specs.items()}
    split = split_torch_state_dict_into_shards(
        meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    return {f: list(names) for f, names in split.filename_to_tensors.items()}


def _header(names: list[str], specs: Specs, metadata: dict[str, str]) -> bytes:
    """A safetensors header (length prefix included) for `names` laid out in that order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in names:
        shape, dtype = specs[name]
        if dtype not in _DTYPES:
            raise ModelError(f"export: tensor {name} has dtype {dtype}, which safetensors lacks")
        end = offset + _nbytes(shape, dtype)
        header[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors_streamed(
    directory: str | os.PathLike[str],
    specs: Specs,
    tensors: Iterable[tuple[str, torch.Tensor | None]],
    *,
    max_shard_size: int = MAX_SHARD_SIZE,
    total_parameters: int | None = None,
    write: bool = True,
) -> dict[str, list[str]]:
    """Write the tensors of `specs` (name -> (shape, dtype)) into `directory` as
    `save_pretrained` lays them out (`shard_files`; plus `model.safetensors.index.json` with
    `metadata` {total_parameters, total_size} and `weight_map` when sharded), taking each
    tensor from `tensors` as it comes and keeping none: `tensors` yields `(name, tensor)` in
    `specs` order (CPU tensors; None where `write` is False, on ranks other than 0).

    Every file's header is written first (from the shapes), then each tensor's bytes at its
    turn, so host memory holds one tensor at a time. With `write` False nothing is written and
    `tensors` is only run to its end (its collectives). If writing fails, `tensors` is still
    run to its end (so the other ranks' gathers complete) and the error raised after.
    Returns file name -> tensor names.

    Raises:
        ModelError: a tensor comes out of order, or its shape/dtype differs from `specs`;
            a dtype safetensors cannot store.
    """
    files = shard_files(specs, max_shard_size)
    where = {name: f for f, names in files.items() for name in names}
    left = {f: len(names) for f, names in files.items()}
    handles: dict = {}
    order = iter(specs)
    error: BaseException | None = None
    try:
        if write:
            for f, names in files.items():  # at most a few files: one handle each
                handles[f] = open(Path(directory) / f, "wb")  # noqa: SIM115
                handles[f].write(_header(names, specs, {"format": "pt"}))
        for name, t in tensors:
            expected = next(order, None)
            if name != expected:
                raise ModelError(f"export: got tensor {name}, expected {expected}")
            if not write or error is not None:
                continue
            try:
                shape, dtype = specs[name]
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise ModelError(
                        f"export: tensor {name} is {tuple(t.shape)} {t.dtype}, "
                        f"expected {shape} {dtype}"
                    )
                f = where[name]
                if t.numel():
                    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                    handles[f].write(memoryview(data.numpy()))
                left[f] -= 1
                if not left[f]:
                    handles.pop(f).close()
            except BaseException as e:  # keep consuming: the other ranks are gathering
                error = e
        missing = next(order, None)
        if missing is not None and error is None:
            raise ModelError(f"export: tensor {missing} never came")
        if error is not None:
            raise error
    finally:
        for h in handles.values():
            h.close()
    if write and len(files) > 1:
        index = {
            "metadata": {
                **({"total_parameters": total_parameters} if total_parameters is not None else {}),
                "total_size": sum(_nbytes(*specs[n]) for n in specs),
            },
            "weight_map": dict(sorted(where.items())),
        }
        (Path(directory) / INDEX_NAME).write_text(
            json.dumps(index, indent=2, sort_keys=True) + "\n"
        )
    return files


def export_names(model: torch.nn.Module) -> list[str] | None:
    """The tensor names `model.save_pretrained` writes, in its order, or None when
    `save_pretrained_streamed` cannot write what it would: a LoRA (peft), quantized or
    remote-code model, or one whose saved names are not its state-dict names (a weight
    conversion that `save_pretrained` reverts on save). Tied weights appear under the input
    embedding's name only; `_keys_to_ignore_on_save` are left out. The order is that of
    transformers' `revert_weight_conversion` (sorted names for a model loaded with
    `from_pretrained`, `state_dict()` order otherwise), which decides the shards. Metadata
    only, no collective; on FSDP2 call it on rank 0 and share the result, since the order can
    differ between a loaded model and its meta-device copies on other ranks."""
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "peft_config", None):
        return None
    if getattr(model, "_hf_peft_config_loaded", False) or not hasattr(model, "config"):
        return None
    is_remote = getattr(model, "is_remote_code", None)
    if is_remote is not None and is_remote():
        return None
    specs = distributed.model_state_specs(model, keep_tied=True)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        specs.pop(key, None)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers: no conversions
        return list(specs)
    meta = {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in specs.items()}
    reverted = revert_weight_conversion(model, dict(meta))
    same = set(reverted) == set(meta) and all(
        tuple(reverted[n].shape) == tuple(meta[n].shape) and reverted[n].dtype == meta[n].dtype
        for n in meta
    )
    return list(reverted) if same else None


def save_pretrained_streamed(
    model,
    tokenizer,
    path: str | os.PathLike[str],
    *,
    names: list[str] | None = None,
    max_shard_size: int = MAX_SHARD_SIZE,
) -> None:
    """`rlhflab.models.build.save_pretrained` for a model too big to gather: every rank calls
    it (a collective under FSDP2); rank 0 writes `path` (which must exist): the weights
    streamed one tensor at a time (`write_safetensors_streamed`; tied weights under the input
    embedding's name only, as `save_pretrained` keeps them), config.json (with `dtype` and
    `architectures` set as `save_pretrained` sets them), generation_config.json for a
    generative model, the tokenizer and the model card. `names`: `export_names(model)`, the
    same list on every rank (None: rank 0 computes it and shares it, a collective).

    Raises:
        ModelError: the model cannot be streamed (`export_names` is None).
    """
    from rlhflab.models.build import write_model_card

    if names is None:  # rank 0's: the order can differ between ranks (see export_names)
        names = distributed.broadcast_object(export_names(model) if distributed.is_main() else None)
    if names is None:
        raise ModelError(f"export: {type(model).__name__} cannot be streamed; save it whole")
    all_specs = distributed.model_state_specs(model, keep_tied=True)
    specs = {n: all_specs[n] for n in names}
    main = distributed.is_main()
    total = model.num_parameters() if hasattr(model, "num_parameters") else None
    write_safetensors_streamed(
        path,
        specs,
        distributed.stream_model_state(model, list(specs)),
        max_shard_size=max_shard_size,
        total_parameters=total,
        write=main,
    )
    if not main:
        return
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    model.config.save_pretrained(path)
    if model.can_generate():
        model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    write_model_card(path, model.config, auto_class="AutoModelForCausalLM")
