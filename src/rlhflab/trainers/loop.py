"""The run harness: one run's life, the same for every trainer family.

A trainer family (SFT, policy gradient, direct alignment, reward model, ...) is a `Trainer`
subclass that supplies its set-up (`__init__`), one optimizer step (`step`), its evaluations and
its share of the checkpoint; `run` owns everything around them, in this order:

    0. set-up: resume point (verified, config diff checked), seeds, device, precision, then the
       trainer's own set-up — every check of the config and the data, before anything is written
    1. the run directory (new, or the checkpoint's own) and its lock, the metrics tracker, the
       sample writer, the health monitor, the non-finite guard, the checkpointer
    2. resume from the checkpoint, or the step-0 evaluation of a fresh run
    3. the step loop: step → health checks → log → periodic evaluation / samples → progress →
       checkpoint and stop signals (SIGTERM / SIGINT, health stops) → time budget
    4. the end-of-training checkpoint, the final evaluation, the model, plots and
       `final_results.json` (rank 0 writes; every rank returns the same results)

A new trainer family is its set-up and `step()`; it inherits resume, stop signals, checkpoints,
time budget and results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhflab import distributed
from rlhflab.checkpoint import Checkpointer, StopSignals
from rlhflab.health import HealthMonitor
from rlhflab.plots import plot_run
from rlhflab.rundir import SampleWriter
from rlhflab.serialize import write_json_atomic
from rlhflab.tracking import Tracker, read_metrics
from rlhflab.trainers.common import (
    NonFiniteGuard,
    TimeBudget,
    default_device,
    open_run,
    resume_point,
    save_final_model,
    seed_everything,
    setup_precision,
)


@dataclass
class Env:
    """What the harness settles before a trainer's set-up: the rank's device, the autocast dtype
    (None: the model's own dtype), and whether the run resumes from a checkpoint."""

    device: torch.device
    autocast_dtype: torch.dtype | None
    resuming: bool


@dataclass
class Checkpointed:
    """A trainer's share of each checkpoint (names are the checkpoint's keys; None entries are
    skipped): models, optimizers, LR schedules, RNG generators and objects with
    `state()`/`load(state)` (a data stream...). The harness adds the non-finite guard, the health
    monitor and the tracker."""

    modules: dict[str, Any]
    optimizers: dict[str, Any]
    schedulers: dict[str, Any]
    generators: dict[str, torch.Generator] = field(default_factory=dict)
    stateful: dict[str, Any] = field(default_factory=dict)


class Trainer:
    """One trainer family, as the harness calls it. Subclasses set, in `__init__` (the set-up,
    phase 0: validation only, nothing written): `model`, `tokenizer`, and anything their `step`
    needs. The harness then sets `run_dir`, `tracker`, `samples` (a `SampleWriter` when
    `writes_samples`, else None), `health` and `guard` before calling anything else.

    Class attributes: `name` (final_results.json's "trainer"), `headline` (the metrics on the
    progress line), `writes_samples` (a samples.jsonl is kept).
    """

    name: str = ""
    headline: tuple[str, ...] = ()
    writes_samples: bool = False

    model: torch.nn.Module
    tokenizer: Any
    # set by the harness before `describe`
    run_dir: Path
    tracker: Tracker
    samples: SampleWriter | None
    health: HealthMonitor
    guard: NonFiniteGuard

    def __init__(self, cfg, env: Env) -> None:
        self.cfg, self.env = cfg, env
        self.device, self.autocast_dtype = env.device, env.autocast_dtype

    # -- What the harness asks of every trainer ----------------------------------------------
    def describe(self) -> str:
        """The run-directory line's details (data counts...)."""
        return ""

    def checkpointed(self) -> Checkpointed:
        """The trainer's share of the checkpoint."""
        raise NotImplementedError

    def begin(self) -> None:
        """A fresh run, before step 1: the step-0 evaluations (not called when resuming)."""

    def state(self) -> dict:
        """The trainer's own checkpointed values (JSON-serialisable): last loss, controller
        coefficients, the step-0 evaluation..."""
        return {}

    def load_state(self, state: dict) -> None:
        """Continue from `state()` of a checkpoint (called instead of `begin` when resuming)."""

    def step(self, step: int) -> tuple[dict, dict]:
        """Optimizer step `step` (1-based): returns (metrics, health inputs), the second as keyword
        arguments of `HealthMonitor.check` (`sample=`, `rollout=`, ...)."""
        raise NotImplementedError

    def periodic(self, step: int, metrics: dict) -> dict:
        """After step `step` (not the last) is logged: periodic evaluations and samples; returns
        metrics to add to the step's (they reach the progress line, not metrics.jsonl, which
        the evaluations write themselves). By default the held-out evaluation every
        `eval.every` steps."""
        every = getattr(getattr(self.cfg, "eval", None), "every", 0)
        if self.has_heldout() and every and step % every == 0:
            return {f"eval/{k}": v for k, v in self.evaluate(step).items()}
        return {}

    def has_heldout(self) -> bool:
        """Whether `evaluate` has anything to evaluate."""
        return False

    def evaluate(self, step: int) -> dict:
        """The held-out evaluation at `step` (logged to metrics.jsonl by the evaluation)."""
        return {}

    def finish(self, step: int) -> None:
        """After the last step and its checkpoint: the final evaluation (kept for `results`)."""

    def save(self, model_dir: Path) -> None:
        """The trained model as a Hugging Face directory (every rank calls it; rank 0 writes)."""
        save_final_model(self.model, self.tokenizer, model_dir, self.cfg.model.lora)

    def results(self) -> dict:
        """The trainer's entries of final_results.json (after `steps` and `status`)."""
        return {}


def run(cfg, make: type[Trainer]) -> dict:
    """Run one training run of trainer family `make` under config `cfg`; returns the final
    results (also written to the run directory's `final_results.json` by rank 0).

    Raises what the set-up raises (ConfigError, DataError, ModelError: one line, nothing written),
    `Interrupted` after a stop signal's checkpoint, `HealthStop` after a health stop's checkpoint,
    and `RunComplete` for `--resume` of a finished run (rlhflab.trainers.common).
    """
    t_start = time.perf_counter()
    # -- 0. Set-up: everything that can fail on bad input fails here, before any file is written.
    ckpt = resume_point(cfg)  # the verified checkpoint to continue from, or None
    seed_everything(cfg.seed)
    device = default_device()
    autocast_dtype = setup_precision(cfg.precision, device)
    trainer = make(cfg, Env(device, autocast_dtype, resuming=ckpt is not None))

    # -- 1. Run directory (a resumed run continues in its own) and what writes to it.
    run_dir = open_run(cfg, ckpt)
    tracker = Tracker.for_run(run_dir, cfg, headline=trainer.headline, ckpt=ckpt)
    samples = None
    if trainer.writes_samples:
        samples = SampleWriter(run_dir, enabled=distributed.is_main(), tracker=tracker)
    health = HealthMonitor(cfg.health, trainer.model, print_fn=tracker.warn)
    guard = NonFiniteGuard(cfg.train.nan_policy, cfg.train.nan_max_skips)
    trainer.run_dir, trainer.tracker, trainer.samples = run_dir, tracker, samples
    trainer.health, trainer.guard = health, guard
    tracker.print(f"run directory: {run_dir}  ({trainer.describe()})")
    closers = (tracker.close,) if samples is None else (tracker.close, samples.close)
    parts = trainer.checkpointed()
    checkpointer = Checkpointer(
        run_dir,
        cfg.model_dump(mode="json"),
        modules=parts.modules,
        optimizers=parts.optimizers,
        schedulers=parts.schedulers,
        generators=parts.generators,
        stateful={**parts.stateful, "nan": guard, "health": health, "tracker": tracker},
        every=cfg.checkpoint.every,
        keep_last=cfg.checkpoint.keep_last,
        resumed_from=ckpt,
        tokenizer=trainer.tokenizer,
    )

    # -- 2. Resume, or evaluate the initial model.
    total = cfg.train.steps
    if ckpt is not None:
        trainer.load_state(checkpointer.resume(ckpt, tracker, total))
    else:
        trainer.begin()
    steps_done = ckpt.step if ckpt is not None else 0

    # -- 3. Training steps.
    budget = TimeBudget(cfg.train.max_seconds, total, t_start)
    with StopSignals() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint, exit
        for step in range(steps_done + 1, total + 1):
            metrics, health_inputs = trainer.step(step)
            steps_done = step
            if cfg.train.nan_policy == "skip":
                metrics["train/nan_skips"] = guard.skipped
            metrics.update(health.check(step, metrics, **health_inputs))
            if step % cfg.tracking.log_every == 0 or step == total:
                tracker.log(step, metrics)
            if step < total:
                metrics.update(trainer.periodic(step, metrics))
            tracker.advance(step, metrics)
            checkpointer.end_step(step, stop, trainer.state, on_stop=closers, halt=health.halt())
            if budget.expired(step):  # per invocation; never after the last step
                break
    budget.say_stop(tracker)
    checkpointer.finish(steps_done, trainer.state(), stopped=budget.stopped_at is not None)

    # -- 4. Final evaluation, model, plots, results.
    trainer.finish(steps_done)
    for close in closers:
        close()
    if cfg.run.save_model:
        trainer.save(run_dir / "model")
    results = {
        "trainer": trainer.name,
        "steps": steps_done,
        "status": budget.status,  # complete | stopped_by_max_seconds
        **trainer.results(),
        "health": health.summary(),
        "wall_s": round(time.perf_counter() - t_start, 2),
        "run_dir": str(run_dir),
        "model_dir": str(run_dir / "model") if cfg.run.save_model else None,
        "world_size": distributed.world_size(),
    }
    if distributed.is_main():
        plot_run(read_metrics(run_dir / "metrics.jsonl"), run_dir / "plots")
        write_json_atomic(run_dir / "final_results.json", results)
    distributed.barrier()
    return results
