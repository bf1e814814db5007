"""A trainer's state as (tensors, JSON): optimizers, RNG streams, and the schema of state.json.

    python_rng_state / set_python_rng_state   python `random` state as JSON and back
    rng_state / set_rng_state                 every RNG stream of this rank (torch, CUDA, generators)
    check_state_schema(path, state)           the keys and types every state.json holds

Tensors go to safetensors files, everything else to JSON: no pickle, so loading cannot execute
code.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from rlhflab import distributed
from rlhflab.errors import CheckpointError

STATE = "state.json"


def _optimizer_state(
    opt: torch.optim.Optimizer, full: dict | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, JSON) of an optimizer's state dict (`full`: one gathered from shards)."""
    from rlhflab.optimizers import flatten_state

    sd = full if full is not None else opt.state_dict()
    tensors, scalars, quantized = {}, {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                flat, meta = flatten_state(f"{idx}.{k}", v)
                tensors.update(flat)
                if meta is not None:  # a quantized state (adamw_8bit): its parts, rebuilt on load
                    quantized[f"{idx}.{k}"] = meta
            else:
                scalars[f"{idx}.{k}"] = v
    meta = {"param_groups": encode_tensors(sd["param_groups"]), "scalars": scalars}
    if quantized:
        meta["quantized"] = quantized
    return tensors, meta


def _load_optimizer_state(
    opt: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    meta: dict,
    module: torch.nn.Module | None = None,
) -> None:
    """Inverse of `_optimizer_state`; `module` is the model the optimizer trains (needed when it
    is sharded: the full state is scattered to this rank's shards)."""
    from rlhflab.optimizers import RANK_LOCAL, unflatten_state

    state: dict[int, dict] = {}
    tensors = dict(tensors)
    rank_local = meta.get("rank_local")
    if rank_local is not None and rank_local["world_size"] != distributed.world_size():
        raise CheckpointError(
            f"this checkpoint's optimizer state was quantized per rank by "
            f"{rank_local['world_size']} ranks (adamw_8bit under fsdp2); resume it with "
            f"{rank_local['world_size']} processes, not {distributed.world_size()}"
        )
    own = f"{RANK_LOCAL}{distributed.rank():05d}"
    for key, qmeta in meta.get("quantized", {}).items():
        if RANK_LOCAL not in key or key.endswith(own):  # another rank's: not read
            tensors[key] = unflatten_state(key, tensors, qmeta)
    params = [p for g in opt.param_groups for p in g["params"]]
    for key, v in tensors.items():
        base, local, _ = key.partition(RANK_LOCAL)
        idx, k = base.split(".", 1)
        if local:  # this rank's own shard of the state, as it was: a DTensor like its parameter
            v = distributed.from_local_like(v, params[int(idx)])
        state.setdefault(int(idx), {})[k] = v
    for key, v in meta["scalars"].items():
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    groups = []
    for g in decode_tensors(meta["param_groups"]):
        g = dict(g)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    if module is not None and distributed.is_sharded(module):
        distributed.load_full_optimizer_state(module, opt, {"state": state, "param_groups": groups})
        return
    opt.load_state_dict({"state": state, "param_groups": groups})


def encode_tensors(value: Any) -> Any:
    """`value` with every one-element tensor in it (torchao's optimizers keep the learning rate
    as a tensor, and LambdaLR then its base rates) written as {"__tensor__": x, "dtype": d}:
    JSON keeps the float exactly, so `decode_tensors` gives back the same bits."""
    if torch.is_tensor(value):
        if value.numel() != 1:
            raise TypeError(f"cannot store a tensor of shape {tuple(value.shape)} as JSON")
        return {"__tensor__": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {k: encode_tensors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(encode_tensors(v) for v in value)
    return value


def decode_tensors(value: Any) -> Any:
    """Inverse of `encode_tensors` (tensors come back 0-dimensional, on the CPU)."""
    if isinstance(value, dict):
        if set(value) == {"__tensor__", "dtype"}:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"]))
        return {k: decode_tensors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(decode_tensors(v) for v in value)
    return value


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


def rng_state(generators: dict[str, torch.Generator]) -> dict:
    """This rank's RNG streams: `{"tensors": {name: uint8 state tensor}, "python": JSON,
    "numpy": JSON}`; tensors are torch CPU (`torch_cpu`), each CUDA device (`torch_cuda_<i>`)
    and each named generator (`generator.<name>`)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, st in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = st
    for name, g in generators.items():
        tensors[f"generator.{name}"] = g.get_state()
    return {"tensors": tensors, "python": python_rng_state(), "numpy": _numpy_rng_state()}


def set_rng_state(
    rng: dict[str, torch.Tensor],
    generators: dict[str, torch.Generator],
    python: list,
    numpy_state: list,
) -> None:
    """Inverse of `rng_state`: restore torch CPU, CUDA (when saved and available), each named
    generator, python `random` and numpy from `rng` (this rank's tensors) and the JSON states.

    Raises:
        KeyError: `rng` lacks `torch_cpu` or a generator's `generator.<name>`.
    """
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
        if states:
            torch.cuda.set_rng_state_all(states)
    for name, g in generators.items():
        g.set_state(rng[f"generator.{name}"])
    set_python_rng_state(python)
    _set_numpy_rng_state(numpy_state)


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
