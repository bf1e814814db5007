"""Plumbing shared by the trainers: seeding, precision, model set-up, optimizer and LR schedule.

No maths of any algorithm lives here; that is in `rlhflab.losses`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from rlhflab import distributed, faults
from rlhflab.config import ModelConfig, OptimConfig, PrecisionConfig
from rlhflab.errors import DataError, ModelError, NonFiniteError
from rlhflab.experience.prompts import check_generation_budget, check_lengths  # noqa: F401
from rlhflab.experience.stream import ShuffledStream  # noqa: F401  (the trainers' data position)
from rlhflab.throughput import STAGES

logger = logging.getLogger(__name__)
_OVER_BUDGET_SAID: set[int] = set()  # budgets whose over-long rows were logged (once a process)


def micro_batches(train, rows: list, widths: list | None, *, pad_row=None,
                  seqs_per_row: int = 1) -> list[tuple[list, float]]:  # fmt: skip
    """This rank's micro-batches of `rows` as (rows, weight) pairs, as many as every other
    rank's (weight 0.0: a padding pass whose loss is multiplied by 0, see
    `distributed.micro_batches`): `train.micro_batch_size` rows each, or, with
    `train.max_tokens_per_micro_batch` set, rows grouped by length into padded grids of at most
    that many tokens (`distributed.token_budget_split`; `widths[i]` are row i's padded segment
    lengths, `seqs_per_row` the sequences one row puts in the forward; ignored without a
    budget). A row over the budget goes alone, logged once a process."""
    budget = train.max_tokens_per_micro_batch
    if budget is None:
        return distributed.micro_batches(rows, train.micro_batch_size, pad_row)
    alone = [distributed.padded_cells(widths, [i], seqs_per_row) for i in range(len(widths))]
    over = [c for c in alone if c > budget]
    if over and budget not in _OVER_BUDGET_SAID:  # once a process, not at every step
        _OVER_BUDGET_SAID.add(budget)
        logger.warning(
            "train.max_tokens_per_micro_batch %d: %d row(s) of up to %d tokens go alone (said "
            "once)", budget, len(over), max(over),
        )  # fmt: skip
    return distributed.micro_batches(
        rows, 0, pad_row, widths=widths, max_tokens=budget, seqs_per_row=seqs_per_row
    )


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA) RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def setup_precision(precision: PrecisionConfig, device: torch.device) -> torch.dtype | None:
    """Set torch threads; return the autocast dtype (None: plain fp32).

    Master weights and optimizer state stay fp32 in every mode; "bf16" autocasts the forward
    passes. "auto" (the default) means bf16 on CUDA GPUs that support it and fp32 elsewhere: on
    CPU the exactness tests (micro-batch gradients, sampler vs trainer log-probs) hold in fp32, and
    "bf16" opts in where the CPU has fast bf16 (about 1.5x on CPUs with AMX-BF16).
    """
    if precision.threads:
        torch.set_num_threads(precision.threads)
    if precision.autocast == "bf16":
        return torch.bfloat16
    if precision.autocast == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def default_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK under torchrun on GPUs, CUDA when available, else CPU."""
    return distributed.device()


def prepare_model(
    model_cfg: ModelConfig,
    *,
    device: torch.device,
    seed: int,
    tokenizer_texts: Callable[[], list[str]] | None = None,
    sharded_later: bool = False,
):
    """Load (hub id / path) or build (from scratch, tokenizer trained on task text) a causal LM.

    Args:
        model_cfg: the `model` section.
        device: where the model lives.
        seed: initialisation seed for built models.
        tokenizer_texts: called only when building: the strings to train the tokenizer on.
        sharded_later: the caller uses the weights only after `distributed.wrap` (shapes and
            config before). Then, under FSDP2 with several processes
            (`distributed.loads_from_rank0`), rank 0 loads or builds the model in host memory
            (not on the GPU) and every other rank builds it on the meta device (no weights read,
            no memory); `wrap` shards it and fills every rank's shards from rank 0. Otherwise
            (and always with one process or DDP) every rank holds the model on `device`.

    Returns:
        (tokenizer, model) with model in train mode, fp32 master weights unless model.dtype says
        otherwise.
    Raises:
        ModelError / ConfigError (one line) when the model cannot be loaded or built.
    """
    from rlhflab.models.build import build_model
    from rlhflab.models.tokenizer import train_tokenizer

    later = sharded_later and distributed.loads_from_rank0()
    empty = later and not distributed.is_main()  # this rank's weights come from rank 0
    if model_cfg.build is not None:
        b = model_cfg.build
        texts = tokenizer_texts() if tokenizer_texts is not None else []
        tokenizer = train_tokenizer(texts, vocab_size=b.vocab_size)
        with torch.device("meta") if empty else contextlib.nullcontext():
            model = build_model(
                tokenizer,
                size=b.size,
                arch=b.arch,
                max_position_embeddings=b.max_position_embeddings,
                seed=seed,
            )
        if model_cfg.dtype != "float32":  # built in float32; model.dtype applies here too
            from rlhflab.models.loading import DTYPES, float64_exact

            model = (
                float64_exact(model)
                if model_cfg.dtype == "float64"
                else model.to(DTYPES[model_cfg.dtype])
            )
    else:
        tokenizer, model = _load_pretrained(model_cfg, device, later=later, empty=empty)
    if not later:
        model.to(device)
    if model_cfg.gradient_checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    return tokenizer, model


def enable_activation_checkpointing(model) -> None:
    """Per-layer activation checkpointing, non-reentrant, under the name this transformers has:
    `activation_checkpointing_enable` (newer releases, which deprecate the old name with a
    FutureWarning) or `gradient_checkpointing_enable` (older ones, e.g. 5.17, which lack the new
    name: calling it there raised AttributeError)."""
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _load_pretrained(
    model_cfg: ModelConfig, device: torch.device, *, later: bool = False, empty: bool = False
):
    """Tokenizer and model from a hub id or local path; errors name `model.name_or_path`.
    `later`: the model stays in host memory (FSDP2 shards it onto `device`); `empty`: built on
    the meta device from its config (not for GGUF files, whose config is inside the weights)."""
    from rlhflab.models.loading import (
        default_attn_implementation,
        empty_model,
        load_model,
        load_tokenizer,
    )

    attn = model_cfg.attn_implementation or default_attn_implementation(device)
    try:
        tokenizer = load_tokenizer(
            model_cfg.name_or_path,
            trust_remote_code=model_cfg.trust_remote_code,
            gguf_file=model_cfg.gguf_file,
        )
        if empty and model_cfg.gguf_file is None:
            model = empty_model(
                model_cfg.name_or_path,
                dtype=model_cfg.dtype,
                attn_implementation=attn,
                trust_remote_code=model_cfg.trust_remote_code,
            )
        else:
            model = load_model(
                model_cfg.name_or_path,
                dtype=model_cfg.dtype,
                attn_implementation=attn,
                trust_remote_code=model_cfg.trust_remote_code,
                gguf_file=model_cfg.gguf_file,
                device="cpu" if later else str(device),
            )
    except ModelError as exc:
        raise ModelError(f"model.name_or_path: {exc}") from None
    return tokenizer, model


def check_context_fit(rows: list[dict], context: int, *, what: str) -> None:
    """Raise DataError naming the first row whose prompt plus longest completion (`chosen`,
    `rejected` or `completion` token ids) exceeds the model's context length."""
    for i, row in enumerate(rows):
        n = len(row["prompt"]) + max(
            len(row[k]) for k in ("chosen", "rejected", "completion") if k in row
        )
        if n > context:
            raise DataError(
                f"{what}: row {i} has {n} tokens > the model's context length {context}; "
                "set data.max_prompt_len / data.max_completion_len to truncate"
            )


def make_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (`optim.name`: `rlhflab.optimizers`); with the
    default "adamw" its state (m, v) is in the parameters' dtype.

    The implementation is `adamw_implementation` of the parameters' devices: torch's fused
    kernel when they are all on CUDA, the default otherwise (CPU, and FSDP2 shards kept in host
    memory by `parallel.cpu_offload`, where the optimizer steps on the CPU).

    Bytes per trainable parameter with fp32 master weights (`model.dtype: float32`):
    weights 4 + gradient 4 + AdamW m and v 8 = 16 (8 + 8 + 16 = 32 in float64). Under FSDP2
    every term is divided by the number of ranks; with `parallel.mixed_precision: bf16` the
    master weights, gradients and state stay fp32 (16 bytes, sharded), and what is added is
    transient: one layer's parameters gathered in bf16 (2 bytes per parameter of that layer)
    and its gradients reduced in fp32 (4). With `parallel.cpu_offload` the 16 bytes (sharded)
    live in host memory and the GPU holds only the layers being computed. The fused kernel
    keeps the same state as the default implementation (no extra bytes per parameter); it
    updates each tensor in one kernel instead of a chain of element-wise ones.
    """
    from rlhflab import optimizers

    params = [p for p in model.parameters() if p.requires_grad]
    return optimizers.build(
        optim.name,
        params,
        lr=optim.lr,
        betas=optim.betas,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        torch_kwargs=adamw_implementation({p.device for p in params}),
    )


def adamw_implementation(devices) -> dict:
    """Keyword arguments choosing `torch.optim.AdamW`'s implementation for parameters on
    `devices` (an iterable of `torch.device`): `{"fused": True}` when every one is a CUDA device
    (one fused kernel per tensor, as torchtitan uses with FSDP2), else `{}` (torch's default:
    foreach on accelerators, the for-loop on the CPU: CPU runs, the tests' included, keep the
    numbers of earlier releases). Mixed devices or no parameters: `{}`."""
    types = {torch.device(d).type for d in devices}
    return {"fused": True} if types == {"cuda"} else {}


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based).

    Linear warmup from 1/(warmup+1) to 1 over `warmup_steps`, then "constant", "linear" decay or
    "cosine" decay to `min_lr_ratio` at `total_steps`.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"optim.schedule: unknown schedule '{schedule}'")
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def make_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, total_steps: int):
    """LambdaLR stepping `lr_factor` once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(
            s,
            warmup_steps=optim.warmup_steps,
            total_steps=total_steps,
            schedule=optim.schedule,
            min_lr_ratio=optim.min_lr_ratio,
        ),
    )


def grad_norm_and_clip(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """After the last micro-batch of an optimizer step: sum the gradients over data-parallel
    ranks (`distributed.sync_grads`; nothing with one process), then return the global L2 norm
    of the gradients (before clipping), clipping them when max_norm is set."""
    from rlhflab import faults

    distributed.sync_grads(model)
    faults.dump_grads(model)
    return distributed.grad_norm(model, max_norm)


class NonFiniteGuard:
    """`train.nan_policy`: what happens when a loss or gradient norm is NaN/inf.

    `check(step, values)` is called after the backward pass and before the optimizer step.
    "raise": a NonFiniteError naming the step and the first non-finite metric. "skip": returns
    False (the caller skips the optimizer and scheduler step), counts the skip, and raises after
    `max_skips` skipped steps in a row. One host sync per optimizer step.
    """

    def __init__(self, policy: str, max_skips: int) -> None:
        self.policy, self.max_skips = policy, max_skips
        self.skipped = 0  # total skipped optimizer steps
        self.in_a_row = 0

    def check(self, step: int, values: dict[str, torch.Tensor | float]) -> bool:
        for name, value in values.items():
            v = float(value)
            if math.isfinite(v):
                continue
            if self.policy == "raise":
                raise NonFiniteError(
                    f"step {step}: {name} is {v}; stopped before the optimizer step "
                    "(train.nan_policy: raise)"
                )
            self.skipped += 1
            self.in_a_row += 1
            if self.in_a_row >= self.max_skips:
                raise NonFiniteError(
                    f"step {step}: {name} is {v}; {self.in_a_row} non-finite steps in a row "
                    f"(train.nan_max_skips: {self.max_skips})"
                )
            return False
        self.in_a_row = 0
        return True

    def state(self) -> dict:
        """The counters as JSON (for checkpoints)."""
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load(self, state: dict) -> None:
        """Continue from a `state()`."""
        self.skipped, self.in_a_row = state["skipped"], state["in_a_row"]


def save_final_model(model, tokenizer, path: Path, lora=None) -> None:
    """The trained model (and tokenizer) as one Hugging Face directory, written by rank 0.

    Every rank calls it. Under FSDP2 a plain model is streamed: each tensor is gathered in turn
    (a collective) and appended to its safetensors file by rank 0, which never holds more than
    one full tensor (`rlhflab.models.export`; sharded as `save_pretrained` shards, 5 GB a file).
    A LoRA model (`lora`: the `model.lora` section) is gathered whole as before and saved with
    its adapters merged into the weights (a plain model), or with `lora.save: adapter` as an
    adapter directory for `PeftModel.from_pretrained` (`rlhflab.models.lora`); one process and
    DDP save the module directly. The directory is written under a temporary name beside `path`
    and renamed into place when complete, so a failed save leaves no half-written `path`."""
    from rlhflab.models.build import save_pretrained
    from rlhflab.models.export import export_names, save_pretrained_streamed
    from rlhflab.models.lora import merged_state, save_adapter

    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    if distributed.is_main():
        _remove_tree(tmp)
        tmp.mkdir(parents=True)
    names = None  # rank 0's list: the order must be the same on every rank
    if distributed.is_sharded(model) and lora is None:
        names = distributed.broadcast_object(export_names(model) if distributed.is_main() else None)
    if names is not None:
        save_pretrained_streamed(model, tokenizer, tmp, names=names)
    else:
        state = distributed.full_model_state(model, keep_tied=True)
        if distributed.is_main():
            if lora is not None and lora.save == "adapter":
                save_adapter(model, tokenizer, tmp, state)
            else:
                save_pretrained(model, tokenizer, tmp, state_dict=merged_state(model, state))
    if distributed.is_main():
        old = path.with_name(f".{path.name}.old")
        _remove_tree(old)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        _remove_tree(old)
    distributed.barrier()


def _remove_tree(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class Reference:
    """The reference policy π_ref of a KL penalty: the initial policy, frozen.

    A full fine-tune keeps a frozen copy (placed and sharded like the policy). Under FSDP2 with
    several processes (`distributed.loads_from_rank0`) the copy is made on the meta device (no
    weights copied) and sharded, and rank 0 sends it the policy's weights, so no rank holds a
    second full copy; with `parallel.mixed_precision: bf16` it is stored in bf16, the dtype
    FSDP2 computes it in anyway (2 bytes per parameter instead of 4; the same numbers).
    Otherwise the copy is a deep copy in the policy's dtype. A LoRA policy is its own reference:
    the same model with its adapters disabled is the frozen base, so no second copy of the
    weights is held. Create it before the policy is trained (and, for the copy, before
    `distributed.wrap` of the policy); score through `scoring()`."""

    def __init__(self, policy: torch.nn.Module, parallel) -> None:
        import copy

        from rlhflab.models.lora import is_lora

        self.policy, self.copy = policy, None
        if is_lora(policy):
            return
        if distributed.loads_from_rank0():
            frozen = distributed.meta_copy(policy).eval().requires_grad_(False)
            if parallel.mixed_precision == "bf16":  # parameters only, as FSDP2 casts them:
                for p in frozen.parameters():  # buffers (RoPE's inv_freq) keep their dtype
                    p.data = p.data.to(torch.bfloat16)
            weights = distributed.host_state(policy) if distributed.is_main() else None
            self.copy = distributed.wrap(frozen, parallel, weights=weights)
        else:
            frozen = copy.deepcopy(policy).eval().requires_grad_(False)
            self.copy = distributed.wrap(frozen, parallel)

    @contextlib.contextmanager
    def scoring(self):
        """Yields the module that computes π_ref: the copy, or the LoRA policy with adapters
        disabled for the duration. Under FSDP2 it stays sharded: its callers score through its
        own forward (one layer gathered at a time), every rank making the same number of passes
        (`common.micro_batches`)."""
        from rlhflab.models.lora import adapters_disabled

        module = self.copy if self.copy is not None else self.policy
        with adapters_disabled(module):
            yield module


def heldout_eval(
    cfg, model, tokenizer, problems, verifier, tracker, step: int, autocast_dtype, system=...,
    instruction=..., baseline: dict | None = None, engine=None, prefix: str = "eval",
):  # fmt: skip
    """Held-out greedy accuracy (and pass@k when `cfg.eval.k` > 0) of `model` on `problems`
    (task Problems or prompt rows), as `cfg.eval` configures it (see
    `rlhflab.eval.accuracy.evaluate`; `verifier` is anything with `score_batch(texts, rows)`);
    logged as `eval/*` at `step` and returned (keys accuracy, accuracy_stderr, n, ...).
    `system` defaults to `cfg.task.system`, `instruction` to the task's answer-format instruction
    (`rlhflab.data.formatting.task_instruction`). `baseline`, the result of
    `rlhflab.eval.accuracy.majority_baseline` on these problems, is logged beside the accuracy
    at every evaluation (`eval/majority_baseline`). `engine` is the run's rollout engine (default:
    the `hf` engine on `model`). `prefix` names the logged keys (`eval/<set>` for the further
    held-out sets of `eval.sets`)."""
    from rlhflab.data.formatting import task_instruction
    from rlhflab.eval.accuracy import evaluate, headline, summarize_scores

    if prefix == "eval" and len(problems) < cfg.eval.n:  # said once per process
        warnings.warn(
            f"eval.n is {cfg.eval.n} but only {len(problems)} held-out problems exist "
            f"(task.n_heldout {cfg.task.n_heldout}, minus questions seen in training): "
            f"evaluating on {len(problems)}",
            stacklevel=2,
        )
    # Each rank evaluates a contiguous share of the problems with the full model; the per-problem
    # scores are gathered in order, so the numbers are those of one process on all of them.
    w, r = distributed.world_size(), distributed.rank()
    with distributed.gathered(model):
        res = evaluate(
            model,
            tokenizer,
            distributed.shard(problems, even=False),
            verifier,
            batch_size=cfg.eval.batch_size,
            max_new_tokens=cfg.eval.max_new_tokens,
            k=cfg.eval.k,
            n_samples=getattr(cfg.eval, "n_samples", 0),
            temperature=cfg.eval.temperature,
            seed=cfg.seed + r,
            system=cfg.task.system if system is ... else system,
            instruction=task_instruction(cfg.task) if instruction is ... else instruction,
            autocast_dtype=autocast_dtype,
            return_scores=w > 1,
            engine=engine,
        )
    if w > 1:  # every per-problem list, gathered in rank order, summarised as one process would
        parts = distributed.all_gather_object(res.pop("per_problem"))
        keys = dict.fromkeys(k for part in parts for k in part)  # a rank may have no problems
        per = {key: [s for part in parts for s in part.get(key, [])] for key in keys}
        res.update(summarize_scores(per))
        if "pass@k" in res:
            res["pass@k"], res["pass@k_stderr"] = (
                res[f"pass@{res['k']}"],
                res[f"pass@{res['k']}_stderr"],
            )
        res["headline"], res["headline_stderr"] = headline(res)[1:]
        res["n"] = len(problems)
    if baseline is not None:
        res["majority_baseline"] = baseline["majority_accuracy"]
    # numbers only (the headline's name is in final_results.json)
    tracker.log(step, {f"{prefix}/{k}": v for k, v in res.items() if not isinstance(v, str)})
    faults.hit("eval", step)
    return res


def write_stopped_results(cfg, exc, wall_s: float) -> dict | None:
    """final_results.json and plots/ of a run that a health check stopped (`health.on_fail:
    stop`, exit code 3), written by rank 0 after the step's committed checkpoint.

    Args:
        cfg: the run's config (`trainer` names the family).
        exc: the `HealthStop` raised by `Checkpointer.end_step` (`run_dir`, `checkpoint` set;
            `health`: the monitor's summary, None when another rank stopped).
        wall_s: seconds since the trainer started.

    Returns:
        The results written, with `"status": "stopped_by_health"`, `failed_checks` (names, in
        the order they failed: the monitor's record, or the stopping check alone) and
        `stopped_by` (check, step, detail); None when nothing is written (no run directory yet,
        or a rank other than 0).
    """
    from rlhflab.plots import frontier_gold_label, plot_run
    from rlhflab.runs import write_json_atomic
    from rlhflab.tracking import read_metrics

    run_dir = getattr(exc, "run_dir", None)
    if run_dir is None or not distributed.is_main():
        return None
    health = exc.health or {"ok": False, "failed": {}, "checked": []}
    failed = list(health["failed"]) or [exc.name]
    results = {
        "trainer": cfg.trainer,
        "status": "stopped_by_health",
        "failed_checks": failed,
        "stopped_by": {"check": exc.name, "step": exc.step, "detail": exc.detail},
        "steps": exc.step,
        "checkpoint": str(exc.checkpoint) if exc.checkpoint is not None else None,
        "health": health,
        "wall_s": round(wall_s, 2),
        "run_dir": str(run_dir),
        "model_dir": None,  # no final model: resume from `checkpoint` with --resume
        "world_size": distributed.world_size(),
    }
    metrics = Path(run_dir) / "metrics.jsonl"
    rows = read_metrics(metrics) if metrics.exists() else []
    plot_run(rows, Path(run_dir) / "plots", stages=STAGES, gold=frontier_gold_label(cfg))
    write_json_atomic(Path(run_dir) / "final_results.json", results)
    return results
