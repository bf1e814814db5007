"""The optimizers a trainer can build (`optim.name`) and the bytes of state each keeps.

    adamw        torch.optim.AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay
                 Regularization", Alg. 2). m and v in the parameters' dtype: 8 bytes per
                 parameter with float32 master weights.
    adamw_8bit   torchao.optim.AdamW8bit: the same update, with m and v stored block-wise
                 quantized to 8 bits (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
                 Quantization", §2: a dynamic quantization map and one absmax scale per block;
                 the paper's blocks hold 2048 values, torchao's 256, its map is
                 `torchao.optim.quant_utils.create_dynamic_map`). Per parameter
                 2 · (1 + 4/256) = 2.03 bytes; a tensor with fewer than 4096 values or a size
                 that is not a multiple of 256 (norm weights, biases) keeps its m and v in its
                 own dtype (torchao's `_new_buffer`: "follow bitsandbytes"). The
                 update is computed in float32 from the dequantized m and v, then they are
                 quantized again: the states lose precision, the arithmetic does not.
    adamw_bf16   torchao.optim._AdamW with bf16_stochastic_round: parameters, gradients, m and v
                 all bfloat16 (2 + 2 + 2 + 2 = 8 bytes per parameter). The update is computed
                 in float32 and written back to the bfloat16 weight with stochastic rounding
                 (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision": x goes to
                 the neighbour above ⌊x⌋ with probability (x − ⌊x⌋)/ε, ε the spacing, so
                 E[round(x)] = x and an update smaller than half a bfloat16 step is kept in
                 expectation instead of always lost; torchao's `_fp32_to_bf16_sr` draws the
                 16 dropped bits' threshold uniformly). Needs `model.dtype: bfloat16`.
                 The random bits come from torch's default generator of the parameter's device
                 (a checkpoint saves and restores it, so a resumed run draws the same bits).

Under FSDP2 torchao quantizes each rank's shard of m and v in blocks of that shard (`_new_buffer`),
so the 8-bit state is not a slice of a global tensor: sharded checkpoints keep it per rank, as it
is (`rank_local_state`, `rlhflab.checkpoint.sharded.optimizer_pieces`), and it resumes exactly at
the same world size only.

torchao is an optional dependency (`pip install "rlhflab[lowmem]"`); its optimizer step is
compiled by torch.compile (on the CPU this needs a C++ compiler, and the first step of each
parameter shape compiles for seconds). Kahan-compensated bfloat16 AdamW is not offered: no
well-kept library ships it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `rlhflab plan` reads the formulas only
    import torch

#: The values of `optim.name` (config.sections.OptimConfig).
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_bf16")

#: torchao quantizes a tensor's m and v only when it has at least this many values...
QUANTIZE_MIN_NUMEL = 4096
#: ... and a multiple of this block size (one float32 scale per block).
BLOCK_SIZE_8BIT = 256


def _torchao_optim():
    try:
        import torchao.optim as tao
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "optim.name adamw_8bit / adamw_bf16 need torchao: pip install 'rlhflab[lowmem]' "
            f"({exc})"
        ) from None
    return tao


def build(name: str, params: list[torch.nn.Parameter], *, lr: float, betas, eps: float,
          weight_decay: float, torch_kwargs: dict | None = None) -> torch.optim.Optimizer:  # fmt: skip
    """The optimizer `name` (one of `OPTIMIZERS`) over `params`.

    Args:
        name: "adamw", "adamw_8bit" or "adamw_bf16" (module docstring).
        params: the trainable parameters (any shapes; all bfloat16 for adamw_bf16).
        lr, betas, eps, weight_decay: AdamW's (weight decay decoupled, as torch's AdamW).
        torch_kwargs: extra keyword arguments of `torch.optim.AdamW` (e.g. fused=True); only
            "adamw" takes them.

    Raises:
        ValueError: an unknown name, or adamw_bf16 over parameters that are not bfloat16.
        ConfigError: adamw_8bit over FSDP2 shards of unequal sizes (`_refuse_uneven_shards`).
        ImportError: torchao is missing (one line saying what to install).
    """
    import torch

    kw = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
    if name == "adamw":
        return torch.optim.AdamW(params, **kw, **(torch_kwargs or {}))
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name: unknown optimizer {name!r} (one of {', '.join(OPTIMIZERS)})")
    if name == "adamw_bf16":
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        if dtypes != ["bfloat16"]:
            raise ValueError(
                "optim.name: adamw_bf16 updates bfloat16 weights with stochastic rounding; the "
                f"trainable parameters are {', '.join(dtypes)} (set model.dtype: bfloat16)"
            )
    tao = _torchao_optim()
    if name == "adamw_8bit":
        _refuse_uneven_shards(params)
        return tao.AdamW8bit(params, **kw, block_size=BLOCK_SIZE_8BIT)
    return tao._AdamW(params, **kw, bf16_stochastic_round=True)


def _refuse_uneven_shards(params) -> None:
    """adamw_8bit over FSDP2 shards of unequal sizes fails inside torchao's compiled step (seen
    with torch 2.13 and torchao 0.18: a graph compiled for one rank-local shape is run on
    another, "expected size 159==160"); refuse it in one line first.

    Raises:
        ConfigError: a sharded parameter whose first dimension the ranks do not divide evenly.
    """
    from rlhflab.errors import ConfigError

    for p in params:
        mesh = getattr(p, "device_mesh", None)  # an FSDP2 shard (a DTensor); this module sits
        if mesh is not None:  # below rlhflab.distributed, so it does not import it
            n = mesh.size()
            if p.dim() and p.shape[0] % n:
                raise ConfigError(
                    f"optim.name: adamw_8bit under fsdp2 needs every parameter's first dimension "
                    f"divisible by the {n} ranks; one of shape {list(p.shape)} is not (torchao's "
                    "8-bit step fails on uneven shards): use adamw_bf16, adamw, or a number of "
                    "ranks that divides it"
                )


#: Suffix of a rank-local optimizer state key in a sharded checkpoint: `<idx>.<name>@rank00001`.
RANK_LOCAL = "@rank"


def rank_local_state(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` keeps state that is not laid out like its parameters under FSDP2 (torchao's
    block-quantized optimizers, adamw_8bit: each rank quantizes its own shard), so that a
    sharded checkpoint must store each rank's state as it is instead of slices of global
    tensors."""
    cls = type(opt)
    return cls.__module__.startswith("torchao.") and cls.__name__ in (
        "AdamW8bit", "Adam8bit", "AdamW4bit", "Adam4bit", "AdamWFp8", "AdamFp8",
    )  # fmt: skip


def state_bytes(name: str, numels: Iterable[int], param_bytes: int) -> int:
    """Bytes of optimizer state for trainable tensors of `numels` values each, whose
    parameters take `param_bytes` bytes per value (4 for float32, 2 for bfloat16).

    adamw: 2 · param_bytes per value (m and v). adamw_8bit: per quantized tensor (≥ 4096 values,
    a multiple of 256) 2 · (n + 4 · n/256) bytes (uint8 codes and float32 scales for m and v),
    others 2 · param_bytes · n; plus two 256-entry float32 quantization maps per quantized
    tensor (2 KiB). adamw_bf16: 2 · 2 per value. AdamW's scalar `step` (4 bytes per tensor) is
    left out.
    """
    total = 0
    for n in numels:
        if name == "adamw":
            total += 2 * param_bytes * n
        elif name == "adamw_bf16":
            total += 4 * n
        elif name == "adamw_8bit":
            if n >= QUANTIZE_MIN_NUMEL and n % BLOCK_SIZE_8BIT == 0:
                total += 2 * (n + 4 * (n // BLOCK_SIZE_8BIT)) + 2 * 4 * 256
            else:
                total += 2 * param_bytes * n
        else:
            raise ValueError(f"state_bytes: unknown optimizer {name!r}")
    return total


def bytes_per_param(name: str, param_bytes: int) -> float:
    """The large-tensor limit of `state_bytes` per parameter (what `rlhflab plan` uses for a
    model whose parameters are nearly all in large matrices): adamw 2 · param_bytes,
    adamw_8bit 2 · (1 + 4/256) = 2.03125, adamw_bf16 4."""
    if name == "adamw":
        return 2.0 * param_bytes
    if name == "adamw_bf16":
        return 4.0
    if name == "adamw_8bit":
        return 2.0 * (1.0 + 4.0 / BLOCK_SIZE_8BIT)
    raise ValueError(f"bytes_per_param: unknown optimizer {name!r}")


def measured_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors hold (a quantized state counted by its inner
    tensors; scalar `step` tensors left out, as in `state_bytes`)."""
    import torch

    total = 0
    for st in opt.state.values():
        for k, v in st.items():
            if k == "step" or not torch.is_tensor(v):
                continue
            total += _tensor_bytes(v)
    return total


def _tensor_bytes(v: torch.Tensor) -> int:
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(v):  # a quantized state, or a DTensor (its local shard)
        names, _ = v.__tensor_flatten__()
        inner = [getattr(v, n) for n in names]  # DTensor also names its (non-tensor) device mesh
        return sum(_tensor_bytes(t) for t in inner if isinstance(t, torch.Tensor))
    return v.numel() * v.element_size()


#: state subclasses a checkpoint may rebuild (module, class): only these are imported on load.
STATE_SUBCLASSES = {
    "torchao.optim.subclass_8bit.OptimState8bit",
    "torchao.optim.subclass_4bit.OptimState4bit",
    "torchao.optim.subclass_fp8.OptimStateFp8",
}


def flatten_state(key: str, v: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict | None]:
    """A state tensor as plain tensors for a safetensors file: itself under `key`, or, for a
    quantized state (a tensor subclass), its inner tensors under `key.<name>` and the JSON
    needed to rebuild it ({"type", "names", "ctx", "size", "stride"}).

    Raises:
        TypeError: a subclass not in `STATE_SUBCLASSES`, or a context value JSON cannot hold.
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(v):
        return {key: v.detach().cpu().contiguous()}, None
    cls = type(v)
    qual = f"{cls.__module__}.{cls.__qualname__}"
    if qual not in STATE_SUBCLASSES:
        raise TypeError(f"optimizer state {key}: cannot save a {qual} tensor")
    names, ctx = v.__tensor_flatten__()
    inner = {f"{key}.{n}": getattr(v, n).detach().cpu().contiguous() for n in names}
    return inner, {"type": qual, "names": list(names), "ctx": [_ctx_json(c) for c in ctx],
                   "size": list(v.shape), "stride": list(v.stride())}  # fmt: skip


def _ctx_json(c):
    import torch

    if isinstance(c, torch.dtype):
        return {"dtype": str(c).removeprefix("torch.")}
    if isinstance(c, bool | int | float | str) or c is None:
        return c
    raise TypeError(f"optimizer state: cannot save a context value {c!r}")


def unflatten_state(key: str, tensors: dict[str, torch.Tensor], meta: dict) -> torch.Tensor:
    """Inverse of `flatten_state` for one quantized state (pops its inner tensors from
    `tensors`).

    Raises:
        TypeError: a type not in `STATE_SUBCLASSES` (nothing else is imported); KeyError: an
            inner tensor missing from `tensors`.
    """
    import importlib

    import torch

    qual = meta["type"]
    if qual not in STATE_SUBCLASSES:
        raise TypeError(f"optimizer state {key}: a {qual} tensor is not one rlhflab rebuilds")
    module, _, name = qual.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    inner = {n: tensors.pop(f"{key}.{n}") for n in meta["names"]}
    ctx = [getattr(torch, c["dtype"]) if isinstance(c, dict) else c for c in meta["ctx"]]
    return cls.__tensor_unflatten__(inner, ctx, torch.Size(meta["size"]), tuple(meta["stride"]))


__all__ = [
    "OPTIMIZERS",
    "RANK_LOCAL",
    "build",
    "bytes_per_param",
    "flatten_state",
    "measured_state_bytes",
    "rank_local_state",
    "state_bytes",
    "unflatten_state",
]
