"""A trained reward model as a reward source: batched scoring of (prompt ids, completion ids).

    scorer = RewardModelScorer.from_pretrained("runs/rm-.../model", kind="preference")
    rewards = scorer.score(prompts_ids, completions_ids)        # Tensor (B,)
    rewards = scorer.score_rollout(rollout)                      # same, from a Rollout

What a score is, per kind:
    preference  the Bradley–Terry scalar r(x, y) at the last real token (unbounded logit scale)
    orm         σ(z) at the last real token: P(correct)
    prm         min_k or Π_k of P(step k correct) at the step-separator tokens of the completion;
                with `credit: dense` each P(step k correct) at its separator token instead
                (`StepRewards`: per-token rewards for the policy-gradient trainer)

`normalize`: "none"; "batch" whitens each call's scores (mean 0, std 1 over the batch); "running"
subtracts a running mean and divides by a running std (Welford over every score seen), the usual
choice for PPO against a learned RM. The raw scores of the last call are kept in `last_raw`.

Integration with the policy-gradient trainer: `reward_model_component` is the reward component
named "reward_model" (`rlhflab.rewards.shaping.REWARD_COMPONENTS`), next to the verifier's
"correctness"; give the gold verifier weight 0 to log it beside the RM score without training on it:

    reward:
      components:
        - {name: reward_model, weight: 1.0, args: {path: runs/rm-.../model, kind: preference}}
        - {name: correctness, weight: 0.0}     # logged as rollout/reward/correctness_mean
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlhflab.errors import ConfigError
from rlhflab.losses.reward_model import prm_solution_score, prm_step_correct_prob
from rlhflab.rollout.sampler import pack

RM_KINDS = ("preference", "orm", "prm")
NORMALIZATIONS = ("none", "batch", "running")
CREDITS = ("sequence", "dense")


@dataclass(frozen=True)
class StepRewards:
    """What a reward component with dense credit returns instead of one scalar per completion.

    values: (B, T) float32, each step's reward at that step's last token (the step-separator
        position of the completion), 0 elsewhere; steps: (B, T) bool, those positions;
    score: (B,) float32, the per-completion score logged as the component's value (a PRM's
        min or product over its steps, what `credit: sequence` would train on).
    All aligned with the scored rollout's completion tokens.
    """

    values: Tensor
    steps: Tensor
    score: Tensor


class RewardModelScorer:
    """Score completions with a reward model in micro-batches, without gradients.

    Args:
        model: a sequence-classification reward model (`rlhflab.models.reward`).
        kind: "preference", "orm" or "prm" (how a score is read, module docstring).
        pad_token_id: id used to pad batches (any id: scores do not depend on it).
        sep_id: step-separator token id (PRM only).
        prm_reduce: "min" or "prod" (PRM only).
        normalize: "none", "batch" or "running".
        micro_batch_size: sequences per forward.
    """

    def __init__(
        self,
        model,
        *,
        kind: str,
        pad_token_id: int,
        sep_id: int | None = None,
        prm_reduce: str = "min",
        normalize: str = "none",
        micro_batch_size: int = 64,
        autocast_dtype: torch.dtype | None = None,
    ):
        if kind not in RM_KINDS:
            raise ConfigError(
                f"reward_model.kind: must be one of {', '.join(RM_KINDS)}, got {kind!r}"
            )
        if normalize not in NORMALIZATIONS:
            raise ConfigError(
                f"reward_model.normalize: must be one of {', '.join(NORMALIZATIONS)}, got {normalize!r}"
            )
        if kind == "prm" and sep_id is None:
            raise ConfigError("reward_model: a PRM needs the step separator token id (sep_id)")
        self.model = model.eval().requires_grad_(False)
        self.kind, self.pad_token_id, self.sep_id = kind, pad_token_id, sep_id
        self.prm_reduce, self.normalize = prm_reduce, normalize
        self.micro_batch_size = micro_batch_size
        self.autocast_dtype = autocast_dtype
        self._n, self._mean, self._m2 = 0, 0.0, 0.0
        self.last_raw: Tensor | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        kind: str,
        device="cpu",
        sep: str = "\n",
        dtype: str = "float32",
        meta: bool = False,
        **kwargs,
    ):
        """Load a saved reward model and its tokenizer (for pad / separator ids).

        dtype: the parameters' dtype ("float32", or "float64" for exactness tests).
        meta: build the model on the meta device from its config instead (no weights, no
            memory: an FSDP2 rank other than 0, filled by `load_sharded`)."""
        from rlhflab.data.prm import separator_id
        from rlhflab.models.loading import load_tokenizer
        from rlhflab.models.reward import load_reward_model

        tokenizer = load_tokenizer(path)
        num_labels = None
        if kind == "prm":
            from transformers import AutoConfig

            num_labels = AutoConfig.from_pretrained(path).num_labels
        if meta:
            model = _meta_reward_model(path, num_labels=num_labels or 1, dtype=dtype)
        else:
            model = load_reward_model(path, num_labels=num_labels or 1, dtype=dtype, device=device)
        sep_id = separator_id(tokenizer, sep) if kind == "prm" else None
        scorer = cls(model, kind=kind, pad_token_id=tokenizer.pad_token_id, sep_id=sep_id, **kwargs)
        scorer.tokenizer = tokenizer  # for scoring decoded text (`score_texts`)
        return scorer

    def score_texts(self, rows: list, texts: list[str], truncated: list[bool]) -> Tensor:
        """Scores (B,) of decoded completions, re-tokenised with the RM's own tokenizer: the prompt
        row rendered with the RM's chat template (`rlhflab.data.prompts.render_row`), the
        completion encoded with eos appended unless it was truncated. For RMs whose tokenizer
        differs from the policy's (third-party RMs). Needs `from_pretrained` (the tokenizer)."""
        return self.score_rollout(self.texts_rollout(rows, texts, truncated))

    def texts_rollout(self, rows: list, texts: list[str], truncated: list[bool]):
        """The Rollout `score_texts` scores: prompts and completions re-tokenised (its doc)."""
        from rlhflab.data.formatting import encode_prompt
        from rlhflab.data.prompts import render_row

        tok = self.tokenizer
        prompts = [encode_prompt(tok, render_row(tok, r)) for r in rows]
        completions = [
            list(tok(t, add_special_tokens=False)["input_ids"])
            + ([] if cut else [tok.eos_token_id])
            for t, cut in zip(texts, truncated, strict=True)
        ]
        return pack(prompts, completions, self.pad_token_id)

    @torch.no_grad()
    def raw_scores_rollout(self, rollout) -> Tensor:
        """Un-normalised scores (B,) of a Rollout (micro-batched)."""
        from rlhflab import distributed
        from rlhflab.models.reward import score_rollout

        if self.kind == "prm":
            probs, steps = self.step_probs_rollout(rollout)
            return prm_solution_score(probs, steps, reduce=self.prm_reduce).float()
        device = next(self.model.parameters()).device
        out = []
        # Sharded (FSDP2, `load_sharded`): unsharded once for this rank's rows (a collective:
        # every rank scores at the same steps); otherwise nothing happens.
        with distributed.gathered(self.model):
            for s in range(0, rollout.completion_ids.size(0), self.micro_batch_size):
                mb = rollout.select(slice(s, s + self.micro_batch_size)).to(device)
                scores = score_rollout(self.model, mb, autocast_dtype=self.autocast_dtype)
                out.append(torch.sigmoid(scores) if self.kind == "orm" else scores)
        return torch.cat(out).float()

    @torch.no_grad()
    def step_probs_rollout(self, rollout) -> tuple[Tensor, Tensor]:
        """A PRM's P(step correct) at every completion token and where the steps end.

        Returns (probs (B, T) float32, the last-class probability at every position, read only
        at steps; steps (B, T) bool, the step-separator tokens within the completion mask),
        aligned with `rollout.completion_ids`, on the RM's device (micro-batched).
        Raises: ValueError for a reward model that is not a PRM."""
        from rlhflab import distributed
        from rlhflab.models.reward import completion_token_logits

        if self.kind != "prm":
            raise ValueError(f"step_probs_rollout needs a PRM (kind 'prm'), got {self.kind!r}")
        device = next(self.model.parameters()).device
        probs, steps = [], []
        with distributed.gathered(self.model):  # as raw_scores_rollout: a collective if sharded
            for s in range(0, rollout.completion_ids.size(0), self.micro_batch_size):
                mb = rollout.select(slice(s, s + self.micro_batch_size)).to(device)
                logits = completion_token_logits(self.model, mb, autocast_dtype=self.autocast_dtype)
                probs.append(prm_step_correct_prob(logits))  # (b, T)
                steps.append((mb.completion_ids == self.sep_id) & mb.mask.bool())
        return torch.cat(probs).float(), torch.cat(steps)

    def score_rollout(self, rollout) -> Tensor:
        """Scores (B,) of a Rollout, normalised as configured."""
        raw = self.raw_scores_rollout(rollout)
        self.last_raw = raw
        return self._normalize(raw)

    def score(self, prompts_ids: list[list[int]], completions_ids: list[list[int]]) -> Tensor:
        """Scores (B,) of prompts (token ids) with completions (token ids, eos included)."""
        return self.score_rollout(pack(prompts_ids, completions_ids, self.pad_token_id))

    __call__ = score

    def running_state(self) -> dict:
        """The running normalisation's statistics (Welford count, mean, M2) as JSON."""
        return {"n": self._n, "mean": self._mean, "m2": self._m2}

    def load_running_state(self, state: dict) -> None:
        """Continue the running normalisation from a `running_state()`."""
        self._n, self._mean, self._m2 = int(state["n"]), float(state["mean"]), float(state["m2"])

    def _normalize(self, raw: Tensor) -> Tensor:
        if self.normalize == "none":
            return raw
        if self.normalize == "batch":
            if raw.numel() < 2:
                return raw - raw.mean()
            return (raw - raw.mean()) / (raw.std() + 1e-8)
        for x in raw.tolist():  # Welford
            self._n += 1
            delta = x - self._mean
            self._mean += delta / self._n
            self._m2 += delta * (x - self._mean)
        std = math.sqrt(self._m2 / (self._n - 1)) if self._n > 1 else 1.0
        return (raw - self._mean) / (std + 1e-8)


def _meta_reward_model(path: str, *, num_labels: int, dtype: str):
    """The reward model `load_reward_model(path, num_labels=..., dtype=...)` would load, built on
    the meta device from its config: the same modules, parameter names, shapes and dtypes, no
    weights (a sequence-classification checkpoint as is; a causal LM with a head, as
    `reward_model_from_causal_lm` makes it, which draws nothing on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhflab.models.loading import DTYPES, float64_exact
    from rlhflab.models.reward import reward_model_from_causal_lm

    config = AutoConfig.from_pretrained(path)
    seq_cls = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        if seq_cls:
            model = AutoModelForSequenceClassification.from_config(config)
        else:
            lm = AutoModelForCausalLM.from_config(config)
    if not seq_cls:  # seeds the global RNG as rank 0's load does (same streams on every rank)
        model = reward_model_from_causal_lm(
            lm, num_labels=num_labels, pad_token_id=lm.config.pad_token_id
        )
    model = model.to(DTYPES[dtype])
    return float64_exact(model) if dtype == "float64" else model


def load_sharded(
    path: str, parallel, *, kind: str, sep: str = "\n", dtype: str = "float32", **kwargs
) -> RewardModelScorer:
    """A `RewardModelScorer` whose model is sharded over the ranks by FSDP2, without a full copy
    on any rank but 0's host (`rlhflab.distributed.loads_from_rank0`): rank 0 loads the model
    in host memory, the other ranks build it on the meta device from its config, and
    `distributed.wrap(..., roots=[backbone, head])` shards it from rank 0's weights (frozen,
    eval). Scoring unshards it for the duration (`distributed.gathered`). A collective: every
    rank calls it at the same point. `parallel` is the `parallel` config section (mixed
    precision, cpu offload); the other arguments are `RewardModelScorer.from_pretrained`'s."""
    from rlhflab import distributed
    from rlhflab.models.reward import reward_head

    meta = not distributed.is_main()
    scorer = RewardModelScorer.from_pretrained(
        path, kind=kind, device="cpu", sep=sep, dtype=dtype, meta=meta, **kwargs
    )
    model = scorer.model
    weights = distributed.host_state(model) if not meta else None
    scorer.model = distributed.wrap(
        model, parallel, roots=[model.base_model, reward_head(model)], weights=weights
    )
    scorer.model.eval().requires_grad_(False)
    return scorer


def check_reward_model_paths(components) -> None:
    """Before the run directory exists: every "reward_model" or "judge" reward component's `path`
    holds a loadable model config (reads config.json only; the model is loaded at the first rollout).

    Raises:
        ConfigError: naming the component's path and why it cannot be loaded.
    """
    from transformers import AutoConfig

    from rlhflab.errors import ModelError
    from rlhflab.models.loading import resolve_name_or_path

    for comp in components:
        if comp.name not in ("reward_model", "judge") or getattr(comp, "function", None):
            continue
        path = comp.args.get("path")
        if comp.name == "judge" and isinstance(path, str):
            from rlhflab.rewards.judge import judge_model_path

            path = judge_model_path(path)  # a run directory: its model/
        try:
            AutoConfig.from_pretrained(resolve_name_or_path(path))  # a mistyped path: at once
        except (OSError, ValueError, TypeError, ModelError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            what = "a reward model" if comp.name == "reward_model" else "a judge model"
            raise ConfigError(
                f"reward.components[{comp.name}].args.path: cannot load {what} from "
                f"{path!r}: {first}"
            ) from None


_SCORERS: dict[tuple, RewardModelScorer] = {}
_PENDING: dict[str, dict] = {}  # running statistics restored before their scorer is loaded


def _state_key(key: tuple) -> str:
    return json.dumps(list(key[:-1]))  # device aside: a run resumed elsewhere continues


def running_norm_state() -> dict[str, dict]:
    """The running-normalisation statistics of every "reward_model" component with
    `normalize: running` (JSON, keyed by the component's arguments): saved in checkpoints so that
    a resumed run normalises exactly as the uninterrupted one."""
    out = dict(_PENDING)
    for key, scorer in _SCORERS.items():
        if scorer.normalize == "running":
            out[_state_key(key)] = scorer.running_state()
    return out


def load_running_norm_state(state: dict[str, dict]) -> None:
    """Restore `running_norm_state()` (a resumed run) or, given {}, start every running
    normalisation from zero (a fresh run in a process that scored before)."""
    _PENDING.clear()
    _PENDING.update(state)
    for scorer in _SCORERS.values():
        scorer.load_running_state({"n": 0, "mean": 0.0, "m2": 0.0})


def _scorer(
    device, parallel, *, path, kind, normalize, prm_reduce, step_separator, micro_batch_size, dtype
) -> tuple[RewardModelScorer, tuple]:
    """The process's scorer for these arguments (loaded at the first call) and its key."""
    from rlhflab import distributed
    from rlhflab.models.loading import DTYPES

    if dtype not in DTYPES:
        raise ConfigError(
            f"reward.components[reward_model].args.dtype: one of {', '.join(DTYPES)}, got {dtype!r}"
        )
    key = (path, kind, normalize, prm_reduce, step_separator, micro_batch_size)
    key = (*key, *([dtype] if dtype != "float32" else []), str(device))
    scorer = _SCORERS.get(key)
    if scorer is None:
        load = dict(
            kind=kind,
            sep=step_separator,
            prm_reduce=prm_reduce,
            normalize=normalize,
            micro_batch_size=micro_batch_size,
        )
        if dtype != "float32":
            load["dtype"] = dtype
        from rlhflab.errors import ModelError

        try:
            if parallel is not None and distributed.loads_from_rank0():
                scorer = load_sharded(path, parallel, **load)
            else:
                scorer = RewardModelScorer.from_pretrained(path, device=device, **load)
        except ModelError as exc:  # a missing or mistyped path: name the argument
            raise ModelError(f"reward_model component's args.path: {exc}") from None
        _SCORERS[key] = scorer
    return scorer, key


def take_part_without_rows(components, parallel, device) -> None:
    """A rank with no rows to score this round (more ranks than prompts) takes part in what the
    sharded reward models' scoring does collectively on the other ranks (loading, unsharding):
    without it they would wait forever. Nothing happens unless the reward models are sharded
    (`load_sharded`)."""
    from rlhflab import distributed

    if parallel is None or not distributed.loads_from_rank0():
        return
    params = inspect.signature(reward_model_component).parameters
    defaults = {k: p.default for k, p in params.items() if k in _SCORER_ARGS and k != "path"}
    for comp in components:
        if comp.name != "reward_model" or getattr(comp, "function", None):
            continue
        args = {**defaults, **{k: v for k, v in comp.args.items() if k in _SCORER_ARGS}}
        scorer, _ = _scorer(device, parallel, **args)
        with distributed.gathered(scorer.model):
            pass


_SCORER_ARGS = (
    "path", "kind", "normalize", "prm_reduce", "step_separator", "micro_batch_size", "dtype"
)  # fmt: skip


def reward_model_component(
    *,
    rollout,
    texts: list[str] | None = None,
    problems: list | None = None,
    path: str,
    kind: str = "preference",
    normalize: str = "none",
    prm_reduce: str = "min",
    step_separator: str = "\n",
    micro_batch_size: int = 64,
    retokenize: bool = False,
    dtype: str = "float32",
    parallel=None,
    raw_scores: bool = False,
    credit: str = "sequence",
) -> Tensor | StepRewards:
    """Reward component "reward_model": the RM's score of each completion of the rollout (B,) on
    the CPU, float32. The RM at `path` is loaded once per process (on the rollout's device) and
    reused; with normalize "running" its statistics persist across steps. `raw_scores` (supplied
    by a caller that measures rather than trains, e.g. the gold-vs-proxy frontier): the RM's
    unnormalised scores, leaving the running statistics untouched.

    retokenize False: the RM shares the policy's tokenizer and scores the sampled token ids as
    they are. True: the decoded completions and their prompt rows are re-tokenised with the RM's
    own tokenizer and chat template (`RewardModelScorer.score_texts`) — an RM whose tokenizer
    differs from the policy's.

    dtype: the RM's parameter dtype ("float32"; "float64" for exactness tests). `parallel` (the
    run's `parallel` config section, supplied by the trainer): under FSDP2 with several
    processes (`distributed.loads_from_rank0`) the RM is sharded without full copies
    (`load_sharded`) and every rank must score at the same steps; otherwise every process
    loads it whole on its device.

    credit "sequence" (default): one score per completion, as above. "dense" (a PRM only, with
    normalize "none" and retokenize False): each step's P(correct) at its step-separator token,
    returned as `StepRewards` (values (B, T), steps (B, T), score (B,) = the min/prod solution
    score, logged); the policy-gradient trainer turns them into per-token rewards
    (`rlhflab.losses.advantages.token_rewards`). With `raw_scores` the (B,) score is returned.

    Raises: ConfigError for a credit other than "sequence"/"dense", or dense credit with a
    reward model that is not a PRM, with normalize other than "none", or with retokenize.
    """
    if credit not in CREDITS:
        raise ConfigError(
            f"reward.components[reward_model].args.credit: one of {', '.join(CREDITS)}, "
            f"got {credit!r}"
        )
    if credit == "dense":
        check_dense_credit(kind=kind, normalize=normalize, retokenize=retokenize)
    device = rollout.completion_ids.device
    scorer, key = _scorer(
        device,
        parallel,
        path=path,
        kind=kind,
        normalize=normalize,
        prm_reduce=prm_reduce,
        step_separator=step_separator,
        micro_batch_size=micro_batch_size,
        dtype=dtype,
    )
    if _state_key(key) in _PENDING:
        scorer.load_running_state(_PENDING.pop(_state_key(key)))
    if retokenize:
        rollout = scorer.texts_rollout(problems, texts, rollout.truncated.tolist())
    if credit == "dense":
        probs, steps = scorer.step_probs_rollout(rollout)
        score = prm_solution_score(probs, steps, reduce=prm_reduce).float().cpu()
        if raw_scores:
            return score
        values = torch.where(steps, probs, 0.0).cpu()
        return StepRewards(values=values, steps=steps.cpu(), score=score)
    if raw_scores:
        return scorer.raw_scores_rollout(rollout).cpu()
    return scorer.score_rollout(rollout).cpu()


def check_dense_credit(*, kind: str, normalize: str = "none", retokenize: bool = False) -> None:
    """Dense credit (per-step rewards at the policy's own tokens) needs a PRM read at the
    policy's token positions, unnormalised (the advantage normalises the step rewards).

    Raises: ConfigError naming the argument that does not fit."""
    where = "reward.components[reward_model].args"
    if kind != "prm":
        raise ConfigError(f"{where}.credit: 'dense' needs kind 'prm' (step scores), got {kind!r}")
    if normalize != "none":
        raise ConfigError(
            f"{where}.normalize: credit 'dense' takes the PRM's P(step correct) as is "
            f"(the advantage normalises them); use 'none', got {normalize!r}"
        )
    if retokenize:
        raise ConfigError(
            f"{where}.retokenize: credit 'dense' places step rewards at the policy's own "
            "tokens; a re-tokenised completion has other positions"
        )
