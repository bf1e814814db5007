"""Running episodes: the model and an environment take turns, token ids kept throughout.

All active episodes of a batch generate their next turn together through the rollout engine
(`engine.generate`, one completion per episode, its prompt the episode's whole token history).
With `EpisodeLimits.kv_reuse` (config `env.kv_reuse`, on by default) a turn does not prefill that
history again: the `hf` engine keeps each episode's KV cache from the end of its last turn and
forwards only the stop token and the observation (`rollout.engines.reusing_prefixes`); vLLM's
prefix cache does the same by itself. The tokens and log-probs are those of prefilling the
whole history, up to float rounding.

Under torchrun each data-parallel rank runs its share of the episodes, and a run equals one
process's (`run_episodes`' `row0` / `n_rows`): every episode samples with the noise of its global
row (the counter-based noise of `rlhflab.rollout.noise`), every rank takes part in every turn
round until the episodes of all ranks are done (a rank with none left takes the round's seed
from the generator without sampling, so the generators stay in step), and each round's prompt
width and token budget are the maxima over ranks. A turn's tokens therefore depend on the
episode's own history, its global row and the round's seed only, never on how many turns
another rank's episodes need.
A model turn is kept exactly as sampled (ids and sampler log-probs, stop token included); an
observation is encoded once, as the chat-template delta that follows an assistant turn
(`observation_ids`), and appended as ids. Earlier turns are never re-tokenised, so the
trajectory the trainer scores is token for token what the sampler saw.

Limits (`EpisodeLimits`): at most `max_turns` model turns; at most `max_turn_tokens` tokens per
turn; at most `max_episode_tokens` tokens after the opening prompt (model and observation
tokens together); and the model's context length. An episode that hits a limit before the
environment says done is `truncated` and keeps the reward collected so far.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from rlhflab import distributed
from rlhflab.data.formatting import encode_prompt, render_messages
from rlhflab.envs.base import as_step_result
from rlhflab.errors import ConfigError
from rlhflab.rollout.engines import SamplingParams, reusing_prefixes
from rlhflab.rollout.sampler import draw_seed
from rlhflab.rollout.trajectory import Trajectory, pack_trajectories

__all__ = ["EpisodeBatch", "EpisodeLimits", "observation_ids", "run_episodes"]


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode budgets: model turns, tokens per model turn, tokens after the opening prompt
    (model + observations), and the model's context length (prompt included); and whether a
    turn continues from the episode's KV cache (`kv_reuse`, see the module docstring)."""

    max_turns: int
    max_turn_tokens: int
    max_episode_tokens: int
    context_length: int
    kv_reuse: bool = True


@dataclass
class EpisodeBatch:
    """Finished episodes, row-aligned: the trajectories (a `Trajectory`), the summed rewards
    (B,) float32, and per episode: its number of model turns, of tool calls, its success (the
    env's `info["success"]` of the last step, else reward == 1), the model turns' texts joined
    by " | " (for samples and text rewards) and the conversation."""

    trajectory: Trajectory
    rewards: torch.Tensor
    turns: list[int]
    tool_calls: list[int]
    success: list[float]
    texts: list[str]
    messages: list[list[dict]] = field(default_factory=list)
    # reward components by name, one value per episode (the last step's `info["components"]`,
    # e.g. a verifiers rubric's functions; 0.0 where an episode has none); the names an env
    # declares in `component_names` are always present
    components: dict[str, list[float]] = field(default_factory=dict)

    def totals(self) -> dict[str, float]:
        """Sums over the batch's episodes: "episodes" (their number), "success", "turns",
        "tool_calls", "truncated" (episodes a limit ended), as Python floats: summed over ranks
        (`distributed.sum_dict`), then divided by the episodes, they are the batch's means."""
        return {
            "episodes": float(len(self.turns)),
            "success": float(sum(self.success)),
            "turns": float(sum(self.turns)),
            "tool_calls": float(sum(self.tool_calls)),
            "truncated": float(self.trajectory.truncated.sum()),
        }

    def per_episode(self) -> dict[str, list[float]]:
        """Per-episode lists, in row order: success (0/1), turns, tool_calls, truncated (0/1)."""
        return {
            "success": list(self.success),
            "turns": [float(t) for t in self.turns],
            "tool_calls": [float(c) for c in self.tool_calls],
            "truncated": [float(t) for t in self.trajectory.truncated.tolist()],
        }


def observation_ids(tokenizer, message: dict) -> list[int]:
    """Token ids of `message` as it follows an assistant turn in the chat template, up to and
    including the next assistant header: the template's rendering of [user, assistant, message]
    with the generation prompt, minus its rendering of [user, assistant].

    Raises ConfigError when the template's rendering of the longer conversation does not start
    with the shorter one's (the delta is then undefined), or renders the message as nothing."""
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    short = render_messages(tokenizer, base, add_generation_prompt=False)
    long = render_messages(tokenizer, [*base, message], add_generation_prompt=True)
    if not long.startswith(short) or len(long) == len(short):
        raise ConfigError(
            f"env: the chat template does not render a '{message.get('role')}' message as a "
            "suffix after an assistant turn; use role 'user' for observations"
        )
    return encode_prompt(tokenizer, long[len(short) :])


def run_episodes(
    engine,
    tokenizer,
    env,
    problems: list,
    sampling: SamplingParams,
    limits: EpisodeLimits,
    *,
    generator: torch.Generator | None = None,
    row0: int = 0,
    n_rows: int | None = None,
) -> EpisodeBatch | None:
    """Run one episode per problem (the batch's rows, in order) and return them (None for a rank
    with no problems, which still takes part in every round; see the module docstring).

    `env` is the configured instance; each episode works on a shallow copy of it
    (`copy.copy`), so `reset` may keep per-episode state on `self`. `sampling` gives the
    sampling distribution (its `n` must be 1 and its `max_new_tokens` is replaced by the
    episode's remaining budget). One `engine.generate` call per turn round, with all active
    episodes. `row0`: the global row of this rank's first episode; `n_rows`: the episodes of
    all ranks (default: this rank's, one process). Every rank must call it (collectives).

    Raises:
        ConfigError: an opening prompt that leaves no room to generate, or an environment that
            returns malformed messages or step results (one line naming the episode).
    """
    if sampling.n != 1:
        raise ValueError("run_episodes: sampling.n must be 1 (repeat problems for groups)")
    stops = set(engine.stop_token_ids) | set(sampling.stop_token_ids)
    n = len(problems)
    envs = [copy.copy(env) for _ in range(n)]
    messages, prompts = [], []
    for i, (e, p) in enumerate(zip(envs, problems, strict=True)):
        msgs = e.reset(p)
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ConfigError(f"env: reset() of episode {i} must return a non-empty message list")
        messages.append(list(msgs))
        prompts.append(encode_prompt(tokenizer, render_messages(tokenizer, msgs)))
        if len(prompts[-1]) >= limits.context_length:
            raise ConfigError(
                f"env: episode {i}'s opening prompt has {len(prompts[-1])} tokens, no room in "
                f"the model's context of {limits.context_length}"
            )
    tokens: list[list[int]] = [[] for _ in range(n)]
    is_model: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    rewards = [0.0] * n
    turns, calls = [0] * n, [0] * n
    success: list[float | None] = [None] * n
    parts: list[dict] = [{} for _ in range(n)]  # info["components"] of each episode's last step
    truncated = [False] * n
    texts: list[list[str]] = [[] for _ in range(n)]
    active = list(range(n))
    device = engine_device(engine)
    with reusing_prefixes(engine, limits.kv_reuse):  # the caches live for this batch
        while True:
            budgets = [_budget(prompts[i], tokens[i], limits) for i in active]
            # this round over all ranks: episodes still running, the widest history, the budget
            local = [len(active), max((len(prompts[i]) + len(tokens[i]) for i in active), default=0),
                     max(budgets, default=0)]  # fmt: skip
            n_active, width, budget = distributed.all_reduce_max(
                torch.tensor(local, dtype=torch.long, device=distributed.device())
            ).tolist()
            if n_active == 0:
                break
            if not active:  # the draw `generate` would take: stay in step with the other ranks
                if not sampling.greedy:
                    draw_seed(generator, device)
                continue
            params = SamplingParams(
                n=1, max_new_tokens=budget, temperature=sampling.temperature,
                top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
                greedy=sampling.greedy, stop_token_ids=sampling.stop_token_ids,
            )  # fmt: skip
            out = engine.generate(
                [prompts[i] + tokens[i] for i in active], params, generator=generator,
                rows=[row0 + i for i in active], n_rows=n_rows or n, width=width,
            )  # fmt: skip
            ids_all, mask_all, lp_all = (
                out.completion_ids.tolist(),
                out.mask.tolist(),
                out.logp.tolist(),
            )
            still = []
            for row, (i, budget) in enumerate(zip(active, budgets, strict=True)):
                turn = [t for t, m in zip(ids_all[row], mask_all[row], strict=True) if m][:budget]
                lp = lp_all[row][: len(turn)]
                stopped = bool(turn) and turn[-1] in stops
                tokens[i] += turn
                is_model[i] += [1] * len(turn)
                logps[i] += lp
                turns[i] += 1
                text = tokenizer.decode(turn[:-1] if stopped else turn, skip_special_tokens=False)
                texts[i].append(text)
                res = as_step_result(envs[i].step(messages[i], text), f"env: episode {i}")
                messages[i].append({"role": "assistant", "content": text})
                rewards[i] += res.reward
                calls[i] += 1 if res.info.get("tool_call") else 0
                if "success" in res.info:
                    success[i] = float(res.info["success"])
                if isinstance(res.info.get("components"), dict):
                    parts[i] = res.info["components"]
                if res.done:
                    continue
                obs = observation_ids(tokenizer, res.observation) if res.observation else []
                room = _budget(prompts[i], tokens[i] + obs, limits)
                if not stopped or turns[i] >= limits.max_turns or room < 1:
                    truncated[i] = True  # a limit ended it before the environment did
                    continue
                tokens[i] += obs
                is_model[i] += [0] * len(obs)
                logps[i] += [0.0] * len(obs)
                messages[i].append(res.observation)
                still.append(i)
            active = still
    if n == 0:
        return None
    trajectory = pack_trajectories(
        prompts, tokens, is_model, logps, truncated, tokenizer.pad_token_id
    ).to(engine_device(engine))
    return EpisodeBatch(
        trajectory=trajectory,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        turns=turns,
        tool_calls=calls,
        success=[
            s if s is not None else float(r == 1.0) for s, r in zip(success, rewards, strict=True)
        ],
        texts=[" | ".join(t) for t in texts],
        messages=messages,
        components={
            k: [float(p.get(k, 0.0)) for p in parts]
            for k in sorted({*getattr(env, "component_names", ()), *(k for p in parts for k in p)})
        },
    )


def _budget(prompt: list[int], tokens: list[int], limits: EpisodeLimits) -> int:
    """Tokens the next model turn may take: the per-turn budget, what is left of the episode's
    and of the context."""
    return min(
        limits.max_turn_tokens,
        limits.max_episode_tokens - len(tokens),
        limits.context_length - len(prompt) - len(tokens),
    )


def engine_device(engine) -> torch.device:
    """The device the engine's model lives on (CPU for engines without a module)."""
    model = getattr(engine, "model", None)
    if model is None:
        return torch.device("cpu")
    return next(model.parameters()).device


def evaluate_episodes(
    engine, tokenizer, env, problems: list, limits: EpisodeLimits, *, batch_size: int
) -> dict[str, list[float]]:
    """Held-out episodes: greedy turns on every problem, in batches of `batch_size`. Returns
    per-episode lists, in problem order: success (0/1), turns, tool_calls, truncated (0/1).
    Under torchrun each batch is shared out over the ranks (contiguous shares) and the lists
    gathered in rank order, so every rank returns one process's lists; every rank must call it."""
    out: dict[str, list[float]] = {"success": [], "turns": [], "tool_calls": [], "truncated": []}
    greedy = SamplingParams(n=1, max_new_tokens=limits.max_turn_tokens, greedy=True)
    for s in range(0, len(problems), batch_size):
        chunk = problems[s : s + batch_size]
        r0, r1 = distributed.shard_bounds(len(chunk), even=False)
        batch = run_episodes(engine, tokenizer, env, chunk[r0:r1], greedy, limits, row0=r0,
                             n_rows=len(chunk))  # fmt: skip
        mine = batch.per_episode() if batch is not None else {k: [] for k in out}
        for part in distributed.all_gather_object(mine):  # rank order: problem order
            for k in out:
                out[k] += part[k]
    return out
