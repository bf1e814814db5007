"""Policy-gradient RL with verifier rewards: the REINFORCE / RLOO / PPO / GRPO family, composed from
named parts.

Each step reads top to bottom (`PolicyGradient.step`; phases 1-2 drawn through the experience
layer's `Sampler`, rlhflab.experience; phases 3-6 in rlhflab.trainers.pg_phases):
    1. rollout     sample `group_size` completions for each of `prompts_per_step` prompts; with
                   dynamic sampling, keep drawing prompts until every group's rewards vary;
                   async, the batch a behaviour copy sampled ahead; with an env, episodes
    2. rewards     score every completion: Σ weight·component (verifier correctness, format, length,
                   overlong, ...), each component logged on its own
    3. old / ref   log-probs of the pre-update policy (when more than one optimizer step uses the
                   batch, or the KL goes into the reward), of the reference policy (when kl.coef > 0)
                   and the critic's values (when there is a value model), without gradients;
                   with `prime:`, PRIME's implicit PRM gives every token its reward and takes its
                   own optimizer step (rlhflab.trainers.prime)
    4. advantages  KL into the reward if kl.placement says so (per sequence or per token), then
                   `loss.advantage` (group baselines on sequence rewards; GAE on token rewards and
                   values), optionally whitened
    5. update      update_epochs × minibatches optimizer steps; each accumulates micro-batches of
                   `loss.surrogate` (+ kl.coef · KL when kl.placement is "loss"), reduced by
                   `loss.aggregation` with denominators counted once per optimizer step; the value
                   model, if any, takes a step on the clipped value loss with its own optimizer
    6. log         metrics (names in docs/metrics.md), samples every N steps, held-out eval; the
                   adaptive KL controller updates kl.coef
At the end: held-out evaluation, the model (and value model) in HF format, plots and
final_results.json. The run's life (run directory, resume, checkpoints, stop signals, results)
is the harness's (rlhflab.trainers.loop).

The algorithm is the preset's composition (see configs/pg/*.yaml); this loop has no branch per
paper. On the first optimizer step of a batch, logp_old is the detached logp of the same forward,
so the ratio is exactly 1 there.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch

from rlhflab import distributed
from rlhflab.config import PGConfig
from rlhflab.eval.accuracy import heldout_results, majority_baseline, majority_results
from rlhflab.experience import PromptSet, RewardComponents, Sampler, eval_sets
from rlhflab.losses.advantages import ADVANTAGES
from rlhflab.losses.kl import KLController, kl_penalty
from rlhflab.losses.policy import POLICY_LOSSES
from rlhflab.models.loading import context_length
from rlhflab.models.lora import apply_lora, is_lora, merged_state
from rlhflab.models.value import ValueModel
from rlhflab.rewards.reward_model import (
    check_reward_model_paths,
    load_running_norm_state,
    running_norm_state,
)
from rlhflab.rewards.shaping import TextRewardScorer, correctness_of
from rlhflab.rewards.verifier import Verifier
from rlhflab.trainers import pg_phases
from rlhflab.trainers.common import (
    Reference,
    heldout_eval,
    make_optimizer,
    make_scheduler,
    prepare_model,
    save_final_model,
)
from rlhflab.trainers.loop import Checkpointed, Env, Trainer, run
from rlhflab.trainers.prime import ImplicitPRM


def train(cfg: PGConfig) -> dict:
    """Run policy-gradient RL as configured; returns final results (also in final_results.json)."""
    return run(cfg, PolicyGradient)


def frontier_enabled(cfg) -> bool:
    """Whether a run measures the gold-vs-proxy frontier (`eval.frontier`; None: when the reward
    has a learned component (a `reward_model` or a `judge`) or `eval.frontier_gold` is set, and
    the task a verifier). One process only: under data
    parallelism it is not measured (said once in `describe`).

    Raises:
        ConfigError: `eval.frontier: true` without a task verifier, or in an episode run."""
    from rlhflab.errors import ConfigError

    default = _learned_reward(cfg) or cfg.eval.frontier_gold is not None
    wanted = cfg.eval.frontier if cfg.eval.frontier is not None else default
    if not wanted or cfg.eval.n == 0:  # no held-out evaluation: nothing to measure it on
        return False
    if cfg.data.source != "task" or cfg.env is not None:
        if cfg.eval.frontier:
            raise ConfigError("eval.frontier needs a task with a verifier (the gold) and no env")
        return False
    return distributed.world_size() == 1


def _learned_reward(cfg) -> bool:
    """Whether the reward has a learned component (a `reward_model` or an LLM `judge`): the
    frontier's proxy."""
    return any(c.name in ("reward_model", "judge") for c in cfg.reward.components)


class PolicyGradient(Trainer):
    """Policy-gradient RL under the run harness (rlhflab.trainers.loop)."""

    name = "policy_gradient"
    headline = ("rollout/reward_mean", "policy/kl", "eval/accuracy")
    writes_samples = True

    # -- Set-up (validation only, nothing written) ---------------------------------------------
    def __init__(self, cfg: PGConfig, env: Env) -> None:
        """Prompts, model, reward scorers, reference, critic, sampler, optimizers, RNGs."""
        super().__init__(cfg, env)
        device, t = env.device, cfg.task
        # Prompt rows (task problems or a dataset's rows) with a deduplicated held-out split,
        # the system turn and (tasks) the answer-format instruction (task.instruction).
        self.prompts = prompts = PromptSet(cfg, seed=cfg.seed)
        splits = self.splits = prompts.splits
        tokenizer, model = prepare_model(
            cfg.model,
            device=device,
            seed=cfg.seed,
            tokenizer_texts=lambda: prompts.tokenizer_texts(cfg.model.build.tokenizer_texts),
            sharded_later=True,  # weights used after wrap only
        )
        prompts.encode(tokenizer, context=context_length(model), seed=cfg.seed,
                       max_new_tokens=cfg.rollout.max_new_tokens,
                       allow_change=cfg.run.allow_config_change)  # fmt: skip
        verifier = Verifier(answer_format=t.answer_format, reward=t.reward, extractor=t.extractor)
        self.verifier = verifier
        check_reward_model_paths(cfg.reward.components)
        # Held-out score: the task's verifier, or a dataset's text-computable rewards.
        scorer = verifier if cfg.data.source == "task" else TextRewardScorer(cfg.reward.components)
        self.scorer = scorer
        # (No held-out eval when no reward can score text alone, e.g. a reward model only; a
        # weight-0 text reward, e.g. a gold exact_match beside a reward model, is evaluated.)
        self.heldout = splits.heldout[: cfg.eval.n] if scorer is verifier or scorer.reported else []
        # Beside every task accuracy: the most common training answer given to every held-out
        # problem.
        self.baseline = (
            majority_baseline(splits.train, self.heldout, verifier) if scorer is verifier else None
        )
        self.eval_sets = eval_sets(cfg, splits)  # eval.sets: further held-out sets
        self.set_evals: dict[str, dict] = {}  # the latest evaluation of each
        distributed.check_split(
            cfg.rollout.prompts_per_step, "rollout.prompts_per_step", "prompts",
            why="whole groups go to one rank",
        )  # fmt: skip
        model = apply_lora(model, cfg.model.lora)  # model.lora unset: unchanged
        # π_ref: a frozen copy of the initial policy, or (LoRA) the policy with adapters disabled.
        self.reference = Reference(model, cfg.parallel) if cfg.kl.coef > 0 else None
        # With β = 0, the initial policy, to measure the distance travelled (policy/kl_ref)
        # without entering the loss or the reward: by default for LoRA (its adapters disabled: no
        # second copy), for a full fine-tune only when asked (kl.track_initial: a frozen copy).
        # The gold-vs-proxy frontier (eval.frontier; default: a reward model scored against a
        # task's verifier) measures KL to the initial policy too: it keeps one when β = 0.
        self.frontier = frontier_enabled(cfg)
        wanted = cfg.kl.track_initial if cfg.kl.track_initial is not None else is_lora(model)
        track = cfg.kl.coef == 0 and (wanted or self.frontier)
        self.initial_policy = Reference(model, cfg.parallel) if track else None
        # β of the KL term: cfg.kl.coef, moved after every step by the adaptive controller
        self.kl = KLController(
            cfg.kl.coef, controller=cfg.kl.controller, target=cfg.kl.target, horizon=cfg.kl.horizon
        )
        value_model = value_optimizer = value_scheduler = None
        if cfg.value is not None:  # PPO's critic: its own weights, optimizer and LR
            value_model = (
                ValueModel.load(cfg.value.init_from, device)
                if cfg.value.init_from
                else ValueModel.from_policy(model)
            )
            value_model.train()
        # PRIME's implicit PRM (a `prime:` section): a copy of the initial policy, trained online
        # with its own optimizer; its dense rewards join the batch's before the advantages.
        optimizer_steps_per_batch = cfg.train.update_epochs * cfg.train.minibatches
        self.implicit_prm = (
            ImplicitPRM(model, cfg, self.reference, cfg.train.steps) if cfg.prime else None
        )
        # Data parallelism (one process: nothing changes): the policy, the frozen reference and
        # the critic are placed and sharded alike.
        model = distributed.wrap(model, cfg.parallel)
        value_model = distributed.wrap(value_model, cfg.parallel) if value_model else None
        self.model, self.tokenizer = model, tokenizer
        self.advantage_kwargs = dict(cfg.loss.advantage_args)
        if ADVANTAGES[cfg.loss.advantage].needs_groups:  # as the registry entry declares
            self.advantage_kwargs["group_size"] = cfg.rollout.group_size
        self.surrogate_fn = POLICY_LOSSES[cfg.loss.surrogate]
        self.group_size = cfg.rollout.group_size
        self.batch_size = cfg.rollout.prompts_per_step * self.group_size
        total_optimizer_steps = cfg.train.steps * optimizer_steps_per_batch
        optimizer = make_optimizer(model, cfg.optim)
        scheduler = make_scheduler(optimizer, cfg.optim, total_optimizer_steps)
        if value_model is not None:
            value_optimizer = make_optimizer(value_model, cfg.value.optim)
            value_scheduler = make_scheduler(
                value_optimizer, cfg.value.optim, total_optimizer_steps
            )
        self.learners = pg_phases.Learners(
            model, optimizer, scheduler, value_model, value_optimizer, value_scheduler
        )
        kl_in_reward = self.reference is not None and cfg.kl.placement != "loss"
        self.need_logp_old = (
            optimizer_steps_per_batch > 1
            or kl_in_reward
            or self.surrogate_fn.select is not None  # Clip-Cov / KL-Cov choose tokens by π_old
            or cfg.loss.rollout_correction.enabled  # weights from π_old / π_sampler
        )
        self.shuffle_rng = torch.Generator().manual_seed(cfg.seed + 1)
        self.initial_eval: dict = {}
        self.final_eval: dict = {}
        self.initial_set_evals: dict[str, dict] = {}
        # Phases 1-2 (rlhflab.experience): prompts → scored, gathered batches in the configured
        # mode (sync, dynamic sampling, async; episodes with an `env`) through the rollout engine.
        scoring = RewardComponents(cfg.reward.components, verifier,
                                   max_new_tokens=cfg.rollout.max_new_tokens, parallel=cfg.parallel,
                                   vllm=cfg.rollout.vllm)  # fmt: skip
        self.sampler = Sampler(cfg, prompts, model, tokenizer, scoring, device=device,
                               autocast_dtype=env.autocast_dtype, context=context_length(model))  # fmt: skip

    def describe(self) -> str:
        text = (
            f"train prompts {len(self.prompts.ids)}, held-out {len(self.heldout)}, held-out dropped "
            f"as seen in training: {self.splits.n_heldout_overlap_dropped}"
        )
        if self.frontier:
            text += f"; gold-vs-proxy frontier on {min(self.cfg.eval.frontier_n, len(self.heldout))} held-out problems"
        elif (
            self.cfg.eval.frontier is not False
            and distributed.world_size() > 1
            and _learned_reward(self.cfg)
        ):
            text += "; gold-vs-proxy frontier not measured with several processes"
        return text

    def checkpointed(self) -> Checkpointed:
        # Every trained model (policy, critic, PRIME's implicit PRM), its optimizer and schedule,
        # every RNG stream and the prompt stream's position; `state()` adds the KL controller's
        # coefficient and the counters. (None entries are skipped.)
        parts, prm = self.learners, self.implicit_prm
        return Checkpointed(
            modules={
                "model": parts.model,
                "value_model": parts.value_model,
                "prime_model": prm and prm.model,
            },
            optimizers={
                "optimizer": parts.optimizer,
                "value_optimizer": parts.value_optimizer,
                "prime_optimizer": prm and prm.optimizer,
            },
            schedulers={
                "scheduler": parts.scheduler,
                "value_scheduler": parts.value_scheduler,
                "prime_scheduler": prm and prm.scheduler,
            },
            generators={**self.sampler.generators(), "shuffle": self.shuffle_rng},
            stateful={"prompts": self.prompts.stream},
        )

    # -- Evaluations, state ----------------------------------------------------------------------
    def has_heldout(self) -> bool:
        return bool(self.heldout) or bool(self.eval_sets)

    def evaluate(self, step: int) -> dict:
        """The run's held-out evaluation (returned; fed to the health checks), then each set of
        `eval.sets` (logged as eval/<name>/..., kept in `set_evals`)."""
        if self.sampler.env is not None:  # episodes (greedy): success, turns, tool calls
            res = self.sampler.evaluate_episodes(self.heldout, batch_size=self.cfg.eval.batch_size)
            self.tracker.log(step, {f"eval/{k}": v for k, v in res.items()})
            self.health.observe_eval(step, res)
            return res
        res, prompts = {}, self.prompts
        with self.sampler.evaluating() as engine:
            if self.heldout:
                res = heldout_eval(
                    self.cfg, self.model, self.tokenizer, self.heldout, self.scorer,
                    self.tracker, step, self.autocast_dtype, system=prompts.system,
                    instruction=prompts.instruction, baseline=self.baseline, engine=engine,
                )  # fmt: skip
            for s in self.eval_sets:
                self.set_evals[s["name"]] = heldout_eval(
                    self.cfg, self.model, self.tokenizer, s["rows"], s["verifier"], self.tracker,
                    step, self.autocast_dtype, system=s["system"], instruction=s["instruction"],
                    engine=engine, prefix=f"eval/{s['name']}",
                )  # fmt: skip
        if self.frontier and self.heldout:
            point = self._frontier_point()
            self.tracker.log(step, {f"frontier/{k}": v for k, v in point.items()
                                    if k != "proxy_values"})  # fmt: skip
            res = {**res, "frontier": point}
        if res:
            self.health.observe_eval(step, res)
        return res

    def _frontier_point(self) -> dict:
        """`eval.frontier.frontier_point` on the first `eval.frontier_n` held-out problems
        (module doc of rlhflab.eval.frontier), against the reference or the initial policy; the
        gold is the task verifier, or the reward component `eval.frontier_gold` (then the
        verifier's score of the same samples is measured beside it)."""
        from rlhflab.eval.frontier import frontier_point
        from rlhflab.experience.scoring import VerifierOnly

        initial = self.reference if self.reference is not None else self.initial_policy
        cfg, prompts = self.cfg, self.prompts
        with self.sampler.evaluating() as engine:
            return frontier_point(
                self.model, initial.scoring, self.tokenizer, self.heldout[: cfg.eval.frontier_n],
                self.sampler.scorer, self._frontier_gold(), engine=engine, system=prompts.system,
                instruction=prompts.instruction, max_new_tokens=cfg.rollout.max_new_tokens,
                temperature=cfg.rollout.temperature, seed=cfg.seed,
                verifier=None if cfg.eval.frontier_gold is None else VerifierOnly(self.verifier),
            )  # fmt: skip

    def _frontier_gold(self):
        """The frontier's gold scorer: `eval.frontier_gold` alone at weight 1 (its raw score),
        else the task verifier."""
        from rlhflab.experience.scoring import RewardComponents, VerifierOnly

        comp = self.cfg.eval.frontier_gold
        if comp is None:
            return VerifierOnly(self.verifier)
        return RewardComponents([comp.model_copy(update={"weight": 1.0})], self.verifier,
                                max_new_tokens=self.cfg.rollout.max_new_tokens,
                                parallel=self.cfg.parallel, vllm=self.cfg.rollout.vllm)  # fmt: skip

    def begin(self) -> None:
        load_running_norm_state({})
        self.initial_eval = self.evaluate(0) if self.has_heldout() else {}
        self.initial_set_evals = dict(self.set_evals)

    def state(self) -> dict:
        # first: waits for the queued rollouts, which move the RNG, prompt stream and counters
        return {
            **self.sampler.state(),
            **self.kl.state(),  # "kl_coef"
            "initial_eval": self.initial_eval,
            "initial_set_evals": self.initial_set_evals,
            "verifier_errors": self.verifier.n_errors,
            "reward_norm": running_norm_state(),
        }

    def load_state(self, state: dict) -> None:
        self.kl.load(state)
        self.initial_eval = state["initial_eval"]
        self.initial_set_evals = state.get("initial_set_evals", {})  # (before eval.sets: none)
        self.verifier.n_errors = state["verifier_errors"]
        load_running_norm_state(state.get("reward_norm", {}))
        self.sampler.load(state)

    def write_samples(self, step: int) -> None:
        """Rollout samples of step 1 and every `tracking.samples_every` steps (the last included)."""
        cfg = self.cfg
        if step % cfg.tracking.samples_every == 0 or step == 1:
            batch = self.last_batch
            self.samples.write(
                step,
                [
                    {
                        "prompt": batch.problems[i].question,
                        "completion": batch.texts[i],
                        "reward": batch.rewards[i].item(),
                        "answer": batch.problems[i].answer,
                    }
                    for i in range(min(cfg.tracking.samples_per_step, len(batch.texts)))
                ],
            )

    # -- One step --------------------------------------------------------------------------------
    def step(self, step: int) -> tuple[dict, dict]:
        cfg, learners, timer = self.cfg, self.learners, self.timer
        t0 = time.perf_counter()
        with timer.stage("rollout"):
            # 1-2: the global batch (async: sampled behind, waited for here)
            batch, sampling_stats = self.sampler.next_batch(step, self.model)
            verifier_errors = sampling_stats.pop("verifier_errors")  # as of that batch
            data = pg_phases.local_share(batch, self.batch_size, self.group_size)  # this rank's
            greedy_stats = {}
            if ADVANTAGES[cfg.loss.advantage].needs_greedy:  # ReMax: the greedy baseline
                greedy_stats = pg_phases.greedy_baseline(
                    data, partial(self.sampler.greedy, step=step), self.group_size
                )
        pg_phases.count_work(timer, data, batch, cfg)
        pg_phases.no_grad_passes(data, learners, self.reference, cfg, self.autocast_dtype,
                                 self.need_logp_old, timer=timer)  # fmt: skip
        with timer.stage("ref"):
            kl_ref = self.kl_to_reference(data)  # before the update: the rollout's own policy
        prime_stats = {}
        if self.implicit_prm is not None:  # PRIME: dense implicit rewards, then its PRM update
            with timer.stage("update"):  # its forward, backward and optimizer step
                prime_stats = self.implicit_prm.step(data, self.autocast_dtype, self.guard, step)
        pg_phases.advantages(data, cfg, self.kl.coef, self.advantage_kwargs)
        if cfg.loss.rollout_correction.enabled:
            pg_phases.rollout_correction(data, cfg)
        with timer.stage("update"):
            stats = pg_phases.update(
                data, learners, self.guard, cfg, step=step, kl_coef=self.kl.coef,
                surrogate_fn=self.surrogate_fn, shuffle_rng=self.shuffle_rng,
                autocast_dtype=self.autocast_dtype,
            )  # fmt: skip
        with timer.stage("weight_sync"):
            self.sampler.sync_weights(self.model)  # "hf": nothing to do
        metrics, kl_seq = pg_phases.step_metrics(
            data, stats, cfg, sampling_stats=sampling_stats, kl_coef=self.kl.coef,
            lr=learners.scheduler.get_last_lr()[0], dt=time.perf_counter() - t0,
            verifier_errors=verifier_errors,
        )  # fmt: skip
        if kl_ref is not None:
            metrics["policy/kl_ref"] = kl_ref
        metrics.update(greedy_stats)
        metrics.update(prime_stats)
        self.kl.update(kl_seq, n_steps=self.batch_size)  # the adaptive controller moves β
        self.last_batch = batch  # for `write_samples`
        health_inputs = {  # the global batch: every rank sees the same
            "rollout": batch.rollout,
            "adv": distributed.gather_cat(data.adv),
            "texts": batch.texts,
            "group_size": self.group_size,
            "correct": correctness_of(batch.components),  # correctness, math_verify, exact_match
        }
        metrics.update(batch.info)  # multi-turn: rollout/turns_mean, rollout/tool_calls_mean
        return metrics, health_inputs

    def kl_to_reference(self, data) -> float | None:
        """k3 estimate of KL(π_θ ‖ π_ref) per token on the rollout's own tokens, π_θ being the
        policy that sampled them (its log-probs: the pre-update trainer's when computed, else
        the sampler's) and π_ref the reference (β > 0) or, with β = 0 (LoRA by default, else
        `kl.track_initial`), the initial policy; over every rank's tokens. None (nothing
        computed) without either.
        Source: k3 = (r − 1) − log r with r = π_ref/π_θ, Schulman 2020, "Approximating KL
        divergence" (`rlhflab.losses.kl`)."""
        rollout, logp_ref = data.local.rollout, data.logp_ref
        if logp_ref is None and self.initial_policy is not None:
            with self.initial_policy.scoring() as initial:
                logp_ref = pg_phases.no_grad_logps(initial, rollout, self.cfg, self.autocast_dtype)
        if logp_ref is None:
            return None
        logp = data.logp_old if data.logp_old is not None else rollout.logp
        k3 = kl_penalty(logp.double(), logp_ref.double(), "k3") * rollout.mask
        sums = distributed.sum_dict({"kl": float(k3.sum()), "tokens": float(rollout.mask.sum())})
        return sums["kl"] / sums["tokens"] if sums["tokens"] else 0.0

    # -- The end -------------------------------------------------------------------------------
    def finish(self, step: int) -> None:
        self.sampler.close()
        self.final_eval = self.evaluate(step) if self.has_heldout() else {}

    def save(self, model_dir: Path) -> None:
        """The policy in HF format and, for PPO, the critic beside it (`value_model/`); with
        `prime:`, the implicit PRM (`prime_model/`)."""
        save_final_model(self.model, self.tokenizer, model_dir, self.cfg.model.lora)
        value_model = self.learners.value_model
        if value_model is not None:
            value_state = distributed.full_model_state(value_model, keep_tied=True)
            if distributed.is_main():  # a LoRA critic's adapters merged into its weights
                value_model.save(
                    self.run_dir / "value_model", state_dict=merged_state(value_model, value_state)
                )
        if self.implicit_prm is not None:  # PRIME's implicit PRM, a causal LM
            self.implicit_prm.save(self.tokenizer, self.run_dir / "prime_model")

    def results(self) -> dict:
        final_eval, initial_eval, cfg = self.final_eval, self.initial_eval, self.cfg
        held = heldout_results(initial_eval, final_eval)
        if not final_eval:  # no held-out evaluation: what it would have measured
            held["heldout_metric"] = "accuracy" if cfg.data.source == "task" else "reward"
        before, after = self.initial_set_evals, self.set_evals
        sets = {
            s["name"]: {
                "task": s["task"],
                **heldout_results(before.get(s["name"], {}), after.get(s["name"], {})),
            }
            for s in self.eval_sets
        }
        return {
            **held,
            **({"eval_sets": sets} if sets else {}),
            **majority_results(self.baseline),
            "heldout_overlap_dropped": self.splits.n_heldout_overlap_dropped,
            "prompt_source": self.splits.source,
            "verifier_errors": self.verifier.n_errors,
        }
