"""`rlhflab eval`: load a model, rebuild the task's held-out split (or read a prompt dataset),
report accuracy (or mean reward) and pass@k."""

from __future__ import annotations

import torch

from rlhflab.data.formatting import answer_instruction
from rlhflab.data.tasks import make_splits
from rlhflab.eval.accuracy import majority_baseline
from rlhflab.eval.common import load_and_evaluate, reward_components_from_specs
from rlhflab.rewards.verifier import Verifier


def training_answer_format(model_path: str) -> tuple[str, str] | None:
    """(task.answer_format, path of the config.yaml) of the run that saved `model_path`, or None.

    A trainer saves its model as `<run>/model` and a checkpoint as `<run>/checkpoints/<step>`,
    with the resolved config in `<run>/config.yaml`; this looks for `config.yaml` in
    `model_path` and its two parent folders. None for a Hub id, a folder without such a file, an
    unreadable file, or a config without a `task.answer_format` (e.g. a reward model's).
    """
    from pathlib import Path

    import yaml

    here = Path(model_path).resolve()
    if not here.is_dir():
        return None
    for folder in (here, *list(here.parents)[:2]):
        path = folder / "config.yaml"
        if not path.is_file():
            continue
        try:
            raw = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            return None
        task = raw.get("task") if isinstance(raw, dict) else None
        fmt = task.get("answer_format") if isinstance(task, dict) else None
        return (fmt, str(path)) if isinstance(fmt, str) else None
    return None


def answer_format_warning(model_path: str, answer_format: str) -> str | None:
    """A one-line warning when `model_path` was trained with another `task.answer_format` than
    the `answer_format` it is about to be scored with (every score could silently be 0), naming
    both formats and the flag to pass; None when they agree or the training config is unknown
    (`training_answer_format`)."""
    found = training_answer_format(model_path)
    if found is None or found[0] == answer_format:
        return None
    trained, path = found
    return (
        f"warning: {model_path} was trained with task.answer_format: {trained} ({path}) but "
        f"answers are read as {answer_format}; pass --answer-format {trained} to match"
    )


def run_eval_command(
    model_path: str,
    *,
    task: str,
    task_config: dict,
    n: int,
    n_train_exclude: int,
    seed: int,
    k: int | list[int],
    temperature: float,
    max_new_tokens: int,
    answer_format: str,
    reward: str,
    batch_size: int,
    system: str | None = None,
    extractor: str | None = None,
    instruction: str = "auto",
    threads: int | None = None,
    show: int = 0,
    gguf_file: str | None = None,
    engine: str = "hf",
    n_samples: int = 0,
    print_fn=print,
) -> dict:
    """Held-out results of `model_path` on `task`.

    The held-out split is rebuilt exactly as the trainers build it (same task config and seed),
    and questions that appear among the first `n_train_exclude` training items are dropped, so a
    model trained with task.n_train <= n_train_exclude is scored only on problems it never saw.

    Args (beyond the task and sampling settings):
        system: system prompt rendered into every question (as `task.system` in training).
        extractor: "module:function" user extractor (overrides answer_format).
        instruction: the answer-format instruction after each question, as `task.instruction`
            in training: "auto" (the answer format's sentence, `formatting.answer_instruction`),
            "none", or a text used verbatim.
        threads: torch threads (None: torch's default).
        gguf_file: a GGUF file inside `model_path` (loaded dequantised).
        engine: the rollout engine that samples ("hf" or "vllm", as `rollout.engine`).
        show: print this many held-out problems with the greedy completion, the extracted
            answer, the gold answer and the score.
    Returns:
        accuracy, accuracy_stderr, n (and pass@k), the majority-answer baseline (the most common
        training answer given to every held-out problem: majority_answer, majority_accuracy,
        majority_accuracy_stderr), heldout_overlap_dropped, verifier_errors.
    """
    if threads:
        torch.set_num_threads(threads)
    prompt_instruction = answer_instruction(instruction, answer_format, extractor=extractor)
    splits = make_splits(task, config=task_config, n_train=n_train_exclude, n_heldout=n, seed=seed)
    verifier = Verifier(answer_format=answer_format, reward=reward, extractor=extractor)
    res = load_and_evaluate(
        model_path,
        splits.heldout,
        verifier,
        gguf_file=gguf_file,
        engine=engine,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        k=k,
        n_samples=n_samples,
        temperature=temperature,
        seed=seed,
        system=system,
        instruction=prompt_instruction,
        return_completions=show > 0,
    )
    completions = res.pop("completions", [])
    for p, text in list(zip(splits.heldout, completions, strict=False))[:show]:
        answer = verifier.extract(text)
        score = verifier.score(text, p)
        print_fn(
            f"--- {p.question!r}\n    completion: {text!r}\n    extracted: {answer!r}  "
            f"gold: {p.answer!r}  score: {score}"
        )
    base = majority_baseline(splits.train, splits.heldout, verifier)
    print_fn(
        f"accuracy {res['accuracy']:.3f} ± {res['accuracy_stderr']:.3f} (n = {res['n']}); "
        f"majority-answer baseline {base['majority_accuracy']:.3f} ± "
        f"{base['majority_accuracy_stderr']:.3f} (answering {base['majority_answer']!r} to all)"
    )
    return {
        "model": model_path,
        "task": task,
        **res,
        **base,
        "heldout_overlap_dropped": splits.n_heldout_overlap_dropped,
        "verifier_errors": verifier.n_errors,
    }


def run_prompt_eval_command(
    model_path: str,
    *,
    data: str,
    name: str | None = None,
    split: str = "test",
    prompt_column: str = "prompt",
    prompt_format: str = "auto",
    template: str | None = None,
    system: str | None = None,
    rewards: list[str],
    n: int | None = None,
    k: int | list[int] = 0,
    n_samples: int = 0,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    batch_size: int = 256,
    seed: int = 0,
    engine: str = "hf",
) -> dict:
    """Mean reward of `model_path`'s greedy completions on a prompt dataset (every row of `split`,
    or the first `n`), scored by reward functions.

    Args:
        data: a Hub id (with `name`, `split`) or a local .json/.jsonl/.parquet file.
        rewards: reward names (REWARD_FUNCTIONS: math_verify, exact_match, think_format) or import
            paths ("pkg.mod:fn", "file.py:fn"), each optionally "=weight"; summed with weights.
        k, n_samples: as `rlhflab.eval.accuracy.evaluate` (a sample passes when its correctness,
            or without one its reward, is 1.0).
        engine: the rollout engine that samples ("hf" or "vllm", as `rollout.engine`).
    Returns:
        {"model", "data", "split", "rewards", "n", "reward" (mean weighted reward),
        "reward_stderr", "reward/<name>" (each reward on its own), "headline_name", "headline",
        "metric", ...}: the headline is a correctness when a verifier-like reward is among
        `rewards` (math_verify, exact_match; then also "accuracy", and "metric": "accuracy"),
        else the weighted reward ("metric": "reward"); never a weighted sum called accuracy.
    Raises:
        ConfigError / DataError: one line naming the option, file, row or field.
    """
    from rlhflab.config import PromptDataConfig
    from rlhflab.data.prompts import load_prompt_source
    from rlhflab.rewards.shaping import TextRewardScorer

    components = reward_components_from_specs(rewards)
    cfg = PromptDataConfig(
        source="dataset",
        path=data,
        name=name,
        split=split,
        prompt_column=prompt_column,
        prompt_format=prompt_format,
        template=template,
        system=system,
        heldout_frac=0.0,
    )
    rows = load_prompt_source(cfg, seed=seed).train
    rows = rows[:n] if n else rows
    res = load_and_evaluate(
        model_path,
        rows,
        TextRewardScorer(components),
        engine=engine,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        k=k,
        n_samples=n_samples,
        temperature=temperature,
        seed=seed,
        system=system,
    )
    return {
        "model": model_path,
        "data": data,
        "split": split,
        "rewards": [f"{c.name}={c.weight:g}" for c in components],
        "metric": "accuracy" if "accuracy" in res else "reward",
        **res,
    }
