"""What every rollout engine shares: `SamplingParams` (how to sample), the `RolloutEngine`
protocol, and the stop set (`stop_ids_for`). Part of `rlhflab.rollout.engines` (re-exported there;
its docstring says what an engine is)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the config and the CLI read this package without torch
    import torch
    from torch import Tensor

    from rlhflab.rollout.sampler import Rollout


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
    # True: `generate` runs the trainer's own module, so a sharded (FSDP2) policy is gathered
    # around it (`lifecycle.generating`); False: the engine samples from weights of its own
    # (vLLM's; the hf engine's half copy), filled without ever gathering the whole policy.
    samples_live_policy: bool

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


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a DDP-style wrapper (its `.module`), else `model`."""
    return getattr(model, "module", model)  # DDP keeps the HF model in .module
