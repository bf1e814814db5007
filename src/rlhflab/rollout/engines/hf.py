"""The `hf` rollout engine: our KV-cache sampler on the live policy module.

It samples with the very module the trainer updates, so `update_weights` has nothing to load and
`sleep` / `wake` nothing to free, and the sampler log-probs are the trainer's (mismatch 0 up to
float rounding). A group's prompt is prefilled once and its KV cache shared by the group's
samples (`rlhflab.rollout.sampler.sample`, prefix sharing).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from rlhflab.rollout.engines import SamplingParams
from rlhflab.rollout.sampler import DECODE_PATHS, Rollout, sample


class HFEngine:
    """Samples from `model` (a Hugging Face causal LM, possibly DDP/FSDP-wrapped) in-process.

    Args:
        model: the policy module; the caller puts it in eval mode (and gathers sharded
            parameters) around `generate`.
        pad_token_id: written after a completion stops.
        stop_token_ids: the stop set, EOS first (`rlhflab.rollout.engines.stop_ids_for`).
        autocast_dtype: forwards under torch.autocast with this dtype, as the trainer's.
        decode, sync_every, cuda_graph: the sampler's decode loop ("eager" or "static"), the
            static loop's tokens between host checks, and whether it captures its step as a
            CUDA graph on CUDA (`rlhflab.rollout.sampler.sample`; config `rollout.decode`,
            `rollout.sync_every`, `rollout.cuda_graph`).

    Raises:
        ValueError: no stop token, an unknown `decode`, or sync_every < 1.
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
    ) -> None:
        if not stop_token_ids:
            raise ValueError("HFEngine: stop_token_ids must hold at least EOS")
        if decode not in DECODE_PATHS or sync_every < 1:
            raise ValueError(
                f"HFEngine: decode must be one of {list(DECODE_PATHS)} and sync_every >= 1 "
                f"(got decode={decode!r}, sync_every={sync_every})"
            )
        self.decode, self.sync_every, self.cuda_graph = decode, sync_every, cuda_graph
        self.model = model
        self.pad_token_id = pad_token_id
        self.stop_token_ids = tuple(stop_token_ids)
        self.autocast_dtype = autocast_dtype

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
        return sample(
            self.model,
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
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Nothing to load: the engine samples with the live policy module."""

    def sleep(self) -> None:
        """Nothing to free."""

    def wake(self) -> None:
        """Nothing to restore."""
