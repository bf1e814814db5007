"""Helpers shared by the evaluation commands (`rlhflab eval` in `eval/cli.py`, best-of-N in
`eval/best_of_n.py`)."""

from __future__ import annotations


def reward_components_from_specs(specs: list[str]) -> list:
    """`--reward-fn` values ("math_verify", "pkg.mod:fn", "file.py:fn", each optionally
    "=WEIGHT") as RewardComponentConfigs. Raises ConfigError naming the spec."""
    from pydantic import ValidationError

    from rlhflab.config import RewardComponentConfig
    from rlhflab.errors import ConfigError
    from rlhflab.rewards.functions import REWARD_FUNCTIONS

    if not specs:
        raise ConfigError("a prompt dataset needs at least one --reward-fn")
    components = []
    for spec in specs:
        target, _, weight = spec.partition("=")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(f"--reward-fn {spec!r}: weight {weight!r} is not a number") from None
        try:
            if target in REWARD_FUNCTIONS:
                components.append(RewardComponentConfig(name=target, weight=w))
            else:
                components.append(RewardComponentConfig(function=target, weight=w))
        except ValidationError as exc:
            msg = exc.errors()[0]["msg"].removeprefix("Value error, ")
            raise ConfigError(f"--reward-fn {spec!r}: {msg}") from None
    return components


def load_and_evaluate(
    model_path: str, rows: list, scorer, *, gguf_file=None, engine: str = "hf", **kw
) -> dict:
    """Load the model and tokenizer at `model_path` (a GGUF file inside it when `gguf_file`) on
    the GPU when there is one, else the CPU, and `evaluate` it on `rows` (keywords: evaluate's),
    sampling with the rollout engine `engine` ("hf" or "vllm", default settings of
    `rollout.vllm`). Raises ConfigError when the engine cannot run here."""
    import torch

    from rlhflab.config import RolloutConfig
    from rlhflab.eval.accuracy import evaluate
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rollout.engines import make_engine

    tokenizer = load_tokenizer(model_path, gguf_file=gguf_file)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(model_path, device=device, gguf_file=gguf_file)
    sampler = make_engine(RolloutConfig(engine=engine), model, tokenizer)
    return evaluate(model, tokenizer, rows, scorer, engine=sampler, **kw)
