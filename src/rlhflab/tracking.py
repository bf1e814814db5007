"""One `.log(step, metrics)` for every sink: metrics.jsonl (always), the console, and optionally
Weights & Biases or TensorBoard (imported lazily, only when enabled).

The console shows a progress bar with ETA and a few headline metrics; every metric of every step
goes to `metrics.jsonl` as one JSON object per line: {"step": int, "time_s": float, ...}.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from rlhflab.runs import redact_json, redact_obj

console = Console(stderr=True)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # json has no NaN/inf; keep them visible as strings
    return value


#: Optional sinks: config flag -> (module to import, pip extra that installs it).
EXTRAS = {"wandb": ("wandb", "wandb"), "tensorboard": ("tensorboard", "tensorboard")}


def check_tracking_extras(tracking) -> None:
    """Before the run directory exists: every enabled optional sink (`tracking.wandb`,
    `tracking.tensorboard`) has its package installed.

    Raises:
        ConfigError: naming the flag and the extra to install.
    """
    import importlib.util

    from rlhflab.errors import ConfigError

    for flag, (module, extra) in EXTRAS.items():
        if getattr(tracking, flag) and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"tracking.{flag}: the {module} package is not installed "
                f"(pip install 'rlhflab[{extra}]', or set tracking.{flag}=false)"
            )


class Tracker:
    """Writes metrics to `<run_dir>/metrics.jsonl` and to the enabled sinks.

    Args:
        run_dir: the run directory (must exist).
        total_steps: for the progress bar's ETA.
        headline: metric keys shown next to the progress bar.
        console_enabled / wandb / tensorboard: which sinks are on.
        config: the resolved config (dict) handed to wandb.
        description: label of the progress bar.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        total_steps: int,
        headline: tuple[str, ...] = (),
        console_enabled: bool = True,
        wandb: bool = False,
        tensorboard: bool = False,
        config: dict | None = None,
        description: str = "train",
        enabled: bool = True,
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.progress = None
        self._wandb = self._tb = None
        if not enabled:  # a data-parallel rank other than 0: rank 0 writes and prints
            self.file = None
            return
        self.file = self.path.open("a")
        self.start = time.perf_counter()
        self.headline = headline
        self._wandb = self._tb = None
        if wandb:
            import wandb as wandb_mod

            self._wandb = wandb_mod.init(
                project="rlhflab", name=Path(run_dir).name, config=config, dir=str(run_dir)
            )
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        self.progress = None
        if console_enabled:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                console=console,
                transient=False,
            )
            self.task = self.progress.add_task(description, total=total_steps, info="")
            self.progress.start()

    @classmethod
    def for_run(cls, run_dir: Path, cfg, headline: tuple[str, ...]) -> Tracker:
        """The tracker of a trainer run: `cfg.tracking` picks the sinks, `cfg.train.steps` sets
        the progress bar's length, `cfg.run.name` labels it, the resolved config goes to wandb.
        Under torchrun only rank 0's tracker writes or prints anything."""
        from rlhflab import distributed

        return cls(
            run_dir,
            total_steps=cfg.train.steps,
            headline=headline,
            console_enabled=cfg.tracking.console,
            wandb=cfg.tracking.wandb,
            tensorboard=cfg.tracking.tensorboard,
            config=redact_obj(cfg.model_dump(mode="json")),
            description=cfg.run.name,
            enabled=distributed.is_main(),
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record the metrics of `step` (values: python or 0-d tensor numbers)."""
        if not self.enabled:
            return
        row = {"step": step, "time_s": round(time.perf_counter() - self.start, 4)}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        self.file.write(redact_json(row) + "\n")
        self.file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, int | float)}, step=step)
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, int | float) and k != "step":
                    self._tb.add_scalar(k, v, step)

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
        """A line on the console above the progress bar."""
        if self.progress is not None:
            self.progress.console.print(message)

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
        if self.progress is not None:
            self.progress.stop()
        if self.file is not None:
            self.file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict]:
    """All rows of a metrics.jsonl file."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
