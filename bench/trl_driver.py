"""Drive a TRL trainer's own `train()` loop and run one rlhflab step after each of its steps.

TRL's time for a step is measured from the end of the previous rlhflab step (or from the first
`on_step_begin`) to TRL's `on_step_end`: it covers fetching and collating the batch, TRL's
`training_step` (generation, rewards, reference log-probs, loss, backward), gradient clipping,
the optimizer and scheduler steps and `zero_grad` — everything of HF Trainer's inner loop for
that step except its periodic logging (logging_steps is set beyond the run).
"""

from __future__ import annotations

import time

from transformers import TrainerCallback


class Alternate(TrainerCallback):
    """After every TRL optimizer step, run `ours()` once and time both."""

    def __init__(self, ours):
        self.ours = ours
        self.trl_times: list[float] = []
        self.our_times: list[float] = []
        self._t0: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.trl_times.append(time.perf_counter() - self._t0)
        t = time.perf_counter()
        self.ours()
        self.our_times.append(time.perf_counter() - t)
        self._t0 = time.perf_counter()


def common_args(output_dir: str, *, steps: int, lr: float, seed: int = 0) -> dict:
    """Settings every TRL config of the benchmarks shares: CPU, fp32, no logging or saving."""
    return dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        max_steps=steps,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        seed=seed,
        dataloader_num_workers=0,
        gradient_accumulation_steps=1,
    )
