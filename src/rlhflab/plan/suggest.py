"""What makes a run fit (`fit_suggestions`): the changes `rlhflab plan` tries when a run does not
fit, each re-planned with the same arithmetic, cheapest first.

"Cheapest" is an order of the changes, from the least change to what the run computes and how
fast it runs to the most (a judgement, stated here and in docs/plan.md):

    0 micro-batch           the largest that fits (only when the user set one): the same gradient
                            (micro-batches are accumulated), fewer rows per forward/backward
    1 activation ckpt       `model.gradient_checkpointing=true`: the same gradient, each layer's
                            forward recomputed in the backward (about a third more train compute)
    2 shard (fsdp2)         `parallel.strategy=fsdp2` over the same GPUs (more than one): the same
                            gradient, parameters / gradients / AdamW state split across ranks, a
                            gather and a reduce-scatter per layer
    3 bf16 in fsdp2         `parallel.mixed_precision=bf16`: layers computed from bf16 copies of the
                            fp32 weights and the frozen reference stored in bf16 (the only way
                            rlhflab keeps a bf16 reference; `trainers.common.Reference`): other
                            rounding, same algorithm
    4 CPU offload           `parallel.cpu_offload=true` (fsdp2): the same numbers, but the state
                            lives in host memory and AdamW steps on the CPU: much slower
    5 LoRA                  `model.lora.r=16 model.dtype=bfloat16`: low-rank adapters on a frozen
                            bf16 base, another parameterisation: a different run
    - more GPUs             the run unchanged but for the exact changes (1, 2) on the smallest
                            power-of-two multiple of the GPUs that fits (that divides the batch:
                            prompts per step, or the batch size): costs hardware

A combination costs more than another when its most expensive change does (then the next, ...):
its cost is Σ 2^rank, so the cheapest combination that fits is the first in that order.
Changes 2–4 need several GPUs (FSDP2 over one process is the plain run). Every total is
`PlanSetting.at` of the run with the change's overrides, at the largest micro-batch that fits
(or the user's micro-batch when it is set and change 0 is not in the combination).
"""

from __future__ import annotations

import dataclasses
import itertools

#: `cost_order` of the suggestions: how "cheapest" is defined.
COST_ORDER = (
    "cheapest first: changes that keep the computed gradient exact (micro-batch, activation "
    "checkpointing, FSDP2 sharding), then bf16 compute weights, then CPU offload (exact but "
    "slowest), then LoRA (another parameterisation), then more GPUs (hardware)"
)


@dataclasses.dataclass(frozen=True)
class Change:
    """One change `rlhflab plan` tries: its name, config overrides and what it costs."""

    rank: int
    name: str
    overrides: tuple[str, ...]
    cost: str


MICRO_BATCH = Change(0, "micro-batch", (), "the same gradient, fewer rows per pass")
CHANGES = (
    Change(1, "activation checkpointing", ("model.gradient_checkpointing=true",),
           "the same gradient, ~1/3 more train compute"),
    Change(2, "FSDP2 sharding", ("parallel.strategy=fsdp2",),
           "the same gradient, state split across the GPUs"),
    Change(3, "bf16 compute weights and reference (FSDP2)",
           ("parallel.strategy=fsdp2", "parallel.mixed_precision=bf16"),
           "bf16 rounding of the layers' weights in compute and of the reference"),
    Change(4, "CPU offload (FSDP2)", ("parallel.strategy=fsdp2", "parallel.cpu_offload=true"),
           "the same numbers, AdamW and the state on the host: much slower"),
    Change(5, "LoRA r=16 on a bf16 base", ("model.lora.r=16", "model.dtype=bfloat16"),
           "trains low-rank adapters: a different run"),
)  # fmt: skip
#: GPU counts tried for "more GPUs": the user's times 2, 4, ... up to this many.
MAX_GPUS = 1024


def _accepted(setting, change: Change) -> bool:
    """Whether the run's config accepts `change`'s overrides (e.g. `adamw_bf16` is refused with
    LoRA or float32 weights: `config.sections.TrainerConfig._optimizer_fits`); a change it
    refuses is not suggested."""
    from rlhflab.errors import ConfigError

    try:
        setting.load(list(change.overrides))
    except ConfigError:
        return False
    return True


def _applies(change: Change, inputs: dict, gpus: int) -> bool:
    """Whether `change` changes the planned run (`inputs`: its PlanInputs as a dict)."""
    if change.rank == 1:
        return not inputs["activation_checkpointing"]
    if change.rank in (2, 3, 4) and gpus < 2:
        return False
    if change.rank == 2:
        return inputs["strategy"] != "fsdp2"
    if change.rank == 3:
        return inputs["mixed_precision"] != "bf16" and inputs["model_dtype"] == "float32"
    if change.rank == 4:
        return not inputs["cpu_offload"]
    if change.rank == 5:
        return inputs["lora_r"] is None
    return False


def _dedup(items) -> list[str]:
    return list(dict.fromkeys(items))


def _try(setting, changes: tuple[Change, ...], gpus: int, user_mb: bool) -> dict:
    """The plan with `changes` applied on `gpus` GPUs, as a suggestion: {"change", "cost",
    "overrides" (the config overrides to add, the micro-batch included), "gpus", "micro_batch",
    "per_gpu_gib", "load_peak_gib", "fits" (steady state and loading)}."""
    extra = _dedup(o for c in changes for o in c.overrides)
    free_mb = MICRO_BATCH in changes or not user_mb
    if free_mb and user_mb:  # replace the user's micro-batch by the largest that fits
        if setting.at(extra, gpus)["token_budget"] is not None:  # a budget sets it: dropped
            extra.append("train.max_tokens_per_micro_batch=null")
        probe = setting.at([*extra, "train.micro_batch_size=1"], gpus)
        extra.append(f"train.micro_batch_size={max(1, probe['max_micro_batch'])}")
        r = setting.at(extra, gpus)
    else:
        r = setting.at(extra, gpus)
        if free_mb:  # searched: pin the value found, so the overrides reproduce this plan
            extra.append(f"train.micro_batch_size={r['inputs']['micro_batch']}")
    return {
        "change": " + ".join(c.name for c in changes) or "none",
        "cost": "; ".join(c.cost for c in changes),
        "overrides": extra,
        "gpus": gpus,
        "micro_batch": r["inputs"]["micro_batch"],
        "per_gpu_gib": r["per_gpu_gib"],
        "load_peak_gib": r["load_peak_gib"],
        "fits": bool(r["fits"] and r["load_fits"]),
    }


def _batch_unit(cfg) -> int:
    """What every rank must get a whole share of: prompts per step (whole groups go to one rank)
    for the policy gradient, else the batch size."""
    if cfg.trainer == "policy_gradient":
        return cfg.rollout.prompts_per_step
    return cfg.train.batch_size


def fit_suggestions(setting, base: dict) -> dict:
    """The changes that make the run of `setting` (a `PlanSetting`; `base` its plan) fit.

    Returns:
        {"cost_order": how "cheapest" is ordered (`COST_ORDER`),
         "each": every change that applies, alone, cheapest first (module docstring), then
             "more GPUs" (the smallest power-of-two multiple of the GPUs on which the run with
             only the exact changes fits, else the largest tried: up to `MAX_GPUS`, while it
             divides the batch; absent when not even twice the GPUs divides it),
         "cheapest": the cheapest combination of the changes that fits (None when none does)};
        each entry as `_try` returns it, so `plan(..., gpus=e["gpus"],
        overrides=[*user_overrides, *e["overrides"]])["per_gpu_gib"] == e["per_gpu_gib"]`.
    """
    gpus, inputs = setting.gpus, base["inputs"]
    user_mb = setting.gives_micro_batch() or base["token_budget"] is not None
    pool = [c for c in CHANGES if _applies(c, inputs, gpus) and _accepted(setting, c)]
    if user_mb and base["max_micro_batch"] < inputs["micro_batch"]:
        pool.insert(0, MICRO_BATCH)
    each = [_try(setting, (c,), gpus, user_mb) for c in pool]
    # combinations in increasing cost (Σ 2^rank): the first that fits is the cheapest
    combos = [c for k in range(1, len(pool) + 1) for c in itertools.combinations(pool, k)]
    combos.sort(key=lambda cs: sum(2**c.rank for c in cs))
    cheapest = None
    for cs in combos:
        tried = _try(setting, cs, gpus, user_mb)
        if tried["fits"]:
            cheapest = {**tried, "changes": [c.name for c in cs]}
            break
    exact = tuple(
        c
        for c in CHANGES
        if c.rank in (1, 2) and (c.rank != 1 or _applies(c, inputs, gpus)) and _accepted(setting, c)
    )
    unit = _batch_unit(setting.load([]))
    n, more = gpus * 2, None
    while n <= MAX_GPUS and unit % n == 0:
        more = _try(setting, exact, n, user_mb)
        more["cost"] = f"{n // gpus}x the GPUs; {more['cost']}"
        more["change"] = f"more GPUs: {n} + {more['change']}"
        if more["fits"]:
            break
        n *= 2
    if more is not None:  # the smallest count that fits, else the largest tried
        each.append(more)
    return {"cost_order": COST_ORDER, "each": each, "cheapest": cheapest}
