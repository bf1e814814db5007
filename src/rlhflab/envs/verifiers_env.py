"""A `verifiers` environment behind rlhflab's env protocol (`env: {verifiers: ...}`).

Targets the classic verifiers API — `SingleTurnEnv` / `MultiTurnEnv` with a `Parser` and a
`Rubric` — shipped as `verifiers.legacy` (aliased as `import verifiers as vf`) in verifiers
0.3.x (tested: 0.3.1). verifiers 0.4.0 removed it (only the `verifiers.v1` agent/harness stack is
left, which runs a program against an OpenAI-compatible HTTP endpoint), so this adapter refuses
0.4 with one line.

How an episode runs (source: verifiers/legacy/envs/multiturn_env.py `MultiTurnEnv.rollout`,
envs/environment.py `_run_rollout_state`, rubrics/rubric.py `Rubric.score_rollout`):

- `reset(row)` starts verifiers' own `env.rollout(input, client, model, sampling_args)` as an
  asyncio task on this adapter's event loop, with `client` a `_TurnClient`: a verifiers `Client`
  whose `get_response` does not call any model — it hands the turn's prompt messages to rlhflab
  and waits. The opening messages are the prompt verifiers asks the model to answer.
- `step(messages, text)` answers that request with the model's turn (text; the tokens stay
  rlhflab's) and runs the rollout on until it asks for the next turn — the new messages after
  the assistant turn (verifiers' `env_response`) are the observation — or ends (its stop
  conditions: `max_turns`, `final_env_response`, errors). At the end the rubric scores the
  state (`rubric.score_rollout`, then `rubric.cleanup`, as `_run_rollout_state` does): the reward
  is `state["reward"]` (Σ weight · function) and `info["components"]` holds every rubric
  function's score by name (logged as `rollout/reward/<name>_mean`).

Why a client that waits and not an OpenAI-style HTTP client backed by the engine: rlhflab's
episode loop batches every active episode's turn into one `engine.generate` call and keeps the
sampled token ids; a client that generated would sample each episode alone and return text that
rlhflab would have to re-tokenise. Here verifiers only ever sees the text of tokens rlhflab
already holds, so the trajectory's ids and sampler log-probs are the sampled ones and only model
tokens carry loss (`rlhflab.envs.episodes`).

Not supported: group reward functions (`score_group`; refused at load), native tool calls
(OpenAI `tool_calls`: the model's turn is plain text, so `ToolEnv` sees no calls — write the
tool protocol into `env_response`, as the tests do), non-text message content, several
observation messages of different roles in one turn (same-role ones are joined by newlines).
An episode that one of rlhflab's limits ends (turn tokens, `env.max_turns`, episode tokens)
before verifiers does is not scored by the rubric: its reward is 0.
"""

from __future__ import annotations

import asyncio
import time
import weakref

from rlhflab.data.prompts import PromptRow
from rlhflab.envs.base import import_module_of
from rlhflab.errors import ConfigError

__all__ = ["VerifiersEnv", "load_verifiers_env"]

MODEL = "rlhflab"  # the model name verifiers records (no model is called by that name)


def _vf():
    """The classic verifiers API (`verifiers.legacy` as `verifiers`), or ConfigError."""
    try:
        import verifiers as vf
        from verifiers.legacy.clients.client import Client  # noqa: F401  (0.3.x layout)
    except ImportError as exc:
        raise ConfigError(
            f"env.verifiers: needs verifiers 0.3.x (pip install 'rlhflab[envs]'): {exc}"
        ) from None
    return vf


def load_verifiers_env(spec: str, args: dict | None = None):
    """Build the verifiers environment `spec` names with `**args`: 'path/to/file.py:fn' or
    'package.module:fn' (the function is called), or an installed environment module's name
    ('my-env' → module `my_env`, its `load_environment`).

    Raises:
        ConfigError: one line naming `env.verifiers` — a missing file or module, an import
            that fails, no such function, a call that raises, or a result that is not a
            verifiers environment with a dataset and a rubric.
    """
    vf = _vf()
    if not isinstance(spec, str) or not spec or spec.count(":") > 1:
        raise ConfigError(
            f"env.verifiers: {spec!r} must be 'file.py:fn', 'package.module:fn' or a module name"
        )
    where, _, name = spec.partition(":")
    name = name or "load_environment"
    if not where.endswith(".py"):
        where = where.replace("-", "_")  # an installed environment's name ('my-env' → my_env)
    module = import_module_of(where, "env.verifiers", prefix="rlhflab_user_vf_env_")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"env.verifiers: '{where}' has no function '{name}'")
    try:
        env = fn(**(args or {}))
    except Exception as exc:
        msg = " ".join(str(exc).split())
        raise ConfigError(f"env.args: {name}(**args) failed: {type(exc).__name__}: {msg}") from None
    if not isinstance(env, vf.Environment):
        raise ConfigError(
            f"env.verifiers: {name}() returned {type(env).__name__}, not a verifiers Environment"
        )
    rubric = env.rubric
    groups = getattr(rubric, "rubrics", [rubric])
    if any(r.has_group_rewards for r in groups):
        raise ConfigError(
            "env.verifiers: the rubric has group reward functions (score_group), not supported"
        )
    return env


def _as_dicts(messages) -> list[dict]:
    """verifiers messages (pydantic models or dicts) as {"role", "content"} dicts.
    Raises ConfigError for non-text content."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        content = d.get("content") or ""
        if not isinstance(content, str):
            raise ConfigError("env.verifiers: only text message content is supported")
        out.append({"role": d["role"], "content": content})
    return out


def _close(loop: asyncio.AbstractEventLoop, shared: dict) -> None:
    """Cancel the rollouts still waiting for a model turn (their clean-up runs), close `loop`."""
    pending = [t for t in shared["tasks"] if not t.done()]
    for t in pending:
        t.cancel()
    if pending and not loop.is_closed():
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    shared["tasks"].clear()
    if not loop.is_closed():
        loop.close()


class _TurnClient:
    """Built by `_client_class()` as a subclass of verifiers' `Client`; see the module doc."""


def _client_class():
    """A verifiers `Client` whose `get_response` waits for rlhflab's turn (module docstring)."""
    from verifiers.legacy.clients.client import Client
    from verifiers.legacy.types import Response, ResponseMessage

    class TurnClient(Client):
        def __init__(self, episode: _Episode) -> None:
            super().__init__(None)
            self.episode = episode

        def setup_client(self, config):  # no provider behind it
            return None

        async def to_native_tool(self, tool):
            raise NotImplementedError

        async def to_native_prompt(self, messages):
            raise NotImplementedError

        async def get_native_response(self, *a, **k):
            raise NotImplementedError

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            raise NotImplementedError

        async def close(self) -> None:
            return None

        async def get_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            ep = self.episode
            ep.request = _as_dicts(prompt)
            ep.answer = asyncio.get_running_loop().create_future()
            text = await ep.answer
            msg = ResponseMessage(role="assistant", content=text, finish_reason="stop",
                                  is_truncated=False, tokens=None)  # fmt: skip
            return Response(id="rlhflab", created=int(time.time()), model=model, message=msg)

    return TurnClient


class _Episode:
    """One rollout's rendezvous: the prompt verifiers asks to answer, the future it waits on."""

    def __init__(self) -> None:
        self.request: list[dict] | None = None
        self.answer: asyncio.Future | None = None
        self.task: asyncio.Task | None = None


class VerifiersEnv:
    """A verifiers environment as an rlhflab environment (module docstring).

    Args:
        load: 'file.py:fn', 'package.module:fn' or an installed environment module's name.
        args: keyword arguments of that function.

    Rows (`prompt_rows`): the environment's dataset (`get_dataset()`) for training and its
    `eval_dataset` (if any) held out; a row's `prompt` is the dataset's formatted prompt messages
    (system prompt and few-shot included) and its columns `answer`, `info`, `task`,
    `example_id` go back to verifiers as the rollout's input.
    """

    def __init__(self, load: str, args: dict | None = None) -> None:
        self.vf_env = load_verifiers_env(load, args)
        self.client_class = _client_class()
        rubrics = getattr(self.vf_env.rubric, "rubrics", [self.vf_env.rubric])
        # every rubric function's name: logged each step, 0 for episodes a limit cut off
        self.component_names = [f.__name__ for r in rubrics for f in r.funcs]
        self.loop = asyncio.new_event_loop()
        self.episode: _Episode | None = None
        # shared by the per-episode copies: the rollouts started, and whether the last call was
        # a step (a reset after a step starts a new batch of episodes)
        self.shared = {"tasks": [], "stepped": False}
        # at garbage collection or exit: cancel the last batch's unfinished rollouts, close the loop
        weakref.finalize(self, _close, self.loop, self.shared)

    # -- Prompts ---------------------------------------------------------------------------------
    def prompt_rows(self) -> tuple[list[PromptRow], list[PromptRow]]:
        """(train rows, held-out rows) from the environment's dataset and eval dataset."""
        train = self._rows(self.vf_env.get_dataset(), "dataset")
        heldout = []
        if getattr(self.vf_env, "eval_dataset", None) is not None:
            heldout = self._rows(self.vf_env.get_eval_dataset(), "eval_dataset")
        return train, heldout

    @staticmethod
    def _rows(dataset, what: str) -> list[PromptRow]:
        rows = []
        for i, r in enumerate(dataset):
            r = dict(r)
            prompt = r.pop("prompt", None)
            if prompt is None:
                raise ConfigError(f"env.verifiers: {what} row {i} has no 'prompt'")
            prompt = _as_dicts(prompt) if isinstance(prompt, list) else prompt
            rows.append(PromptRow(prompt, r, index=i))
        return rows

    # -- Episodes --------------------------------------------------------------------------------
    def reset(self, problem) -> list[dict]:
        """Start verifiers' rollout on `problem` (a `PromptRow` of `prompt_rows`); the messages
        it asks the model to answer first."""
        columns = dict(getattr(problem, "columns", {}) or {})
        columns.setdefault("example_id", getattr(problem, "index", 0))
        inp = {"prompt": problem.prompt, **columns}
        if self.shared["stepped"]:
            self._cancel_unfinished()
        self.episode = ep = _Episode()
        client = self.client_class(ep)
        ep.task = self.loop.create_task(self._run(inp, client))
        self.shared["tasks"].append(ep.task)
        self._advance()
        if ep.request is None:
            raise ConfigError(self._ended_early(ep))
        return list(ep.request)

    def _cancel_unfinished(self) -> None:
        """Cancel the rollouts of the previous batch that are still waiting for a model turn (an
        rlhflab limit ended them before verifiers did); their `finally` clean-up runs."""
        pending = [t for t in self.shared["tasks"] if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.shared["tasks"].clear()
        self.shared["stepped"] = False

    async def _run(self, inp: dict, client):
        """`Environment._run_rollout_state` with score_rollouts on (environment.py)."""
        env = self.vf_env
        state = await env.rollout(inp, client, MODEL, None)
        await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
        return state

    def _advance(self) -> None:
        """Run the loop until the rollout waits for a model turn or finishes."""
        ep = self.episode

        async def until_request_or_done():
            while not ep.task.done() and (ep.answer is None or ep.answer.done()):
                await asyncio.sleep(0)

        self.loop.run_until_complete(until_request_or_done())

    @staticmethod
    def _ended_early(ep: _Episode) -> str:
        err = ep.task.exception() if ep.task.done() else None
        state = ep.task.result() if ep.task.done() and err is None else {}
        why = err or state.get("error") or state.get("stop_condition")
        return f"env.verifiers: the rollout ended before asking the model ({why!r})"

    def step(self, messages: list[dict], assistant_turn: str):
        """Answer verifiers' pending request with `assistant_turn`; (observation, 0, False, info)
        when it asks for another turn, (None, reward, True, info) with `info["components"]`
        (each rubric function's score) when it ends."""
        ep = self.episode
        self.shared["stepped"] = True
        before = len(ep.request)
        ep.answer.set_result(assistant_turn)
        self._advance()
        if not ep.task.done():
            new = ep.request[before + 1 :]  # after the prompt and this assistant turn
            return self._observation(new), 0.0, False, {}
        err = ep.task.exception()
        if err is not None:
            raise ConfigError(f"env.verifiers: the rollout raised {type(err).__name__}: {err}")
        state = ep.task.result()
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()}
        info = {"components": metrics, "stop_condition": state.get("stop_condition")}
        if state.get("error") is not None:
            info["error"] = repr(state["error"])
        return None, float(state.get("reward") or 0.0), True, info

    @staticmethod
    def _observation(new: list[dict]) -> dict | None:
        """verifiers' env_response messages as one observation message (same-role contents
        joined by newlines). Raises ConfigError for messages of different roles."""
        if not new:
            return None
        roles = {m["role"] for m in new}
        if len(roles) > 1:
            raise ConfigError(
                f"env.verifiers: env_response returned messages of several roles {sorted(roles)}"
                "; rlhflab takes one observation message per turn"
            )
        return {"role": new[0]["role"], "content": "\n".join(m["content"] for m in new)}
