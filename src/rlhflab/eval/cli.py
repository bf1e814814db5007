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
    task: str | None = None,
    task_config: dict | None = None,
    n: int | None = None,
    n_train_exclude: int | None = None,
    seed: int | None = None,
    k: int | list[int] = 0,
    temperature: float | None = None,
    max_new_tokens: int | None = None,
    answer_format: str | None = None,
    reward: str | None = None,
    batch_size: int = 256,
    system: str | None = None,
    extractor: str | None = None,
    instruction: str | None = None,
    threads: int | None = None,
    show: int = 0,
    gguf_file: str | None = None,
    engine: str = "hf",
    n_samples: int = 0,
    judge: dict | None = None,
    print_fn=print,
) -> dict:
    """Held-out results of `model_path` on `task`.

    The held-out split is rebuilt exactly as the trainers build it (same task config and seed),
    and questions that appear among the first `n_train_exclude` training items are dropped, so a
    model trained with task.n_train <= n_train_exclude is scored only on problems it never saw.

    Every setting left None is taken from the run that trained `model_path` when its
    config.yaml is found (`rlhflab.eval.training_run`: the run's task kwargs, held-out seed and
    size, answer format, instruction, system prompt, reward, prompt template and
    eval.max_new_tokens; the kwargs, seed and size only when `task` is the run's task or None),
    else from the `task` / `eval` sections' defaults. Each given value that differs from the
    run's is named in a one-line warning (`print_fn`). A run with an environment (`env:`) is
    evaluated as it evaluated itself: one greedy episode per held-out problem with its
    environment (`rlhflab.eval.episodes`).

    Args (beyond the task and sampling settings):
        task: reasoning_gym task name; None: the training run's.
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
        judge: score the greedy completions with an LLM judge too and measure its agreement
            with the verifier (`rlhflab.eval.agreement.judge_vs_verifier`): {"path", and
            optionally "template", "low" (1), "high" (10), "threshold" ((low + high)/2),
            "max_new_tokens" (16)}; the verifier's verdict is "correct" at score 1.0.
    Returns:
        accuracy, accuracy_stderr, n (and pass@k), the majority-answer baseline (the most common
        training answer given to every held-out problem: majority_answer, majority_accuracy,
        majority_accuracy_stderr), heldout_overlap_dropped, verifier_errors, "settings" (every
        setting used) and "training_config" (the run's config.yaml, or None); for episodes
        also turns, tool_calls, truncated and env; with `judge`, "judge" (judge_vs_verifier's
        result and the judge's path).
    Raises:
        ConfigError: no task given and none found; pass@k or --show asked of episodes; a
            judge whose path, range or template is bad (checked before anything is evaluated).
    """
    from rlhflab.data.prompts import apply_template, rows_from_problems
    from rlhflab.errors import ConfigError
    from rlhflab.eval.training_run import find_training_run, resolve_settings

    if threads:
        torch.set_num_threads(threads)
    try:
        run = find_training_run(model_path)
    except ConfigError as exc:
        run = None
        print_fn(f"warning: the training run's settings are not used: {exc}")
    given = {
        "task": task, "task_config": task_config, "seed": seed, "n_train_exclude": n_train_exclude,
        "n": n, "answer_format": answer_format, "extractor": extractor, "reward": reward,
        "system": system, "instruction": instruction, "max_new_tokens": max_new_tokens,
        "temperature": temperature,
    }  # fmt: skip
    sampling = bool(k) or n_samples > 0
    env = run.env if run is not None else None
    if env is not None and env.class_ is None:  # rows from the environment (data.source: env)
        raise ConfigError(
            f"eval: {model_path} was trained on a verifiers / OpenEnv environment's rows; "
            "`rlhflab eval` of such runs is not supported yet (the run's own eval/* metrics are)"
        )
    if env is not None and sampling:
        raise ConfigError(
            f"eval --k: {model_path} was trained with an environment ({env.class_}); its "
            "held-out evaluation is greedy episodes, pass@k of episodes is not implemented"
        )
    if env is not None and show:
        raise ConfigError(f"eval --show: not available for episodes ({env.class_})")
    if env is not None and judge:
        raise ConfigError(f"eval --judge: not available for episodes ({env.class_})")
    if judge:
        _check_judge(judge)
    s, lines = resolve_settings(given, run, sampling=sampling)
    for line in lines:
        print_fn(line)
    same_task = run is not None and s["task"] == run.settings["task"]
    # the run's held-out rows are the first eval.n of a draw of task.n_heldout (make_splits keeps
    # draws in order, so a larger draw starts with the same rows)
    draw = max(run.n_heldout, s["n"]) if same_task else s["n"]
    splits = make_splits(
        s["task"], config=s["task_config"], n_train=s["n_train_exclude"], n_heldout=draw,
        seed=s["seed"],
    )  # fmt: skip
    rows = rows_from_problems(splits.heldout[: s["n"]])
    if run is not None and run.template is not None:
        rows = apply_template(rows, run.template)
    verifier = Verifier(
        answer_format=s["answer_format"], reward=s["reward"], extractor=s["extractor"]
    )
    if env is not None:
        from rlhflab.eval.episodes import load_and_run_episodes

        print_fn(
            f"note: held-out episodes with the run's environment ({env.class_}, up to "
            f"{env.max_turns} turns), greedy, as the run evaluated itself"
        )
        res = load_and_run_episodes(
            model_path, rows, env, rollout_max_new_tokens=run.rollout_max_new_tokens,
            batch_size=batch_size, engine=engine, gguf_file=gguf_file,
        )  # fmt: skip
    else:
        res = load_and_evaluate(
            model_path,
            rows,
            verifier,
            gguf_file=gguf_file,
            engine=engine,
            batch_size=batch_size,
            max_new_tokens=s["max_new_tokens"],
            k=k,
            n_samples=n_samples,
            temperature=s["temperature"],
            seed=s["seed"],
            system=s["system"],
            instruction=answer_instruction(
                s["instruction"], s["answer_format"], extractor=s["extractor"]
            ),
            return_completions=show > 0 or bool(judge),
        )
    completions = res.pop("completions", [])
    if judge:
        res["judge"] = _judge_agreement(judge, rows, completions, verifier)
    for p, text in list(zip(rows, completions, strict=False))[:show]:
        answer = verifier.extract(text)
        score = verifier.score(text, p)
        print_fn(
            f"--- {p.question!r}\n    completion: {text!r}\n    extracted: {answer!r}  "
            f"gold: {p.answer!r}  score: {score}"
        )
    base = majority_baseline(splits.train, rows, verifier)
    print_fn(
        f"{'success' if env is not None else 'accuracy'} {res['accuracy']:.3f} ± "
        f"{res['accuracy_stderr']:.3f} (n = {res['n']}); "
        f"majority-answer baseline {base['majority_accuracy']:.3f} ± "
        f"{base['majority_accuracy_stderr']:.3f} (answering {base['majority_answer']!r} to all)"
    )
    return {
        "model": model_path,
        "task": s["task"],
        **res,
        **base,
        "heldout_overlap_dropped": splits.n_heldout_overlap_dropped,
        "verifier_errors": verifier.n_errors,
        "settings": s,
        "training_config": str(run.config_path) if run is not None else None,
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


def _check_judge(judge: dict) -> None:
    """Raise ConfigError for a `--judge` that cannot run: no model directory at its path (or a
    run directory's `model/`), low >= high, or a template that is not a pointwise one."""
    import os

    from rlhflab.errors import ConfigError
    from rlhflab.rewards.judge import check_template, judge_model_path

    if not os.path.isdir(judge_model_path(judge["path"])):
        raise ConfigError(f"eval --judge {judge['path']}: no such model or run directory")
    low, high = judge.get("low", 1), judge.get("high", 10)
    if low >= high:
        raise ConfigError(f"eval --judge-low {low} --judge-high {high}: low must be below high")
    if judge.get("template") is not None:
        check_template(judge["template"], "pointwise", field="eval --judge-template")


def _judge_agreement(judge: dict, rows: list, completions: list[str], verifier) -> dict:
    """`judge_vs_verifier` of the judge `judge["path"]` on the greedy `completions` of `rows`
    (the judge on the GPU when there is one, else the CPU)."""
    from rlhflab.eval.agreement import judge_vs_verifier
    from rlhflab.rewards.judge import JudgeScorer, prompt_text

    low, high = judge.get("low", 1), judge.get("high", 10)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    scorer = JudgeScorer.from_pretrained(
        judge["path"], device=device, max_new_tokens=judge.get("max_new_tokens", 16)
    )
    scores = scorer.score([prompt_text(r) for r in rows], completions, low=low, high=high,
                          template=judge.get("template"))  # fmt: skip
    correct = [verifier.score(t, r) == 1.0 for t, r in zip(completions, rows, strict=True)]
    threshold = judge.get("threshold")
    threshold = (low + high) / 2 if threshold is None else threshold
    return {"path": judge["path"], **judge_vs_verifier(scores, correct, threshold=threshold)}
