"""The environment protocol of multi-turn RL, and loading a user's environment class from YAML.

An environment is a Python class with two methods, in the reset/step shape of gymnasium adapted
to chat (as verl's agent loop and TRL's environment functions are):

    reset(problem) -> messages
        the opening chat messages ([{"role", "content"}, ...]) of one episode on `problem`
        (a `rlhflab.data.tasks.Problem` for task prompts);
    step(messages, assistant_turn) -> (observation | None, reward, done, info)
        after the model's turn (its text, stop token removed; `messages` is the conversation so
        far, that turn not yet appended): the next message for the model (a string, sent as a
        "user" message, or a {"role", "content"} dict, e.g. role "tool"), the reward of this
        step (an episode's reward is the sum over its steps), whether the episode is over, and a
        dict of diagnostics (`tool_call`: truthy when the turn called a tool; `success`: the
        episode's 0/1 outcome, for held-out success).

Configured as `env: {class: 'path/to/file.py:MyEnv', args: {...}}` (or 'package.module:MyEnv');
the class is constructed as `MyEnv(**args)`. Subclassing `Environment` is optional: it adds
`run_tool`, which runs a parsed tool call with the configured tool timeout.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhflab.envs.tools import TOOLS, UNSAFE_SETTING, ToolCall, check_sandbox, python_sandbox
from rlhflab.errors import ConfigError

__all__ = ["Environment", "StepResult", "as_step_result", "load_env"]


@dataclass
class StepResult:
    """What `step` returns, normalised: observation (a message dict or None), reward (float),
    done (bool), info (dict)."""

    observation: dict | None
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


class Environment:
    """Optional base class of environments (see the module docstring for the protocol).

    Attributes set by the trainer after construction: `tool_timeout_s` (wall-clock limit of one
    python tool call, seconds) and `tool_unsafe_local` (`env.tools.unsafe_local`: run the python
    tool without OS isolation where none works)."""

    tool_timeout_s: float = 5.0
    tool_unsafe_local: bool = False

    def reset(self, problem: Any) -> list[dict]:
        """The opening messages of an episode on `problem`."""
        raise NotImplementedError

    def step(self, messages: list[dict], assistant_turn: str):
        """(observation | None, reward, done, info) after the model's turn."""
        raise NotImplementedError

    def run_tool(self, call: ToolCall) -> str:
        """The output of a parsed tool call (`rlhflab.envs.tools.TOOLS`), or a one-line
        "error: ..." for an unknown tool. The python tool runs sandboxed with `tool_timeout_s`.

        Raises:
            SandboxUnavailable: a python call where no OS isolation works and
                `tool_unsafe_local` is False (`rlhflab.envs.tools.python_sandbox`)."""
        if call.name == "python":
            return python_sandbox(
                call.input, timeout_s=self.tool_timeout_s, unsafe_local=self.tool_unsafe_local
            )
        tool = TOOLS.get(call.name)
        if tool is None:
            return f"error: unknown tool '{call.name}' (tools: {', '.join(sorted(TOOLS))})"
        return tool(call.input)


def as_step_result(value: Any, where: str) -> StepResult:
    """`step`'s return value as a StepResult. Raises ConfigError (one line, naming `where`) when
    it is not a 4-tuple (observation str | dict | None, reward number, done bool, info dict)."""
    if isinstance(value, StepResult):
        return value
    if not isinstance(value, tuple) or len(value) != 4:
        raise ConfigError(
            f"{where}: step() must return (observation | None, reward, done, info), got "
            f"{type(value).__name__}"
        )
    obs, reward, done, info = value
    if isinstance(obs, str):
        obs = {"role": "user", "content": obs}
    elif obs is not None and not (
        isinstance(obs, dict) and isinstance(obs.get("content"), str) and "role" in obs
    ):
        raise ConfigError(
            f"{where}: step()'s observation must be a string, a {{'role', 'content'}} dict or "
            f"None, got {type(obs).__name__}"
        )
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ConfigError(f"{where}: step()'s reward must be a number, got {reward!r}")
    if not isinstance(info, dict):
        raise ConfigError(f"{where}: step()'s info must be a dict, got {type(info).__name__}")
    return StepResult(obs, float(reward), bool(done), info)


def import_module_of(where: str, field: str, *, prefix: str, reuse: bool = False):
    """The module `where` names: a file 'path/to/file.py' (relative to the working directory),
    executed as the module `prefix` + a hash of its resolved path and registered in
    `sys.modules` before it runs (dataclasses and pickling look modules up there), or an
    importable 'package.module'. `reuse`: a file already executed under that name is returned
    as it is (its classes keep one identity across several loads). Used by `env.class`,
    `env.verifiers` and `env.openenv`.

    Raises:
        ConfigError: "<field>: file '...' not found", or "<field>: importing '...' failed:
            <exception>" (one line).
    """
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"{field}: file '{where}' not found")
            mod_name = f"{prefix}{abs(hash(str(path.resolve())))}"
            module = sys.modules.get(mod_name) if reuse else None
            if module is None:
                mod_spec = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(mod_spec)
                sys.modules[mod_name] = module
                mod_spec.loader.exec_module(module)
            return module
        return importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:
        msg = " ".join(str(exc).split())
        raise ConfigError(
            f"{field}: importing '{where}' failed: {type(exc).__name__}: {msg}"
        ) from None


def load_env(
    spec: str,
    args: dict | None = None,
    *,
    tool_timeout_s: float = 5.0,
    unsafe_local: bool = False,
    print_fn=None,
) -> Any:
    """Construct the environment `spec` names: 'path/to/file.py:ClassName' (a file, relative to
    the working directory) or 'package.module:ClassName', called with `**args`; set its
    `tool_timeout_s` and `tool_unsafe_local`. With `unsafe_local` (`env.tools.unsafe_local:
    true`) and no working OS isolation here, prints one line saying that the python tool runs
    model-written code unisolated (`print_fn`, default: stderr).

    Raises:
        ConfigError: one line naming `env.class` or `env.args` — a spec without ':', a missing
            file or module, an import that fails, no such class, a class without callable
            `reset` and `step`, or a constructor that rejects `args`.
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(
            f"env.class: {spec!r} must be 'path/to/file.py:ClassName' or 'package.module:ClassName'"
        )
    where, name = spec.split(":")
    module = import_module_of(where, "env.class", prefix="rlhflab_user_env_")
    cls = getattr(module, name, None)
    if cls is None or not inspect.isclass(cls):
        raise ConfigError(f"env.class: '{where}' has no class '{name}'")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise ConfigError(f"env.class: {name} has no {method}() method (see docs/multiturn.md)")
    try:
        env = cls(**(args or {}))
    except Exception as exc:
        msg = " ".join(str(exc).split())
        raise ConfigError(f"env.args: {name}(**args) failed: {type(exc).__name__}: {msg}") from None
    env.tool_timeout_s = tool_timeout_s
    env.tool_unsafe_local = unsafe_local
    if unsafe_local:
        how = check_sandbox(unsafe_local=True)
        if how.startswith("none"):
            line = (
                f"warning: {UNSAFE_SETTING}: the python tool runs model-written code without OS "
                f"isolation (rlimits and an audit hook only; {how.split(';')[0]})"
            )
            (print_fn or (lambda m: print(m, file=sys.stderr)))(line)
    return env
