"""An engine's life cycle around a generation, written once: the policy in eval mode, the engine
awake (a colocated vLLM's weights and KV cache back on the GPU), a sharded policy gathered; then
the engine asleep (its memory freed for the update) and the policy back in train mode; and
`sample_chunks`, generation in chunks with the texts decoded, for code that samples outside a
training loop (evaluation, data for reward models and DPO, the replications); and
`reusing_prefixes`, KV reuse across the turns of multi-turn episodes. Part of
`rlhflab.rollout.engines` (re-exported there)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rlhflab.rollout.engines.base import RolloutEngine
    from rlhflab.rollout.sampler import Rollout


@contextlib.contextmanager
def awake(engine: RolloutEngine) -> Iterator[RolloutEngine]:
    """`engine.wake()`, the body, `engine.sleep()` — the sleep also when the body raises. For
    code that generates through `engine` and sets the model's mode itself (held-out evaluation).
    """
    engine.wake()
    try:
        yield engine
    finally:
        engine.sleep()


@contextlib.contextmanager
def generating(model: torch.nn.Module, engine: RolloutEngine, *,
               train_after: bool = True) -> Iterator[RolloutEngine]:  # fmt: skip
    """One generation from `model` through `engine`: `model.eval()`, the engine `awake`, the
    model's full parameters on every rank while the body runs (`distributed.gathered`; nothing
    for an unsharded model, nor for an engine with weights of its own:
    `engine.samples_live_policy` False); then the engine asleep and `model.train()` — unless
    `train_after` is False (a frozen teacher stays in eval mode). The train mode is set only
    when the body returns: a body that raises leaves the model in eval mode, the engine asleep."""
    from rlhflab import distributed

    model.eval()
    live = getattr(engine, "samples_live_policy", True)
    with awake(engine), distributed.gathered(model) if live else contextlib.nullcontext():
        yield engine
    if train_after:
        model.train()


@contextlib.contextmanager
def reusing_prefixes(engine: RolloutEngine, enabled: bool = True) -> Iterator[RolloutEngine]:
    """KV reuse for the `generate` calls of the body (one batch of multi-turn episodes): a turn
    whose prompt extends a finished sequence starts from that sequence's KV cache. The `hf`
    engine keeps the caches itself (`HFEngine.reuse_prefixes`, freed on exit); an engine without
    `reuse_prefixes` (vLLM, whose own prefix cache finds the shared prefix) is used as it is.
    `enabled` False: every turn prefills its whole prompt."""
    start = getattr(engine, "reuse_prefixes", None)
    if not enabled or start is None:
        yield engine
        return
    with start():
        yield engine


def sample_chunks(model: torch.nn.Module, engine: RolloutEngine, tokenizer, prompts: list[list[int]],
                  params, *, chunk: int | None = None, generator: torch.Generator | None = None,
                  desc: str | None = None) -> list[tuple[int, Rollout, list[str]]]:  # fmt: skip
    """`params.n` completions of every prompt (token-id lists) through `engine`, `chunk` prompts
    per `generate` call (None: all at once), decoded (stopping at the engine's stop ids), with
    `model` in eval mode and its mode restored afterwards; `desc` shows a progress bar.

    The engine's life cycle (`awake`) and gathering a sharded model stay the caller's: this
    runs inside them. The random stream `generator` is consumed chunk after chunk, as one loop of
    `generate` calls would.

    Returns:
        [(index of the chunk's first prompt, its `Rollout` (rows group-contiguous), its texts)].
    """
    from rlhflab.rollout.sampler import decode_completions
    from rlhflab.tracking import progress

    step = chunk or max(1, len(prompts))
    starts = range(0, len(prompts), step)
    was_training = model.training
    model.eval()
    out = []
    try:
        for s in progress(starts, desc) if desc else starts:
            ro = engine.generate(prompts[s : s + step], params, generator=generator)
            out.append((s, ro, decode_completions(tokenizer, ro, engine.stop_token_ids)))
    finally:
        model.train(was_training)
    return out
