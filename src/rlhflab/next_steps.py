"""What to run next: the one-line hints the CLI prints after `rlhflab train` / `rlhflab quickstart`,
and the error for a preset whose starting SFT model does not exist yet.

The presets under configs/pg, configs/dpo and configs/rm start from `runs/sft/model`, a
placeholder: run directories are `<root>/<name>-<timestamp>/`, so the SFT run that makes the model
writes `runs/sft-<timestamp>/model`, which the user passes as `model.name_or_path=...`.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from rlhflab.errors import ConfigError
from rlhflab.serialize import redact_obj

SFT_PRESET = "configs/sft/tiny_scratch.yaml"
# the task section of the SFT preset and of configs/pg/grpo.yaml and configs/dpo/dpo.yaml
_PRESET_TASK = {"name": "spell_backward", "config": {}, "answer_format": "plain"}


def _config_json(config: dict) -> str:
    """A task's kwargs as JSON for a printed command, redacted as in config.yaml (`redact_obj`:
    a value under a secret-named key, `{"token": ...}`, is '***')."""
    return json.dumps(redact_obj(config))


def _task_overrides(cfg: Any) -> list[str]:
    """`task.<key>=value` overrides that make the presets' task section equal `cfg.task`'s name,
    kwargs and answer format (empty when they already are)."""
    task = getattr(cfg, "task", None)
    if task is None:
        return []
    out = []
    if task.name != _PRESET_TASK["name"]:
        out.append(f"task.name={task.name}")
    if task.config != _PRESET_TASK["config"]:
        out.append(shlex.quote(f"task.config={_config_json(task.config)}"))
    if task.answer_format != _PRESET_TASK["answer_format"]:
        out.append(f"task.answer_format={task.answer_format}")
    return out


def sft_command(cfg: Any) -> str:
    """The `rlhflab train` command of the SFT run that makes a starting model for `cfg`'s task."""
    return " ".join(["rlhflab train", SFT_PRESET, *_task_overrides(cfg)])


def check_start_model(cfg: Any) -> None:
    """Refuse, before any run directory exists, a config whose `model.name_or_path` is a run's
    model directory (`.../model`) that does not exist, such as the presets' `runs/sft/model`.

    Raises:
        ConfigError: one line naming `model.name_or_path`, the SFT command that makes such a
            model (`sft_command`) and where it writes it.
    """
    path = getattr(getattr(cfg, "model", None), "name_or_path", None)
    if not path or getattr(cfg, "trainer", None) == "sft":
        return
    if Path(path).name != "model" or os.path.exists(os.path.expanduser(path)):
        return
    if path.count("/") < 2 and not path.startswith((".", "~", "/")):
        return  # "org/model" may be a Hub id
    raise ConfigError(
        f"model.name_or_path: {path} does not exist; the presets start from an SFT model: "
        f"make one with `{sft_command(cfg)}` and pass its model directory as "
        "model.name_or_path=runs/sft-<timestamp>/model"
    )


def _eval_command(cfg: Any, model_dir: str) -> str:
    """`rlhflab eval` of `model_dir` on `cfg.task`'s held-out split, as the trainer built it."""
    task = cfg.task
    words = ["rlhflab eval", shlex.quote(model_dir), f"--task {task.name}"]
    if task.config:
        words.append(f"--task-config {shlex.quote(_config_json(task.config))}")
    if task.answer_format != "plain":
        words.append(f"--answer-format {task.answer_format}")
    if task.seed != 0:
        words.append(f"--seed {task.seed}")
    if task.n_train != 20000:
        words.append(f"--exclude-train {task.n_train}")
    if task.n_heldout != 500:
        words.append(f"--n {task.n_heldout}")
    for flag, value in (
        ("--extractor", task.extractor),
        ("--instruction", None if task.instruction == "auto" else task.instruction),
        ("--system", task.system),
    ):
        if value is not None:
            words.append(f"{flag} {shlex.quote(value)}")
    return " ".join([*words, "--k 8"])


def next_command(cfg: Any, results: dict) -> str | None:
    """The next useful command after `rlhflab train` with `cfg` returned `results`, or None.

    SFT on a task: GRPO (or DPO) from its model. Policy-gradient or DPO on a task: pass@k of its
    model on the same held-out split (`rlhflab eval --k 8`); with an environment (`env:`),
    `rlhflab eval MODEL`, which runs the held-out episodes with the run's environment. A reward model trained from a policy
    on task samples: best-of-N with it. None when no model was saved or the data is not a task.
    """
    model_dir = results.get("model_dir")
    if not model_dir:
        return None
    trainer = getattr(cfg, "trainer", None)
    if trainer == "sft" and cfg.data.source == "task":
        overrides = " ".join(
            [shlex.quote(f"model.name_or_path={model_dir}"), *_task_overrides(cfg)]
        )
        return (
            f"next: rlhflab train configs/pg/grpo.yaml {overrides}   "
            "# or configs/dpo/dpo.yaml for DPO"
        )
    if trainer == "policy_gradient" and cfg.data.source == "task":
        if getattr(cfg, "env", None) is not None:  # eval reads the env from the run's config
            return (
                f"next: rlhflab eval {shlex.quote(model_dir)}   # held-out episodes with the "
                "run's environment, as the run evaluated them"
            )
        return f"next: {_eval_command(cfg, model_dir)}   # pass@8 on the same held-out split"
    if trainer == "direct_alignment" and cfg.prompts.source == "task":
        return f"next: {_eval_command(cfg, model_dir)}   # pass@8 on the same held-out split"
    if trainer == "reward_model" and cfg.data.source == "task_samples":
        policy = cfg.data.policy or cfg.model.name_or_path
        if policy:
            task = cfg.task
            cmd = [
                "rlhflab best-of-n",
                shlex.quote(policy),
                f"--rm {shlex.quote(f'{model_dir}:{cfg.kind}')}",
                f"--task {task.name}",
            ]
            if task.config:
                cmd.append(f"--task-config {shlex.quote(_config_json(task.config))}")
            if task.answer_format != "plain":
                cmd.append(f"--answer-format {task.answer_format}")
            return f"next: {' '.join(cmd)}"
    return None


def after_quickstart(results: dict) -> str | None:
    """The next useful commands after `rlhflab quickstart` (two lines), or None when its models or
    its SFT run's config.yaml are missing: pass@k of its GRPO model on the same held-out split,
    and another policy-gradient preset from its SFT model on the same task."""
    from rlhflab.config import config_from_dict, read_yaml

    grpo_model, sft_run = results.get("model_dir"), results.get("sft_run")
    if not grpo_model or not sft_run or not (Path(sft_run) / "config.yaml").is_file():
        return None
    try:
        cfg = config_from_dict(read_yaml(Path(sft_run) / "config.yaml"))
    except ConfigError:
        return None
    sft_model = shlex.quote(f"model.name_or_path={Path(sft_run) / 'model'}")
    train = " ".join(["rlhflab train configs/pg/rloo.yaml", sft_model, *_task_overrides(cfg)])
    return (
        f"next: {_eval_command(cfg, grpo_model)}   # pass@8 on the same held-out split\n"
        f"      {train}   # another algorithm from the same SFT model"
    )
