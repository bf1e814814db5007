"""`rlhflab quickstart`: the main job, end to end on a real reasoning_gym task.

    1. build a BPE tokenizer on the task text and a small Qwen3-shape model from scratch
    2. SFT it on question → answer pairs from the training split
    3. GRPO from the SFT model with a binary verifier reward
    4. held-out greedy accuracy after SFT and after GRPO, on problems absent from all training data
    5. report.md (before/after table, plots, where everything is) and final_results.json

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
from rlhflab.rundir import create_run_dir
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


def run_quickstart(
    *, fast: bool = False, root: str = "runs", overrides: list[str] | None = None
) -> dict:
    """Run the whole job; returns the final results (also written to final_results.json)."""
    from rlhflab.trainers import policy_gradient, sft, train_recording_stops

    t0 = time.perf_counter()
    name = "quickstart-fast" if fast else "quickstart"
    # Validate both configs before anything is written.
    build_configs(fast=fast, root=Path(root), overrides=overrides)
    run_dir = create_run_dir(root, name)
    sft_cfg, grpo_cfg = build_configs(fast=fast, root=run_dir, overrides=overrides)

    sft_results = train_recording_stops(sft.train, sft_cfg)
    grpo_cfg = grpo_cfg.model_copy(
        update={
            "model": grpo_cfg.model.model_copy(update={"name_or_path": sft_results["model_dir"]})
        }
    )
    write_yaml_atomic(run_dir / "grpo_config.yaml", grpo_cfg.model_dump(mode="json"))
    write_yaml_atomic(run_dir / "sft_config.yaml", sft_cfg.model_dump(mode="json"))
    rl_results = train_recording_stops(policy_gradient.train, grpo_cfg)

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
        f"RL gain: **{r['rl_gain_points']:+.1f} points**. Total wall-clock {r['wall_s']:.0f} s.",
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
