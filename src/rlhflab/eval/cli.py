"""`rlhflab eval`: load a model, rebuild the task's held-out split, report accuracy and pass@k."""

from __future__ import annotations

import torch

from rlhflab.data.tasks import make_splits
from rlhflab.eval.accuracy import evaluate
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
) -> dict:
    """Held-out results of `model_path` on `task`.

    The held-out split is rebuilt exactly as the trainers build it (same task config and seed),
    and questions that appear among the first `n_train_exclude` training items are dropped, so a
    model trained with task.n_train <= n_train_exclude is scored only on problems it never saw.
    """
    splits = make_splits(task, config=task_config, n_train=n_train_exclude, n_heldout=n, seed=seed)
    tokenizer = load_tokenizer(model_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(model_path, device=device)
    verifier = Verifier(answer_format=answer_format, reward=reward)
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
    )
    return {
        "model": model_path,
        "task": task,
        **res,
        "heldout_overlap_dropped": splits.n_heldout_overlap_dropped,
        "verifier_errors": verifier.n_errors,
    }
