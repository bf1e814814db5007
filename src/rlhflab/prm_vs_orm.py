"""PRM vs ORM on the same data budget: one command, one plot.

    rlhflab prm-vs-orm --root runs/prm_vs_orm

1. Policy: SFT from scratch on worked arithmetic solutions (one "a op b = c" step per line, then
   "<answer>v</answer>"), unless --policy gives one that writes steps.
2. Data: the policy samples K solutions for each of P training prompts (one sampling, same seed for
   both). The ORM learns each solution's outcome (verifier); the PRM learns each step's rating from
   the step checker (`rlhflab.data.prm.label_steps`). Same prompts, same samples, same steps of
   training: the only difference is the label granularity.
3. Best-of-N on held-out problems (questions never in training): N_max samples per problem, each
   RM picks one of N; accuracy vs N for both, with oracle (pass@N) and random references.
"""

from __future__ import annotations

import time


def run_prm_vs_orm(
    *,
    root: str = "runs",
    policy: str | None = None,
    task: str = "chain_sum",
    task_config: dict | None = None,
    size: str = "small",
    sft_steps: int = 400,
    n_prompts: int = 256,
    samples_per_prompt: int = 8,
    rm_steps: int = 200,
    problems: int = 200,
    n_train: int = 4000,
    ns: list[int] = (1, 2, 4, 8, 16),
    max_new_tokens: int = 64,
    prm_reduce: str = "min",
    seed: int = 0,
    threads: int | None = None,
) -> dict:
    """PRM vs ORM from the same data budget: SFT a policy (or load `policy`), sample it once,
    train an ORM and a PRM on those samples, and report best-of-N accuracy vs N on held-out
    problems for both (with oracle and random picks), with a plot. Returns the results dict."""
    import torch

    from rlhflab.config import config_from_dict
    from rlhflab.data.prm import solution_text, solve_steps
    from rlhflab.data.tasks import make_splits
    from rlhflab.eval.best_of_n import best_of_n_eval, plot_curves
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.reward_model import RewardModelScorer
    from rlhflab.rewards.verifier import Verifier
    from rlhflab.rundir import create_run_dir
    from rlhflab.serialize import to_json
    from rlhflab.trainers import run_config

    t0 = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    task_config = task_config or {"min_terms": 3, "max_terms": 4, "min_digits": 1, "max_digits": 2}
    out_dir = create_run_dir(root, "prm-vs-orm")
    task_cfg = {
        "name": task,
        "config": task_config,
        "n_train": n_train,
        "n_heldout": problems,
        "seed": seed,
        "answer_format": "tags",
        # the policy learns the worked-solution format from bare questions: no instruction
        "instruction": "none",
    }
    common = {
        "seed": seed,
        "task": task_cfg,
        "precision": {"threads": threads},
        "tracking": {"console": False},
    }
    timings = {}
    # 1. Policy.
    if policy is None:
        splits = make_splits(task, config=task_config, n_train=n_train, n_heldout=1, seed=seed)
        sft_path = out_dir / "worked_solutions.jsonl"
        with open(sft_path, "w") as fh:
            for p in splits.train:
                try:
                    steps = solve_steps(p.entry["metadata"]["expression"])
                except (ValueError, KeyError):
                    continue
                row = {
                    "prompt": p.question,
                    "completion": solution_text(steps, f"<answer>{p.answer}</answer>"),
                }
                fh.write(to_json(row) + "\n")
        sft = run_config(
            config_from_dict(
                {
                    "trainer": "sft",
                    **common,
                    "model": {
                        "build": {"size": size, "vocab_size": 1024, "max_position_embeddings": 192}
                    },
                    "data": {"source": "jsonl", "path": str(sft_path)},
                    "train": {
                        "steps": sft_steps,
                        "batch_size": 64,
                        "micro_batch_size": 64,
                        "max_len": 160,
                    },
                    "optim": {
                        "lr": 2e-3,
                        "warmup_steps": 20,
                        "schedule": "cosine",
                        "min_lr_ratio": 0.1,
                    },
                    "eval": {"n": 100, "max_new_tokens": max_new_tokens},
                    "run": {"name": "policy-sft", "root": str(out_dir)},
                }
            )
        )
        policy = sft["model_dir"]
        timings["sft_s"] = sft["wall_s"]
        timings["policy_greedy_accuracy"] = sft["heldout_accuracy"]
    # 2. ORM and PRM from the same samples.
    rms = {}
    for kind in ("orm", "prm"):
        res = run_config(
            config_from_dict(
                {
                    "trainer": "reward_model",
                    "kind": kind,
                    **common,
                    "model": {"name_or_path": policy},
                    "data": {
                        "source": "task_samples",
                        "n_prompts": n_prompts,
                        "samples_per_prompt": samples_per_prompt,
                        "max_new_tokens": max_new_tokens,
                        "max_len": 192,
                    },
                    "loss": {"prm_reduce": prm_reduce},
                    "train": {"steps": rm_steps, "batch_size": 32, "micro_batch_size": 32},
                    "optim": {"lr": 3e-4, "warmup_steps": 10},
                    "eval": {"n_problems": min(problems, 64), "max_new_tokens": max_new_tokens},
                    "run": {"name": kind, "root": str(out_dir)},
                }
            )
        )
        rms[kind] = res
        timings[f"{kind}_s"] = res["wall_s"]
    # 3. Best-of-N on held-out problems.
    tokenizer = load_tokenizer(policy)
    splits = make_splits(task, config=task_config, n_train=n_train, n_heldout=problems, seed=seed)
    scorers = {
        "ORM": RewardModelScorer.from_pretrained(rms["orm"]["model_dir"], kind="orm"),
        f"PRM ({prm_reduce})": RewardModelScorer.from_pretrained(
            rms["prm"]["model_dir"], kind="prm", prm_reduce=prm_reduce
        ),
    }
    t1 = time.perf_counter()
    bon = best_of_n_eval(
        load_model(policy).eval(),
        tokenizer,
        splits.heldout,
        Verifier(answer_format="tags"),
        scorers,
        ns=sorted(ns),
        max_new_tokens=max_new_tokens,
        seed=seed + 12345,
    )
    timings["best_of_n_s"] = round(time.perf_counter() - t1, 2)
    plot_curves(bon["curves"], out_dir / "prm_vs_orm.png", title=f"PRM vs ORM, {task}")
    summary = {
        "policy": policy,
        "task": task,
        "task_config": task_config,
        "heldout_problems": len(splits.heldout),
        "data_budget": {"prompts": n_prompts, "samples_per_prompt": samples_per_prompt},
        "orm": {"eval": rms["orm"]["eval"], "train_examples": rms["orm"]["train_examples"]},
        "prm": {
            "eval": rms["prm"]["eval"],
            "train_examples": rms["prm"]["train_examples"],
            "data": rms["prm"]["data"],
        },
        "curves": bon["curves"],
        "timings": timings,
        "wall_s": round(time.perf_counter() - t0, 2),
        "plot": str(out_dir / "prm_vs_orm.png"),
        "out_dir": str(out_dir),
    }
    with open(out_dir / "prm_vs_orm.json", "w") as fh:
        fh.write(to_json(summary, indent=2, default=str) + "\n")
    return summary
