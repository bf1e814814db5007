"""The run harness: one run's life, the same for every trainer family.

A trainer family (SFT, policy gradient, direct alignment, reward model, ...) is a `Trainer`
subclass that supplies its set-up (`__init__`), one optimizer step (`step`), its evaluations and
its share of the checkpoint; `run` owns everything around them, in this order:

    0. set-up: resume point (verified, config diff checked), seeds, device, precision, then the
       trainer's own set-up — every check of the config and the data, before anything is written
    1. the run directory (new, or the checkpoint's own) and its lock, the metrics tracker, the
       sample writer, the health monitor, the non-finite guard, the checkpointer
    2. resume from the checkpoint, or the step-0 evaluation of a fresh run
    3. the step loop: step → health checks → periodic evaluation → samples → log (the step's
       timings included) → progress → checkpoint and stop signals (SIGTERM / SIGINT, health
       stops) → time budget
    4. the end-of-training checkpoint, the final evaluation, the model, plots and
       `final_results.json` (rank 0 writes; every rank returns the same results)

A new trainer family is its set-up and `step()`; it inherits resume, stop signals, checkpoints,
time budget and results. `Run` is the same run a step at a time (0-2 on construction, 3 per
`step()`, 4 in `finish()`); `run` is a loop over it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhflab import distributed, faults
from rlhflab.checkpoint import Checkpointer, StopSignals
from rlhflab.errors import ConfigError  # noqa: F401  (check_launch raises it, via check_parallel)
from rlhflab.health import HealthMonitor
from rlhflab.health.checks import resolved_health
from rlhflab.models.card import write_trained_model_card
from rlhflab.plots import frontier_gold_label, plot_run
from rlhflab.rundir import SampleWriter
from rlhflab.serialize import write_json_atomic
from rlhflab.throughput import STAGES, StageTimer
from rlhflab.tracking import Tracker, read_metrics
from rlhflab.trainers.common import (
    NonFiniteGuard,
    default_device,
    save_final_model,
    seed_everything,
    setup_precision,
)


def open_run(cfg, ckpt) -> Path:
    """The run directory, locked for this process (`rlhflab.rundir`): a new one (config.yaml
    written) or, when resuming, the checkpoint's run (checked by `resume_point`; here: no
    symlinks in it, not in use by another process, its logs intact up to the checkpoint)."""
    from rlhflab.rundir import check_logs, check_no_symlinks, lock_run_dir
    from rlhflab.runs import create_run_dir, write_yaml_atomic

    # Rank 0 alone writes the run directory, so rank 0 alone creates and locks it; when it
    # refuses (locked by another process, not writable), every rank stops with it
    # (`distributed.main_then_share`: the reason printed once, no rank left in a collective).
    if ckpt is not None:
        check_no_symlinks(ckpt.run_dir)
        distributed.main_then_share(lambda: lock_run_dir(ckpt.run_dir))
        check_logs(ckpt.run_dir, ckpt)
        return ckpt.run_dir

    def create() -> str:
        run_dir = create_run_dir(cfg.run.root, cfg.run.name)
        lock_run_dir(run_dir)
        write_yaml_atomic(run_dir / "config.yaml", cfg.model_dump(mode="json"))
        return str(run_dir)

    return Path(distributed.main_then_share(create))  # the others learn its path


def check_launch(cfg) -> None:
    """Refusals that depend only on the config and the number of processes, made once the
    process group is joined and before anything is read, loaded or written (so under torchrun
    every rank refuses the same way before any collective, and the CLI prints it once): a vLLM
    tensor-parallel size that does not fit the ranks, a global batch that does not split over
    the ranks. (The
    trainers repeat the split checks where they shard; these come first.)

    Raises:
        ConfigError: naming the key (`rollout.engine`, `train.batch_size`,
            `rollout.prompts_per_step`).
    """
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None:  # a vLLM tensor-parallel group is a group of ranks
        from rlhflab.experience import check_engine_layout

        check_engine_layout(rollout, distributed.world_size())
    if cfg.trainer == "distill":  # completions are split over the ranks
        distributed.check_split(
            cfg.rollout.prompts_per_step * cfg.rollout.group_size, "rollout.prompts_per_step",
            "completions",
        )  # fmt: skip
    elif cfg.trainer == "policy_gradient":
        distributed.check_split(
            cfg.rollout.prompts_per_step, "rollout.prompts_per_step", "prompts",
            why="whole groups go to one rank",
        )  # fmt: skip
    else:
        what = "examples" if cfg.trainer == "reward_model" else "rows"
        distributed.check_split(cfg.train.batch_size, "train.batch_size", what)


def resume_point(cfg):
    """The verified checkpoint `run.resume` asks for (None: fresh run), after checking that no
    config key that matters changed and that the enabled tracking sinks are installed. Called
    first in set-up, before anything is written, so a bad request fails early.

    Raises `RunComplete` (caught by `rlhflab.trainers.run_config`, which returns its results)
    when the checkpoint is the last step of a run that finished: its `final_results.json` says
    `"status": "complete"` at that step, after the checks of `open_run` (the run is not in use,
    its logs are intact). Nothing more is done then: no model is loaded, no file is written
    (but the lock's). (A run whose last checkpoint is its last step but whose end was cut off, with no
    such results, is resumed: the final evaluation and results are done again.)"""
    from rlhflab.checkpoint import check_config_change, find_resume_checkpoint
    from rlhflab.tracking import check_tracking_extras

    check_tracking_extras(cfg.tracking)
    ckpt = find_resume_checkpoint(cfg.run.resume, cfg.run.root, cfg.run.name)
    if ckpt is not None:
        check_config_change(ckpt, cfg.model_dump(mode="json"), allow=cfg.run.allow_config_change)
        if ckpt.step >= cfg.train.steps:
            results = _complete_results(ckpt.run_dir, ckpt.step)
            if results is not None:
                open_run(cfg, ckpt)  # its guards still apply: not in use, no links, logs intact
                raise RunComplete(ckpt.run_dir, ckpt.step, results)
    return ckpt


class RunComplete(Exception):
    """`--resume` of a run that already finished: `results` are its `final_results.json`."""

    def __init__(self, run_dir: Path, step: int, results: dict) -> None:
        super().__init__(f"run {run_dir} is complete (step {step}): nothing to resume")
        self.run_dir, self.step, self.results = run_dir, step, results


def _complete_results(run_dir: Path, step: int) -> dict | None:
    """The run's final results when they say it completed at `step`; None otherwise (missing,
    unreadable, stopped early, or of another step)."""
    import json

    try:
        results = json.loads((Path(run_dir) / "final_results.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(results, dict):
        return None
    if results.get("status") != "complete" or results.get("steps") != step:
        return None
    return results


class TimeBudget:
    """`train.max_seconds`: a wall-clock budget **per invocation**. Each `rlhflab train` (a
    fresh run or a `--resume`) gets the whole budget, counted from its own start (`start`, the
    trainer's set-up start, model loading included); time spent by earlier invocations of the
    same run does not count.

    `expired(step)` is asked after optimizer step `step` is done (its evaluation and periodic
    checkpoint included): it is True when the budget ran out by then, on any rank, so every
    rank stops after the same step; every invocation makes at least one step. It is never True
    after the last step (`total_steps`): a run whose budget runs out during its last step,
    its last evaluation or its last checkpoint is complete, not stopped. A stop by the budget
    writes a checkpoint at that step (even with `checkpoint.every: 0`), from which `--resume`
    continues with a fresh budget.

    The fault rule `<point>@<n>=expire` (`rlhflab.faults`) makes the budget run out at that point
    (tests of the boundaries, without sleeping).
    """

    def __init__(self, max_seconds: float | None, total_steps: int, start: float) -> None:
        self.max_seconds, self.total_steps, self.start = max_seconds, total_steps, start
        self.stopped_at: int | None = None
        faults.clear_expired()  # an "expire" fault of an earlier run in this process is spent

    def expired(self, step: int) -> bool:
        """Whether to stop after step `step` (the same answer on every rank; a collective when
        `max_seconds` is set, so every rank must ask after every step)."""
        if self.max_seconds is None:
            return False
        over = faults.expired() or time.perf_counter() - self.start > self.max_seconds
        over = bool(distributed.any_rank(over))  # collective: every rank asks at every step
        if over and step < self.total_steps:
            self.stopped_at = step
            return True
        return False

    @property
    def status(self) -> str:
        """`complete`, or `stopped_by_max_seconds` (final_results.json's `status`)."""
        return "complete" if self.stopped_at is None else "stopped_by_max_seconds"

    def say_stop(self, tracker) -> None:
        """The console line of a stop by the budget (with the command that continues)."""
        if self.stopped_at is not None:
            tracker.print(
                f"stopping at step {self.stopped_at} of {self.total_steps}: train.max_seconds "
                f"({self.max_seconds:g} s for this invocation) reached; checkpoint written, "
                "continue with --resume (a fresh budget)"
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

    @classmethod
    def one_model(
        cls, model, optimizer, scheduler, data, generators: dict | None = None
    ) -> Checkpointed:
        """The usual share of a trainer with one trained model: "model", its "optimizer" and
        LR "scheduler", the data stream's position ("data"), and `generators` (name → RNG)."""
        return cls(
            modules={"model": model},
            optimizers={"optimizer": optimizer},
            schedulers={"scheduler": scheduler},
            generators=generators or {},
            stateful={"data": data},
        )


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
    # the step's stage timer (`rlhflab.throughput`); the harness sets an enabled one. Trainers
    # name their phases with `with self.timer.stage("update"): ...` (a no-op outside the harness)
    timer: StageTimer = StageTimer(enabled=False)

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
        """After step `step` (not the last), before its line is logged (its time is the step's
        `perf/eval_s`): periodic evaluations (samples are `write_samples`'); returns metrics to
        add to the step's (they reach the progress line, not the step's metrics.jsonl line;
        the evaluations write their own, before it). By default the held-out
        evaluation every `eval.every` steps."""
        every = getattr(getattr(self.cfg, "eval", None), "every", 0)
        if self.has_heldout() and every and step % every == 0:
            return {f"eval/{k}": v for k, v in self.evaluate(step).items()}
        return {}

    def write_samples(self, step: int) -> None:
        """After step `step` (the last too) and its periodic evaluation, before its checkpoint:
        in-loop samples to `self.samples` (trainers with `writes_samples`). By default none."""

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


def longest_prompt(trainer: Trainer) -> int | None:
    """The longest training prompt in tokens of a trainer that samples from prompts
    (`trainer.prompts`: token-id lists), else None (the plan's default applies)."""
    prompts = getattr(trainer, "prompts", None)
    return max(map(len, prompts)) if prompts else None


def perf_setup(cfg, trainer: Trainer, device) -> tuple[StageTimer, dict, float | None]:
    """The run's stage timer (with the trained model's shape for FLOPs, when its config has
    one), the `perf/` keys every line repeats, and one card's peak TFLOP/s for MFU.

    Peak: `perf.peak_tflops`, else on CUDA the card's entry of `throughput.PEAK_TFLOPS`
    (`perf/peak_tflops` is logged), else None (no MFU: CPU, or a card not in the table).
    On CUDA, `perf/plan_peak_gib` is `rlhflab plan`'s prediction of the per-GPU peak for this
    config (`throughput.planned_peak_gib`, computed once here, with the longest training prompt
    as the prompt length when the trainer samples from prompts) beside the measured
    `perf/peak_mem_gib`; on CPU neither is logged."""
    from rlhflab import throughput

    timer = StageTimer(device, enabled=cfg.perf.stage_timers)
    static: dict = {}
    model_cfg = getattr(getattr(trainer, "model", None), "config", None)
    try:
        timer.shape = throughput.shape_from_hf_config(model_cfg) if model_cfg else None
    except (ValueError, AttributeError, TypeError):
        timer.shape = None  # a model without the usual config fields: no FLOPs
    timer.lm_head = cfg.trainer != "reward_model"
    peak = cfg.perf.peak_tflops
    if peak is None and timer.cuda:
        peak = throughput.peak_tflops_of(torch.cuda.get_device_name(device))
    if peak is not None:
        static["perf/peak_tflops"] = peak
    if timer.cuda and timer.enabled and timer.shape is not None:
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        planned = throughput.planned_peak_gib(
            cfg,
            timer.shape,
            gpus=distributed.world_size(),
            gpu_memory_gib=total,
            prompt_len=longest_prompt(trainer),
        )
        if planned is not None:
            static["perf/plan_peak_gib"] = planned
    return timer, (static if timer.enabled else {}), peak


def run(cfg, make: type[Trainer]) -> dict:
    """Run one training run of trainer family `make` under config `cfg`; returns the final
    results (also written to the run directory's `final_results.json` by rank 0).

    Raises what the set-up raises (ConfigError, DataError, ModelError: one line, nothing written),
    `Interrupted` after a stop signal's checkpoint, `HealthStop` after a health stop's checkpoint,
    and `RunComplete` for `--resume` of a finished run.
    """
    session = Run(cfg, make)  # 0-2: set-up, run directory, resume or step-0 evaluation
    with session:  # SIGTERM / SIGINT: finish the step, checkpoint, exit
        while session.step() is not None:  # 3: one optimizer step and what follows it
            pass
    return session.finish()  # 4: final checkpoint and evaluation, model, plots, results


class Run:
    """One run, a step at a time: what `run` does, for callers that interleave the steps with
    other work (the benchmarks drive a trainer this way, one step after each step of another
    framework). `run(cfg, make)` is exactly

        session = Run(cfg, make)            # phases 0-2 (below)
        with session:                        # stop signals (SIGTERM / SIGINT) are caught
            while session.step() is not None:
                pass
        results = session.finish()          # phase 4

    `Run(cfg, make)` does the set-up, opens the run directory and its writers, and resumes or
    runs the step-0 evaluation. `step()` is one iteration of the step loop (the trainer's step,
    health checks, logging, periodic evaluation, samples, progress, checkpoint policy and stop
    signals, the time budget) and returns that step's metrics; None once the run is over (its
    last step done, or `train.max_seconds` ran out after the previous step). `finish()` writes
    the end-of-training checkpoint, the final evaluation, the model, plots and results. Used
    without `with`, SIGTERM and SIGINT keep the handlers they had (no checkpoint on a signal).

    Attributes: `trainer` (the `Trainer`; its `model`, `tokenizer` and, for trainers that
    sample, `engine`), `run_dir`, `steps_done`, `t_start` (`time.perf_counter()` at the start
    of set-up, which `train.max_seconds` counts from).

    Raises: as `run` (set-up errors from the constructor; `Interrupted`, `HealthStop` from
    `step`).
    """

    def __init__(self, cfg, make: type[Trainer]) -> None:
        self.cfg = cfg
        t_start = self.t_start = time.perf_counter()
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
        health = HealthMonitor(  # logp_mismatch's threshold by precision unless set
            resolved_health(cfg, autocast_dtype), trainer.model, print_fn=tracker.warn
        )
        guard = NonFiniteGuard(cfg.train.nan_policy, cfg.train.nan_max_skips)
        trainer.run_dir, trainer.tracker, trainer.samples = run_dir, tracker, samples
        trainer.health, trainer.guard = health, guard
        trainer.timer, self.perf_static, self.peak_tflops = perf_setup(cfg, trainer, device)
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

        budget = TimeBudget(cfg.train.max_seconds, total, t_start)
        self.trainer, self.run_dir, self.tracker, self.health = trainer, run_dir, tracker, health
        self.guard, self.checkpointer, self.closers, self.budget = (
            guard,
            checkpointer,
            closers,
            budget,
        )
        self.total, self.steps_done, self.over = total, steps_done, steps_done >= total
        self.stop = StopSignals()

    def __enter__(self) -> Run:
        self.stop.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.__exit__(*exc)

    def step(self) -> dict | None:
        """-- 3. One training step: step → health checks → periodic evaluation → samples → log
        (the step's timings included) → progress → checkpoint and stop signals (SIGTERM /
        SIGINT, health stops) → time budget. Returns the step's metrics (as logged, with its
        `perf/` timings, plus the periodic evaluation's), or None when the run is over (nothing
        is done then)."""
        if self.over:
            return None
        cfg, trainer, health, tracker = self.cfg, self.trainer, self.health, self.tracker
        guard, checkpointer, closers, budget = (
            self.guard,
            self.checkpointer,
            self.closers,
            self.budget,
        )
        stop, total, step = self.stop, self.total, self.steps_done + 1
        # The step's wall time (perf/step_s): from here to its log line, measured by this
        # clock, apart from the stage timer's own; its checkpoint comes after the line.
        # (On CUDA both ends wait for the queued kernels, as the stage boundaries do.)
        trainer.timer.synchronize()
        t_step = time.perf_counter()
        trainer.timer.begin()
        metrics, health_inputs = trainer.step(step)
        self.steps_done = step
        if cfg.train.nan_policy == "skip":
            metrics["train/nan_skips"] = guard.skipped
        metrics.update(health.check(step, metrics, **health_inputs))
        logged = dict(metrics)  # the evaluation logs its own line
        if step < total:
            with trainer.timer.stage("eval"):
                metrics.update(trainer.periodic(step, metrics))
        trainer.write_samples(step)
        trainer.timer.synchronize()
        step_s = time.perf_counter() - t_step
        perf = trainer.timer.end(step_s, devices=distributed.world_size(),
                                 peak_tflops=self.peak_tflops)  # fmt: skip
        perf.update(self.perf_static, **{"perf/step_s": step_s})
        logged.update(perf)
        metrics.update(perf)  # the caller sees the step's timings too
        if step % cfg.tracking.log_every == 0 or step == total:
            tracker.log(step, logged)
        tracker.advance(step, metrics)
        checkpointer.end_step(step, stop, trainer.state, on_stop=closers, halt=health.halt())
        if budget.expired(step) or step == total:  # per invocation; never after the last step
            self.over = True
        return metrics

    def finish(self) -> dict:
        """-- 4. The end-of-training checkpoint, final evaluation, model, plots, results; returns
        the final results (rank 0 writes final_results.json; every rank returns them)."""
        cfg, trainer, tracker, health = self.cfg, self.trainer, self.tracker, self.health
        budget, run_dir, steps_done = self.budget, self.run_dir, self.steps_done
        budget.say_stop(tracker)
        self.checkpointer.finish(steps_done, trainer.state(), stopped=budget.stopped_at is not None)

        trainer.finish(steps_done)
        for close in self.closers:
            close()
        if cfg.run.save_model:
            trainer.save(run_dir / "model")
        results = {
            "trainer": trainer.name,
            "steps": steps_done,
            "status": budget.status,  # complete | stopped_by_max_seconds
            **trainer.results(),
            "health": health.summary(),
            "wall_s": round(time.perf_counter() - self.t_start, 2),
            "run_dir": str(run_dir),
            "model_dir": str(run_dir / "model") if cfg.run.save_model else None,
            "world_size": distributed.world_size(),
        }
        if distributed.is_main():
            plot_run(
                read_metrics(run_dir / "metrics.jsonl"),
                run_dir / "plots",
                stages=STAGES,
                gold=frontier_gold_label(cfg),
            )
            write_json_atomic(run_dir / "final_results.json", results)
            if cfg.run.save_model:  # the model card says what the model is (rlhflab.models.card)
                write_trained_model_card(run_dir / "model", cfg, results)
        distributed.barrier()
        return results
