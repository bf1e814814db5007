"""Rollout engines: one seam between the trainers and whatever generates completions.

An engine takes token-id prompts and `SamplingParams` and returns the `Rollout` the trainers use
(token ids, sampler log-probs, completion mask, truncated flags), `n` completions per prompt,
group-contiguous. It receives the policy's new weights after an update (`update_weights`) and may
free its memory while the trainer updates (`sleep` / `wake`, colocated mode). Trainers never import
an inference library; an engine never computes a loss.

Engines (`rollout.engine`):
- `hf`   — our KV-cache sampler (`rlhflab.rollout.sampler.sample`) on the live policy module: the
           default, the CPU and teaching path. Sampler log-probs equal the trainer's by
           construction (same module, same arithmetic), so the training–inference mismatch is 0.
- `vllm` — vLLM's offline `LLM` in the trainer's process (colocated; one per torchrun rank),
           weights pushed in place after every update (LoRA merged in the push).
           Optional: `pip install rlhflab[vllm]` (see README).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rlhflab.rollout.sampler import Rollout

ENGINES = ("hf", "vllm")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: the fields of vLLM's `SamplingParams` that the trainers use.

    Attributes:
        n: completions per prompt (a group); the rollout has len(prompts) × n rows, prompt i's
            samples in rows i·n … i·n + n − 1.
        max_new_tokens: generation budget per completion.
        temperature, top_p, top_k, min_p: the sampling distribution softmax(logits / τ) truncated
            to the top-k / nucleus / min-p set (top_k 0, top_p 1, min_p 0: off). Sampler log-probs
            are those of the tempered distribution before truncation (TRL / verl convention).
        greedy: argmax decoding (evaluation); log-probs then at temperature 1.
        stop_token_ids: stop tokens besides the engine's own (EOS and the model's other
            end-of-turn ids); a completion stops at the first one and keeps it.
    """

    n: int = 1
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams: n and max_new_tokens must be >= 1 "
                f"(got n={self.n}, max_new_tokens={self.max_new_tokens})"
            )
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1:
            raise ValueError(
                f"SamplingParams: need temperature > 0, 0 < top_p <= 1, 0 <= min_p < 1 (got "
                f"temperature={self.temperature}, top_p={self.top_p}, min_p={self.min_p})"
            )


class RolloutEngine(Protocol):
    """What every engine provides (see the module docstring)."""

    name: str
    stop_token_ids: tuple[int, ...]  # the engine's stop set: EOS first, then the others

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
        """`params.n` completions per prompt → Rollout of len(prompts)·n rows (group-contiguous).

        One seed is drawn from `generator` per call whatever the engine, so RNG streams stay in
        step across engines and data-parallel ranks. `rows` / `n_rows` / `width`: the global rows
        of the output rows, the global batch size and prompt width (data parallelism; see
        `rlhflab.rollout.sampler.sample`); engines that cannot honour them raise."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load the policy's current parameters (HF names) into the engine."""
        ...

    def sleep(self) -> None:
        """Free what the engine holds between rollouts (colocated mode)."""
        ...

    def wake(self) -> None:
        """Undo `sleep` before the next `generate`."""
        ...


def stop_ids_for(model, tokenizer, extra: Sequence[int] = ()) -> tuple[int, ...]:
    """EOS, then the model's other end ids (generation_config.eos_token_id may be a list, as in
    Llama-3 instruct), then `extra`; without repeats. Raises ModelError without an EOS id."""
    from rlhflab.errors import ModelError

    if tokenizer.eos_token_id is None:
        raise ModelError("the tokenizer has no eos_token_id: the sampler needs a stop token")
    ids = [int(tokenizer.eos_token_id)]
    gen = getattr(model, "generation_config", None)
    more = getattr(gen, "eos_token_id", None) if gen is not None else None
    more = [] if more is None else [more] if isinstance(more, int) else list(more)
    for i in [*more, *extra]:
        if int(i) not in ids:
            ids.append(int(i))
    return tuple(ids)


def make_engine(
    rollout_cfg, model: torch.nn.Module, tokenizer, *, autocast_dtype: torch.dtype | None = None
) -> RolloutEngine:
    """The engine `rollout_cfg.engine` names ("hf" or "vllm") for `model`.

    `rollout_cfg` is a config section with `engine`, `stop_token_ids` and `vllm` (see
    `rlhflab.config.RolloutConfig`), or None for the `hf` engine with the model's stop ids.
    Under torchrun every rank calls this at the same point (the vllm engine is one per rank and
    its first weight push gathers FSDP2 shards). Raises ConfigError for an engine that cannot
    run here (vllm not installed, a tensor-parallel size that does not fit the ranks)."""
    from rlhflab.errors import ConfigError

    stops = stop_ids_for(_unwrapped(model), tokenizer, getattr(rollout_cfg, "stop_token_ids", ()))
    name = getattr(rollout_cfg, "engine", "hf")
    if name == "hf":
        from rlhflab.rollout.engines.hf import HFEngine
        from rlhflab.rollout.sampler import supports_static_decode

        if getattr(rollout_cfg, "decode", "eager") == "static" and not supports_static_decode(
            _unwrapped(model)
        ):
            raise ConfigError(
                f"rollout.decode: static needs a model that takes a static KV cache; "
                f"{type(_unwrapped(model)).__name__} does not (use rollout.decode=eager)"
            )
        if getattr(rollout_cfg, "half_weights", False):
            from rlhflab.models.lora import is_lora

            if autocast_dtype not in (torch.bfloat16, torch.float16):
                raise ConfigError(
                    "rollout.half_weights: needs a bf16 or fp16 compute dtype (autocast); "
                    f"this run computes in {autocast_dtype or 'the model dtype'}"
                )
            if is_lora(_unwrapped(model)):
                raise ConfigError("rollout.half_weights: not for LoRA policies (model.lora)")

        return HFEngine(
            model,
            pad_token_id=tokenizer.pad_token_id,
            stop_token_ids=stops,
            autocast_dtype=autocast_dtype,
            decode=getattr(rollout_cfg, "decode", "eager"),
            sync_every=getattr(rollout_cfg, "sync_every", 8),
            cuda_graph=getattr(rollout_cfg, "cuda_graph", True),
            half_weights=getattr(rollout_cfg, "half_weights", False),
        )
    if name == "vllm":  # LoRA policies too: adapters are merged into the pushed weights
        from rlhflab.rollout.engines.vllm import VLLMEngine

        return VLLMEngine.from_model(
            _unwrapped(model), tokenizer, rollout_cfg.vllm, stop_token_ids=stops
        )
    raise ConfigError(f"rollout.engine: unknown engine {name!r}; choose one of {list(ENGINES)}")


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP keeps the HF model in .module
