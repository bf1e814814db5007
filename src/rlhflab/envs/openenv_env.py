"""An OpenEnv environment, run in-process, behind rlhflab's env protocol (`env: {openenv: ...}`).

OpenEnv (openenv-core, tested: 0.3.0) environments are gymnasium-shaped servers with typed
messages: `Environment.reset(seed, episode_id) -> Observation` and `step(Action) ->
Observation`, the observation carrying `done`, `reward` and `metadata`
(openenv/core/env_server/interfaces.py `Environment`, types.py `Action` / `Observation`).
Actions and observations are environment-specific pydantic models, not chat text, so the user
supplies the two translations:

    make(**args) -> Environment          a fresh environment (one per episode: OpenEnv
                                         environments keep their episode's state on self)
    action(text) -> Action               the model's turn as the environment's action
    render(observation) -> str           an observation as the next user message

Episodes: one per training row, a row being a reset seed (`n_train` seeds 0.., `n_heldout`
held-out seeds after them). `reset` renders the reset observation as the opening user message;
each `step` renders the next observation as the following user message until `done`. The reward
of a step is the observation's `reward` (None → 0; OpenEnv computes it inside `step`, with the
environment's own rubric if it has one), an episode's the sum over its steps; numeric entries of
the last observation's `metadata` are logged as reward components.

Not supported: OpenEnv clients over HTTP / WebSocket / containers (`EnvClient`, `from_docker_
image`, `AutoEnv`): only in-process `Environment` objects; MCP tool environments'
`CallToolAction` unless `action` builds it; `step_async`-only environments; an environment
that wants its episode's token ids (it sees text only).
"""

from __future__ import annotations

from rlhflab.data.prompts import PromptRow
from rlhflab.envs.base import import_module_of
from rlhflab.errors import ConfigError

__all__ = ["OpenEnvEnv"]


def _load_callable(spec: str, field: str):
    """The callable 'path/to/file.py:fn' or 'package.module:fn' names.
    Raises ConfigError naming `field`."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"{field}: {spec!r} must be 'file.py:fn' or 'package.module:fn'")
    where, name = spec.split(":")
    module = import_module_of(where, field, prefix="rlhflab_user_openenv_", reuse=True)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"{field}: '{where}' has no function '{name}'")
    return fn


class OpenEnvEnv:
    """An in-process OpenEnv environment as an rlhflab environment (module docstring).

    Args:
        make, action, render: 'file.py:fn' / 'package.module:fn' specs (module docstring).
        args: keyword arguments of `make`.
        n_train, n_heldout: reset seeds for training rows / held-out rows.

    Raises:
        ConfigError: openenv-core missing, a spec that cannot be loaded, or `make` that does
            not return an OpenEnv `Environment` (checked once here).
    """

    def __init__(self, make: str, action: str, render: str, args: dict | None = None,
                 n_train: int = 256, n_heldout: int = 32) -> None:  # fmt: skip
        try:
            from openenv.core.env_server.interfaces import Environment
        except ImportError as exc:
            raise ConfigError(
                f"env.openenv: needs openenv-core (pip install 'rlhflab[envs]'): {exc}"
            ) from None
        self.make = _load_callable(make, "env.openenv.make")
        self.to_action = _load_callable(action, "env.openenv.action")
        self.render = _load_callable(render, "env.openenv.render")
        self.args = dict(args or {})
        self.n_train, self.n_heldout = n_train, n_heldout
        probe = self._new()
        if not isinstance(probe, Environment):
            raise ConfigError(
                f"env.openenv.make: returned {type(probe).__name__}, not an OpenEnv Environment"
            )
        probe.close()
        self.env = None

    def _new(self):
        try:
            return self.make(**self.args)
        except Exception as exc:
            msg = " ".join(str(exc).split())
            raise ConfigError(
                f"env.args: make(**args) failed: {type(exc).__name__}: {msg}"
            ) from None

    def prompt_rows(self) -> tuple[list[PromptRow], list[PromptRow]]:
        """(train rows, held-out rows): one per reset seed (the prompt a label only; the
        opening message is the rendered reset observation)."""

        def rows(seeds):
            return [PromptRow(f"openenv episode, seed {s}", {"seed": s}, index=s) for s in seeds]

        n = self.n_train
        return rows(range(n)), rows(range(n, n + self.n_heldout))

    def reset(self, problem) -> list[dict]:
        """A fresh environment reset with the row's seed; its observation as a user message."""
        seed = int(problem.columns["seed"])
        self.env = self._new()
        obs = self.env.reset(seed=seed, episode_id=f"seed-{seed}")
        if obs.done:
            raise ConfigError(f"env.openenv: the episode of seed {seed} is done at reset")
        return [{"role": "user", "content": str(self.render(obs))}]

    def step(self, messages: list[dict], assistant_turn: str):
        """The turn's text as an action; (rendered observation | None, reward, done, info)."""
        obs = self.env.step(self.to_action(assistant_turn))
        reward = float(obs.reward or 0.0)
        if not obs.done:
            return {"role": "user", "content": str(self.render(obs))}, reward, False, {}
        components = {
            k: float(v)
            for k, v in (obs.metadata or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self.env.close()
        return None, reward, True, {"components": components}
