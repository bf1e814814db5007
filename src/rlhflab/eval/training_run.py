"""What `rlhflab eval MODEL --task ...` takes from the run that trained MODEL.

A trainer saves its model as `<run>/model` and a checkpoint as `<run>/checkpoints/<step>`, with
the resolved config in `<run>/config.yaml`. When that file is found (`find_training_run`), the
held-out evaluation is rebuilt as the run's own was, not from the task's defaults: the same task
kwargs (`task.config`: a model trained on 3–5 letter words is not scored on the default lengths),
held-out seed and size, answer format, instruction, system prompt, reward, prompt template,
`eval.max_new_tokens` and, for a multi-turn run, its environment (`env:`; the held-out set is then
run as greedy episodes, as the trainer evaluates it). A value given on the command line wins, and
`resolve_settings` names each one that differs from the run's in a one-line warning.

Which runs count: a run whose held-out evaluation was a task (policy-gradient and distillation
runs with `data.source: task`, DPO on verifiable task pairs, SFT on a task or with `eval.n` > 0).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhflab.errors import ConfigError

#: (setting, `rlhflab eval` flag, where a run's config keeps it) of every setting that defines a
#: task evaluation's held-out rows, prompts, scoring or decoding.
SETTINGS: tuple[tuple[str, str, str], ...] = (
    ("task", "--task", "task.name"),
    ("task_config", "--task-config", "task.config"),
    ("seed", "--seed", "task.seed"),
    ("n_train_exclude", "--exclude-train", "task.n_train"),
    ("n", "--n", "eval.n"),
    ("answer_format", "--answer-format", "task.answer_format"),
    ("extractor", "--extractor", "task.extractor"),
    ("reward", "--reward", "task.reward"),
    ("system", "--system", "task.system"),
    ("instruction", "--instruction", "task.instruction"),
    ("max_new_tokens", "--max-new-tokens", "eval.max_new_tokens"),
    ("temperature", "--temperature", "eval.temperature"),
)
#: Settings that describe the task's distribution: taken from the run only when the evaluated
#: task is the run's own (another task keeps its own defaults). The others (how prompts are
#: written and answers read, decoding) describe the model and are taken from the run always.
DISTRIBUTION = frozenset({"task_config", "seed", "n_train_exclude", "n"})


def default_settings() -> dict[str, Any]:
    """The settings without a training run: the `task` and `eval` sections' defaults
    (`TaskConfig`, `EvalConfig`); `task` has none (it must be given)."""
    from rlhflab.config.sections import EvalConfig, TaskConfig

    t = TaskConfig()
    return _settings(t, EvalConfig(), task=None, n=t.n_heldout)


def _settings(t: Any, e: Any, *, task: str | None, n: int) -> dict[str, Any]:
    """The eval settings (keys of `SETTINGS`) read off a `task` section `t` and an `eval`
    section `e`, with the task's name and the number of held-out rows given."""
    return {
        "task": task,
        "task_config": dict(t.config),
        "seed": t.seed,
        "n_train_exclude": t.n_train,
        "n": n,
        "answer_format": t.answer_format,
        "extractor": t.extractor,
        "reward": t.reward,
        "system": t.system,
        "instruction": t.instruction,
        "max_new_tokens": e.max_new_tokens,
        "temperature": e.temperature,
    }


@dataclass(frozen=True)
class TrainingRun:
    """The held-out evaluation of the run that trained a model, as its config.yaml defines it.

    Attributes:
        config_path: the run's config.yaml.
        settings: {setting: value} for every key of `SETTINGS`; `n` is the number of held-out
            problems the run evaluated (`eval.n`, at most `task.n_heldout`; `task.n_heldout`
            when the run had no held-out evaluation), `n_heldout` below the draw size.
        n_heldout: the run's `task.n_heldout` (the held-out draw its first `n` rows come from).
        template: the run's prompt template (`data.template` / `prompts.template`), or None.
        env: the run's `env` section (an `EnvConfig`: multi-turn episodes), or None.
        rollout_max_new_tokens: `rollout.max_new_tokens` (an episode turn's default budget).
        batch_size: `eval.batch_size`.
    """

    config_path: Path
    settings: dict[str, Any]
    n_heldout: int
    template: str | None = None
    env: Any = None
    rollout_max_new_tokens: int = 32
    batch_size: int = 256


def _config_path(model_path: str) -> Path | None:
    """`config.yaml` in `model_path` or one of its two parent folders (a run's `model/` or
    `checkpoints/<step>/`), or None (a Hub id, or no such file)."""
    here = Path(model_path).expanduser()
    if not here.is_dir():
        return None
    here = here.resolve()
    for folder in (here, *list(here.parents)[:2]):
        path = folder / "config.yaml"
        if path.is_file():
            return path
    return None


def _heldout_task_section(cfg) -> tuple[Any, str | None] | None:
    """(the section whose prompts the run's held-out rows are, its template) when the run's
    held-out evaluation was its `task`, else None."""
    trainer = getattr(cfg, "trainer", None)
    if trainer in ("policy_gradient", "distill"):
        return (cfg.data, cfg.data.template) if cfg.data.source == "task" else None
    if trainer == "direct_alignment":
        ok = cfg.prompts.source == "task" and cfg.data.source == "verifiable"
        return (cfg.prompts, cfg.prompts.template) if ok else None
    if trainer == "sft":
        return (cfg.data, None) if cfg.data.source == "task" or cfg.eval.n > 0 else None
    return None


def find_training_run(model_path: str) -> TrainingRun | None:
    """The held-out evaluation of the run that saved `model_path` (see the module docstring), or
    None: no config.yaml beside it, or a run whose held-out set was not a task (a prompt
    dataset, a preference file, a reward model).

    Raises:
        ConfigError: one line naming the config.yaml that cannot be read or validated.
    """
    from rlhflab.config import config_from_dict, read_yaml

    path = _config_path(model_path)
    if path is None:
        return None
    cfg = config_from_dict(read_yaml(path) or {}, source=str(path))
    found = _heldout_task_section(cfg)
    if found is None:
        return None
    _, template = found
    t, e = cfg.task, cfg.eval
    n = min(e.n, t.n_heldout) if e.n > 0 else t.n_heldout
    settings = _settings(t, e, task=t.name, n=n)
    rollout = getattr(cfg, "rollout", None)
    return TrainingRun(
        config_path=path,
        settings=settings,
        n_heldout=t.n_heldout,
        template=template,
        env=getattr(cfg, "env", None),
        rollout_max_new_tokens=getattr(rollout, "max_new_tokens", e.max_new_tokens),
        batch_size=e.batch_size,
    )


def _flag_value(value: Any) -> str:
    """A setting's value as it is written on the command line."""
    if isinstance(value, dict):
        return shlex.quote(json.dumps(value))
    return shlex.quote(str(value))


def resolve_settings(
    given: dict[str, Any], run: TrainingRun | None, *, sampling: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """The settings of a task evaluation: each given one (not None), else the training run's
    (`run`; the `DISTRIBUTION` settings only when the task is the run's own), else the default.

    Args:
        given: {setting: value or None (not given)} for every key of `SETTINGS`.
        run: the training run (`find_training_run`), or None.
        sampling: pass@k is sampled (then the temperature is compared too).
    Returns:
        (settings, lines): every key of `SETTINGS` resolved, and the lines to print: a note with
        the flags taken from the run that differ from the defaults, and a warning naming each
        given value that differs from the run's (`--n 100 (run: 500)`), since the results are
        then not those of the run's own held-out evaluation.
    Raises:
        ConfigError: no task given and no training run to take it from.
    """
    defaults = default_settings()
    if run is None:
        out = {k: defaults[k] if given.get(k) is None else given[k] for k in defaults}
        if out["task"] is None:
            raise ConfigError(
                "eval: give --task NAME or --data PATH (no config.yaml of a run that trained "
                "the model was found to take the task from)"
            )
        return out, []
    same_task = given.get("task") is None or given["task"] == run.settings["task"]
    inherited = [k for k in defaults if same_task or k not in DISTRIBUTION]
    if not sampling:
        inherited = [k for k in inherited if k != "temperature"]
    out, taken, differs = {}, [], []
    for key, flag, _ in SETTINGS:
        mine = given.get(key)
        if key in inherited and mine is None:
            out[key] = run.settings[key]
            if run.settings[key] != defaults[key] and key != "task":
                taken.append(f"{flag} {_flag_value(run.settings[key])}")
        else:
            out[key] = defaults[key] if mine is None else mine
        if key in inherited and key != "task" and mine is not None and mine != run.settings[key]:
            differs.append(f"{flag} {_flag_value(mine)} (run: {_flag_value(run.settings[key])})")
    lines = []
    where = run.config_path
    if run.template is not None:
        taken.append("and its prompt template (data.template)")
    if taken:
        lines.append(f"note: as the run that trained the model ({where}): {' '.join(taken)}")
    if not same_task:
        lines.append(
            f"note: the model was trained on task {run.settings['task']} ({where}); "
            f"{given['task']} is evaluated with its own task defaults"
        )
    if differs:
        lines.append(
            f"warning: not the run's own held-out evaluation ({where}): {', '.join(differs)}"
        )
    return out, lines
