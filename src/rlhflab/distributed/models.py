"""Models under data parallelism: `wrap` (ddp | fsdp2, loading from rank 0 without full
copies), gradient synchronisation, gathering for sampling, gradient norms. Part of
`rlhflab.distributed` (re-exported there: call `distributed.wrap(...)`); see its docstring for the
strategies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlhflab.distributed.group import _STATE, _on, _talk, device, is_main

# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _fsdp():
    from torch.distributed import fsdp

    return fsdp


def is_sharded(model: torch.nn.Module | None) -> bool:
    """True for a model (or a part of it) wrapped by FSDP2: its parameters are DTensor shards."""
    if model is None or not _on():
        return False
    fsdp = _fsdp()
    return any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a causal LM (decoder layers), found as the longest
    nn.ModuleList in the model; [] when there is none."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def wrap(
    model: torch.nn.Module,
    parallel,
    *,
    roots: list[torch.nn.Module] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> torch.nn.Module:
    """Prepare a model for data parallelism; returns the same object.

    Args:
        model: policy, reference, critic or reward model; a frozen model (the reference) is
            sharded the same way and simply has no gradients or optimizer state. Under "ddp" it
            is on `device()` on every rank; under "fsdp2" rank 0's holds the weights (on the
            CPU or the device) and the other ranks' may be on the meta device (no memory; see
            `loads_from_rank0`).
        parallel: the `parallel` config section (strategy, mixed_precision, cpu_offload).
        roots: under fsdp2, the parts sharded as separate FSDP roots instead of `model` itself
            (the reward model: backbone and score head, which the scorer calls one by one).
        weights: under fsdp2, rank 0's weights to load instead of the model's own (`host_state`
            of another model with the same names: the reference's are the policy's); ignored on
            other ranks.
    With one process or strategy "none", the model is returned unchanged; under "ddp" rank 0's
    parameters and buffers are broadcast so every replica starts equal (`sync_grads` keeps them
    equal). Under "fsdp2" the model goes to the meta device, each decoder layer and then the
    root are `fully_shard`ed, every rank allocates its shards on `device()` and receives them
    from rank 0 one tensor at a time (`set_model_state_dict(..., broadcast_from_rank0=True)`,
    as torchtune does), non-persistent buffers (RoPE's `inv_freq`) too: no rank but 0 holds a
    full copy, and none on its GPU.
    """
    if not _talk():
        return model
    if _STATE["strategy"] != "fsdp2":  # ddp: every replica starts from rank 0's weights
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
        return model
    fsdp = _fsdp()
    full = (weights if weights is not None else host_state(model)) if is_main() else {}
    persistent = set(model.state_dict())
    _to_meta(model)
    mp = None
    if parallel.mixed_precision == "bf16":
        mp = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {}
    if mp is not None:
        kwargs["mp_policy"] = mp
    if parallel.cpu_offload:
        kwargs["offload_policy"] = offload_policy(device())
    for block in _blocks(model):
        fsdp.fully_shard(block, **kwargs)
    for root in roots or [model]:
        fsdp.fully_shard(root, **kwargs)
    # Shards on the device; with cpu_offload in host memory from the start (FSDP2 pins them on
    # CUDA at its first forward), so the optimizer steps there and its state is created there
    # (also when a checkpoint's state is loaded before any forward), while the buffers, which
    # FSDP2 does not move, are used on the device (torchtitan's order).
    model.to_empty(device=torch.device("cpu") if parallel.cpu_offload else device())
    _load_from_rank0(model, full, persistent)
    if parallel.cpu_offload:
        for m in model.modules():
            for key, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[key] = buf.to(device())
    for m in model.modules():  # sum over ranks (denominators are global); gloo has only SUM
        if isinstance(m, fsdp.FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def loads_from_rank0() -> bool:
    """True when `wrap` fills every rank's model from rank 0's weights (FSDP2 over several
    processes): ranks other than 0 may then build their models on the meta device (shapes, no
    memory), and rank 0 may keep its copy in host memory until `wrap` shards it."""
    return _on() and _STATE["strategy"] == "fsdp2"


def host_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of every parameter and buffer (non-persistent ones such as RoPE's
    `inv_freq` included), detached and sharing storage with the model: what `wrap` broadcasts
    from rank 0. The tensors stay valid after the model itself goes to the meta device."""
    out = {name: b.detach() for name, b in model.named_buffers()}
    out.update({name: t.detach() for name, t in model.state_dict(keep_vars=True).items()})
    return out


def _meta_tensors(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """{id(tensor): a meta copy} for every parameter and buffer; one copy per shared tensor,
    parameters stay Parameters with their `requires_grad`."""
    memo: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        empty = torch.empty_like(t, device="meta")
        if isinstance(t, torch.nn.Parameter):
            empty = torch.nn.Parameter(empty, requires_grad=t.requires_grad)
        memo[id(t)] = empty
    return memo


def _to_meta(model: torch.nn.Module) -> None:
    """Replace the model's parameters and buffers by meta tensors in place (tied weights stay
    tied, frozen ones frozen); the old tensors live on where something else holds them."""
    memo = _meta_tensors(model)
    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for key, t in store.items():
                if t is not None:
                    store[key] = memo[id(t)]


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` (modules, config, patched methods) whose parameters and buffers
    are on the meta device: no memory is copied. For a frozen reference loaded by `wrap(copy,
    parallel, weights=host_state(model))`."""
    import copy

    return copy.deepcopy(model, memo=_meta_tensors(model))


def _load_from_rank0(model: torch.nn.Module, full: dict, persistent: set[str]) -> None:
    """Fill a sharded model (shards allocated) from rank 0's `full` state: the state dict one
    tensor at a time, then the non-persistent buffers (not in a state dict) by broadcast.
    Raises RuntimeError naming a key when the state does not fit the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = {k: v for k, v in full.items() if k in persistent}
    if is_main() and set(sd) != persistent:
        missing = sorted(persistent - set(sd))[:3]
        raise RuntimeError(f"rank 0's weights lack {missing} of the model being sharded")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, sd, options=options)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in persistent:
                continue
            if is_main():
                buf.copy_(full[name])
            dist.broadcast(buf, src=0)


def offload_policy(dev: torch.device):
    """FSDP2's `CPUOffloadPolicy` for ranks whose compute device is `dev` (`parallel.cpu_offload`).

    The sharded parameters, their gradients and so the optimizer state live in host memory;
    each layer's shards are copied to `dev` for its forward/backward and the optimizer steps on
    the CPU. On CUDA the host copies are pinned (page-locked), for asynchronous transfers; on a
    CPU device there is no accelerator to pin for (torch refuses: "Cannot access accelerator
    device when none is available") and placement is unchanged, so the policy only takes
    FSDP2's offload code path (which the tests on CPU run).
    """
    return _fsdp().CPUOffloadPolicy(pin_memory=dev.type == "cuda")


def sync_grads(model: torch.nn.Module) -> None:
    """Sum gradients over ranks after the last micro-batch of an optimizer step ("ddp").

    FSDP2 reduce-scatters (sums) during each backward, and one process has nothing to do; in
    both cases this is a no-op. Parameters without a gradient on any rank get a zero gradient
    first, so every rank all-reduces the same buckets.
    """
    if not _talk() or is_sharded(model):
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # flat buckets of ~25 MB, like DDP's default bucket size
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= 25 * 2**20:
            _all_reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _all_reduce_bucket(bucket)


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@contextlib.contextmanager
def gathered(model: torch.nn.Module | None) -> Iterator[None]:
    """Full parameters on every rank for the duration (sampling, no-grad scoring, evaluation):
    under FSDP2 the model is unsharded once and its forwards do no communication, so ranks may
    run different numbers of them. Otherwise nothing happens."""
    if model is None or not is_sharded(model):
        yield
        return
    fsdp = _fsdp()
    mods = [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]
    for m in mods:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True)


def grad_norm(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of the gradients before clipping (over all shards), clipping to `max_norm`
    when it is set. After `sync_grads` every replica holds the summed gradient, so the local
    norm is the global one; FSDP2's DTensor gradients are reduced by `clip_grad_norm_`.
    Returns a 0-d float32 tensor (the same on every rank)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if is_sharded(model):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"))
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if max_norm is None:
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: full gradient on CPU} (a collective under FSDP2); tied parameters once."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().cpu().clone().contiguous()
    return out
