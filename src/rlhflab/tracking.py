"""One `.log(step, metrics)` for every sink: metrics.jsonl (always), the console, and optionally
Weights & Biases, trackio or TensorBoard (imported lazily, only when enabled).

The console shows a progress bar with ETA and a few headline metrics on a terminal; outside one
(CI, `nohup`, a pipe, a log file) it prints one plain line per logging interval instead
(`plain_line`: step, headline metrics, elapsed, ETA), so a log shows progress while the run goes.
Every metric of every step goes to `metrics.jsonl` as one JSON object per line:
{"step": int, "time_s": float, ...}.

wandb and trackio: the options of `tracking.wandb` / `tracking.trackio` (project, entity, group,
tags, name) go to `init`; an option left unset is not passed, so wandb's own WANDB_* variables
apply (`wandb_init_kwargs`). The run's id is saved in every checkpoint (`Tracker.state`), and a
run resumed from a checkpoint continues the same wandb run (`init(id=..., resume="allow")`) and
the same trackio run (same project and name, `resume="allow"`). wandb ignores values logged at a
step lower than one it has seen, so the steps redone after resuming from an older checkpoint keep
their first values there (metrics.jsonl is cut back and rewritten exactly). Rollout samples go to
both as a table (`samples`) every `tracking.samples_every` steps, next to samples.jsonl.
wandb gets the redacted config only: what it would record on its own (the command line in its
run metadata, code, git, `pip freeze`, the console) is off (`WANDB_SETTINGS`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlhflab.serialize import redact_json, redact_obj

console = Console(stderr=True)


def _jsonable(value: Any) -> Any:
    # NaN / inf stay floats here: metrics.jsonl gets null and a `<key>_note` (serialize.to_json)
    if hasattr(value, "item"):
        value = value.item()
    return value


#: Optional sinks: config flag -> (module to import, pip extra that installs it).
EXTRAS = {
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
    "tensorboard": ("tensorboard", "tensorboard"),
}

#: Project used when neither the config nor the environment names one.
DEFAULT_PROJECT = "rlhflab"

#: wandb settings (`wandb.Settings` field names of wandb 0.19 and later) that turn off what
#: wandb records on its own, outside the config rlhflab hands it and so outside its redaction:
#: the run metadata (the command line `sys.argv`, where `task.system=<secret>` may be, the
#: program, the git remote and commit, user, host), the code and git diff, `pip freeze` (a direct
#: URL may hold a credential) and the console capture (it reads what the process writes before
#: the CLI's redaction). The metrics, the redacted config, the samples tables and the system
#: metrics (CPU, memory) are still logged.
WANDB_SETTINGS = {
    "x_disable_meta": True,
    "disable_git": True,
    "disable_code": True,
    "save_code": False,
    "x_save_requirements": False,
    "console": "off",
}


def _options(value: Any) -> dict:
    """A sink's options as a dict: True → {}, a pydantic section → its set fields, a dict → itself."""
    if value is True or value is None:
        return {}
    if hasattr(value, "model_dump"):
        return value.model_dump(exclude_none=True)
    return {k: v for k, v in dict(value).items() if v is not None}


def wandb_init_kwargs(
    options: Any,
    run_dir: Path,
    config: dict | None,
    *,
    resume_id: str | None = None,
    env: dict[str, str] | None = None,
) -> dict:
    """Keyword arguments of `wandb.init` for a run.

    Args:
        options: `tracking.wandb` (True, a `WandbConfig` or a dict with project / entity / group /
            tags / name). A set option wins; an unset one is not passed, so wandb reads its own
            variable (WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_GROUP, WANDB_TAGS, WANDB_NAME).
            Without option and variable, project is "rlhflab" and name the run directory's name.
        run_dir: the run directory (wandb's files go to `<run_dir>/wandb/`).
        config: the resolved config (redacted) shown in the wandb run.
        resume_id: the wandb run id saved in the checkpoint being resumed: `id` and
            `resume="allow"` continue that run (unless WANDB_RUN_ID is set: the user's choice).
        env: the environment (default `os.environ`).

    `settings` is always `WANDB_SETTINGS` (what wandb would record unredacted is off).
    """
    env = os.environ if env is None else env
    opts = _options(options)
    kw: dict[str, Any] = {"config": config, "dir": str(run_dir), "settings": dict(WANDB_SETTINGS)}
    kw.update({k: opts[k] for k in ("project", "entity", "group", "tags", "name") if k in opts})
    if "project" not in kw and not env.get("WANDB_PROJECT"):
        kw["project"] = DEFAULT_PROJECT
    if "name" not in kw and not env.get("WANDB_NAME"):
        kw["name"] = Path(run_dir).name
    if resume_id and not env.get("WANDB_RUN_ID"):
        kw["id"], kw["resume"] = resume_id, "allow"
    return kw


def trackio_init_kwargs(
    options: Any, run_dir: Path, config: dict | None, *, resume: dict | None = None
) -> dict:
    """Keyword arguments of `trackio.init`: project (default "rlhflab"), name (default the run
    directory's name), group / space_id when set, the config; a resumed run (`resume`: the
    project and name saved in the checkpoint) continues that run with `resume="allow"`."""
    opts = _options(options)
    kw: dict[str, Any] = {
        "project": opts.get("project", DEFAULT_PROJECT),
        "name": opts.get("name", Path(run_dir).name),
        "config": config,
    }
    kw.update({k: opts[k] for k in ("group", "space_id") if k in opts})
    if resume:
        kw["project"], kw["name"], kw["resume"] = resume["project"], resume["name"], "allow"
    return kw


def _table(module, rows: list[dict]):
    """`module.Table` (wandb's or trackio's) of sample rows: columns in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    data = [[_jsonable(row.get(c)) for c in columns] for row in rows]
    return module.Table(columns=columns, data=data)


def check_tracking_extras(tracking) -> None:
    """Before the run directory exists: every enabled optional sink (`tracking.wandb`,
    `tracking.tensorboard`) has its package installed.

    Raises:
        ConfigError: naming the flag and the extra to install.
    """
    import importlib.util

    from rlhflab.errors import ConfigError

    for flag, (module, extra) in EXTRAS.items():
        if getattr(tracking, flag) and _find_spec(importlib.util, module) is None:
            raise ConfigError(
                f"tracking.{flag}: the {module} package is not installed "
                f"(pip install 'rlhflab[{extra}]', or set tracking.{flag}=false)"
            )
    if tracking.wandb:
        check_wandb_settings()


def check_wandb_settings(wandb_mod: Any = None) -> None:
    """The installed wandb knows every switch of `WANDB_SETTINGS`: an older or newer wandb that
    has renamed one would record the command line (and any secret in it) unredacted.

    Raises:
        ConfigError: naming the wandb version and the settings it lacks.
    """
    from rlhflab.errors import ConfigError

    if wandb_mod is None:
        import wandb as wandb_mod
    fields = getattr(getattr(wandb_mod, "Settings", None), "model_fields", None)
    if fields is None:  # not the real package (a test double): nothing to check
        return
    missing = [k for k in WANDB_SETTINGS if k not in fields]
    if missing:
        version = getattr(wandb_mod, "__version__", "?")
        raise ConfigError(
            f"tracking.wandb: wandb {version} has no setting {', '.join(missing)}, which rlhflab "
            "needs to keep wandb from recording the command line unredacted (tested with wandb "
            "0.31; or set tracking.wandb=false)"
        )


def _find_spec(util, module: str):
    """`importlib.util.find_spec`, honouring a module set (or set to None) in sys.modules."""
    import sys

    if module in sys.modules:
        return None if sys.modules[module] is None else True
    return util.find_spec(module)


class Tracker:
    """Writes metrics to `<run_dir>/metrics.jsonl` and to the enabled sinks.

    Args:
        run_dir: the run directory (must exist).
        total_steps: for the progress bar's ETA.
        headline: metric keys shown next to the progress bar.
        console_enabled / tensorboard: which sinks are on.
        wandb / trackio: off (False / None), on with defaults (True) or the sink's options
            (`WandbConfig` / `TrackioConfig` or a dict; `wandb_init_kwargs`).
        config: the resolved config (dict) handed to wandb / trackio.
        description: label of the progress bar.
        resume_state: `state()` saved in the checkpoint a resumed run starts from: the same
            wandb / trackio run continues.

    As a checkpoint's stateful object (`state()` / `load()`) it saves the wandb run id and the
    trackio project and name; `load` does nothing (they are read before `init`, from the
    checkpoint, by `for_run`). Checkpoints written before this existed resume without it.
    """

    state_optional = True  # checkpoints without a "tracker" entry still resume

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        headline: tuple[str, ...] = (),
        console_enabled: bool = True,
        wandb: Any = False,
        trackio: Any = False,
        tensorboard: bool = False,
        config: dict | None = None,
        description: str = "train",
        enabled: bool = True,
        resume_state: dict | None = None,
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.progress = None
        self.plain = False  # outside a terminal: one printed line per logged step (below)
        self.total_steps, self.description = total_steps, description
        self._wandb = self._tb = self._trackio = None
        self._wandb_mod = self._wandb_id = None
        self._trackio_run: dict | None = None
        if not enabled:  # a data-parallel rank other than 0: rank 0 writes and prints
            self.file = None
            return
        self.file = self.path.open("a")
        self.start = time.perf_counter()
        self.headline = headline
        resume_state = resume_state or {}
        if wandb:
            import wandb as wandb_mod

            self._wandb_mod = wandb_mod
            self._wandb = wandb_mod.init(
                **wandb_init_kwargs(wandb, run_dir, config, resume_id=resume_state.get("wandb_id"))
            )
            run_id = getattr(self._wandb, "id", None)
            self._wandb_id = run_id if isinstance(run_id, str) else None
        if trackio:
            import trackio as trackio_mod

            kw = trackio_init_kwargs(trackio, run_dir, config, resume=resume_state.get("trackio"))
            trackio_mod.init(**kw)
            self._trackio = trackio_mod
            self._trackio_run = {"project": kw["project"], "name": kw["name"]}
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self._announce = _ANNOUNCE[-1] if _ANNOUNCE and not console_enabled else None
        if self._announce is not None:
            label, say, _ = self._announce
            self._announced_at = time.perf_counter()
            say(f"{label}: {description}: {total_steps} steps -> {run_dir}")
        if console_enabled and not _live_console():
            self.plain = True
        elif console_enabled:
            self.progress = Progress(
                *_bar_columns(),
                TextColumn("{task.fields[info]}"),
                console=console,
                transient=False,
            )
            self.task = self.progress.add_task(description, total=total_steps, info="")
            self.progress.start()
            _LIVE.append(self.progress)

    @classmethod
    def for_run(cls, run_dir: Path, cfg, headline: tuple[str, ...], ckpt=None) -> Tracker:
        """The tracker of a trainer run: `cfg.tracking` picks the sinks, `cfg.train.steps` sets
        the progress bar's length, `cfg.run.name` labels it, the resolved config goes to wandb /
        trackio; `ckpt` (the checkpoint a resumed run starts from) names the wandb / trackio run
        to continue. Under torchrun only rank 0's tracker writes or prints anything."""
        from rlhflab import distributed

        resume_state = None
        if ckpt is not None:
            resume_state = ckpt.state.get("stateful", {}).get("tracker")
        return cls(
            run_dir,
            total_steps=cfg.train.steps,
            headline=headline,
            console_enabled=cfg.tracking.console,
            wandb=cfg.tracking.wandb,
            trackio=cfg.tracking.trackio,
            tensorboard=cfg.tracking.tensorboard,
            config=redact_obj(cfg.model_dump(mode="json")),
            description=cfg.run.name,
            enabled=distributed.is_main(),
            resume_state=resume_state,
        )

    def state(self) -> dict:
        """What a checkpoint keeps so that a resumed run continues the same tracker runs: the
        wandb run id and the trackio project and name (JSON; empty when those sinks are off)."""
        out: dict[str, Any] = {}
        if self._wandb_id is not None:
            out["wandb_id"] = self._wandb_id
        if self._trackio_run is not None:
            out["trackio"] = dict(self._trackio_run)
        return out

    def load(self, state: dict) -> None:
        """Nothing to restore after `init` (`for_run` hands the saved state to `init`)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record the metrics of `step` (values: python or 0-d tensor numbers)."""
        if not self.enabled:
            return
        row = {"step": step, "time_s": round(time.perf_counter() - self.start, 4)}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        self.file.write(redact_json(row) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in row.items() if isinstance(v, int | float) and math.isfinite(v)}
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)
        if self._trackio is not None:
            self._trackio.log(numbers, step=step)
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, int | float) and math.isfinite(v) and k != "step":
                    self._tb.add_scalar(k, v, step)
        if self.plain and any(k in row for k in self.headline):
            line = plain_line(
                self.description, step, self.total_steps, row, self.headline, row["time_s"]
            )
            console.file.write(line + "\n")
            console.file.flush()
        if self._announce is not None:
            label, say, every_s = self._announce
            now = time.perf_counter()
            if now - self._announced_at >= every_s or step >= self.total_steps:
                self._announced_at = now
                say(f"{label}: " + plain_line(self.description, step, self.total_steps, row,
                                              self.headline, row["time_s"]))  # fmt: skip

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """Rollout samples of `step` (prompt, completion, reward, ...) as a table named
        `samples` in wandb and trackio (samples.jsonl is `rlhflab.rundir.SampleWriter`'s)."""
        if not self.enabled or not rows:
            return
        rows = redact_obj(rows)
        if self._wandb is not None:
            self._wandb.log({"samples": _table(self._wandb_mod, rows)}, step=step)
        if self._trackio is not None and hasattr(self._trackio, "Table"):
            self._trackio.log({"samples": _table(self._trackio, rows)}, step=step)

    def advance(self, step: int, metrics: dict[str, Any]) -> None:
        """Move the progress bar to `step` and show the headline metrics."""
        if self.progress is None:
            return
        shown = []
        for key in self.headline:
            if key in metrics:
                shown.append(f"{key.split('/')[-1]}={float(_jsonable(metrics[key])):.3g}")
        self.progress.update(self.task, completed=step, info=" ".join(shown))

    def print(self, message: str) -> None:
        """A line on the console above the progress bar (outside a terminal: a plain line)."""
        if self.progress is not None:
            self.progress.console.print(message)
        elif self.plain:
            console.file.write(message + "\n")
            console.file.flush()

    def warn(self, message: str) -> None:
        """A warning line: on the console above the progress bar, or on stderr when the console
        sink is off (warnings are never silent). Data-parallel ranks other than 0 stay quiet:
        their checks see the same global metrics."""
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.console.print(message, markup=False)
        else:
            import sys

            print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the progress bar and close every sink."""
        if getattr(self, "_announce", None) is not None:
            label, say, _ = self._announce
            self._announce = None
            elapsed = _duration(time.perf_counter() - self.start)
            say(f"{label}: {self.description}: ended after {elapsed} ({self.path.parent})")
        if self.progress is not None:
            self.progress.stop()
            if self.progress in _LIVE:
                _LIVE.remove(self.progress)
        if self.file is not None:
            self.file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._trackio is not None:
            self._trackio.finish()
            self._trackio = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


#: The progress display of the running trainer's Tracker (phases add their bar to it).
_LIVE: list[Progress] = []
#: `announce_runs` while active: (label, print_fn, seconds between progress lines).
_ANNOUNCE: list[tuple[str, Any, float]] = []


@contextlib.contextmanager
def announce_runs(label: str, *, print_fn=None, every_s: float = 30.0):
    """For long commands made of several training runs (`rlhflab replicate`): while the block
    runs, every run whose console sink is off (`tracking.console: false`, as in the replication
    configs) still reports through `print_fn` (default: a line on stderr): a line when it starts
    (`<label>: <run name>: <steps> steps -> <run dir>`), its `plain_line` progress at most every
    `every_s` seconds and at its last step, and one when it ends. Runs with the console on
    report as usual; ranks other than 0 stay quiet."""
    import sys

    say = print_fn or (lambda line: print(line, file=sys.stderr, flush=True))
    _ANNOUNCE.append((label, say, every_s))
    try:
        yield
    finally:
        _ANNOUNCE.remove((label, say, every_s))


def _live_console() -> bool:
    """Whether the console can draw a live progress bar (an interactive terminal)."""
    return console.is_terminal and not console.is_dumb_terminal


def _duration(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def plain_line(
    description: str,
    step: int,
    total: int,
    row: dict[str, Any],
    headline: tuple[str, ...],
    elapsed_s: float,
) -> str:
    """The line printed per logged step outside a terminal, e.g.
    `sft step 20/130  train/loss=0.912  elapsed 0:00:14  eta 0:01:17`: the headline metrics in
    `row` (numbers to 4 significant digits, others as they are), the time since the tracker
    started and a linear ETA (elapsed / step × steps left; none at step 0)."""
    parts = [f"{description} step {step}/{total}"]
    for key in headline:
        if key in row:
            v = row[key]
            shown = f"{v:.4g}" if isinstance(v, float) else str(v)
            parts.append(f"{key}={shown}")
    parts.append(f"elapsed {_duration(elapsed_s)}")
    if 0 < step < total:
        parts.append(f"eta {_duration(elapsed_s / step * (total - step))}")
    return "  ".join(parts)


class _Bar:
    """The handle `phase` yields: `advance(n)` moves its bar (nothing when there is none)."""

    def __init__(self, progress: Progress | None = None, task: Any = None) -> None:
        self._progress, self._task = progress, task

    def advance(self, n: float = 1) -> None:
        """Count `n` more items done."""
        if self._progress is not None:
            self._progress.advance(self._task, n)


def progress_wanted() -> bool:
    """Progress bars are drawn only on an interactive terminal (stderr is a TTY: never into a
    log file or a captured test stream), on data-parallel rank 0, and unless RLHFLAB_PROGRESS=0."""
    from rlhflab import distributed

    if os.environ.get("RLHFLAB_PROGRESS", "1") == "0":
        return False
    return _live_console() and distributed.is_main()


def _bar_columns() -> tuple:
    """The columns of every progress bar: description, bar, done/total, elapsed, eta."""
    return (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )


@contextlib.contextmanager
def phase(description: str, total: int | None = None):
    """A transient progress bar for a long preparation phase (tokenizer training, drawing a big
    task split, sampling verifiable pairs, a long evaluation): `with phase("eval", n) as bar:
    ... bar.advance(k)`. `total` None: an indeterminate bar. Inside a training run the bar joins
    the run's progress display (rich allows one live display) and is removed when the phase ends.
    Nothing is drawn unless `progress_wanted()`."""
    if not progress_wanted():
        yield _Bar()
        return
    if _LIVE:
        host = _LIVE[-1]
        task = host.add_task(description, total=total, info="")
        try:
            yield _Bar(host, task)
        finally:
            host.remove_task(task)
        return
    progress = Progress(*_bar_columns(), console=console, transient=True)
    with progress:
        yield _Bar(progress, progress.add_task(description, total=total))


def progress(items, description: str, total: int | None = None):
    """`items`, advancing a `phase` bar by one per item (`total` defaults to `len(items)`):
    `for batch in progress(batches, "eval (500 problems)"): ...`."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with phase(description, total) as bar:
        for item in items:
            yield item
            bar.advance()


def read_metrics(path: Path) -> list[dict]:
    """All rows of a metrics.jsonl file."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
