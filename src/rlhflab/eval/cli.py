"""`rlhflab eval`: load a model, rebuild the task's held-out split, report accuracy and pass@k."""

from __future__ import annotations

import torch

from rlhflab.data.tasks import make_splits
from rlhflab.eval.accuracy import evaluate, majority_baseline
from rlhflab.models.loading import load_model, load_tokenizer
from rlhflab.rewards.verifier import Verifier


def run_eval_command(
    model_path: str,
    *,
    task: str,
    task_config: dict,
    n: int,
    n_train_exclude: int,
    seed: int,
    k: int,
    temperature: float,
    max_new_tokens: int,
    answer_format: str,
    reward: str,
    batch_size: int,
    system: str | None = None,
    extractor: str | None = None,
    threads: int | None = None,
    show: int = 0,
    gguf_file: str | None = None,
    print_fn=print,
) -> dict:
    """Held-out results of `model_path` on `task`.

    The held-out split is rebuilt exactly as the trainers build it (same task config and seed),
    and questions that appear among the first `n_train_exclude` training items are dropped, so a
    model trained with task.n_train <= n_train_exclude is scored only on problems it never saw.

    Args (beyond the task and sampling settings):
        system: system prompt rendered into every question (as `task.system` in training).
        extractor: "module:function" user extractor (overrides answer_format).
        threads: torch threads (None: torch's default).
        gguf_file: a GGUF file inside `model_path` (loaded dequantised).
        show: print this many held-out problems with the greedy completion, the extracted
            answer, the gold answer and the score.
    Returns:
        accuracy, accuracy_stderr, n (and pass@k), the majority-answer baseline (the most common
        training answer given to every held-out problem: majority_answer, majority_accuracy,
        majority_accuracy_stderr), heldout_overlap_dropped, verifier_errors.
    """
    if threads:
        torch.set_num_threads(threads)
    splits = make_splits(task, config=task_config, n_train=n_train_exclude, n_heldout=n, seed=seed)
    tokenizer = load_tokenizer(model_path, gguf_file=gguf_file)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(model_path, device=device, gguf_file=gguf_file)
    verifier = Verifier(answer_format=answer_format, reward=reward, extractor=extractor)
    res = evaluate(
        model,
        tokenizer,
        splits.heldout,
        verifier,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        k=k,
        temperature=temperature,
        seed=seed,
        system=system,
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
