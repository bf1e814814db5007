"""Drive a TRL trainer's own `train()` loop and run one rlhflab step after each of its steps.

TRL's time for a step is measured from the end of the previous rlhflab step (or from the first
`on_step_begin`) to TRL's `on_step_end`: it covers fetching and collating the batch, TRL's
`training_step` (generation, rewards, reference log-probs, loss, backward), gradient clipping,
the optimizer and scheduler steps and `zero_grad` — everything of HF Trainer's inner loop for
that step except its periodic logging (logging_steps is set beyond the run).

Fairness switches: `common_args` sets every TRL / transformers switch that changes the work of a
step explicitly (TRL 1.16's configs default some of them differently from rlhflab's trainers, e.g.
gradient checkpointing on and fused AdamW); bench/README.md ("Fairness rules") lists them with
rlhflab's side. `Alternate` checks at `on_train_begin` and before the first step, when HF Trainer
has applied them, that
gradient checkpointing is the same on both sides, and refuses to measure otherwise.
"""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

# The settings rlhflab's trainers run with (OptimConfig defaults; AdamW is torch.optim.AdamW with
# its default implementation: the for-loop one for CPU tensors, not fused).
ADAM = dict(adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8)


class Alternate(TrainerCallback):
    """After every TRL optimizer step, run `ours()` once and time both.

    `our_model` / `checkpointing`: rlhflab's model and whether its row runs with gradient
    checkpointing; at `on_train_begin` and before the first step TRL's live `args.gradient_checkpointing` and its model's
    `is_gradient_checkpointing` must both equal it (and rlhflab's model's too), or no step runs."""

    def __init__(self, ours, our_model: torch.nn.Module, *, checkpointing: bool = False):
        self.ours = ours
        self.our_model = our_model
        self.checkpointing = checkpointing
        self.trl_times: list[float] = []
        self.our_times: list[float] = []
        self._t0: float | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._check(args, model)

    def _check(self, args, model) -> None:
        found = {
            "TRL args.gradient_checkpointing": bool(args.gradient_checkpointing),
            "TRL model.is_activation_checkpointing": checkpointing_of(model),
            "rlhflab model.is_activation_checkpointing": checkpointing_of(self.our_model),
        }
        wrong = {k: v for k, v in found.items() if v != self.checkpointing}
        if wrong:
            raise RuntimeError(
                f"unfair benchmark: gradient checkpointing should be {self.checkpointing} on both "
                f"sides, found {wrong}; refusing to measure"
            )

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self._t0 is None:
            self._check(args, model)  # again, before the first step, in case TRL switched it
            self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.trl_times.append(time.perf_counter() - self._t0)
        t = time.perf_counter()
        self.ours()
        self.our_times.append(time.perf_counter() - t)
        self._t0 = time.perf_counter()


def checkpointing_of(model) -> bool:
    """`is_gradient_checkpointing` (transformers 5 names it `is_activation_checkpointing` and keeps
    the old name as a deprecated alias): any layer set to recompute its activations."""
    model = getattr(model, "module", model)  # an accelerate / DDP wrapper
    if hasattr(model, "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


def common_args(
    output_dir: str, *, steps: int, lr: float, seed: int = 0, checkpointing: bool = False
) -> dict:
    """Settings every TRL config of the benchmarks shares: CPU, fp32, no logging or saving, and
    every switch that changes a step's work set explicitly to what rlhflab's side does."""
    return dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        tf32=None,  # CUDA-only; nothing to set on CPU
        report_to="none",
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        optim="adamw_torch",  # TRL 1.16 default: adamw_torch_fused; rlhflab: torch.optim.AdamW
        **ADAM,
        logging_steps=10**9,
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        seed=seed,
        full_determinism=False,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        gradient_accumulation_steps=1,
        # TRL 1.16 defaults gradient checkpointing to True in every config; rlhflab to False.
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None,
        torch_compile=False,
        use_liger_kernel=False,
        torch_empty_cache_steps=None,
        average_tokens_across_devices=False,  # one process
        include_num_input_tokens_seen="no",
        disable_dropout=True,  # the models' dropout probabilities are 0 anyway
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
    )


def grpo_args(*, n_prompts: int, group: int, max_new: int, beta: float, fixed_length: bool,
              temperature: float = 1.0) -> dict:  # fmt: skip
    """GRPOConfig settings that make TRL's step rlhflab's grpo preset step: one generation and one
    optimizer update per step, group z-score, PPO-clip ε = 0.2 per token, per-sequence token mean,
    plain k3 KL in the loss (TRL 1.16 multiplies it by the ratio by default), no masking of
    truncated completions, no entropy terms, HF `generate` (no vLLM, no paged / continuous
    batching, no static cache)."""
    return dict(
        per_device_train_batch_size=n_prompts * group,
        num_generations=group,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=max_new,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        beta=beta,
        epsilon=0.2,
        epsilon_high=None,  # = epsilon
        delta=None,
        loss_type="grpo",
        scale_rewards="group",
        importance_sampling_level="token",
        use_bias_correction_kl=False,  # rlhflab: k3 as is
        mask_truncated_completions=False,
        top_entropy_quantile=1.0,
        entropy_coef=0.0,
        cast_lm_head_to_fp32=False,
        use_vllm=False,
        use_transformers_paged=False,
        cache_implementation=None,
        remove_unused_columns=False,
        # Fixed length, as ours (stop set that never matches).
        generation_kwargs={"eos_token_id": None} if fixed_length else None,
    )
