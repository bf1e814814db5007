"""Multi-turn environments and tools (docs/multiturn.md).

- `base`: the environment protocol (`reset(problem) -> messages`, `step(messages,
  assistant_turn) -> (observation | None, reward, done, info)`) and `load_env`, which builds the
  class a config's `env.class` names;
- `tools`: tool-call parsing, the calculator and the sandboxed Python executor;
- `episodes`: running episodes with a rollout engine, token ids kept, into `Trajectory` rollouts;
- `arithmetic`: a built-in calculator environment for arithmetic tasks;
- `calculator_demos`: its SFT demonstrations (`python -m rlhflab.envs.calculator_demos CONFIG`).
"""

from rlhflab.envs.base import Environment, StepResult, load_env

__all__ = ["Environment", "StepResult", "load_env"]
