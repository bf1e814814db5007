"""Padded tokens per update: how much of the forward/backward grid is padding, for each way a
step's rows can be laid out, on real rows (no model is timed; the grids are counted).

Workloads:
    quickstart_grpo   the rollouts of the quickstart's GRPO stage (configs/pg/quickstart_grpo.yaml
                      from the SFT model of configs/sft/quickstart.yaml, `--sft-steps`), captured
                      at each of `--grpo-steps` steps: 16 prompts × 8 samples, up to 10 new tokens
    quickstart_sft    the SFT stage's rows (prompt + answer), batches of 64
    hh_dpo            preference pairs in HH-RLHF's schema (bench/make_hh_fixture.py, one and
                      two-turn conversations), tokenized by the quickstart model's tokenizer,
                      chosen and rejected in one forward, batches of 64 pairs

Layouts (cells = sequences × columns of every forward pass of a step; cells per token = cells /
real tokens, where a sequence's prompt counts once per sequence; padded fraction = 1 − real
tokens / cells, for the padded layouts):
    step_width    fixed micro-batches, each padded to the whole step's widths (what rlhflab's
                  policy-gradient and distillation updates paid off the CPU's packed path
                  before `Rollout.trimmed`; SFT, DPO and RM micro-batches were always built at
                  their own widths)
    own_width     fixed micro-batches, each at its own widths (`completion_logps` now)
    token_budget  rows grouped by length into micro-batches of at most B padded tokens
                  (`train.max_tokens_per_micro_batch`, `distributed.token_budget_split`), B =
                  the largest own-width fixed micro-batch's grid of the step (the same peak
                  activation memory)
    packed        the CPU's padding-free layout of each fixed micro-batch (the tree layout of
                  `rlhflab.models.packing.packed_layout`: shared prompts written once; the
                  padded own-width layout where packing would save < 15%)
    varlen        the varlen layout of each fixed micro-batch (FSDP2 ranks, GPUs with sdpa or
                  eager: every sequence whole, in rows of 1, 1.5 or 2× the longest, whichever
                  grid is smallest; own-width padded where it would save < 15%)
    varlen_flash  the same in one row (flash attention's varlen kernel): no padding at all, packed
                  wherever that saves anything

The micro-batch size (`--micro`, rows; a DPO row is a pair) is a GPU-like value; the quickstart
itself runs one micro-batch of 128 rows on CPU. bench/make_hh_fixture.py's rows and the
quickstart's are synthetic in text, real in schema and length spread.

    python -m bench.padding --out bench/padding_results.json
    python -m bench.padding --smoke --out /tmp/padding.json     # tiny sizes, not results
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cells_step_width(ro) -> int:
    """Every micro-batch at the whole step's widths."""
    return ro.mask.size(0) * (ro.prompt_ids.size(1) + ro.mask.size(1))


def _cells_own(widths, parts) -> int:
    """Every micro-batch at its own widths (`distributed.padded_cells`)."""
    from rlhflab.distributed import padded_cells

    return sum(padded_cells(widths, rows) for rows in parts)


def _cells_packed(ro, parts, **layout) -> int:
    """Every micro-batch in `packed_layout(..., **layout)` (own widths where it returns None)."""
    import torch

    from rlhflab.models.packing import packed_layout

    total = 0
    for rows in parts:
        micro = ro.select(torch.tensor(rows)).trimmed()
        lay = packed_layout(micro, **layout)
        total += lay.input_ids.numel() if lay is not None else micro.input_ids.numel()
    return total


def layouts(ro, micro: int, seqs_per_row: int = 1) -> dict:
    """Cells of each layout of one step's rows (`ro`, a Rollout; a DPO step is its 2n sequences,
    chosen then rejected, pair i = rows i and n + i). The token budget is the largest fixed
    own-width micro-batch's grid: the same peak activation memory as the fixed micro-batches."""
    from rlhflab.distributed import token_budget_split

    n = ro.mask.size(0) // seqs_per_row
    widths = ro.widths()
    pair_w = [
        tuple(max(widths[i + k * n][s] for k in range(seqs_per_row)) for s in range(2))
        for i in range(n)
    ]

    def seqs(parts):  # a part of pairs -> its sequences
        return [[i + k * n for k in range(seqs_per_row) for i in part] for part in parts]

    fixed = seqs([list(range(s, min(n, s + micro))) for s in range(0, n, micro)])
    budget = max(_cells_own(widths, [part]) for part in fixed)
    budgeted = seqs(token_budget_split(pair_w, budget, seqs_per_row))
    return {
        "real_tokens": sum(p + c for p, c in widths),
        "budget": budget,
        "passes_fixed": len(fixed),
        "passes_budget": len(budgeted),
        "step_width": _cells_step_width(ro),
        "own_width": _cells_own(widths, fixed),
        "token_budget": _cells_own(widths, budgeted),
        "packed": _cells_packed(ro, fixed),
        "varlen": _cells_packed(ro, fixed, share_prompts=False),
        "varlen_flash": _cells_packed(ro, fixed, share_prompts=False, one_row=True),
    }


def _train(config: str, overrides: list[str], make, on_update=None):
    """One run of `config`, a step at a time: (its final results, the trainer). `on_update`
    sees each step's local rollout before the update."""
    from rlhflab.config import load_config
    from rlhflab.trainers import pg_phases
    from rlhflab.trainers.loop import Run

    real_update = pg_phases.update
    if on_update is not None:

        def update(data, *args, **kwargs):
            on_update(data.local.rollout)
            return real_update(data, *args, **kwargs)

        pg_phases.update = update
    try:
        session = Run(load_config(ROOT / config, overrides), make)
        with session:
            while session.step() is not None:
                pass
        return session.finish(), session.trainer
    finally:
        pg_phases.update = real_update


def _sum(steps: list[dict]) -> dict:
    """Totals over steps; per layout its cells and cells per real token (1.0: no padding; below
    1 where shared prompts are written once) and, for the padded layouts, the padded fraction."""
    real = sum(s["real_tokens"] for s in steps)
    out = {"steps": len(steps), "real_tokens": real,
           "budget_max": max(s["budget"] for s in steps),
           "passes_fixed": sum(s["passes_fixed"] for s in steps),
           "passes_budget": sum(s["passes_budget"] for s in steps)}  # fmt: skip
    for k in ("step_width", "own_width", "token_budget", "packed", "varlen", "varlen_flash"):
        cells = sum(s[k] for s in steps)
        out[k] = {"cells": cells, "cells_per_token": round(cells / real, 4)}
        if k not in ("packed",):  # the tree layout writes shared prompts once: not a fraction
            out[k]["padded_frac"] = round(1 - real / cells, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sft-steps", type=int, default=130)
    ap.add_argument("--grpo-steps", type=int, default=5)
    ap.add_argument("--micro", type=int, default=16, help="rows per fixed micro-batch")
    ap.add_argument("--hh-rows", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a test, not results)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.sft_steps, args.grpo_steps, args.hh_rows = 2, 1, 64
    import random
    import subprocess
    import sys

    import torch

    from rlhflab.models.loading import load_tokenizer
    from rlhflab.rollout.sampler import pack
    from rlhflab.trainers.policy_gradient import PolicyGradient
    from rlhflab.trainers.sft import SFT

    torch.set_num_threads(1)
    from bench.common import machine

    result = {"machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "out"}}
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"run.root={tmp}", "tracking.console=false", "eval.n=0"]
        sft, sft_trainer = _train("configs/sft/quickstart.yaml",
                                  [*common, f"train.steps={args.sft_steps}", "eval.every=0"],
                                  SFT)  # fmt: skip
        tok = load_tokenizer(sft["model_dir"])
        rollouts = []
        _train("configs/pg/quickstart_grpo.yaml",
               [*common, f"model.name_or_path={sft['model_dir']}",
                f"train.steps={args.grpo_steps}", "eval.every=0"],
               PolicyGradient, on_update=lambda ro: rollouts.append(ro.to("cpu")))  # fmt: skip
        result["quickstart_grpo"] = _sum([layouts(r, args.micro) for r in rollouts])
        # the SFT stage's own rows (prompt, answer), in steps of its batch size
        rows = [(p, c) for p, c, _ in sft_trainer.pairs]
        b = sft_trainer.cfg.train.batch_size
        result["quickstart_sft"] = _sum([
            layouts(pack([p for p, _ in rows[s : s + b]], [c for _, c in rows[s : s + b]],
                         tok.pad_token_id), args.micro)
            for s in range(0, min(len(rows), 8 * b) - b + 1, b)
        ])  # fmt: skip

        hh = Path(tmp) / "hh"
        subprocess.run([sys.executable, str(ROOT / "bench/make_hh_fixture.py"), str(hh),
                        str(args.hh_rows)], check=True, capture_output=True)  # fmt: skip
        pairs = [json.loads(x) for x in (hh / "hh.jsonl").read_text().splitlines()]
        rng = random.Random(0)
        rng.shuffle(pairs)
        steps = []
        for s in range(0, len(pairs) - 63, 64):
            batch = pairs[s : s + 64]
            prompts, chosen, rejected = [], [], []
            for row in batch:
                p, c = _split_hh(row["chosen"])
                _, r = _split_hh(row["rejected"])
                prompts.append(tok.encode(p, add_special_tokens=False))
                chosen.append(tok.encode(c, add_special_tokens=False))
                rejected.append(tok.encode(r, add_special_tokens=False))
            ro = pack(prompts * 2, chosen + rejected, tok.pad_token_id)
            steps.append(layouts(ro, args.micro // 2 or 1, seqs_per_row=2))
        result["hh_dpo"] = _sum(steps)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


def _split_hh(text: str) -> tuple[str, str]:
    """HH's "\\n\\nHuman: ... \\n\\nAssistant: answer": (everything up to the last
    "Assistant:", the answer)."""
    cut = text.rindex("\n\nAssistant:") + len("\n\nAssistant:")
    return text[:cut], text[cut:]


if __name__ == "__main__":
    raise SystemExit(main())
