"""Config of `trainer: policy_gradient`: rollout, reward, loss, KL and critic sections and
`PGConfig` (see rlhflab.trainers.policy_gradient)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, Field, StrictBool, field_validator, model_validator

from rlhflab.config.base import Strict, _check_clip_bounds, _check_kwargs, _check_name
from rlhflab.config.sections import (
    MAX_SECONDS_DOC,
    EvalConfig,
    OptimConfig,
    PromptDataConfig,
    RewardComponentConfig,
    TrainBase,
    TrainerConfig,
)
from rlhflab.errors import ConfigError
from rlhflab.rollout.engines import ENGINE_NAMES

# ---------------------------------------------------------------------------------------------
# Policy gradients
# ---------------------------------------------------------------------------------------------


def _our_name(
    value: Any, aliases: dict[str, str], field: str = "", near_misses: dict[str, str] | None = None
) -> Any:
    """`value` under our name when it is another library's name for the same thing (a key of
    `aliases`, the registry's alias table); resolved before validation, so the run's config.yaml
    records our name. A name that looks like ours but computes something else (a key of
    `near_misses`) is refused: ConfigError naming `field` and the difference."""
    if isinstance(value, str) and near_misses and value in near_misses:
        raise ConfigError(f"{field}: {near_misses[value]}; set ours explicitly")
    return aliases.get(value, value) if isinstance(value, str) else value


class DynamicSamplingConfig(Strict):
    """DAPO's dynamic sampling: draw further prompt batches until every group of the step has
    non-zero reward variance (groups with all-equal rewards carry no gradient and are dropped)."""

    enabled: bool = False
    max_rounds: int = Field(8, ge=1)  # generation rounds per step; then a DataError


class VLLMConfig(Strict):
    """The colocated `vllm` rollout engine (vLLM's offline LLM in the trainer's process; one
    per torchrun rank, see rlhflab.rollout.engines.vllm)."""

    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)  # share of GPU memory vLLM may take
    enable_prefix_caching: bool = True  # a group's prompt is prefilled once
    max_model_len: int | None = Field(None, ge=1)  # default: the model's context length
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    cpu_kvcache_space_gb: int = Field(1, ge=1)  # CPU build only: its KV-cache size (GiB)
    # Colocated mode: between rollouts vLLM offloads its weights to CPU memory and frees its KV
    # cache (vLLM sleep mode, level 1), so the trainer's update has the GPU. CUDA/ROCm only.
    sleep: bool = False
    # vLLM's tensor parallelism for a model too large for one GPU: under torchrun each group of
    # this many consecutive ranks shards one engine (external_launcher); it must divide the
    # number of ranks. 1: one whole engine per rank.
    tensor_parallel_size: int = Field(1, ge=1)
    # Weight sync: parameters are pushed in buckets of whole decoder layers of at least this
    # many MiB (full tensors in the engine's dtype); the largest extra memory of a push.
    sync_bucket_mb: float = Field(512.0, gt=0)
    # KV-cache block size in tokens (None: vLLM's default, 16 on GPUs, 128 on the CPU build);
    # prefix caching shares whole blocks only
    block_size: int | None = Field(None, ge=1)


class RolloutConfig(Strict):
    """Sampling: all prompts of a step in one batched generation, through `engine`
    (rlhflab.rollout.engines: "hf", our KV-cache sampler; "vllm", colocated vLLM).

    Which keys a trainer family reads is its config's `ROLLOUT_KEYS`; `ONLY_WITH` lists the keys
    read under one setting of another key only. A key set away from its default where it would
    not be read is refused at load (`rlhflab.config.sections.TrainerConfig`)."""

    #: (key or section, (the key it depends on, the value under which it is read))
    ONLY_WITH: ClassVar[tuple[tuple[str, tuple[str, Any]], ...]] = (
        ("max_staleness", ("mode", "async")),
        ("async_worker", ("mode", "async")),
        ("behav_correction", ("mode", "async")),
        ("behav_cap", ("mode", "async")),
        ("dynamic_sampling.max_rounds", ("dynamic_sampling.enabled", True)),
        ("vllm", ("engine", "vllm")),
        ("decode", ("engine", "hf")),
        ("half_weights", ("engine", "hf")),
        ("sync_every", ("engine", "hf")),
        ("sync_every", ("decode", "static")),
        ("cuda_graph", ("engine", "hf")),
        ("cuda_graph", ("decode", "static")),
    )

    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: off
    min_p: float = Field(0.0, ge=0, lt=1)  # 0: off
    stop_token_ids: list[int] = Field(default_factory=list)  # besides EOS and the model's own
    engine: Literal[ENGINE_NAMES] = "hf"  # rlhflab.rollout.engines.ENGINES
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    # engine "hf" only (rlhflab.rollout.sampler.sample): "eager" drops stopped rows at every
    # token; "static": static KV cache, stop checks on the device, the host syncs every
    # `sync_every` tokens, the decode step a CUDA graph on CUDA (`cuda_graph`). Same tokens.
    decode: Literal["eager", "static"] = "eager"
    sync_every: int = Field(8, ge=1)
    cuda_graph: bool = True
    # engine "hf": generate with a bf16/fp16 copy of the policy (the run's autocast dtype),
    # refreshed before each rollout, instead of casting float32 weights at every token
    half_weights: bool = False
    # Asynchronous rollouts (docs/async.md): "async" generates step t+1's batch in a background
    # thread with a behaviour copy of the policy while step t updates; the batch of step s comes
    # from the policy of max_staleness updates earlier (fewer in the first steps).
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = Field(1, ge=1)
    # Where async generation runs: "thread" (in the trainer's process; the GIL is shared) or
    # "process" (a spawned process, CPU only: rlhflab.rollout.async_process). Same batches.
    async_worker: Literal["thread", "process"] = "thread"
    # The lag correction (rlhflab.losses.correction.decoupled): "decoupled" weights the
    # surrogate (clipped against the trainer's π_prox) by min(π_prox / π_behav, behav_cap);
    # "none" ignores the lag (ablation).
    behav_correction: Literal["decoupled", "none"] = "decoupled"
    behav_cap: float = Field(2.0, gt=0)


class RewardConfig(Strict):
    """The scalar reward of a completion: the sum of weighted named components (each logged as
    rollout/reward/<name>_mean). `correctness` scores with the task's verifier (task.reward)."""

    components: list[RewardComponentConfig] = Field(
        default_factory=lambda: [RewardComponentConfig(name="correctness")]
    )

    @model_validator(mode="after")
    def _unique(self) -> RewardConfig:
        names = [c.label or c.name for c in self.components]
        if not names:
            raise ValueError("reward.components: at least one component is required")
        if len(set(names)) != len(names):
            raise ValueError(
                f"reward.components: names must be unique (give repeats a `label`), got {names}"
            )
        return self

    @property
    def dense(self) -> bool:
        """A weighted component gives per-token rewards (`args.credit: dense`, a PRM's steps)."""
        return any(c.weight != 0 and c.dense for c in self.components)

    @property
    def has_outcome(self) -> bool:
        """A weighted component gives one reward per completion (at its last token)."""
        return any(c.weight != 0 and not c.dense for c in self.components)


class TISConfig(Strict):
    """Truncated importance sampling of the policy-gradient term by min(π_θold / π_sampler, cap)
    (rlhflab.losses.correction.truncated_importance_weights; Yao et al. 2025)."""

    enabled: bool = False
    cap: float = Field(2.0, gt=0)  # C; 2 in SkyRL's TIS examples, 3 is TRL's default


class RolloutCorrectionConfig(Strict):
    """Rollout correction beside TIS (rlhflab.losses.correction): importance weights
    π_θold / π_sampler per token or per sequence (truncated at is_cap; optionally normalised to
    mean 1 over the global batch) and/or rejection of tokens / sequences whose ratio (token,
    sequence, or geometric mean over the sequence) leaves [reject_low, reject_high]
    (reject_low None: 1 / reject_high). Multiplies the policy-gradient term, not the KL."""

    is_level: Literal["none", "token", "sequence"] = "none"
    is_cap: float | None = Field(2.0, gt=0)  # None: untruncated
    batch_normalize: bool = False
    reject: Literal["none", "token", "sequence", "geometric"] = "none"
    reject_low: float | None = Field(None, gt=0)
    reject_high: float = Field(2.0, gt=0)

    @property
    def enabled(self) -> bool:
        """True when an importance-sampling level or a rejection rule is set."""
        return self.is_level != "none" or self.reject != "none"

    @model_validator(mode="after")
    def _consistent(self) -> RolloutCorrectionConfig:
        if self.batch_normalize and self.is_level == "none":
            raise ValueError(
                "loss.rollout_correction.batch_normalize needs is_level token/sequence"
            )
        if self.reject_low is not None and self.reject_low > self.reject_high:
            raise ValueError(
                f"loss.rollout_correction.reject_low ({self.reject_low}) must be <= reject_high "
                f"({self.reject_high})"
            )
        return self


class LossConfig(Strict):
    """The named parts of the update: advantage, surrogate and aggregation (see losses/).
    entropy_coef c > 0 subtracts c·H(π_θ(·|o_<t)) from every token's loss (an entropy bonus,
    reduced by the same aggregation; Williams & Peng 1991)."""

    advantage: str = "group_zscore"
    advantage_args: dict[str, Any] = Field(default_factory=dict)
    whiten_advantages: bool = False  # losses.advantages.whiten over the batch's valid tokens
    surrogate: str = "ppo_clip"
    surrogate_args: dict[str, Any] = Field(default_factory=dict)
    aggregation: str = "seq_mean_token_mean"
    entropy_coef: float = Field(0.0, ge=0)
    tis: TISConfig = Field(default_factory=TISConfig)  # training–inference mismatch correction
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)

    @field_validator("surrogate", mode="before")
    @classmethod
    def _surrogate_alias(cls, value: Any) -> Any:
        from rlhflab.losses.policy import POLICY_LOSS_ALIASES  # verl's loss_mode names

        return _our_name(value, POLICY_LOSS_ALIASES)

    @field_validator("advantage", mode="before")
    @classmethod
    def _advantage_alias(cls, value: Any) -> Any:
        from rlhflab.losses.advantages import ADVANTAGE_ALIASES  # verl's adv_estimator names

        return _our_name(value, ADVANTAGE_ALIASES)

    @field_validator("aggregation", mode="before")
    @classmethod
    def _aggregation_alias(cls, value: Any) -> Any:
        from rlhflab.losses.aggregate import AGGREGATION_ALIASES, AGGREGATION_NEAR_MISSES

        # verl's, TRL's names
        return _our_name(value, AGGREGATION_ALIASES, "loss.aggregation", AGGREGATION_NEAR_MISSES)

    @model_validator(mode="after")
    def _names_and_args(self) -> LossConfig:
        from rlhflab.losses.advantages import ADVANTAGES
        from rlhflab.losses.aggregate import AGGREGATIONS
        from rlhflab.losses.policy import POLICY_LOSSES

        _check_name("loss.advantage", self.advantage, ADVANTAGES)
        _check_name("loss.surrogate", self.surrogate, POLICY_LOSSES)
        _check_name("loss.aggregation", self.aggregation, AGGREGATIONS)
        advantage = ADVANTAGES[self.advantage]
        _check_kwargs(
            "loss.advantage_args",
            advantage.fn,
            self.advantage_args,
            ({"group_size"} if advantage.needs_groups else set())  # the trainer passes them
            | ({"baseline"} if advantage.needs_greedy else set())
            | ({"logp", "sum_pi_squared"} if advantage.needs_token_probs else set())
            | ({"steps"} if advantage.needs_steps else set())
            | ({"outcome"} if advantage.needs_outcome else set()),
            required=True,
        )
        _check_kwargs(
            "loss.surrogate_args", POLICY_LOSSES[self.surrogate].fn, self.surrogate_args,
            {"selected"},
        )  # fmt: skip
        if self.tis.enabled and self.rollout_correction.is_level != "none":
            raise ValueError(
                "loss.tis and loss.rollout_correction.is_level both weight the loss by "
                "π_old/π_sampler; enable one"
            )
        _check_clip_bounds("loss.surrogate_args", self.surrogate_args)
        return self


class KLConfig(Strict):
    """KL(π_θ ‖ π_ref) regularisation. A reference model is loaded only when coef > 0 (or, to
    measure the distance only, `track_initial`); `policy/kl_ref` logs the k3 KL to it every step.

    placement: "loss" adds coef·KL_t to the per-token loss (GRPO); "reward_sequence" subtracts
    coef·Σ_t KL_t from the completion's reward before the advantage (RLOO, REINFORCE);
    "reward_token" gives each token the reward −coef·KL_t, plus the completion's reward at its last
    token (PPO / InstructGPT; needs a per-token advantage such as gae).
    controller: "fixed" keeps coef; "adaptive" is Ziegler et al. 2019's proportional controller
    towards `target` (KL per completion, summed over tokens) with horizon `horizon` completions.
    """

    coef: float = Field(0.0, ge=0)
    estimator: str = "k3"
    placement: Literal["loss", "reward_sequence", "reward_token"] = "loss"
    controller: Literal["fixed", "adaptive"] = "fixed"
    target: float | None = Field(None, gt=0)
    horizon: int = Field(10000, ge=1)
    # With coef 0 no reference is loaded; track_initial keeps the initial policy (LoRA: the same
    # model with its adapters disabled; otherwise a frozen copy) to log policy/kl_ref, the k3
    # KL to it, every step at the cost of one more forward pass (and, without LoRA, the copy).
    # None (default): on for LoRA policies (no extra weights), off for full fine-tunes.
    track_initial: bool | None = None

    @field_validator("estimator", mode="before")
    @classmethod
    def _estimator_alias(cls, value: Any) -> Any:
        from rlhflab.losses.kl import KL_ESTIMATOR_ALIASES, KL_ESTIMATOR_NEAR_MISSES

        # verl's kl_loss_type names
        return _our_name(value, KL_ESTIMATOR_ALIASES, "kl.estimator", KL_ESTIMATOR_NEAR_MISSES)

    @model_validator(mode="after")
    def _estimator(self) -> KLConfig:
        from rlhflab.losses.kl import KL_ESTIMATORS

        _check_name("kl.estimator", self.estimator, KL_ESTIMATORS)
        if self.controller == "adaptive" and (self.target is None or self.coef <= 0):
            raise ValueError(
                "kl.controller 'adaptive' needs kl.target and an initial kl.coef > 0 "
                f"(got target={self.target}, coef={self.coef})"
            )
        return self


class ValueConfig(Strict):
    """PPO's critic: the policy's backbone (copied at start, or loaded from `init_from`, e.g. a
    reward model) with a scalar head, trained with its own AdamW on the clipped value loss."""

    init_from: str | None = None  # None: a copy of the initial policy with a fresh head
    clip_range: float = Field(0.2, gt=0)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-4))


class PrimeConfig(Strict):
    """PRIME's implicit process reward model (Cui et al. 2025, arXiv 2502.01456;
    rlhflab.trainers.prime): a causal LM π_φ, a copy of the initial policy, scored against the
    frozen initial policy π_ref. Every step it gives each completion token the reward
    coef·r_φ(y_t), r_φ(y_t) = β·log π_φ(y_t|y_<t)/π_ref(y_t|y_<t) (dense credit, beside the
    outcome reward), then takes one optimizer step of its own on the cross-entropy loss against
    the batch's outcome labels (the correctness component). A section of its own, like `value:`,
    and not a reward component: it is a trained model with optimizer state that the trainer
    updates and checkpoints, which the scoring layer (`experience/`) never does."""

    beta: float = Field(0.05, gt=0, allow_inf_nan=False)  # β (PRIME code: beta_train 0.05)
    # weight of r_φ(y_t) in the reward; 1/β gives the PRIME code's unscaled log-ratio
    coef: float = Field(1.0, gt=0, allow_inf_nan=False)
    # PRIME code: lr 1e-6, grad_clip 10.0 (training/examples/run_prime_main.sh)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-6, max_grad_norm=10.0))


class ToolsConfig(Strict):
    """How the environment's tools run (rlhflab.envs.tools, docs/multiturn.md)."""

    # true: run the python tool's model-written code without OS isolation (bubblewrap) where
    # none works here; the run prints one line saying so at start. false: such code is refused.
    unsafe_local: StrictBool = False


class OpenEnvSpec(Strict):
    """An in-process OpenEnv environment (rlhflab.envs.openenv_env, the `envs` extra): three
    'file.py:fn' / 'package.module:fn' specs and the reset seeds of the training / held-out rows."""

    make: str  # make(**env.args) -> an openenv Environment (a fresh one per episode)
    action: str  # action(text) -> the environment's Action
    render: str  # render(observation) -> str, the next user message
    n_train: int = Field(256, ge=1)  # training rows: reset seeds 0 .. n_train - 1
    n_heldout: int = Field(32, ge=0)  # held-out rows: the next n_heldout seeds


class EnvConfig(Strict):
    """A multi-turn environment (rlhflab.envs, docs/multiturn.md): the user's class and its
    arguments, and the per-episode limits. With `env` set, a rollout is one episode per sample
    (the model and the environment take turns) and the reward is the environment's."""

    # 'path/to/file.py:ClassName' or 'package.module:ClassName'; written `class:` in YAML
    class_: str | None = Field(None, validation_alias=AliasChoices("class", "class_"))
    # Instead of `class`: a verifiers environment (rlhflab.envs.verifiers_env, the `envs` extra):
    # 'path/to/file.py:fn', 'package.module:fn' or an installed environment module's name; with
    # data.source 'env' its dataset gives the prompts, its rubric the reward.
    verifiers: str | None = None
    # Instead of `class`: an OpenEnv environment run in-process (with data.source 'env').
    openenv: OpenEnvSpec | None = None
    args: dict[str, Any] = Field(default_factory=dict)  # the constructor's keyword arguments
    max_turns: int = Field(4, ge=1)  # model turns per episode
    max_turn_tokens: int | None = Field(None, ge=1)  # per model turn; None: rollout.max_new_tokens
    # tokens after the opening prompt (model turns + observations); None: the context length
    max_episode_tokens: int | None = Field(None, ge=1)
    tool_timeout_s: float = Field(5.0, gt=0)  # wall-clock limit of one python tool call
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    # KV reuse across turns: a turn continues from the episode's KV cache instead of prefilling
    # its whole history again (hf engine with rollout.decode eager; the vllm engine through its
    # prefix cache). Same tokens and log-probs up to float rounding. false: re-prefill each turn.
    kv_reuse: bool = True

    @model_validator(mode="after")
    def _one_kind(self) -> EnvConfig:
        if sum(x is not None for x in (self.class_, self.verifiers, self.openenv)) != 1:
            raise ValueError("env: set exactly one of env.class, env.verifiers and env.openenv")
        return self

    def target(self) -> tuple[str, dict]:
        """(the class spec `rlhflab.envs.load_env` builds, its keyword arguments): `class` and
        `args`, or for `verifiers` / `openenv` the adapter class with the spec and `args`."""
        if self.openenv is not None:
            adapter = "rlhflab.envs.openenv_env:OpenEnvEnv"
            return adapter, {**self.openenv.model_dump(), "args": dict(self.args)}
        if self.verifiers is not None:
            adapter = "rlhflab.envs.verifiers_env:VerifiersEnv"
            return adapter, {"load": self.verifiers, "args": dict(self.args)}
        return self.class_, dict(self.args)


def check_env_prompts(env: EnvConfig | None, data) -> None:
    """`data.source: env` and the third-party environments go together: their rows come from the
    environment (`rlhflab.experience.prompts.env_prompt_splits`).

    Raises:
        ValueError: data.source 'env' without an `env` section, or env.verifiers / env.openenv
            with another data.source (one line naming `data.source`)."""
    if data.source == "env" and env is None:
        raise ValueError("data.source: 'env' takes the prompts of an `env:` section; add one")
    if env is not None and env.class_ is None and data.source != "env":
        kind = "verifiers" if env.verifiers is not None else "openenv"
        raise ValueError(
            f"data.source: env.{kind} takes its prompts from the environment's rows; "
            "set data.source: env"
        )


def check_sampling_modes(rollout: RolloutConfig, env: EnvConfig | None) -> None:
    """The one check of the sampling modes, for every trainer family that samples through
    `rlhflab.experience.Sampler` (policy gradient, distillation): which of sync / async /
    dynamic sampling / episodes (`env`) combine, as the sampler implements them. A family
    refuses further combinations its loss cannot use in its own validator.

    Raises:
        ValueError: one line naming the keys that do not combine.
    """
    if rollout.dynamic_sampling.enabled and rollout.group_size < 2:
        raise ValueError(
            "rollout.group_size must be >= 2 for rollout.dynamic_sampling "
            f"(got {rollout.group_size})"
        )
    if env is not None and env.kv_reuse:
        if rollout.engine == "hf" and rollout.decode == "static":
            raise ValueError(
                "env.kv_reuse: the hf engine's static decode cannot start from a kept KV cache; "
                "use rollout.decode 'eager' or env.kv_reuse false"
            )
        if rollout.engine == "vllm" and not rollout.vllm.enable_prefix_caching:
            raise ValueError(
                "env.kv_reuse: the vllm engine reuses a turn's history through its prefix cache; "
                "set rollout.vllm.enable_prefix_caching true or env.kv_reuse false"
            )
    if env is not None and rollout.dynamic_sampling.enabled:
        raise ValueError("env: rollout.dynamic_sampling is not supported with an environment")
    if rollout.mode == "async":  # what the background generation supports (docs/async.md)
        if rollout.engine != "hf":
            raise ValueError("rollout.mode 'async' needs rollout.engine 'hf' (vllm: not yet)")
        if rollout.dynamic_sampling.enabled:
            raise ValueError("rollout.mode 'async' does not support rollout.dynamic_sampling yet")
        if env is not None:
            raise ValueError("rollout.mode 'async' does not support env (multi-turn) yet")


class PGTrainConfig(TrainBase):
    """Policy-gradient budget: rollout steps, micro-batch size, update epochs × minibatches."""

    steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(64, ge=1)  # completions per forward/backward
    update_epochs: int = Field(1, ge=1)  # passes over each rollout batch
    minibatches: int = Field(1, ge=1)  # optimizer steps per epoch
    max_seconds: float | None = Field(None, gt=0, description=MAX_SECONDS_DOC)


class EvalSetConfig(Strict):
    """One more held-out set (`eval.sets[i]`), evaluated beside the run's own at every
    evaluation and logged as `eval/<name>/...`: the run's `task` with the keys of `task`
    replaced (a harder `config`, another task `name`, another `answer_format`...), its first
    `n` held-out problems (default `eval.n`) whose questions are not among the run's training
    prompts."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$")
    task: dict[str, Any] = Field(default_factory=dict)
    n: int | None = Field(None, ge=1)

    @field_validator("name")
    @classmethod
    def _not_a_metric(cls, value: str) -> str:
        reserved = {"reward", "accuracy", "headline", "n", "majority_baseline"}
        if value in reserved or value.startswith(("pass@", "maj@")):
            raise ValueError(f"eval.sets name {value!r} is a metric name; choose another")
        return value


class PGEvalConfig(EvalConfig):
    """`eval` of a policy-gradient run: `EvalConfig` plus `sets`, further held-out sets, and the
    gold-vs-proxy frontier (`rlhflab.eval.frontier`)."""

    sets: list[EvalSetConfig] = Field(default_factory=list)
    # At every evaluation, on `frontier_n` held-out problems: the training reward (proxy), the
    # verifier (gold) and KL(π‖π_init) of one sample each (frontier/*, plots/frontier.png).
    # None: on when the reward has a reward_model component and the task a verifier.
    frontier: bool | None = None
    frontier_n: int = Field(128, ge=1)
    # The frontier's gold: a reward component (e.g. `{name: judge, args: {path: ...}}`) scored on
    # the same samples instead of the task verifier; its weight is ignored. None: the verifier.
    frontier_gold: RewardComponentConfig | None = None


class PGConfig(TrainerConfig):
    """Config of `trainer: policy_gradient` (see trainers/policy_gradient.py)."""

    #: every key of `rollout` (async and dynamic sampling are this family's alone)
    ROLLOUT_KEYS: ClassVar[frozenset[str]] = frozenset(RolloutConfig.model_fields)

    trainer: Literal["policy_gradient"] = "policy_gradient"
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    value: ValueConfig | None = None  # set for advantages that need a critic (gae)
    prime: PrimeConfig | None = None  # PRIME's online implicit PRM: dense rewards at every token
    data: PromptDataConfig = Field(default_factory=PromptDataConfig)
    train: PGTrainConfig = Field(default_factory=PGTrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: PGEvalConfig = Field(default_factory=PGEvalConfig)
    env: EnvConfig | None = None  # multi-turn episodes with this environment (rlhflab.envs)

    def eval_set_task(self, i: int):
        """The TaskConfig of `eval.sets[i]`: the run's task with the set's keys replaced.
        Raises ValueError naming eval.sets[i].task for an unknown key or a bad value."""
        from pydantic import ValidationError

        from rlhflab.config.sections import TaskConfig

        s = self.eval.sets[i]
        try:
            return TaskConfig(**{**self.task.model_dump(), **s.task})
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ValueError(f"eval.sets[{i}] ({s.name}).task.{where}: {err['msg']}") from None

    @model_validator(mode="after")
    def _consistency(self) -> PGConfig:
        from rlhflab.losses.advantages import ADVANTAGES

        advantage = ADVANTAGES[self.loss.advantage]  # what it declares it needs
        if advantage.needs_groups and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size must be >= 2 for the group advantage "
                f"'{self.loss.advantage}' (got {self.rollout.group_size})"
            )
        if advantage.needs_values and self.value is None:
            raise ValueError(
                f"value: loss.advantage '{self.loss.advantage}' needs a value model; "
                "add a `value:` section"
            )
        if self.value is not None and not advantage.needs_values:
            raise ValueError(
                f"value: a value model is set but loss.advantage '{self.loss.advantage}' "
                "does not use one (use 'gae' or remove the `value:` section)"
            )
        if self.kl.placement == "reward_token" and not advantage.per_token:
            raise ValueError(
                f"kl.placement 'reward_token' needs a per-token advantage such as 'gae' "
                f"(loss.advantage is '{self.loss.advantage}'; use 'reward_sequence')"
            )
        if self.prime is not None:
            self._check_prime()
        if self.reward.dense or self.prime is not None:  # per-token rewards: an estimator
            what = "credit 'dense'" if self.reward.dense else "prime"  # that takes them
            if not advantage.per_token:
                raise ValueError(
                    f"loss.advantage: {what} gives per-token rewards; "
                    f"'{self.loss.advantage}' takes one reward per completion (use "
                    "'process_group_zscore', 'prime_rloo', or 'gae' with a value model)"
                )
            if self.kl.placement == "reward_sequence":
                raise ValueError(
                    f"kl.placement: 'reward_sequence' with {what}; use 'loss' or 'reward_token'"
                )
            if self.rollout.mode == "async":
                raise ValueError(
                    f"{'reward.components' if self.reward.dense else 'prime'}: {what} is not "
                    "supported with rollout.mode 'async' yet"
                )
        if advantage.needs_steps and self.kl.placement != "loss":
            raise ValueError(
                f"kl.placement: '{self.loss.advantage}' reads rewards only where they are "
                f"given (step ends), so a per-token KL penalty would be dropped; use 'loss' "
                f"(got '{self.kl.placement}')"
            )
        for comp in self.reward.components:
            if comp.name == "overlong":  # DAPO's L_cache must fit in L_max
                cache, limit = comp.args.get("cache"), comp.args.get("max_len")
                limit = limit or self.rollout.max_new_tokens
                if not isinstance(cache, int) or isinstance(cache, bool) or not 0 < cache <= limit:
                    raise ValueError(
                        f"reward.components[overlong].args.cache must be an integer in "
                        f"1..{limit} (args.max_len or rollout.max_new_tokens), got {cache!r}"
                    )
        names = [s.name for s in self.eval.sets]
        if len(set(names)) < len(names):
            raise ValueError(f"eval.sets: names must differ (got {names})")
        for i in range(len(self.eval.sets)):
            self.eval_set_task(i)
        if self.data.source == "dataset" and any(
            c.name == "correctness" and c.function is None for c in self.reward.components
        ):
            raise ValueError(
                "reward.components: 'correctness' scores with the task's verifier; with "
                "data.source 'dataset' use math_verify, exact_match or a reward function"
            )
        if self.env is not None:
            self._check_env()
        check_env_prompts(self.env, self.data)
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.train.minibatches:
            raise ValueError(
                f"train.minibatches ({self.train.minibatches}) must divide the rollout batch "
                f"(rollout.prompts_per_step × rollout.group_size = {batch})"
            )
        check_sampling_modes(self.rollout, self.env)
        if self.rollout.mode == "async":  # what the background generation supports (docs/async.md)
            if advantage.needs_greedy:
                raise ValueError(
                    f"loss.advantage: {self.loss.advantage!r} (a greedy-rollout baseline) is not "
                    "supported with rollout.mode 'async' yet"
                )
            if self.loss.tis.enabled and self.rollout.behav_correction == "decoupled":
                raise ValueError(
                    "loss.tis: rollout.mode 'async' with behav_correction 'decoupled' already "
                    "weights by min(π_prox/π_behav, rollout.behav_cap); disable loss.tis"
                )
        return self

    def _check_prime(self) -> None:
        """`prime:` needs outcome labels (a correctness component) and one sample per row."""
        from rlhflab.rewards.shaping import CORRECTNESS_COMPONENTS

        names = {c.name for c in self.reward.components}
        if not names & set(CORRECTNESS_COMPONENTS):
            raise ValueError(
                f"prime: the implicit PRM learns from outcome labels; add one of "
                f"{', '.join(CORRECTNESS_COMPONENTS)} to reward.components (weight 0 is fine)"
            )
        if self.env is not None:
            raise ValueError("prime: not supported with an `env` (multi-turn episodes) yet")
        if self.model.lora is not None:
            raise ValueError("prime: not supported with model.lora yet (π_φ is a full copy)")

    def _check_env(self) -> None:
        """What multi-turn episodes do not combine with (yet), beyond `check_sampling_modes`."""
        from rlhflab.losses.advantages import ADVANTAGES

        if ADVANTAGES[self.loss.advantage].needs_greedy:
            raise ValueError(
                f"loss.advantage: {self.loss.advantage!r} (a greedy single-turn baseline) is not "
                "supported with env (multi-turn episodes) yet"
            )
        if [c.name for c in self.reward.components] != ["correctness"] or any(
            c.weight != 1.0 or c.function for c in self.reward.components
        ):
            raise ValueError(
                "reward.components: with `env` the reward is the environment's; remove the "
                "reward section"
            )
