"""Full (gathered) model and optimizer state of sharded models, for the final export, and this
rank's pieces for sharded checkpoints (rlhflab.checkpoint.sharded). Part of `rlhflab.distributed`
(re-exported there); see rlhflab.checkpoint for why not DCP.
"""

from __future__ import annotations

import torch

from rlhflab.distributed.group import is_main
from rlhflab.distributed.models import is_sharded

# ---------------------------------------------------------------------------------------------
# Full state for checkpoints (gathered; see rlhflab.checkpoint for why not DCP)
# ---------------------------------------------------------------------------------------------


def _sd_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(
    model: torch.nn.Module, *, keep_tied: bool = False
) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict on CPU, on rank 0 (None on other ranks) for an FSDP2 model.

    A collective under FSDP2 (every rank must call it). Tied parameters appear under one name
    only: the first in sorted order, or with `keep_tied` the name `save_pretrained` keeps (the
    input embedding's, not the LM head's). For other models this returns None: they are saved
    from the module directly.
    """
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model, options=_sd_options())
    if not is_main():
        return None
    for name in _tied_dropped(model, keep_tied=keep_tied):
        sd.pop(name, None)
    return {k: v.contiguous() for k, v in sd.items()}


def _tied_dropped(model: torch.nn.Module, *, keep_tied: bool) -> set[str]:
    """The names of tied parameters that a saved state leaves out (see `full_model_state`)."""
    out: set[str] = set()
    for group in tied_groups(model):
        if keep_tied:  # what save_pretrained writes for a tied model: the input embedding's name
            drop = [n for n in group if n in _output_embedding_names(model)]
            drop = drop if len(drop) < len(group) else []
        else:
            drop = sorted(group)[1:]
        out.update(drop)
    return out


def model_state_specs(
    model: torch.nn.Module, *, keep_tied: bool = True
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(global shape, dtype) of each tensor of `model`'s full state dict, in `state_dict()`
    order, tied names left out as in `full_model_state(keep_tied=...)`. Reads metadata only: no
    collective, nothing gathered (a sharded parameter's DTensor knows its global shape)."""
    dropped = _tied_dropped(model, keep_tied=keep_tied)
    return {
        name: (tuple(t.shape), t.dtype)
        for name, t in model.state_dict().items()
        if name not in dropped
    }


def stream_model_state(model: torch.nn.Module, names: list[str]):
    """Yields `(name, tensor)` for each of `names` (keys of `model.state_dict()`), one at a
    time and in that order: the full tensor, detached, contiguous, on the CPU, on rank 0, and
    None on other ranks. For an FSDP2 model each sharded tensor is gathered as it is reached
    (`DTensor.full_tensor`, a collective: every rank must run the generator to its end, in
    the same order), so rank 0 holds one full tensor at a time, not the whole state (4 bytes
    a parameter in float32). Plain models and replicated tensors are read as they are."""
    dtensor = _dtensor_type()
    sd = model.state_dict()  # sharded DTensors under FSDP2: nothing gathered yet
    for name in names:
        t = sd[name].detach()
        if isinstance(t, dtensor):
            t = t.full_tensor()
        yield name, (t.cpu().contiguous() if is_main() else None)
        del t


def is_shard(t: torch.Tensor) -> bool:
    """True for a sharded parameter (a DTensor under FSDP2): `full_tensor` of it is a
    collective. No communication."""
    return isinstance(t, _dtensor_type())


def full_tensor(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole of `t` on every rank, detached, cast to `dtype` (None: `t`'s own dtype).

    For a DTensor (an FSDP2 shard) the local shard is cast first and then all-gathered, so the
    traffic and the full tensor are in `dtype` (bf16 halves them): a collective, every rank
    must call it for the same tensors in the same order. A plain tensor (DDP, one process) is
    cast locally; no communication. Used to push one layer at a time into a rollout engine."""
    t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if isinstance(t, _dtensor_type()):
        t = t.full_tensor()
    return t


def load_full_model_state(
    model: torch.nn.Module, sd: dict[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load a full (unsharded) state dict, as written from `full_model_state`, into an FSDP2
    model on every rank; tied names are filled from the saved one. Raises RuntimeError / KeyError
    when names or shapes do not fit. `strict=False` loads a part (a LoRA model's adapters; the
    caller checks the names) and leaves the other parameters as they are."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    sd = dict(sd)
    for group in tied_groups(model):
        kept = sorted(group)[0]
        for name in group:
            if strict or kept in sd:
                sd.setdefault(name, sd[kept])
    set_model_state_dict(model, sd, options=_sd_options_load(strict))


def _sd_options_load(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, strict=strict)


def _output_embedding_names(model: torch.nn.Module) -> set[str]:
    """Parameter names of a Hugging Face model's output embedding (LM head), if it has one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return set()
    return {f"{n}.weight" for n, m in model.named_modules() if m is head}


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (tied embeddings), each group sorted; [] when
    nothing is tied. Saved states (full or sharded) hold each group once."""
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return [sorted(names) for names in seen.values() if len(names) > 1]


def full_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict | None:
    """An FSDP2 model's optimizer state unsharded, in `Optimizer.state_dict()` form (state keyed
    by parameter index, as one process has it) on rank 0; None on other ranks and for
    unsharded models (whose `opt.state_dict()` is already complete). A collective."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=_sd_options())
    if not is_main():
        return None
    index: dict[str, int] = {}
    groups = []
    for g in osd["param_groups"]:
        ids = []
        for fqn in g["params"]:
            index[fqn] = len(index)
            ids.append(index[fqn])
        groups.append({**g, "params": ids})
    state = {index[fqn]: st for fqn, st in osd["state"].items()}
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, sd: dict) -> None:
    """Inverse of `full_optimizer_state` on every rank of an FSDP2 model (a collective).
    Raises: KeyError / RuntimeError when the state does not fit the optimizer's parameters
    (the checkpoint module turns these into one CheckpointError line)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # The FQN of each parameter index, in the optimizer's own order.
    template = get_optimizer_state_dict(model, opt, options=StateDictOptions())
    fqns = [fqn for g in template["param_groups"] for fqn in g["params"]]
    state = {fqns[int(i)]: st for i, st in sd["state"].items()}
    groups, start = [], 0
    for g in sd["param_groups"]:
        n = len(g["params"])
        groups.append({**g, "params": fqns[start : start + n]})
        start += n
    set_optimizer_state_dict(
        model,
        opt,
        {"state": state, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints: this rank's pieces (rlhflab.checkpoint.sharded writes and reads the files)
# ---------------------------------------------------------------------------------------------


def _dtensor_type():
    from torch.distributed.tensor import DTensor

    return DTensor


def shard_region(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, global offset, local shape) of this rank's piece of `t`: for a DTensor
    (an FSDP2 parameter, or optimizer state shaped like one) the box its local tensor covers
    in the global tensor (`compute_local_shape_and_global_offset`, as DCP computes it; under
    FSDP2's Shard(0) rank r holds rows [r·c, min((r+1)·c, n)) with c = ceil(n / world), possibly
    none); for a plain tensor the whole tensor."""
    if not isinstance(t, _dtensor_type()):
        shape = tuple(t.shape)
        return shape, (0,) * len(shape), shape
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(t.shape), tuple(offset), tuple(local)


def local_piece(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]] | None:
    """What this rank saves of `t` in a sharded checkpoint: (its local tensor, detached, on the
    CPU; global shape; global offset), or None when another rank saves it — a plain tensor
    (replicated on every rank: a buffer, AdamW's `step`) is rank 0's, and a DTensor piece
    replicated over a mesh dimension is saved by the rank at coordinate 0 there. No collective:
    no rank ever holds more than its own shards."""
    dtensor = _dtensor_type()
    if not isinstance(t, dtensor):
        return (t.detach().cpu(), tuple(t.shape), (0,) * t.dim()) if is_main() else None
    coord = t.device_mesh.get_coordinate() or []
    for c, placement in zip(coord, t.placements, strict=False):
        if not placement.is_shard() and c != 0:
            return None
    shape, offset, _ = shard_region(t)
    return t.to_local().detach().cpu(), shape, offset


def from_local_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`local` (this rank's piece of a tensor laid out like `like`, of shape
    `shard_region(like)[2]`) as such a tensor: a DTensor on `like`'s mesh with its placements
    (on `like`'s local device), or `local` itself when `like` is a plain tensor."""
    dtensor = _dtensor_type()
    if not isinstance(like, dtensor):
        return local
    return dtensor.from_local(
        local.to(like.to_local().device),
        like.device_mesh,
        like.placements,
        shape=like.shape,
        stride=like.stride(),
    )


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor to copy this rank's piece of `t` into: a DTensor's local tensor (sharing its
    storage), a plain tensor itself."""
    return t.to_local() if isinstance(t, _dtensor_type()) else t
