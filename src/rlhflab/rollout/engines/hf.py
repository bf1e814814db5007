"""The `hf` rollout engine: our KV-cache sampler on the live policy module.

It samples with the very module the trainer updates, so `update_weights` has nothing to load and
`sleep` / `wake` nothing to free, and the sampler log-probs are the trainer's (mismatch 0 up to
float rounding). A group's prompt is prefilled once and its KV cache shared by the group's
samples (`rlhflab.rollout.sampler.sample`, prefix sharing). Inside `reuse_prefixes()` (a
multi-turn episode batch) a sequence that stops keeps its KV cache and a later prompt that extends
it (the next turn) forwards only its new tokens (`rlhflab.rollout.kv_cache.PrefixStore`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from rlhflab import distributed
from rlhflab.rollout.engines.base import SamplingParams, unwrapped
from rlhflab.rollout.kv_cache import PrefixStore
from rlhflab.rollout.sampler import DECODE_PATHS, Rollout, sample


class HFEngine:
    """Samples from `model` (a Hugging Face causal LM, possibly DDP/FSDP-wrapped) in-process.

    Args:
        model: the policy module; the caller puts it in eval mode (and gathers sharded
            parameters, unless `half_weights`) around `generate`.
        pad_token_id: written after a completion stops.
        stop_token_ids: the stop set, EOS first (`rlhflab.rollout.engines.stop_ids_for`).
        autocast_dtype: forwards under torch.autocast with this dtype, as the trainer's.
        decode, sync_every, cuda_graph: the sampler's decode loop ("eager" or "static"), the
            static loop's tokens between host checks, and whether it captures its step as a
            CUDA graph on CUDA (`rlhflab.rollout.sampler.sample`; config `rollout.decode`,
            `rollout.sync_every`, `rollout.cuda_graph`).
        half_weights: generate with a copy of the policy in `autocast_dtype` (bf16 / fp16),
            refreshed from the live module (`half_copy`, `refresh_half_copy`) instead of
            casting the float32 weights at every token: before every `generate`, or, for an
            FSDP2-sharded policy, at `wake` (every rank, one parameter gathered at a time), so
            the whole float32 policy is never gathered for a rollout
            (`samples_live_policy` False).

    Raises:
        ValueError: no stop token, an unknown `decode`, sync_every < 1, or half_weights
            without a 16-bit autocast_dtype.
    """

    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        stop_token_ids: tuple[int, ...],
        autocast_dtype: torch.dtype | None = None,
        decode: str = "eager",
        sync_every: int = 8,
        cuda_graph: bool = True,
        half_weights: bool = False,
    ) -> None:
        if not stop_token_ids:
            raise ValueError("HFEngine: stop_token_ids must hold at least EOS")
        if decode not in DECODE_PATHS or sync_every < 1:
            raise ValueError(
                f"HFEngine: decode must be one of {list(DECODE_PATHS)} and sync_every >= 1 "
                f"(got decode={decode!r}, sync_every={sync_every})"
            )
        self.decode, self.sync_every, self.cuda_graph = decode, sync_every, cuda_graph
        if half_weights and autocast_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                "HFEngine: half_weights needs a bfloat16 or float16 autocast_dtype (the run's "
                f"compute dtype), got {autocast_dtype}"
            )
        self.half = half_copy(model, autocast_dtype) if half_weights else None
        self.model = model
        self.pad_token_id = pad_token_id
        self.stop_token_ids = tuple(stop_token_ids)
        self.autocast_dtype = autocast_dtype
        self.prefix_store: PrefixStore | None = None
        # prompt tokens forwarded by prefills ("prefilled") and taken from kept caches ("reused")
        self.stats: dict[str, int] = {"prefilled": 0, "reused": 0}

    @contextmanager
    def reuse_prefixes(self) -> Iterator[None]:
        """KV reuse for the `generate` calls inside: each stopped sequence's cache is kept and a
        prompt extending it starts from it (`sample`'s `prefix_store`); the caches are freed on
        exit. Raises ValueError with decode "static", whose cache cannot start from a prefix."""
        if self.decode != "eager":
            raise ValueError("HFEngine.reuse_prefixes: KV reuse needs decode 'eager'")
        self.prefix_store = PrefixStore()
        try:
            yield
        finally:
            self.prefix_store = None

    @classmethod
    def from_config(cls, rollout_cfg, model: torch.nn.Module, tokenizer, *,
                    stop_token_ids: tuple[int, ...],
                    autocast_dtype: torch.dtype | None = None) -> HFEngine:  # fmt: skip
        """The engine for `rollout.engine: hf`: `rollout_cfg` (`rlhflab.config.RolloutConfig`, or
        None for the defaults) gives `decode`, `sync_every`, `cuda_graph`, `half_weights`.
        Raises ConfigError, naming the key, for a static decode on a model without a static KV
        cache, and for half weights without a bf16/fp16 autocast dtype or on a LoRA policy."""
        from rlhflab.errors import ConfigError
        from rlhflab.rollout.sampler import supports_static_decode

        decode = getattr(rollout_cfg, "decode", "eager")
        if decode == "static" and not supports_static_decode(unwrapped(model)):
            raise ConfigError(
                f"rollout.decode: static needs a model that takes a static KV cache; "
                f"{type(unwrapped(model)).__name__} does not (use rollout.decode=eager)"
            )
        half_weights = getattr(rollout_cfg, "half_weights", False)
        if half_weights:
            from rlhflab.models.lora import is_lora

            if autocast_dtype not in (torch.bfloat16, torch.float16):
                raise ConfigError(
                    "rollout.half_weights: needs a bf16 or fp16 compute dtype (autocast); "
                    f"this run computes in {autocast_dtype or 'the model dtype'}"
                )
            if is_lora(unwrapped(model)):
                raise ConfigError("rollout.half_weights: not for LoRA policies (model.lora)")
        return cls(
            model,
            pad_token_id=tokenizer.pad_token_id,
            stop_token_ids=stop_token_ids,
            autocast_dtype=autocast_dtype,
            decode=decode,
            sync_every=getattr(rollout_cfg, "sync_every", 8),
            cuda_graph=getattr(rollout_cfg, "cuda_graph", True),
            half_weights=half_weights,
        )

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        rows: list[int] | None = None,
        n_rows: int | None = None,
        width: int | None = None,
    ) -> Rollout:
        """`params.n` completions of each prompt (group-contiguous rows); see `RolloutEngine`."""
        stops = (*self.stop_token_ids, *params.stop_token_ids)
        if self.half is not None and not distributed.is_sharded(self.model):
            refresh_half_copy(self.half, self.model)  # a sharded policy's: at `wake`
        return sample(
            self.half if self.half is not None else self.model,
            [p for p in prompts for _ in range(params.n)],
            max_new_tokens=params.max_new_tokens,
            eos_token_id=stops[0],
            pad_token_id=self.pad_token_id,
            stop_token_ids=stops[1:],
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            greedy=params.greedy,
            generator=generator,
            autocast_dtype=self.autocast_dtype,
            rows=rows,
            n_rows=n_rows,
            width=width,
            decode=self.decode,
            sync_every=self.sync_every,
            cuda_graph=self.cuda_graph,
            prefix_store=self.prefix_store,
            stats=self.stats,
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Nothing to load: the engine samples with the live policy module."""

    @property
    def samples_live_policy(self) -> bool:
        """False with a half copy: the sharded policy is never gathered around `generate`."""
        return self.half is None

    def sleep(self) -> None:
        """Nothing to free."""

    def wake(self) -> None:
        """With a half copy of an FSDP2-sharded policy: refresh it, one parameter gathered at
        a time (a collective: every rank wakes the engine before generating, in step, as
        `lifecycle.generating` and `awake` do). Otherwise nothing to restore."""
        if self.half is not None and distributed.is_sharded(self.model):
            refresh_half_copy(self.half, self.model)


def _hf_class(module: torch.nn.Module) -> type:
    """The model's own class: FSDP2 makes a subclass `FSDP<Name>` of it at wrap time."""
    cls = type(module)
    while cls.__name__.startswith("FSDP") and len(cls.__mro__) > 2:
        cls = next(c for c in cls.__mro__[1:] if not c.__name__.startswith("FSDP"))
    return cls


def half_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """An empty copy of `model`'s architecture (a Hugging Face causal LM; DDP's `.module` is
    unwrapped, an FSDP2 model's own class is used) with its parameters in `dtype` on the
    model's device, for generation only (eval mode, no gradients).

    Built on the meta device and then allocated in `dtype` (`to_empty`), so no full copy in
    the model's own dtype is ever made: the memory is that of the copy alone (2 bytes a
    parameter in bf16). Buffers (rotary tables) are shared with the model as they are. The
    weights are undefined until `refresh_half_copy`.

    Raises:
        ValueError: a LoRA (peft) model, whose adapters the plain architecture does not have.
    """
    from rlhflab.models.lora import is_lora

    src = unwrapped(model)
    if is_lora(src):
        raise ValueError("half_weights: a LoRA policy has no plain architecture to copy")
    device = next(src.parameters()).device
    with torch.device("meta"):
        copy = _hf_class(src)(src.config)
    copy = copy.to(dtype).to_empty(device=device)
    if hasattr(copy, "tie_weights"):
        copy.tie_weights()  # to_empty allocates tied parameters separately
    for name, buf in src.named_buffers():
        owner, _, leaf = name.rpartition(".")
        copy.get_submodule(owner)._buffers[leaf] = buf
    return copy.eval().requires_grad_(False)


@torch.no_grad()
def refresh_half_copy(copy: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copy `model`'s current parameters into `copy` (`half_copy`), cast one tensor at a time.
    A parameter that is an FSDP2 shard (DTensor) is gathered alone (`full_tensor`, a collective:
    every rank refreshes, in the same order), so no rank holds more than one full float32
    parameter beyond its shards. Raises KeyError for a parameter the model does not have."""
    src = dict(unwrapped(model).named_parameters())
    for name, p in copy.named_parameters():
        s = src[name].detach()
        if hasattr(s, "full_tensor"):
            s = s.full_tensor()
        p.copy_(s)
