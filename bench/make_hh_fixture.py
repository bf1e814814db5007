"""Write a synthetic preference dataset in Anthropic HH-RLHF's schema (for `rlhflab pipeline` runs
without the Hub): `chosen` is a short on-topic helpful answer, `rejected` an unhelpful one; a
fifth of the rows are two-turn conversations. Also writes SFT rows (`messages`: the chosen
conversation) for the policy the pipeline starts from.

    python bench/make_hh_fixture.py OUT_DIR [N_ROWS]   # OUT_DIR/hh.jsonl, OUT_DIR/sft.jsonl
"""

import json
import random
import sys
from pathlib import Path

TOPICS = [
    "bread",
    "tea",
    "rain",
    "cats",
    "music",
    "chess",
    "paint",
    "boats",
    "stars",
    "maps",
    "bees",
    "snow",
    "soup",
    "clocks",
    "trees",
    "kites",
    "books",
    "salt",
    "wind",
    "glass",
]
ASK = [
    "Tell me about {t}.",
    "What do you know about {t}?",
    "Can you explain {t}?",
    "I want to learn about {t}.",
    "Why do people like {t}?",
]
GOOD = [
    "Sure! {T} are interesting: here is a short summary of {t}.",
    "Happy to help. {T} have a long history; I can tell you more about {t}.",
    "Of course. The basics of {t} are simple, and I can explain them step by step.",
]
BAD = ["No.", "I don't care.", "Figure it out yourself.", "Whatever."]


def main(out_dir: str, n: int = 400) -> None:
    rng = random.Random(0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "hh.jsonl", "w") as hh, open(out / "sft.jsonl", "w") as sft:
        for i in range(n):
            t = rng.choice(TOPICS)
            q = f"Question {i}: " + rng.choice(ASK).format(t=t)  # distinct prompts
            good = rng.choice(GOOD).format(t=t, T=t.capitalize())
            bad = rng.choice(BAD)
            pre = "\n\nHuman: Hi!\n\nAssistant: Hello! How can I help?" if i % 5 == 0 else ""
            hh.write(
                json.dumps(
                    {
                        "chosen": f"{pre}\n\nHuman: {q}\n\nAssistant: {good}",
                        "rejected": f"{pre}\n\nHuman: {q}\n\nAssistant: {bad}",
                    }
                )
                + "\n"
            )
            # SFT on a mix: the policy starts out sometimes helpful, sometimes not.
            answer = good if rng.random() < 0.5 else bad
            sft.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": q},
                            {"role": "assistant", "content": answer},
                        ]
                    }
                )
                + "\n"
            )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 400)
