"""An engine's life cycle around a generation, written once: the policy in eval mode, the engine
awake (a colocated vLLM's weights and KV cache back on the GPU), a sharded policy gathered; then
the engine asleep (its memory freed for the update) and the policy back in train mode. Part of
`rlhflab.rollout.engines` (re-exported there)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rlhflab.rollout.engines.base import RolloutEngine


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
    for an unsharded model); then the engine asleep and `model.train()` — unless `train_after`
    is False (a frozen teacher stays in eval mode). The train mode is set only when the body
    returns: a body that raises leaves the model in eval mode, the engine asleep."""
    from rlhflab import distributed

    model.eval()
    with awake(engine), distributed.gathered(model):
        yield engine
    if train_after:
        model.train()
