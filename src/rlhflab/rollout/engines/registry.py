"""The rollout engines as one table: `rollout.engine` name → the class that implements it
(imported on first use, so vLLM is imported only by runs that ask for it). The config's
`rollout.engine` choices and the CLI's `--engine` choices are this table's keys. Every engine class
has `from_config(rollout_cfg, model, tokenizer, *, stop_token_ids, autocast_dtype)`. Part of
`rlhflab.rollout.engines` (re-exported there)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from rlhflab.rollout.engines.base import RolloutEngine, stop_ids_for, unwrapped

if TYPE_CHECKING:  # annotations only: the config and the CLI read the table without torch
    import torch

#: name → "module:Class"; add an engine here and it is a valid `rollout.engine` everywhere.
ENGINES: dict[str, str] = {
    "hf": "rlhflab.rollout.engines.hf:HFEngine",
    "vllm": "rlhflab.rollout.engines.vllm:VLLMEngine",
}
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def engine_class(name: str) -> type:
    """The class of engine `name` (imported now). Raises ConfigError for a name not in
    `ENGINES`."""
    from rlhflab.errors import ConfigError

    if name not in ENGINES:
        raise ConfigError(f"rollout.engine: unknown engine {name!r}; choose one of "
                          f"{list(ENGINES)}")  # fmt: skip
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_engine(
    rollout_cfg, model: torch.nn.Module, tokenizer, *, autocast_dtype: torch.dtype | None = None
) -> RolloutEngine:
    """The engine `rollout_cfg.engine` names (a key of `ENGINES`) for `model`.

    `rollout_cfg` is a config section with `engine`, `stop_token_ids` and the engine's own keys
    (see `rlhflab.config.RolloutConfig`), or None for the `hf` engine with the model's stop ids.
    Under torchrun every rank calls this at the same point (the vllm engine is one per rank and
    its first weight push gathers FSDP2 shards). Raises ConfigError for an engine that cannot
    run here (an unknown name, vllm not installed, a tensor-parallel size that does not fit the
    ranks, an option the engine refuses for this model)."""
    stops = stop_ids_for(unwrapped(model), tokenizer, getattr(rollout_cfg, "stop_token_ids", ()))
    cls = engine_class(getattr(rollout_cfg, "engine", "hf"))
    return cls.from_config(rollout_cfg, model, tokenizer, stop_token_ids=stops,
                           autocast_dtype=autocast_dtype)  # fmt: skip
