"""The sampler of every trainer that samples (policy gradient, distillation): prompts in, a scored,
gathered batch out, in the mode the `rollout` section asks for.

`Sampler.next_batch(step, model)` returns the step's global batch (`ScoredBatch`, group-contiguous:
the `group_size` completions of a prompt are adjacent rows) and the sampling statistics:
- `sync` (rollout.mode): `prompts_per_step` prompts from the prompt stream, `group_size`
  completions each, sampled by the trainer's current policy, then scored;
- `dynamic` (rollout.dynamic_sampling.enabled): rounds of prompts until every kept group's rewards
  vary (DAPO, `rlhflab.rollout.dynamic.dynamic_sample`);
- `async` (rollout.mode "async"): the batch was sampled ahead by a behaviour copy of the policy in a
  background thread (`rlhflab.rollout.async_rollouts`) or, with `rollout.async_worker: process`,
  in a spawned process (`rlhflab.rollout.async_process`), at most `rollout.max_staleness`
  updates old;
- with an `env` section, every row is an episode: the model and the environment take turns
  (`rlhflab.envs.episodes`), the reward the environment's.

Each data-parallel rank samples and scores a contiguous share of the groups (global rows: the
draws do not depend on how the groups are split), and the scored shares are gathered, so every
rank returns the same global batch. The engine's life cycle (eval mode, wake, gather, sleep, train
mode) is `rlhflab.rollout.engines.generating`, around every generation here. The sampler's random
stream (`generators()`: the checkpoint key "sampler") and, under async, the queued batches
(`state()`: the key "async_rollouts") are checkpointed, so a resumed run draws what an
uninterrupted one would.

Scoring is the trainer's `Scorer` (`rlhflab.experience.scoring`): reward components (policy
gradient) or the verifier only (distillation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from functools import partial

import torch

from rlhflab import distributed
from rlhflab.errors import ConfigError
from rlhflab.experience.prompts import PromptSet
from rlhflab.experience.scoring import Scorer
from rlhflab.rewards.shaping import dense_step_rewards
from rlhflab.rollout.dynamic import ScoredBatch, dynamic_sample
from rlhflab.rollout.engines import SamplingParams, awake, generating, make_engine
from rlhflab.rollout.sampler import decode_completions, draw_seed

__all__ = ["Sampler", "check_engine_layout"]


class Sampler:
    """Prompts → scored batches for one run (module doc).

    Args:
        cfg: the trainer's config; reads `rollout`, `seed`, `train.steps`, `precision.threads`
            and, when present, `env`.
        prompts: the run's `PromptSet`, encoded (`PromptSet.encode`).
        model: the policy (wrapped for data parallelism); the `hf` engine samples with it.
        tokenizer: the policy's tokenizer.
        scorer: a `Scorer`.
        device: where batches live.
        autocast_dtype: the engine's autocast dtype (None: off).
        context: the model's context length (episode limits).

    Raises:
        ConfigError: the environment of `env` cannot be built (`rlhflab.envs.load_env`).
    """

    def __init__(self, cfg, prompts: PromptSet, model, tokenizer, scorer: Scorer, *, device,
                 autocast_dtype, context: int) -> None:  # fmt: skip
        r = cfg.rollout
        self.prompts, self.tokenizer, self.scorer, self.device = prompts, tokenizer, scorer, device
        self.rollout = r
        self.group_size, self.prompts_per_step = r.group_size, r.prompts_per_step
        self.model, self.autocast_dtype = model, autocast_dtype
        self._other: tuple | None = None  # (a frozen model, its hf engine): `draw_from`
        # The rollout engine (rollout.engine): "hf" samples with `model` itself; "vllm" holds its
        # own copy of the weights, pushed after every update (`sync_weights`).
        self.engine = make_engine(r, model, tokenizer, autocast_dtype=autocast_dtype)
        self.sampling = SamplingParams(
            n=r.group_size, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
            top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
        )  # fmt: skip
        self.rng = torch.Generator(device=device).manual_seed(cfg.seed)
        env = getattr(cfg, "env", None)
        self.env = self.limits = None
        if env is not None:
            self.env = self._load_env(env, r.max_new_tokens, context)
        # rollout.mode "async": a background thread generates the next batches with a behaviour
        # copy of the policy while the trainer updates (rlhflab.rollout.async_rollouts).
        self.async_rollouts = self.group = None
        if r.mode == "async" and r.async_worker == "process":  # a spawned generation process
            from rlhflab.rollout.async_process import ProcessRollouts

            if torch.device(device).type != "cpu":
                raise ConfigError(
                    "rollout.async_worker 'process' runs on the CPU only; use 'thread' on GPUs"
                )
            self.async_rollouts = ProcessRollouts(
                model,
                partial(make_engine, r, tokenizer=tokenizer, autocast_dtype=autocast_dtype),
                tokenizer,
                self._request_behind,
                self._finish_behind,
                max_staleness=r.max_staleness,
                total_steps=cfg.train.steps,
                threads=cfg.precision.threads,
            )
        elif r.mode == "async":  # (not with FSDP2: `check_engine_layout`)
            from rlhflab.rollout.async_rollouts import AsyncRollouts

            # the background thread gathers its batches on a group of its own (the main thread's
            # collectives run meanwhile on the run's group)
            self.group = distributed.side_group()
            self.async_rollouts = AsyncRollouts(
                model,
                lambda m: make_engine(r, m, tokenizer, autocast_dtype=autocast_dtype),
                self._generate_behind,
                max_staleness=r.max_staleness,
                total_steps=cfg.train.steps,
                threads=cfg.precision.threads,
            )

    # -- Checkpointed state ----------------------------------------------------------------------
    def generators(self) -> dict[str, torch.Generator]:
        """The random streams to checkpoint (key "sampler")."""
        return {"sampler": self.rng}

    def state(self) -> dict:
        """Under async, {"async_rollouts": the queued batches} (waiting for them first: they move
        the random stream, the prompt stream and the verifier's counters); else {}. Call it
        before the checkpointer reads the generators and the prompt stream."""
        if self.async_rollouts is None:
            return {}
        return {"async_rollouts": self.async_rollouts.state()}

    def load(self, state: dict) -> None:
        """Continue from a `state()` (a checkpoint's trainer state)."""
        if self.async_rollouts is not None and "async_rollouts" in state:
            problems_of = partial(self.prompts.problems_of, group_size=self.group_size)
            self.async_rollouts.load(state["async_rollouts"], problems_of, self.device)

    def close(self) -> None:
        """Stop the background generation, if any."""
        if self.async_rollouts is not None:
            self.async_rollouts.close()

    # -- Batches ---------------------------------------------------------------------------------
    def next_batch(self, step: int, model) -> tuple[ScoredBatch, dict]:
        """The global batch of `step` and its sampling statistics: "verifier_errors" (the
        verifier's error count as of this batch) and, with dynamic sampling, "rounds",
        "prompts_drawn", "zero_std_group_frac"; under async, "staleness" and
        "behaviour_version". `model` is the trainer's policy (async: its weights are queued for
        the later batches)."""
        if self.async_rollouts is not None:  # sampled behind: wait for this step's batch
            batch, stats, _ = self.async_rollouts.next(step, model)
            return batch, stats
        stream = self.prompts.stream
        if not self.rollout.dynamic_sampling.enabled:
            batch, stats = (
                self.draw(list(itertools.islice(stream, self.prompts_per_step)), step),
                {},
            )
        else:
            ds = self.rollout.dynamic_sampling
            batch, stats = dynamic_sample(
                itertools.islice(stream, ds.max_rounds * self.prompts_per_step),
                partial(self.draw, step=step),
                n_groups=self.prompts_per_step,
                group_size=self.group_size,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        return batch, {**stats, "verifier_errors": self.scorer.verifier.n_errors}

    def _generate_behind(self, step: int, model, engine) -> tuple[ScoredBatch, dict, list[int]]:
        """The batch of `step` in the background thread (rollout.mode "async"), with the
        behaviour copy `model` and its `engine`; returns (batch, stats, prompt indices)."""
        chosen = list(itertools.islice(self.prompts.stream, self.prompts_per_step))
        batch = self.draw(chosen, step, model=model, engine=engine, group=self.group)
        return batch, {"verifier_errors": self.scorer.verifier.n_errors}, chosen

    def draw(self, chosen: list[int], step: int, *, model=None, engine=None,
             train_after: bool = True, group=None) -> ScoredBatch:  # fmt: skip
        """`group_size` completions of each prompt index in `chosen` (the global list), scored;
        the global batch on every rank. `model` / `engine` replace the policy and its engine (the
        async behaviour copy, a GKD teacher with `train_after` False: it stays in eval mode);
        `group`: the process group of the gather (the async thread's own)."""
        if self.env is not None:
            return self._draw_episodes(chosen)
        model = self.model if model is None else model
        engine = self.engine if engine is None else engine
        device, g, ids = self.device, self.group_size, self.prompts.ids
        g0, g1 = distributed.shard_bounds(len(chosen), even=False)
        mine = chosen[g0:g1]
        if not mine:  # more ranks than prompts in a dynamic-sampling round's remainder
            draw_seed(self.rng, device)  # the draw `generate` would take: stay in step
            self.scorer.idle(device)
            return ScoredBatch.gather(None, self.tokenizer.pad_token_id, device, group)
        with generating(model, engine, train_after=train_after):
            rollout = engine.generate(
                [ids[i] for i in mine],
                self.sampling,
                generator=self.rng,
                rows=list(range(g0 * g, g1 * g)),  # global rows: the noise of a row
                n_rows=len(chosen) * g,
                width=max(len(ids[i]) for i in chosen),  # the global batch's prompt width
            )
        texts = decode_completions(self.tokenizer, rollout, engine.stop_token_ids)
        return self._scored(step, mine, rollout, texts, group)

    def _scored(self, step: int, mine: list[int], rollout, texts: list[str],
                group=None) -> ScoredBatch:  # fmt: skip
        """This rank's rollout of the prompt indices `mine`, scored, then the global batch."""
        device = self.device
        problems = self.prompts.problems_of(mine, self.group_size)
        dense = []  # dense-credit components' step rewards (a PRM's, per token)
        rewards, components = self.scorer.score(
            texts, rollout, problems, where=f"step {step}", dense=dense
        )
        components = {k: v.to(device) for k, v in components.items()}
        step_rewards, steps = dense_step_rewards(dense, rollout.mask)
        local = ScoredBatch(rollout, rewards.to(device), components, texts, problems,
                            step_rewards=step_rewards, steps=steps)  # fmt: skip
        return ScoredBatch.gather(local, self.tokenizer.pad_token_id, device, group)

    def _request_behind(self, step: int) -> tuple[list[int], dict | None]:
        """The first half of `draw` for a generation process (rollout.async_worker "process"):
        the step's prompt indices and this rank's request (None when it has no prompts). The
        one seed `generate` draws is taken from the sampler's generator here, in step order; the
        request carries the generator's state before it, so the worker draws the same seed."""
        chosen = list(itertools.islice(self.prompts.stream, self.prompts_per_step))
        g, ids = self.group_size, self.prompts.ids
        g0, g1 = distributed.shard_bounds(len(chosen), even=False)
        rng_state = self.rng.get_state()
        draw_seed(self.rng, self.device)  # the worker's engine takes this very draw
        if g0 == g1:
            return chosen, None
        return chosen, {
            "rng_state": rng_state, "prompts": [ids[i] for i in chosen[g0:g1]],
            "params": self.sampling, "rows": list(range(g0 * g, g1 * g)),
            "n_rows": len(chosen) * g, "width": max(len(ids[i]) for i in chosen),
        }  # fmt: skip

    def _finish_behind(self, step: int, chosen: list[int], rollout, texts: list[str]):
        """The second half: the worker's rollout scored and gathered (on the run's group, in
        the trainer's thread); returns (global batch, stats)."""
        g0, g1 = distributed.shard_bounds(len(chosen), even=False)
        stats = lambda: {"verifier_errors": self.scorer.verifier.n_errors}  # noqa: E731
        if rollout is None:
            self.scorer.idle(self.device)
            return ScoredBatch.gather(None, self.tokenizer.pad_token_id, self.device), stats()
        rollout = rollout.to(self.device)
        return self._scored(step, chosen[g0:g1], rollout, texts), stats()

    def draw_from(self, model, chosen: list[int], step: int) -> ScoredBatch:
        """`draw` with another, frozen model sampling (a GKD teacher), through an `hf` engine of
        its own (built at the first call); the model stays in eval mode. The same random stream
        as the policy's draws."""
        if self._other is None or self._other[0] is not model:
            engine = make_engine(None, model, self.tokenizer, autocast_dtype=self.autocast_dtype)
            self._other = (model, engine)
        return self.draw(chosen, step, model=model, engine=self._other[1], train_after=False)

    def greedy(self, prompts: list[list[int]], problems: list, step: int
               ) -> tuple[torch.Tensor, int]:  # fmt: skip
        """One greedy completion of each of this rank's prompts (token lists; `problems` their
        rows) with the rollout's budget, scored: ReMax's baseline. Returns (rewards (n,),
        completion tokens generated)."""
        n = len(prompts)
        g0 = distributed.shard_bounds(self.prompts_per_step)[0]
        greedy = SamplingParams(n=1, max_new_tokens=self.rollout.max_new_tokens, greedy=True)
        with generating(self.model, self.engine) as engine:
            rollout = engine.generate(
                prompts, greedy, generator=torch.Generator(device=self.device).manual_seed(0),
                rows=list(range(g0, g0 + n)), n_rows=self.prompts_per_step,
                width=max(len(p) for p in prompts),
            )  # fmt: skip
        texts = decode_completions(self.tokenizer, rollout, engine.stop_token_ids)
        where = f"step {step} (greedy baseline)"
        rewards, _ = self.scorer.score(texts, rollout, problems, where=where)
        return rewards, int(rollout.mask.sum().item())

    # -- Evaluation and the engine ---------------------------------------------------------------
    @contextlib.contextmanager
    def evaluating(self) -> Iterator:
        """The engine awake for a held-out evaluation that sets the model's mode itself; yields
        the engine to sample with."""
        with awake(self.engine) as engine:
            yield engine

    def sync_weights(self, model) -> None:
        """Push `model`'s updated weights to the engine (`hf`: nothing to do)."""
        self.engine.update_weights(model.named_parameters())

    # -- Multi-turn episodes (cfg.env; rlhflab.envs, docs/multiturn.md) ---------------------------
    def _load_env(self, env, max_new_tokens: int, context: int):
        """The configured environment (one instance per rank); sets the episode limits
        (`self.limits`)."""
        from rlhflab.envs import load_env
        from rlhflab.eval.episodes import episode_limits

        self.limits = episode_limits(env, rollout_max_new_tokens=max_new_tokens, context=context)
        if self.prompts.env is not None:  # data.source "env": built once, for its rows
            return self.prompts.env
        spec, args = env.target()
        return load_env(
            spec, args, tool_timeout_s=env.tool_timeout_s, unsafe_local=env.tools.unsafe_local
        )

    def _draw_episodes(self, chosen: list[int]) -> ScoredBatch:
        """`group_size` episodes per chosen problem (rows group-contiguous), the reward the
        environment's summed step rewards; one trajectory per episode, its loss mask 1 on the
        model's tokens only (rlhflab.rollout.trajectory). Each rank runs a contiguous share of
        the groups with the noise of their global rows (`run_episodes`); the shares are gathered,
        and the episode statistics are over all of them."""
        from rlhflab.envs.episodes import run_episodes

        device, g = self.device, self.group_size
        g0, g1 = distributed.shard_bounds(len(chosen), even=False)
        problems = self.prompts.problems_of(chosen[g0:g1], g)
        one = dataclasses.replace(self.sampling, n=1)  # one row per episode
        with generating(self.model, self.engine) as engine:
            out = run_episodes(engine, self.tokenizer, self.env, problems, one, self.limits,
                               generator=self.rng, row0=g0 * g, n_rows=len(chosen) * g)  # fmt: skip
        local, sums = (
            None,
            dict.fromkeys(("episodes", "success", "turns", "tool_calls", "truncated"), 0.0),
        )
        if out is not None:
            components = {"success": torch.tensor(out.success, device=device)}
            for name, values in out.components.items():  # e.g. a verifiers rubric's functions
                components[name] = torch.tensor(values, dtype=torch.float32, device=device)
            local = ScoredBatch(out.trajectory.to(device), out.rewards.to(device), components,
                                out.texts, problems)  # fmt: skip
            sums = out.totals()
        batch = ScoredBatch.gather(local, self.tokenizer.pad_token_id, device)
        sums = distributed.sum_dict(sums)
        n = max(1.0, sums["episodes"])
        batch.info = {
            "rollout/success": sums["success"] / n,
            "rollout/turns_mean": sums["turns"] / n,
            "rollout/tool_calls_mean": sums["tool_calls"] / n,
            "rollout/episode_truncated_frac": sums["truncated"] / n,
        }
        return batch

    def evaluate_episodes(self, rows: list, *, batch_size: int) -> dict:
        """One greedy episode per held-out row (shared out over the ranks,
        `envs.episodes.evaluate_episodes`): {"accuracy" (= success rate), "accuracy_stderr",
        "n", and the means of "turns", "tool_calls", "truncated"} (`eval.episodes`'s summary)."""
        from rlhflab.envs.episodes import evaluate_episodes
        from rlhflab.eval.episodes import summarize_episodes

        with generating(self.model, self.engine) as engine:
            per = evaluate_episodes(engine, self.tokenizer, self.env, rows, self.limits,
                                    batch_size=batch_size)  # fmt: skip
        summary = summarize_episodes(per, env_class="")
        keys = ("accuracy", "accuracy_stderr", "n", "turns", "tool_calls", "truncated")
        return {k: summary[k] for k in keys}


def check_engine_layout(rollout, world_size: int) -> None:
    """Refuse, before any collective, a sampling layout that does not fit the ranks: a vLLM
    tensor-parallel size that does not divide `world_size` (or combines with what it cannot);
    rollout.mode "async" with FSDP2 over several processes (the behaviour copy is a whole
    replica of the policy: DDP only, for now).

    Raises:
        ConfigError: naming `rollout.vllm.tensor_parallel_size` (`rlhflab.rollout.engines.vllm`)
            or `rollout.mode`.
    """
    if rollout.mode == "async" and distributed.loads_from_rank0():
        raise ConfigError(
            "rollout.mode 'async' under torchrun needs parallel.strategy 'ddp' (the behaviour "
            "copy is a whole replica of the policy; fsdp2: not yet)"
        )
    if rollout.engine == "vllm":  # a TP group is a group of ranks
        from rlhflab.rollout.engines.vllm import check_parallel

        check_parallel(rollout.vllm.tensor_parallel_size, world_size,
                       dynamic=rollout.dynamic_sampling.enabled)  # fmt: skip
