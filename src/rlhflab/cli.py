"""`rlhflab <command>`: argument parsing only; the work is done by the modules it calls.

Commands:
    train CONFIG [key.path=value ...]   run the trainer named by the config's `trainer` key
    eval MODEL --task NAME              held-out greedy accuracy and pass@k of a model
    quickstart [--fast]                 the main job: tiny model → SFT → GRPO → held-out eval

Every user-facing error is printed as one line `error: ...` with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rlhflab.errors import RlhfLabError

EXIT_USER_ERROR = 2


def _cmd_train(args: argparse.Namespace) -> int:
    from rlhflab.config import load_config
    from rlhflab.trainers import run_config

    cfg = load_config(args.config, args.overrides)
    results = run_config(cfg)
    print(json.dumps(results, indent=2))
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from rlhflab.eval.cli import run_eval_command

    results = run_eval_command(
        args.model,
        task=args.task,
        task_config=json.loads(args.task_config) if args.task_config else {},
        n=args.n,
        n_train_exclude=args.exclude_train,
        seed=args.seed,
        k=args.k,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        answer_format=args.answer_format,
        reward=args.reward,
        batch_size=args.batch_size,
    )
    print(json.dumps(results, indent=2))
    return 0


def _cmd_quickstart(args: argparse.Namespace) -> int:
    from rlhflab.quickstart import run_quickstart

    results = run_quickstart(fast=args.fast, root=args.root, overrides=args.overrides)
    print(json.dumps(results, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhflab",
        description="LLM post-training for people who study RLHF.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a YAML preset with dotted overrides")
    p.add_argument("config", help="YAML preset, e.g. configs/pg/grpo.yaml")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. optim.lr=1e-5")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("eval", help="held-out accuracy (greedy) and pass@k of a model on a task")
    p.add_argument("model", help="hub id or local directory of a causal LM")
    p.add_argument("--task", required=True, help="reasoning_gym dataset name")
    p.add_argument("--task-config", default=None, help="the dataset's kwargs as JSON")
    p.add_argument("--n", type=int, default=500, help="held-out problems (default 500)")
    p.add_argument(
        "--exclude-train",
        type=int,
        default=20000,
        help="drop held-out questions that appear among the first N training items (default 20000)",
    )
    p.add_argument("--seed", type=int, default=0, help="task seed used for training (default 0)")
    p.add_argument("--k", type=int, default=0, help="samples per problem for pass@k (0: off)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--answer-format", choices=["plain", "tags"], default="plain")
    p.add_argument("--reward", choices=["binary", "partial"], default="binary")
    p.add_argument("--batch-size", type=int, default=256)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("quickstart", help="tiny model → SFT → GRPO → held-out eval, with a report")
    p.add_argument("--fast", action="store_true", help="same code path, smaller budget (~2 min)")
    p.add_argument("--root", default="runs", help="where run directories go (default runs/)")
    p.add_argument(
        "overrides",
        nargs="*",
        help="overrides for the embedded presets: sft.<key>=value or grpo.<key>=value",
    )
    p.set_defaults(func=_cmd_quickstart)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RlhfLabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
