"""Config of `trainer: policy_gradient`: rollout, reward, loss, KL and critic sections and
`PGConfig` (see rlhflab.trainers.policy_gradient)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

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
    """The colocated `vllm` rollout engine (vLLM's offline LLM in the trainer's process)."""

    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)  # share of GPU memory vLLM may take
    enable_prefix_caching: bool = True  # a group's prompt is prefilled once
    max_model_len: int | None = Field(None, ge=1)  # default: the model's context length
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    cpu_kvcache_space_gb: int = Field(1, ge=1)  # CPU build only: its KV-cache size (GiB)
    # Colocated mode: between rollouts vLLM offloads its weights to CPU memory and frees its KV
    # cache (vLLM sleep mode, level 1), so the trainer's update has the GPU. CUDA/ROCm only.
    sleep: bool = False
    # vLLM's tensor parallelism for a model too large for one GPU: the LLM shards the model over
    # this many GPUs (vLLM starts one worker process per GPU). Untested here (no GPU).
    tensor_parallel_size: int = Field(1, ge=1)


class RolloutConfig(Strict):
    """Sampling: all prompts of a step in one batched generation, through `engine`
    (rlhflab.rollout.engines: "hf", our KV-cache sampler; "vllm", colocated vLLM)."""

    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: off
    min_p: float = Field(0.0, ge=0, lt=1)  # 0: off
    stop_token_ids: list[int] = Field(default_factory=list)  # besides EOS and the model's own
    engine: Literal["hf", "vllm"] = "hf"
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)


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


class TISConfig(Strict):
    """Truncated importance sampling of the policy-gradient term by min(π_θold / π_sampler, cap)
    (rlhflab.losses.correction.truncated_importance_weights; Yao et al. 2025)."""

    enabled: bool = False
    cap: float = Field(2.0, gt=0)  # C; Yao et al. use 2, TRL's default is 3


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
            | ({"logp", "sum_pi_squared"} if advantage.needs_token_probs else set()),
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
    """KL(π_θ ‖ π_ref) regularisation. A reference model is loaded only when coef > 0.

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


class PGTrainConfig(TrainBase):
    """Policy-gradient budget: rollout steps, micro-batch size, update epochs × minibatches."""

    steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(64, ge=1)  # completions per forward/backward
    update_epochs: int = Field(1, ge=1)  # passes over each rollout batch
    minibatches: int = Field(1, ge=1)  # optimizer steps per epoch
    max_seconds: float | None = Field(None, gt=0, description=MAX_SECONDS_DOC)


class PGConfig(TrainerConfig):
    """Config of `trainer: policy_gradient` (see trainers/policy_gradient.py)."""

    trainer: Literal["policy_gradient"] = "policy_gradient"
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    kl: KLConfig = Field(default_factory=KLConfig)
    value: ValueConfig | None = None  # set for advantages that need a critic (gae)
    data: PromptDataConfig = Field(default_factory=PromptDataConfig)
    train: PGTrainConfig = Field(default_factory=PGTrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @model_validator(mode="after")
    def _consistency(self) -> PGConfig:
        from rlhflab.losses.advantages import ADVANTAGES

        advantage = ADVANTAGES[self.loss.advantage]  # what it declares it needs
        if advantage.needs_groups and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size must be >= 2 for the group advantage "
                f"'{self.loss.advantage}' (got {self.rollout.group_size})"
            )
        if self.rollout.dynamic_sampling.enabled and self.rollout.group_size < 2:
            raise ValueError(
                "rollout.group_size must be >= 2 for rollout.dynamic_sampling "
                f"(got {self.rollout.group_size})"
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
        for comp in self.reward.components:
            if comp.name == "overlong":  # DAPO's L_cache must fit in L_max
                cache, limit = comp.args.get("cache"), comp.args.get("max_len")
                limit = limit or self.rollout.max_new_tokens
                if not isinstance(cache, int) or isinstance(cache, bool) or not 0 < cache <= limit:
                    raise ValueError(
                        f"reward.components[overlong].args.cache must be an integer in "
                        f"1..{limit} (args.max_len or rollout.max_new_tokens), got {cache!r}"
                    )
        if self.data.source == "dataset" and any(
            c.name == "correctness" and c.function is None for c in self.reward.components
        ):
            raise ValueError(
                "reward.components: 'correctness' scores with the task's verifier; with "
                "data.source 'dataset' use math_verify, exact_match or a reward function"
            )
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.train.minibatches:
            raise ValueError(
                f"train.minibatches ({self.train.minibatches}) must divide the rollout batch "
                f"(rollout.prompts_per_step × rollout.group_size = {batch})"
            )
        return self
