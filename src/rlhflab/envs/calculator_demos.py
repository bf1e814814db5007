"""Calculator-use demonstrations: the SFT data of configs/multiturn/calculator_sft.yaml.

    python -m rlhflab.envs.calculator_demos configs/multiturn/calculator_sft.yaml [key=value ...]
        [--out FILE] [--tool-share 0.4] [--seed S]

writes one multi-turn `messages` row per problem of the SFT config's training split (the task's
`make_splits`, as the run makes it; give the same `key=value` overrides as to `rlhflab train`
so the split is the same): for a share `--tool-share` of the problems (drawn with
Random(seed)) the assistant calls `CalculatorEnv`'s tool and answers with its result,

    user: Calculate 315 * 135.   assistant: <tool>calc: 315 * 135</tool>
    user: 42525                  assistant: <answer>42525</answer>

and for the others it answers directly (`<answer>42525</answer>`). The file goes to `--out`
(default: the config's `data.path`), and `rlhflab train CONFIG` then reads it. The task must be
reasoning_gym basic_arithmetic with "Calculate <expression>." questions.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

from rlhflab.errors import ConfigError, RlhfLabError
from rlhflab.serialize import to_json

#: The share of demonstrations that call the calculator in the multi-turn experiment
#: (docs/multiturn.md): the rest answer directly.
TOOL_SHARE = 0.4


def demonstrations(problems, tool_share: float, seed: int) -> list[dict]:
    """`messages` rows for `problems` (objects with `question` "Calculate <expr>." and `answer`):
    a tool-use demonstration for each problem with Random(seed).random() < tool_share (drawn in
    order), a direct answer for the others.

    Raises:
        ConfigError: a question that is not "Calculate <expression>." (names the question).
    """
    rng = random.Random(seed)
    rows = []
    for p in problems:
        expr = re.fullmatch(r"Calculate (.*)\.", p.question.strip())
        if expr is None:
            raise ConfigError(
                f"task: calculator demonstrations need 'Calculate <expression>.' questions "
                f"(reasoning_gym basic_arithmetic), got {p.question!r}"
            )
        answer = f"<answer>{p.answer}</answer>"
        msgs = [{"role": "user", "content": p.question}]
        if rng.random() < tool_share:
            msgs += [
                {"role": "assistant", "content": f"<tool>calc: {expr.group(1)}</tool>"},
                {"role": "user", "content": str(p.answer)},
            ]
        msgs.append({"role": "assistant", "content": answer})
        rows.append({"messages": msgs})
    return rows


def write_demos(
    config: str | Path,
    overrides: list[str] | None = None,
    *,
    out: str | Path | None = None,
    tool_share: float = TOOL_SHARE,
    seed: int | None = None,
) -> Path:
    """Write the demonstrations of the SFT config `config` (with `overrides`) as JSONL.

    Args:
        out: the file (default: the config's `data.path`); its folder is created.
        tool_share: the share of rows that call the calculator, in [0, 1].
        seed: the draw of which rows call it (default: the config's `seed`).

    Returns:
        The path written: one `{"messages": [...]}` row per training problem.

    Raises:
        ConfigError: the config does not load, is not an SFT config, has no `data.path` and no
            `out` is given, or `tool_share` is outside [0, 1].
    """
    from rlhflab.config import load_config
    from rlhflab.data.tasks import make_splits

    if not 0.0 <= tool_share <= 1.0:
        raise ConfigError(f"--tool-share must be in [0, 1], got {tool_share}")
    cfg = load_config(config, overrides or [])
    if cfg.trainer != "sft":
        raise ConfigError(
            f"{config}: demonstrations are SFT data; this is a '{cfg.trainer}' config"
        )
    target = Path(out if out is not None else cfg.data.path or "")
    if not str(target) or str(target) == ".":
        raise ConfigError(f"{config}: data.path is not set; pass --out FILE")
    t = cfg.task
    splits = make_splits(
        t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout, seed=t.seed
    )
    rows = demonstrations(splits.train, tool_share, cfg.seed if seed is None else seed)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text("".join(to_json(row) + "\n" for row in rows), encoding="utf-8")
    tmp.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring). Bad input: one line on stderr, exit code 2."""
    ap = argparse.ArgumentParser(
        prog="python -m rlhflab.envs.calculator_demos",
        description="Write the calculator-use SFT demonstrations of an SFT config "
        "(configs/multiturn/calculator_sft.yaml) to its data.path.",
    )
    ap.add_argument("config", help="the SFT config to make the data of")
    ap.add_argument("overrides", nargs="*", help="key=value, as given to `rlhflab train`")
    ap.add_argument("--out", default=None, help="the file to write (default: data.path)")
    ap.add_argument("--tool-share", type=float, default=TOOL_SHARE,
                    help=f"share of rows that call the calculator (default {TOOL_SHARE})")  # fmt: skip
    ap.add_argument("--seed", type=int, default=None, help="default: the config's seed")
    args = ap.parse_args(argv)
    try:
        path = write_demos(args.config, args.overrides, out=args.out,
                           tool_share=args.tool_share, seed=args.seed)  # fmt: skip
    except RlhfLabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open(path, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    print(f"wrote {n} demonstrations to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
