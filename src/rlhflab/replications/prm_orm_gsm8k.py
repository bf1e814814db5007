"""Synthetic GSM8K-format word problems (used by the R1-Zero replication's base data).

This module held the former `prm-orm-gsm8k` replication (Monte-Carlo step labels on these word
problems); `rlhflab replicate prm-orm` (`rlhflab.replications.prm_orm`, exact step labels on
chained arithmetic) replaces it, and the former name runs that one.
"""

from __future__ import annotations

import random

NAMES = ["Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ian", "Jo"]
ITEMS = ["apples", "marbles", "stickers", "coins", "books", "shells", "cards", "pens"]


def synthetic_rows(n: int, *, seed: int) -> list[dict]:
    """`n` GSM8K-format rows: a person's count of an item changed 2–3 times by buying (+) or giving
    away (−), values 1..20, never negative; the answer is the worked solution with GSM8K's
    calculator annotations and `#### n` (`rlhflab.data.gsm8k.parse_gsm8k_row` reads it)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        value = rng.randint(1, 20)
        sentences, lines = [f"{name} has {value} {item}."], []
        for _ in range(rng.randint(2, 3)):
            k = rng.randint(1, 20)
            if rng.random() < 0.5 or k > value:
                sentences.append(f"{name} buys {k} more.")
                new, op = value + k, "+"
            else:
                sentences.append(f"{name} gives away {k}.")
                new, op = value - k, "-"
            lines.append(f"{value}{op}{k} = <<{value}{op}{k}={new}>>{new}")
            value = new
        question = " ".join(sentences) + f" How many {item} does {name} have now?"
        rows.append({"question": question, "answer": "\n".join(lines) + f"\n#### {value}"})
    return rows
