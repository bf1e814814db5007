"""rlhflab's side of the benchmarks: the trainers themselves, as `rlhflab train` runs them.

Each row writes a config in the trainer's own schema, as a user would (`grpo_config`,
`dpo_config`, `rm_config`: the bench model, the row's data file, fp32, SDPA, one thread,
checkpoints, held-out evaluation, samples and the saved model off, console off), and builds the
run with the harness's public stepping API, `rlhflab.trainers.loop.Run`: set-up, run directory,
the (here empty) step-0 evaluation. `OursRun.step()` is one `Run.step()`: one iteration of the
harness's step loop — the trainer's step, health checks, logging, the checkpoint policy and stop
signals, the time budget — the loop body `rlhflab train` runs, nothing re-assembled here.

A step's time is the wall time of that call (what a user waits for per step). Each step's own
timers are recorded beside it: every `perf/*` key the step's metrics carry, whichever the trainer
reports (`perf/step_s`, per-stage times, `perf/tokens_per_s`).

Fixed generation lengths: the rollout engine's stop set (`engine.stop_token_ids`, a public
attribute of every engine, `rlhflab.rollout.engines.RolloutEngine`) is replaced by one id that
never occurs (-1), so every completion has `max_new_tokens` tokens; TRL gets
`generation_kwargs={"eos_token_id": None}`. There is no config key for this (a trained model
should stop at EOS); it is the bench's only change to a trainer after set-up.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench import common

# The reward both sides call (TRL convention), by import path for rlhflab's config.
VOWEL_REWARD = "bench.common:vowel_reward"


def set_checkpointing(model, on: bool) -> None:
    """Gradient checkpointing as the trainers set it (`model.gradient_checkpointing`, default off):
    on means non-reentrant activation checkpointing of every layer; off is made explicit here so
    that a model loaded with it on cannot slip into a row that says off."""
    if on:  # the trainers' call (rlhflab.trainers.common)
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    elif model.is_activation_checkpointing:
        model.activation_checkpointing_disable()


def _base(trainer: str, model_dir, root, *, steps: int, lr: float, name: str) -> dict:
    """The sections every row's config shares: what the bench fixes and what it turns off."""
    return {
        "trainer": trainer,
        "seed": 0,
        "model": {
            "name_or_path": str(model_dir),
            "dtype": "float32",
            "attn_implementation": "sdpa",
            "gradient_checkpointing": False,  # TRL side: gradient_checkpointing=False
        },
        "optim": {
            "lr": lr,
            "weight_decay": 0.0,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "warmup_steps": 0,
            "schedule": "constant",
            "max_grad_norm": 1.0,
        },
        "precision": {"autocast": "none", "threads": common.THREADS},
        "checkpoint": {"every": 0},  # none (a stop signal would still write one)
        "tracking": {"console": False},
        "run": {"name": name, "root": str(root), "save_model": False},
    }


def grpo_config(model_dir, root, prompts_file, *, steps: int, n_prompts: int, group: int,
                max_new: int, beta: float, lr: float, task: dict | None = None) -> dict:  # fmt: skip
    """`trainer: policy_gradient` with the grpo preset's loss (configs/pg/grpo.yaml: group
    z-score with Bessel, PPO-clip ε 0.2, per-sequence token mean, k3 KL in the loss with
    coefficient `beta`, a reference model when beta > 0), one update per batch, one micro-batch
    of the whole batch, on the prompts of `prompts_file` (rendered texts, `data.template:
    "{prompt}"`: used as they are) scored by `vowel_reward`; with `task` (a `task` section)
    instead, the task's prompts scored by its verifier (`correctness`)."""
    raw = _base("policy_gradient", model_dir, root, steps=steps, lr=lr, name="bench_grpo")
    raw.update(
        data={
            "source": "dataset",
            "path": str(prompts_file),
            "template": "{prompt}",
            "heldout_frac": 0.0,
        },
        rollout={
            "prompts_per_step": n_prompts,
            "group_size": group,
            "max_new_tokens": max_new,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
        },
        reward={"components": [{"function": VOWEL_REWARD, "weight": 1.0}]},
        loss={
            "advantage": "group_zscore",
            "advantage_args": {"unbiased": True},
            "whiten_advantages": False,
            "surrogate": "ppo_clip",
            "surrogate_args": {"eps_low": 0.2, "eps_high": 0.2},
            "aggregation": "seq_mean_token_mean",
        },
        kl={"coef": beta, "estimator": "k3", "placement": "loss", "controller": "fixed"},
        train={
            "steps": steps,
            "micro_batch_size": n_prompts * group,
            "update_epochs": 1,
            "minibatches": 1,
        },
        eval={"n": 0},
    )
    if task is not None:
        raw.update(
            task=task, data={"source": "task"}, reward={"components": [{"name": "correctness"}]}
        )
    raw["tracking"].update(samples_every=10**6, samples_per_step=0)
    return raw


def dpo_config(model_dir, root, pairs_file, *, steps: int, batch: int, beta: float,
               lr: float) -> dict:  # fmt: skip
    """`trainer: direct_alignment`, the dpo loss (sigmoid, `beta`), `batch` pairs per step in
    one micro-batch, from `pairs_file` (format pairs: the prompt is rendered with the chat
    template); reference log-probs cached at set-up (its only mode; not timed)."""
    raw = _base("direct_alignment", model_dir, root, steps=steps, lr=lr, name="bench_dpo")
    raw.update(
        data={"source": "file", "path": str(pairs_file), "format": "pairs", "heldout_pairs": 0},
        loss={"name": "dpo", "args": {"beta": beta}},
        train={"steps": steps, "batch_size": batch, "micro_batch_size": batch},
        eval={"n": 0, "pref_every": 0},
    )
    raw["tracking"].update(samples_every=10**6, samples_per_step=0)
    return raw


def rm_config(model_dir, root, pairs_file, *, steps: int, batch: int, lr: float) -> dict:
    """`trainer: reward_model`, kind preference (Bradley–Terry, no margin, no centring), `batch`
    pairs per step in one micro-batch, from `pairs_file` (format pairs), no held-out rows."""
    raw = _base("reward_model", model_dir, root, steps=steps, lr=lr, name="bench_rm")
    raw.update(
        kind="preference",
        data={
            "source": "preference",
            "path": str(pairs_file),
            "format": "pairs",
            "heldout_frac": 0.0,
            "max_len": 1024,
        },
        loss={"margin": None, "center_coef": 0.0},
        train={"steps": steps, "batch_size": batch, "micro_batch_size": batch},
    )
    return raw


def sft_config(model_dir, root, data_file, *, steps: int, batch: int, lr: float) -> dict:
    """`trainer: sft` on `data_file` (prompt/completion rows; the prompt is rendered with the chat
    template, the completion followed by eos is trained), `batch` rows per step in one
    micro-batch (scored padding-free where that removes padding: its default)."""
    raw = _base("sft", model_dir, root, steps=steps, lr=lr, name="bench_sft")
    raw.update(
        data={"source": "dataset", "path": str(data_file)},
        train={"steps": steps, "batch_size": batch, "micro_batch_size": batch, "max_len": 1024},
        eval={"n": 0},
    )
    return raw


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSON-lines file (the rows' data file); returns `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class OursRun:
    """One rlhflab run of config `raw` (a dict in the trainer's schema), built with
    `rlhflab.trainers.loop.Run` and stepped by `step()`. `fixed_length`: the rollout engine's
    stop set becomes (-1,) (see the module docstring). `model`, `tokenizer`: the trainer's.

    `step_s`: each `step()`'s wall time; `perf`: each step's `perf/*` metrics (the trainer's own
    timers and counters); `response_len`: each step's `rollout/response_len_mean`."""

    def __init__(self, raw: dict, *, fixed_length: bool = False) -> None:
        from rlhflab.config import config_from_dict
        from rlhflab.trainers.direct_alignment import DirectAlignment
        from rlhflab.trainers.loop import Run
        from rlhflab.trainers.policy_gradient import PolicyGradient
        from rlhflab.trainers.reward_model import RewardModelTrainer
        from rlhflab.trainers.sft import SFT

        trainers = {
            "policy_gradient": PolicyGradient,
            "direct_alignment": DirectAlignment,
            "reward_model": RewardModelTrainer,
            "sft": SFT,
        }
        self.cfg = config_from_dict(raw)
        self.session = Run(self.cfg, trainers[self.cfg.trainer])
        self.trainer = self.session.trainer
        self.model, self.tokenizer = self.trainer.model, self.trainer.tokenizer
        if fixed_length:
            self.trainer.sampler.engine.stop_token_ids = (-1,)  # never matches: no early stop
        self.step_s: list[float] = []
        self.perf: list[dict[str, float]] = []
        self.response_len: list[float] = []  # policy gradient: mean completion tokens per step

    def step(self) -> None:
        """One iteration of the harness's step loop (`Run.step()`), timed."""
        t0 = time.perf_counter()
        metrics = self.session.step()
        dt = time.perf_counter() - t0
        if metrics is None:
            raise RuntimeError("the rlhflab run has no steps left (train.steps too small)")
        self.step_s.append(dt)
        self.perf.append({k: float(v) for k, v in metrics.items() if k.startswith("perf/")})
        if "rollout/response_len_mean" in metrics:
            self.response_len.append(float(metrics["rollout/response_len_mean"]))

    def perf_means(self, skip: int) -> dict[str, float]:
        """Mean of every `perf/*` key over the steps after the first `skip` (warm-up)."""
        rows = self.perf[skip:]
        keys = sorted({k for r in rows for k in r})
        return {k: sum(r.get(k, 0.0) for r in rows) / max(1, len(rows)) for k in keys}

    def finish(self) -> dict:
        """`Run.finish()`: the run's end (no model saved, no evaluation: off in the config)."""
        return self.session.finish()
