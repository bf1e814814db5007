"""The trained judge against the task verifier on the held-out pool of make_judge_data.py (800
samples of the SFT policy on heldout[200:400], none of them in the RL frontier's heldout[:128]):
parse failures, score counts, accuracy and Cohen's kappa of "judge says >= 6" against "verifier
says correct".

    python judge_agreement.py JUDGE HELDOUT_JSONL [MAX_NEW_TOKENS (default 16)]

MAX_NEW_TOKENS must fit the longest answer: "Score: 10" is 9 tokens with the rm-overopt
tokenizer, and a budget of 8 cuts it to "Score: 1", which parses as a 1 (README).
"""

import json
import sys
from pathlib import Path

import torch

from rlhflab.eval.agreement import accuracy, cohen_kappa
from rlhflab.rewards.judge import JudgeScorer

TEMPLATE = "{prompt}\nResponse: {completion}\nScore {low}-{high}?"  # as in make_judge_data.py

torch.set_num_threads(1)
judge_path, rows_path = sys.argv[1], sys.argv[2]
max_new = int(sys.argv[3]) if len(sys.argv) > 3 else 16
rows = [json.loads(line) for line in Path(rows_path).read_text().splitlines()]
judge = JudgeScorer.from_pretrained(judge_path, max_new_tokens=max_new)
scores = judge.score([r["question"] for r in rows], [r["response"] for r in rows],
                     template=TEMPLATE)  # fmt: skip
pred = [None if s is None else s >= 6 for s in scores]
truth = [r["correct"] for r in rows]
out = {
    "judge_max_new_tokens": max_new,
    "n": len(rows),
    "verifier_correct": sum(truth),
    "parse_failed": sum(s is None for s in scores),
    "accuracy": accuracy(pred, truth),
    "kappa": cohen_kappa(pred, truth),
    "score_counts": {str(k): scores.count(k) for k in sorted({s for s in scores if s is not None})},
}
print(json.dumps(out, indent=1))
