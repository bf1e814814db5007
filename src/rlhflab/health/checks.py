"""The health checks: pure measurements (`prob_sum_error`, `repetition`, `degeneracy`,
`relative_change`), the `CHECKS` table (name, measure, threshold, hint) and `training_signal`.

The pure functions import only torch and the standard library. The monitor that runs the checks
every step is `rlhflab.health.monitor.HealthMonitor`; the overview is in `rlhflab.health`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# Default threshold of the `logp_mismatch` check (`health.logp_mismatch_max` unset): the mean
# |sampler logp − trainer logp| per token, nats, by the precision of the forward passes.
# fp32: the hf engine's log-probs are the trainer's to ~1e-7 and vLLM-CPU's (fp32) to < 3e-6 on
# every token (tests/rollout/engines); 1e-3 leaves > 300x of room for other kernels (GPU fp32
# without TF32) while a real defect (wrong temperature, padding or positions: ~0.1-1 nats) fails.
# bf16: the 1.41 B Qwen3-shape probe (H200, bf16 autocast) gave a per-token max of 0.07-0.09;
# vLLM-CPU in bfloat16 against an fp32 trainer (the `small` model, 12 GRPO steps,
# bench/vllm_mismatch.py) a per-step mean of 0.001-0.005 and max of 0.004-0.018, the mean growing
# as the policy sharpens (docs/engine_vllm.md). 0.05 is ~10x those means and above half the
# large model's worst tokens: a mean above it is a systematic difference, not bf16 rounding.
LOGP_MISMATCH_MAX = {"fp32": 1e-3, "bf16": 0.05}


def mismatch_max(cfg) -> float:
    """The `logp_mismatch` threshold of a `health` section: its `logp_mismatch_max`, or the fp32
    default when unset (the trainers fill it by precision: `run_precision`)."""
    return cfg.logp_mismatch_max if cfg.logp_mismatch_max is not None else LOGP_MISMATCH_MAX["fp32"]


def run_precision(cfg, autocast_dtype: torch.dtype | None) -> str:
    """ "bf16" when any forward pass that produces log-probs runs in 16 bits: bf16/fp16 autocast,
    FSDP2 bf16 mixed precision, a 16-bit model dtype or a 16-bit vLLM engine; else "fp32"."""
    half = (torch.bfloat16, torch.float16)
    sixteen = ("bfloat16", "float16")
    parallel, model = getattr(cfg, "parallel", None), getattr(cfg, "model", None)
    rollout = getattr(cfg, "rollout", None)
    if (
        autocast_dtype in half
        or getattr(parallel, "mixed_precision", "fp32") == "bf16"
        or getattr(model, "dtype", "float32") in sixteen
        or (rollout is not None and rollout.engine == "vllm" and rollout.vllm.dtype in sixteen)
    ):
        return "bf16"
    return "fp32"


def resolved_health(cfg, autocast_dtype: torch.dtype | None):
    """`cfg.health` with `logp_mismatch_max` filled by the run's precision when unset."""
    if cfg.health.logp_mismatch_max is not None:
        return cfg.health
    limit = LOGP_MISMATCH_MAX[run_precision(cfg, autocast_dtype)]
    return cfg.health.model_copy(update={"logp_mismatch_max": limit})


# ---------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------


def prob_sum_error(logits: Tensor) -> tuple[float, float]:
    """How far softmax(logits) is from a probability distribution, at each position.

    Args:
        logits: (N, V) any float dtype; computed in float32 as the trainer's log-softmax is.
    Returns:
        (max over positions of |Σ_v p_v − 1|, max over positions and tokens of log p_v). A valid
        distribution gives ~1e-7 and ≤ 0; NaN/inf logits give NaN (which every threshold fails).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    err = (logp.exp().sum(-1) - 1.0).abs()  # (N,)
    if not torch.isfinite(logp).all():
        return float("nan"), float("nan")
    return float(err.max()), float(logp.max())


@torch.no_grad()
def sampled_distribution(model, input_ids: Tensor, attention_mask: Tensor, n_positions: int = 16):
    """`prob_sum_error` of `model`'s output at up to `n_positions` real positions of ONE sequence.

    Args:
        model: a causal LM returning `.logits` (1, L, V).
        input_ids, attention_mask: (L,) long: the sequence (left or right padding allowed).
        n_positions: evenly spaced real positions checked (the forward pass covers all of them).
    Returns:
        (prob_sum_err, logp_max) as `prob_sum_error`.
    """
    keep = attention_mask.bool()
    ids = input_ids[keep].unsqueeze(0)  # (1, L') real tokens only
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=ids).logits[0]  # (L', V)
    finally:
        model.train(was_training)
    idx = torch.linspace(0, logits.size(0) - 1, min(n_positions, logits.size(0))).long()
    return prob_sum_error(logits[idx.to(logits.device)])


def repetition(ids: list[int], n: int = 3) -> float:
    """1 − distinct n-grams / n-grams of one completion: 0 without repeats, → 1 for "a a a a ...".

    Completions with fewer than 2n tokens count as 0 (too short to call repetitive).
    """
    if len(ids) < 2 * n:
        return 0.0
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def degeneracy(
    completion_ids: Tensor,
    mask: Tensor,
    texts: list[str],
    group_size: int,
    correct: Tensor | None = None,
    *,
    ngram: int = 3,
    repeat_threshold: float = 0.5,
) -> dict[str, float]:
    """Fractions of degenerate completions in a rollout batch (group-contiguous rows).

    Args:
        completion_ids, mask: (B, T) token ids and 0/1 completion mask.
        texts: B decoded completions.
        group_size: G, completions per prompt (B = n_groups · G).
        correct: (B,) optional; a group of identical completions counts only if not all correct
            (a model that has solved a prompt rightly answers it the same way every time).
        ngram, repeat_threshold: a completion is repetitive when `repetition(ids, ngram)` exceeds
            the threshold.
    Returns:
        {"empty": share of completions that are empty or whitespace,
         "repetition": share that are repetitive,
         "identical_group": share of groups (G > 1) whose G texts are all equal (and not all correct),
         "nonprintable": share with a character that is neither printable nor whitespace}
    """
    b = len(texts)
    lengths = mask.sum(1).long().tolist()  # (B,)
    ids = completion_ids.tolist()
    out = {
        "empty": sum(not t.strip() for t in texts) / b,
        "repetition": sum(
            repetition(ids[i][: lengths[i]], ngram) > repeat_threshold for i in range(b)
        )
        / b,
        "nonprintable": sum(any(not (c.isprintable() or c.isspace()) for c in t) for t in texts)
        / b,
    }
    if group_size > 1 and b % group_size == 0:
        n_groups, same = b // group_size, 0
        for g in range(n_groups):
            rows = range(g * group_size, (g + 1) * group_size)
            if len({texts[i] for i in rows}) == 1:
                all_right = correct is not None and bool(
                    (correct[g * group_size :][:group_size] == 1).all()
                )
                same += not all_right
        out["identical_group"] = same / n_groups
    return out


def relative_change(before: Tensor, after: Tensor) -> float:
    """‖after − before‖ / ‖before‖ (∞-safe: ‖before‖ = 0 gives ‖after − before‖)."""
    diff = torch.linalg.vector_norm((after - before).double())
    base = torch.linalg.vector_norm(before.double())
    return float(diff / base) if base > 0 else float(diff)


def _param_sample(model: torch.nn.Module, per_tensor: int = 1024) -> Tensor:
    """Up to `per_tensor` evenly strided elements of every trainable parameter, concatenated."""
    parts = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        t = p.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor shard under FSDP
        flat = t.reshape(-1)
        if flat.numel() == 0:
            continue
        stride = max(1, flat.numel() // per_tensor)
        parts.append(flat[::stride][:per_tensor].float().cpu().clone())
    return torch.cat(parts) if parts else torch.zeros(0)


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One check: `measure(view) -> value or None` (None: no input this step), `fails(value, cfg)`,
    whether it is sustained (needs `patience` steps in a row) and what to look at."""

    name: str
    measure: Callable[[dict], float | None]
    fails: Callable[[float, object], bool]
    sustained: bool
    threshold: Callable[[object], str]
    hint: str


def _get(key: str) -> Callable[[dict], float | None]:
    return lambda v: v["metrics"].get(key)


def _bad(x: float) -> bool:
    return not math.isfinite(x)


def _loss(v: dict) -> float | None:
    m = v["metrics"]
    return m.get("train/loss", m.get("policy/loss"))


CHECKS: dict[str, Check] = {
    c.name: c
    for c in [
        Check(
            "nonfinite",
            lambda v: (
                0.0
                if all(
                    math.isfinite(float(x))
                    for x in (_loss(v), v["metrics"].get("optim/grad_norm"))
                    if x is not None
                )
                else float("nan")
            ),
            lambda x, c: _bad(x),
            False,
            lambda c: "finite",
            "a NaN/inf loss or gradient norm (train.nan_policy skipped the step); lower optim.lr, "
            "check the data for empty rows",
        ),
        Check(
            "prob_sum",
            lambda v: v.get("prob_sum_err"),
            lambda x, c: _bad(x) or x > c.prob_sum_tol,
            False,
            lambda c: f"|sum p - 1| <= {c.prob_sum_tol:g}",
            "the model's softmax does not sum to 1 (NaN/inf logits); look at the weights and "
            "optim/grad_norm",
        ),
        Check(
            "logp_positive",
            lambda v: v.get("logp_max"),
            lambda x, c: _bad(x) or x > c.logp_tol,
            False,
            lambda c: f"log p <= {c.logp_tol:g}",
            "a log-probability above 0 is not a probability; check the log-softmax / temperature",
        ),
        Check(
            "logp_mismatch",
            _get("rollout/logp_diff_mean"),
            lambda x, c: _bad(x) or x > mismatch_max(c),
            True,
            lambda c: f"<= {mismatch_max(c):g} nats/token",
            "the sampler's log-probs differ from the trainer's (training-inference mismatch): "
            "precision, temperature, padding or position ids",
        ),
        Check(
            "ratio_first_update",
            _get("policy/ratio_mean"),
            lambda x, c: _bad(x) or abs(x - 1.0) > c.ratio_tol,
            False,
            lambda c: f"|ratio - 1| <= {c.ratio_tol:g}",
            "the first update of a batch is on-policy, so pi/pi_old must be 1; logp_old is stale",
        ),
        Check(
            "grad_norm_zero",
            _get("optim/grad_norm"),
            lambda x, c: x < c.grad_norm_min,
            True,
            lambda c: f">= {c.grad_norm_min:g}",
            "no gradient flows through log pi: all advantages zero, a saturated softmax "
            "(learning rate far too high) or frozen parameters",
        ),
        Check(
            "grad_norm_exploding",
            _get("optim/grad_norm"),
            lambda x, c: x > c.grad_norm_max,
            False,
            lambda c: f"<= {c.grad_norm_max:g}",
            "the gradient norm exploded; lower optim.lr or set optim.max_grad_norm",
        ),
        Check(
            "params_frozen",
            lambda v: v.get("param_change"),
            lambda x, c: x < c.param_change_min,
            True,
            lambda c: f"relative change >= {c.param_change_min:g}",
            "the parameters did not change over an optimizer step: requires_grad, the optimizer's "
            "parameter list, a zero learning rate, skipped steps",
        ),
        Check(
            "loss_flat",
            lambda v: v.get("loss_range"),
            lambda x, c: x < c.loss_change_min,
            False,
            lambda c: f"range over window >= {c.loss_change_min:g}",
            "the loss has not moved over health.window steps: nothing is being learned",
        ),
        Check(
            "distill_kl_flat",
            lambda v: v.get("distill_kl_ratio"),
            lambda x, c: _bad(x) or x > c.distill_kl_ratio_max,
            True,
            lambda c: f"mean KL of the last window <= {c.distill_kl_ratio_max:g} x the first's",
            "the student–teacher KL (distill/kl) is not decreasing: lower or raise optim.lr, "
            "check that the teacher is the intended model and that the student is trained",
        ),
        Check(
            "adv_zero",
            lambda v: v.get("adv_max"),
            lambda x, c: x < 1e-12,
            True,
            lambda c: "max |adv| > 0",
            "every group has equal rewards, so every advantage is 0: the task is too hard or too "
            "easy for the policy (rollout/accuracy), or the reward is constant",
        ),
        Check(
            "reward_flat",
            lambda v: v.get("reward_range"),
            lambda x, c: x < c.reward_change_min,
            False,
            lambda c: f"range over window >= {c.reward_change_min:g}",
            "the mean reward has not moved over health.window steps: samples.jsonl shows what the "
            "policy writes",
        ),
        Check(
            "entropy_collapse",
            _get("policy/entropy"),
            lambda x, c: x < c.entropy_min,
            True,
            lambda c: f">= {c.entropy_min:g} nats/token",
            "the policy samples deterministically; exploration is gone (lower optim.lr, add KL)",
        ),
        Check(
            "entropy_blowup",
            lambda v: (
                v["metrics"].get("policy/entropy") / v["log_vocab"]
                if v.get("log_vocab") and "policy/entropy" in v["metrics"]
                else None
            ),
            lambda x, c: _bad(x) or x > c.entropy_max_frac,
            True,
            lambda c: f"entropy / ln V <= {c.entropy_max_frac:g}",
            "the policy is close to uniform over the vocabulary: untrained or destroyed",
        ),
        Check(
            "kl_exploding",
            _get("policy/kl"),
            lambda x, c: _bad(x) or x > c.kl_max,
            True,
            lambda c: f"<= {c.kl_max:g} nats/token",
            "the policy moved far from the reference; raise kl.coef or lower optim.lr",
        ),
        Check(
            "clip_frac_high",
            lambda v: (
                v["metrics"]["update/clip_frac_low"] + v["metrics"]["update/clip_frac_high"]
                if "update/clip_frac_low" in v["metrics"]
                else None
            ),
            lambda x, c: x > c.clip_frac_max,
            True,
            lambda c: f"<= {c.clip_frac_max:g}",
            "many tokens clipped: updates are too large (lower optim.lr, fewer epochs/minibatches)",
        ),
        Check(
            "truncation_high",
            _get("rollout/truncated_frac"),
            lambda x, c: x > c.truncation_max,
            True,
            lambda c: f"<= {c.truncation_max:g}",
            "most completions hit rollout.max_new_tokens without EOS",
        ),
        Check(
            "empty_completions",
            lambda v: v.get("degeneracy", {}).get("empty"),
            lambda x, c: x > c.empty_max,
            True,
            lambda c: f"<= {c.empty_max:g}",
            "most completions are empty (EOS first)",
        ),
        Check(
            "repetition",
            lambda v: v.get("degeneracy", {}).get("repetition"),
            lambda x, c: x > c.repeat_max,
            True,
            lambda c: f"<= {c.repeat_max:g}",
            "most completions repeat the same n-grams (a collapsed policy)",
        ),
        Check(
            "identical_group",
            lambda v: v.get("degeneracy", {}).get("identical_group"),
            lambda x, c: x > c.identical_max,
            True,
            lambda c: f"<= {c.identical_max:g}",
            "most groups sample one identical (and not correct) completion G times",
        ),
        Check(
            "nonprintable",
            lambda v: v.get("degeneracy", {}).get("nonprintable"),
            lambda x, c: x > c.nonprintable_max,
            True,
            lambda c: f"<= {c.nonprintable_max:g}",
            "most completions contain non-printable characters (byte garbage)",
        ),
        Check(
            "reward_hacking",
            lambda v: v.get("heldout_drop"),
            lambda x, c: x > 0,
            False,
            lambda c: f"held-out drop <= max({c.hacking_drop:g}, 2 se) while reward rises",
            "held-out accuracy fell while the training reward rose: over-optimisation or reward "
            "hacking; read samples.jsonl",
        ),
    ]
}
CHECK_NAMES = tuple(CHECKS)
_SEQ_LOGPS = ("logps/chosen", "logps/rejected", "logps/completion")  # means of summed log-probs


def training_signal(metrics: dict) -> float | None:
    """What the trainer is pushing up, for `reward_hacking` (a float, or None).

    Policy gradients: the mean rollout reward. Paired direct-alignment losses: the mean margin
    between the chosen and rejected implicit rewards, `dpo/margin` (DPO: β·(Δ_chosen −
    Δ_rejected) with Δ = log π_θ − log π_ref, Rafailov et al. 2023, eq. 5; SimPO, ORPO and the
    others: the loss's own reward); over-optimisation in these losses: Rafailov et al. 2024,
    arXiv 2406.02900. KTO: desirable minus undesirable mean implicit reward. None for SFT and
    RM steps, which push up no such signal."""
    if "rollout/reward_mean" in metrics:
        return float(metrics["rollout/reward_mean"])
    if "dpo/margin" in metrics:
        return float(metrics["dpo/margin"])
    if "kto/chosen_reward" in metrics and "kto/rejected_reward" in metrics:
        return float(metrics["kto/chosen_reward"]) - float(metrics["kto/rejected_reward"])
    return None
