"""The model card of a trained model (`<run>/model/README.md`): what the model is, as TRL's cards
say it (`trl/templates/lm_model_card.md`: the base model, the data, the trainer and its paper, the
framework versions) and what rlhflab knows besides: the task, the algorithm's parts, the steps,
the held-out result under its honest name, the seed.

`write_trained_model_card(model_dir, cfg, results)` is called by the run harness once the run's
results exist (`rlhflab.trainers.loop`); `models.build.write_model_card` writes the card's
loading section, and is what a model saved outside a run gets.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

#: What each trainer family is, in the card's words.
TRAINERS = {
    "sft": "supervised fine-tuning (SFT)",
    "policy_gradient": "policy-gradient RL",
    "direct_alignment": "direct alignment from preferences",
    "reward_model": "reward-model training",
    "distill": "on-policy distillation",
}


def _base_model(cfg) -> tuple[str, str | None]:
    """(the base model in words, its Hub id or None): `model.name_or_path`, or the shape built
    from scratch."""
    m = cfg.model
    if m.name_or_path is None:
        b = m.build
        return (
            f"none: built from scratch (`model.build`: {b.arch} {b.size}, vocabulary "
            f"{b.vocab_size}, tokenizer trained on the task)",
            None,
        )
    path = m.name_or_path
    hub_like = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if os.path.exists(os.path.expanduser(path)) or not hub_like:  # a path of this machine
        return f"`{path}` (a local directory)", None
    return f"[{path}](https://huggingface.co/{path})", path


def _task_words(task) -> str:
    kwargs = json.dumps(task.config) if task.config else "default kwargs"
    return (
        f"reasoning_gym task `{task.name}` ({kwargs}; {task.n_train} training problems, "
        f"seed {task.seed}; answers read as `{task.answer_format}`)"
    )


def _data(cfg) -> str:
    """The training data in words: the task (name and kwargs) or the file / dataset."""
    t, data = cfg.trainer, cfg.data
    if t == "direct_alignment":
        if data.source == "file":
            return f"preference pairs from `{data.path}`"
        if cfg.prompts.source != "task":
            return f"verifiable pairs sampled on the prompts of `{cfg.prompts.path}`"
        return "verifiable pairs sampled on the " + _task_words(cfg.task)
    if t == "reward_model":
        if data.source == "task_samples":
            policy = data.policy or cfg.model.name_or_path
            return f"samples of `{policy}`, scored on the " + _task_words(cfg.task)
        return f"`{data.path}` ({data.source})"
    if data.source == "task":
        return _task_words(cfg.task)
    return f"`{data.path}` ({data.source})"


def _algorithm(cfg) -> str:
    """The algorithm's named parts (the loss, and for the policy gradient its composition)."""
    t = cfg.trainer
    if t == "policy_gradient":
        loss = cfg.loss
        kl = f"KL coefficient {cfg.kl.coef:g}" if cfg.kl.coef else "no KL penalty"
        parts = (
            f"advantage `{loss.advantage}`, surrogate `{loss.surrogate}`, aggregation "
            f"`{loss.aggregation}`, {kl}, {cfg.rollout.group_size} samples per prompt"
        )
        env = getattr(cfg, "env", None)
        return parts + (f", multi-turn episodes with `{env.class_}`" if env else "")
    if t == "direct_alignment":
        return f"loss `{cfg.loss.name}`"
    if t == "distill":
        return f"divergence `{cfg.loss.divergence}` (λ = {cfg.loss.lmbda:g})"
    if t == "reward_model":
        return f"a {cfg.kind} reward model"
    return "next-token cross-entropy on the completions"


def _fmt(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, int | float) and x == x else "n/a"


def heldout_line(cfg, results: dict) -> str:
    """The held-out result under its honest name: what was measured (greedy decoding, the
    metric, binary or partial credit), its value ± standard error, n, the value before
    training and the majority-answer baseline; or why there is none."""
    if cfg.trainer == "reward_model":
        ev = results.get("eval") or {}
        if not ev:
            return "no held-out evaluation"
        what = {
            "preference": "pairwise accuracy (chosen scored above rejected)",
            "orm": "outcome-reward accuracy",
            "prm": "step accuracy",
        }.get(cfg.kind, "accuracy")
        n = ev.get("n", results.get("eval_examples"))
        return f"held-out {what}: {_fmt(ev.get('accuracy'))} (n = {n})"
    head = results.get("headline")
    if not head:
        n = getattr(getattr(cfg, "eval", None), "n", 0)
        return "no held-out evaluation" + (" (eval.n 0)" if not n else "")
    if getattr(cfg, "env", None) is not None:  # the trainer's eval/accuracy is the success rate
        name = "held-out episode success (greedy, the run's environment)"
    elif head["name"] == "correctness (task verifier)" and cfg.task.reward == "binary":
        name = "held-out accuracy, greedy decoding (correct: the task's verifier scores it 1)"
    elif head["name"] == "correctness (task verifier)":
        name = "held-out mean score, greedy decoding (the task verifier's partial credit, 0–1)"
    else:
        name = f"held-out {head['name']}, greedy decoding"
    se = f" ± {_fmt(head['stderr'])}" if head.get("stderr") is not None else ""
    line = f"{name}: {_fmt(head['value'])}{se} (n = {head['n']}"
    if head.get("before") is not None:
        line += f"; {_fmt(head['before'])} before training"
    line += ")"
    if results.get("heldout_majority_baseline") is not None:
        line += (
            f"; majority-answer baseline {_fmt(results['heldout_majority_baseline'])} "
            f"(answering {results.get('heldout_majority_answer')!r} to every problem)"
        )
    return line


def card_fields(cfg, results: dict) -> dict[str, str]:
    """The card's facts about the run, in order: base model, data, trainer, algorithm, steps,
    held-out result, seed, run, versions."""
    import torch
    import transformers

    from rlhflab import __version__

    base, _ = _base_model(cfg)
    steps = results.get("steps")
    total = getattr(getattr(cfg, "train", None), "steps", None)
    status = results.get("status", "complete")
    return {
        "Base model": base,
        "Training data": _data(cfg),
        "Trainer": f"{TRAINERS.get(cfg.trainer, cfg.trainer)} (`trainer: {cfg.trainer}`)",
        "Algorithm": _algorithm(cfg),
        "Steps": f"{steps} of {total} ({status})" if total else f"{steps} ({status})",
        "Held-out result": heldout_line(cfg, results),
        "Seed": str(cfg.seed),
        "Run": f"`{Path(results.get('run_dir', '')).name}` (its resolved config: `../config.yaml`)",
        "Versions": (
            f"rlhflab {__version__}, transformers {transformers.__version__}, "
            f"torch {torch.__version__}"
        ),
    }


def write_trained_model_card(model_dir: str | os.PathLike[str], cfg, results: dict) -> None:
    """Rewrite `<model_dir>/README.md` with the run's facts (`card_fields`) above the loading
    section (`models.build.write_model_card`), and `base_model` / the trainer in its YAML
    header (as TRL's cards). Secrets are redacted as in every file of the run directory
    (`rlhflab.serialize.redact`). Does nothing when `model_dir` has no config.json."""
    from types import SimpleNamespace

    from rlhflab.models.build import write_model_card
    from rlhflab.serialize import redact

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        return
    config = SimpleNamespace(**json.loads((model_dir / "config.json").read_text()))
    auto = (
        "AutoModelForSequenceClassification"
        if cfg.trainer == "reward_model"
        else "AutoModelForCausalLM"
    )
    _, hub = _base_model(cfg)
    fields = {k: redact(v) for k, v in card_fields(cfg, results).items()}  # as every run file
    write_model_card(
        model_dir, config, auto_class=auto, training=fields,
        tags=[cfg.trainer], base_model=redact(hub) if hub else None,
    )  # fmt: skip
