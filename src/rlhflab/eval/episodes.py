"""Held-out evaluation of a multi-turn run's model by episodes with the run's environment, as the
trainers evaluate it (`rlhflab.experience.Sampler.evaluate_episodes`): one greedy episode
per held-out problem (`rlhflab.envs.episodes.evaluate_episodes`), the model and the environment
taking turns within the run's `env` limits; success is the environment's `info["success"]`."""

from __future__ import annotations

#: The headline of an evaluation by episodes (its `accuracy` is the success rate, as the trainer
#: logs `eval/accuracy`).
EPISODE_HEADLINE = "episode success (greedy, the run's environment)"


def episode_limits(env, *, rollout_max_new_tokens: int, context: int):
    """The trainer's `EpisodeLimits` for an `env` section (`EnvConfig`): a turn's budget
    defaults to `rollout.max_new_tokens`, an episode's to the model's context; `env.kv_reuse`."""
    from rlhflab.envs.episodes import EpisodeLimits

    return EpisodeLimits(
        max_turns=env.max_turns,
        max_turn_tokens=env.max_turn_tokens or rollout_max_new_tokens,
        max_episode_tokens=env.max_episode_tokens or context,
        context_length=context,
        kv_reuse=getattr(env, "kv_reuse", True),
    )


def summarize_episodes(per: dict[str, list[float]], env_class: str) -> dict:
    """The result of `evaluate_episodes`'s per-episode lists: accuracy (= success rate) with its
    standard error, n, and the means of turns, tool_calls and truncated (as the trainer logs
    them), with the headline named `EPISODE_HEADLINE`."""
    from rlhflab.eval.accuracy import mean_and_stderr

    accuracy, stderr = mean_and_stderr(per["success"])
    n = max(1, len(per["success"]))
    return {
        "n": len(per["success"]),
        "accuracy": accuracy,
        "accuracy_stderr": stderr,
        "headline_name": EPISODE_HEADLINE,
        "headline": accuracy,
        "headline_stderr": stderr,
        **{k: sum(per[k]) / n for k in ("turns", "tool_calls", "truncated")},
        "env": env_class,
    }


def load_and_run_episodes(
    model_path: str,
    rows: list,
    env,
    *,
    rollout_max_new_tokens: int,
    batch_size: int,
    engine: str = "hf",
    gguf_file: str | None = None,
) -> dict:
    """Load the model and tokenizer at `model_path` (the GPU when there is one, else the CPU)
    and run one greedy episode per row with the environment of `env` (an `EnvConfig`:
    `env.class`, its `args`, `max_turns`, the token limits, `tool_timeout_s`), `batch_size`
    episodes at a time, sampled by the rollout engine `engine`.

    Returns:
        `summarize_episodes`'s dict: n, accuracy (success rate), accuracy_stderr, headline,
        turns, tool_calls, truncated, env.
    Raises:
        ConfigError: the environment cannot be built (`rlhflab.envs.load_env`), the engine
            cannot run here, or an episode's opening prompt leaves no room to generate.
    """
    import torch

    from rlhflab.config import RolloutConfig
    from rlhflab.envs import load_env
    from rlhflab.envs.episodes import evaluate_episodes
    from rlhflab.models.loading import context_length, load_model, load_tokenizer
    from rlhflab.rollout.engines import make_engine

    spec, args = env.target()
    environment = load_env(
        spec, args, tool_timeout_s=env.tool_timeout_s, unsafe_local=env.tools.unsafe_local
    )
    tokenizer = load_tokenizer(model_path, gguf_file=gguf_file)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(model_path, device=device, gguf_file=gguf_file).eval()
    sampler = make_engine(RolloutConfig(engine=engine), model, tokenizer)
    limits = episode_limits(
        env, rollout_max_new_tokens=rollout_max_new_tokens, context=context_length(model)
    )
    with torch.no_grad():
        per = evaluate_episodes(
            sampler, tokenizer, environment, rows, limits, batch_size=batch_size
        )
    name = env.class_ or env.verifiers or env.openenv.make
    return summarize_episodes(per, name)
