# Run from the repository root after the runs of docs/distillation.md (run directories under exp/).
"""Held-out greedy accuracy of a model prompted as SDPO's self-teacher: the question, "Correct
solution:" and the gold answer (a stand-in for a correct sibling), then the book's closing line."""

import dataclasses
import json
import sys

import torch

from rlhflab.config import load_config
from rlhflab.data.formatting import task_instruction
from rlhflab.data.prompts import load_prompt_source
from rlhflab.eval.accuracy import evaluate
from rlhflab.models.loading import load_model, load_tokenizer
from rlhflab.rewards.verifier import Verifier


def main() -> None:
    torch.set_num_threads(1)
    model_dir, n = sys.argv[1], int(sys.argv[2])
    cfg = load_config("configs/distill/sdpo.yaml")
    t = cfg.task
    splits = load_prompt_source(cfg.data, t, seed=0)
    rows = splits.heldout[:n]
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    model.eval()
    v = Verifier(answer_format=t.answer_format, reward=t.reward, extractor=t.extractor)
    kw = dict(max_new_tokens=10, system=t.system, instruction=task_instruction(t))
    plain = evaluate(model, tok, rows, v, **kw)["accuracy"]
    demo = [
        dataclasses.replace(
            r,
            prompt=f"{r.question}\nCorrect solution:\n\n{r.columns['answer']}\n\nCorrectly solve the original question.\n",
        )
        for r in rows
    ]
    taught = evaluate(model, tok, demo, v, **kw)["accuracy"]
    print(json.dumps({"model": model_dir, "n": n, "plain": plain, "with_gold_demo": taught}))


if __name__ == "__main__":
    main()
