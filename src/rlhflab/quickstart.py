"""`rlhflab quickstart`: the main job, end to end on a real reasoning_gym task.

    1. build a BPE tokenizer on the task text and a small Qwen3-shape model from scratch
    2. SFT it on question → answer pairs from the training split
    3. GRPO from the SFT model with a binary verifier reward
    4. held-out greedy accuracy after SFT and after GRPO, on problems absent from all training data
    5. report.md (before/after table, plots, where everything is) and final_results.json

Resuming (`rlhflab quickstart --resume [DIR]`, with the arguments it was started with, recorded
in DIR/quickstart.json): a stage whose run finished (`final_results.json` with `status: complete`)
is skipped, the interrupted stage continues from its newest committed checkpoint (the harness's
`run.resume=auto`), and the report is written when the GRPO stage ends. An interruption (Ctrl-C,
SIGTERM) carries the quickstart directory as `resume_dir`; the CLI prints the command.

The settings are the embedded preset `rlhflab/presets/quickstart.yaml` (the file you read is the
run you get); `--fast` applies the preset's `fast` overrides (same code path, smaller budget).
"""

from __future__ import annotations

import copy
import json
import time
from importlib import resources
from pathlib import Path

import yaml

from rlhflab.config import apply_overrides, config_from_dict
from rlhflab.errors import ConfigError
from rlhflab.rundir import create_run_dir, is_run_of, newest_complete_run
from rlhflab.serialize import write_json_atomic, write_text_atomic, write_yaml_atomic


def load_preset() -> dict:
    """The embedded quickstart preset as a dict with keys task, sft, grpo, fast."""
    text = resources.files("rlhflab.presets").joinpath("quickstart.yaml").read_text()
    return yaml.safe_load(text)


def build_configs(*, fast: bool, root: Path, overrides: list[str] | None = None):
    """The validated SFT and GRPO configs of the quickstart (GRPO's model path filled in later)."""
    preset = load_preset()
    stages = {}
    for stage in ("sft", "grpo"):
        raw = copy.deepcopy(preset[stage])
        raw["task"] = copy.deepcopy(preset["task"])
        raw.setdefault("run", {})["root"] = str(root)
        stage_overrides = list(preset["fast"].get(stage, [])) if fast else []
        prefix = f"{stage}."
        for item in overrides or []:
            if item.startswith("task."):  # the task is shared: both stages get it
                stage_overrides.append(item)
            elif item.startswith(prefix):
                stage_overrides.append(item[len(prefix) :])
            elif not item.startswith(("sft.", "grpo.")):
                raise ConfigError(
                    f"quickstart override '{item}' must start with 'task.', 'sft.' or 'grpo.'"
                )
        stages[stage] = apply_overrides(raw, stage_overrides)
    stages["grpo"]["model"] = {"name_or_path": "<the SFT model>"}
    sft_cfg = config_from_dict(stages["sft"], source="quickstart preset (sft)")
    grpo_cfg = config_from_dict(stages["grpo"], source="quickstart preset (grpo)")
    return sft_cfg, grpo_cfg


INVOCATION = "quickstart.json"


def find_resume_dir(resume: str, *, fast: bool, root: str) -> Path:
    """The quickstart directory `--resume` continues: `resume` itself, or for "latest" the
    newest `<root>/quickstart[-fast]-<timestamp>` directory.

    Raises:
        ConfigError: no such directory, or none under `root`.
    """
    name = "quickstart-fast" if fast else "quickstart"
    if resume != "latest":
        path = Path(resume)
        if not path.is_dir():
            raise ConfigError(f"quickstart --resume: {resume} is not a directory")
        return path
    found = [p for p in Path(root).glob(f"{name}-*") if p.is_dir() and is_run_of(p.name, name)]
    if not found:
        raise ConfigError(
            f"quickstart --resume: no {name}-<timestamp> directory under {root} to continue"
        )
    return max(found, key=lambda p: p.name)


def _check_invocation(run_dir: Path, invocation: dict) -> None:
    """Refuse to resume a quickstart started with other arguments (one line naming them)."""
    path = run_dir / INVOCATION
    if not path.is_file():
        raise ConfigError(f"quickstart --resume: {run_dir} is not a quickstart directory "
                          f"(no {INVOCATION})")  # fmt: skip
    old = json.loads(path.read_text())
    for key in ("fast", "overrides"):
        if old.get(key) != invocation[key]:
            raise ConfigError(
                f"quickstart --resume: {run_dir} was started with {key} {json.dumps(old.get(key))}"
                f", not {json.dumps(invocation[key])}; resume with the arguments it was started with"
            )


def _finished(run_dir: Path, name: str) -> dict | None:
    """The final results of the newest finished run (`status: complete`) of stage `name`."""
    found = newest_complete_run(run_dir, name)
    return found[1] if found else None


def _stage(train, cfg, run_dir: Path, resume: bool) -> dict:
    """Train one stage; when resuming: a finished run's results, else continue its newest
    checkpoint (`run.resume=auto`: a fresh run when it has none)."""
    from rlhflab.trainers import train_recording_stops

    if resume:
        done = _finished(run_dir, cfg.run.name)
        if done is not None:
            return done
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": "auto"})})
    return train_recording_stops(train, cfg)


def run_quickstart(
    *,
    fast: bool = False,
    root: str = "runs",
    overrides: list[str] | None = None,
    resume: str | None = None,
) -> dict:
    """Run the whole job; returns the final results (also written to final_results.json).

    `resume`: None (a new directory), "latest" (the newest quickstart directory under `root`) or
    a quickstart directory: continue it (module doc). An interruption (`Interrupted`,
    KeyboardInterrupt) propagates with `resume_dir` set to the quickstart directory."""
    from rlhflab.trainers import policy_gradient, sft

    t0 = time.perf_counter()
    name = "quickstart-fast" if fast else "quickstart"
    invocation = {"fast": fast, "overrides": list(overrides or [])}
    # Validate both configs before anything is written.
    build_configs(fast=fast, root=Path(root), overrides=overrides)
    if resume is None:
        run_dir = create_run_dir(root, name)
        write_json_atomic(run_dir / INVOCATION, invocation)
    else:
        run_dir = find_resume_dir(resume, fast=fast, root=root)
        _check_invocation(run_dir, invocation)
    sft_cfg, grpo_cfg = build_configs(fast=fast, root=run_dir, overrides=overrides)
    try:
        sft_results = _stage(sft.train, sft_cfg, run_dir, resume is not None)
        grpo_cfg = grpo_cfg.model_copy(
            update={
                "model": grpo_cfg.model.model_copy(
                    update={"name_or_path": sft_results["model_dir"]}
                )
            }
        )
        write_yaml_atomic(run_dir / "grpo_config.yaml", grpo_cfg.model_dump(mode="json"))
        write_yaml_atomic(run_dir / "sft_config.yaml", sft_cfg.model_dump(mode="json"))
        rl_results = _stage(policy_gradient.train, grpo_cfg, run_dir, resume is not None)
    except BaseException as exc:  # Ctrl-C, SIGTERM, a health stop: the CLI says how to continue
        exc.resume_dir = run_dir
        raise

    acc_sft = rl_results["heldout_accuracy_before"]
    acc_rl = rl_results["heldout_accuracy"]
    results = {
        "task": sft_cfg.task.name,
        "task_config": sft_cfg.task.config,
        "fast": fast,
        "heldout_accuracy_sft": acc_sft,
        "heldout_accuracy_rl": acc_rl,
        "rl_gain_points": round(100 * (acc_rl - acc_sft), 2),
        "heldout_accuracy_rl_stderr": rl_results["heldout_accuracy_stderr"],
        # the most common training answer given to every held-out problem
        "heldout_majority_answer": rl_results["heldout_majority_answer"],
        "heldout_majority_baseline": rl_results["heldout_majority_baseline"],
        "heldout_majority_baseline_stderr": rl_results["heldout_majority_baseline_stderr"],
        "heldout_n": rl_results["heldout_n"],
        "heldout_overlap_dropped": rl_results["heldout_overlap_dropped"],
        "sft_steps": sft_results["steps"],
        "sft_wall_s": sft_results["wall_s"],
        "grpo_steps": rl_results["steps"],
        "grpo_wall_s": rl_results["wall_s"],
        "wall_s": round(time.perf_counter() - t0, 2),
        "resumed": resume is not None,
        "sft_run": sft_results["run_dir"],
        "grpo_run": rl_results["run_dir"],
        "model_dir": rl_results["model_dir"],
        "health": {"sft": sft_results["health"], "grpo": rl_results["health"]},
    }
    write_json_atomic(run_dir / "final_results.json", results)
    write_text_atomic(run_dir / "report.md", _report(results, run_dir))
    return {**results, "report": str(run_dir / "report.md")}


def _report(r: dict, run_dir: Path) -> str:
    grpo = Path(r["grpo_run"]).relative_to(run_dir)
    sft = Path(r["sft_run"]).relative_to(run_dir)
    se = r["heldout_accuracy_rl_stderr"]
    lines = [
        f"# rlhflab quickstart{' (fast)' if r['fast'] else ''}",
        "",
        f"Task: `{r['task']}` {json.dumps(r['task_config'])}, binary verifier reward.",
        f"Held-out: {r['heldout_n']} problems, none of them in the SFT data or the RL prompts "
        f"({r['heldout_overlap_dropped']} candidates dropped because they appeared in training).",
        "",
        "| stage | held-out greedy accuracy | steps | wall-clock |",
        "|---|---|---|---|",
        f"| after SFT | {100 * r['heldout_accuracy_sft']:.1f}% | {r['sft_steps']} | {r['sft_wall_s']:.0f} s |",
        f"| after GRPO | {100 * r['heldout_accuracy_rl']:.1f}% (± {100 * se:.1f}) | {r['grpo_steps']} | {r['grpo_wall_s']:.0f} s |",
        f"| majority-answer baseline | {_majority(r)} | – | – |",
        "",
        "The majority-answer baseline answers every held-out problem with the most common "
        "training answer: a model that learnt only that answer scores this much.",
        "",
        f"RL gain: **{r['rl_gain_points']:+.1f} points**. Total wall-clock {r['wall_s']:.0f} s"
        + (
            " (this invocation, which resumed an interrupted quickstart; the stage rows give each"
            " stage's own invocation)."
            if r.get("resumed")
            else "."
        ),
        "",
        "## Health checks",
        "",
        *_health_lines(r["health"]),
        "",
        "## Curves",
        "",
        f"![reward]({grpo}/plots/reward.png) ![accuracy]({grpo}/plots/accuracy.png)",
        f"![length]({grpo}/plots/response_length.png) ![entropy]({grpo}/plots/entropy.png)",
        f"![sft loss]({sft}/plots/loss.png)",
        "",
        "## Where everything is",
        "",
        f"- SFT run: `{sft}/` (config.yaml, metrics.jsonl, plots/, model/)",
        f"- GRPO run: `{grpo}/` (config.yaml, metrics.jsonl, samples.jsonl, plots/, model/)",
        f"- Final model (Hugging Face format): `{Path(r['model_dir']).relative_to(run_dir)}/`",
        "- Numbers: `final_results.json`",
        "",
    ]
    return "\n".join(lines)


def _majority(r: dict) -> str:
    """The majority-answer baseline as "12.3% (± 1.5, answering 'x' to all)"."""
    if r["heldout_majority_baseline"] is None:
        return "–"
    return (
        f"{100 * r['heldout_majority_baseline']:.1f}% "
        f"(± {100 * r['heldout_majority_baseline_stderr']:.1f}, answering "
        f"{r['heldout_majority_answer']!r} to all)"
    )


def summary_line(r: dict) -> str:
    """One line for the console: held-out accuracy after SFT and GRPO, beside the baseline."""
    return (
        f"held-out accuracy: after SFT {100 * r['heldout_accuracy_sft']:.1f}%, after GRPO "
        f"{100 * r['heldout_accuracy_rl']:.1f}% (± {100 * r['heldout_accuracy_rl_stderr']:.1f}); "
        f"majority-answer baseline {_majority(r)}"
    )


def summary_lines(r: dict) -> list[str]:
    """What `rlhflab quickstart` prints (its whole results object with `--json`): the stages and
    wall-clock, the held-out accuracies beside the baseline (`summary_line`), the health checks,
    and where the report and the final model are."""
    from rlhflab.summary import duration

    resumed = ", resumed" if r.get("resumed") else ""
    health = "; ".join(
        f"{stage} all {len(h['checked'])} checks passed" if h["ok"]
        else f"{stage} failed {', '.join(h['failed'])}"
        for stage, h in r["health"].items()
    )  # fmt: skip
    return [
        f"quickstart{' --fast' if r['fast'] else ''} finished in {duration(r['wall_s'])}"
        f"{resumed}: SFT {r['sft_steps']} steps, GRPO {r['grpo_steps']} steps",
        summary_line(r),
        f"health: {health} (docs/health.md)",
        f"report: {r['report']} (final_results.json beside it; final model {r['model_dir']})",
    ]


def _health_lines(health: dict) -> list[str]:
    """One line per stage: all checks passed, or each failed check with its first step and count."""
    lines = []
    for stage, h in health.items():
        if h["ok"]:
            lines.append(f"- {stage}: all {len(h['checked'])} checks passed (docs/health.md)")
        else:
            failed = ", ".join(
                f"`{name}` (first at step {f['first_step']}, {f['count']} steps)"
                for name, f in h["failed"].items()
            )
            lines.append(f"- {stage}: **failed** {failed} (docs/health.md)")
    return lines
