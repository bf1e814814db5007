"""Judge SFT data for the judge-as-gold frontier: the rm-overopt SFT policy's own samples on
training problems (spell_backward, train[5000:7000], 8 samples each, temperature 1), each rendered
with the judge's pointwise template TEMPLATE and labelled by the task verifier: "Score: 10" when
correct, "Score: 1" when not; balanced by dropping surplus wrong samples. Also a held-out pool for
the judge's agreement with the verifier: 4 samples on each of heldout[200:400] (the RL frontier
uses heldout[:128]).

    python make_judge_data.py POLICY OUT_DIR judge_sft.yaml
writes OUT_DIR/judge_sft.jsonl ({"prompt", "completion"}) and OUT_DIR/judge_heldout.jsonl
({"prompt", "completion", "correct", "question", "response"}).
"""

import json
import random
import sys

import torch

from rlhflab.config import load_config
from rlhflab.data.tasks import make_splits
from rlhflab.models.loading import load_model, load_tokenizer
from rlhflab.rewards.judge import prompt_text
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.scored import sample_and_score

#: The judge's pointwise template (also the RL config's frontier_gold template).
TEMPLATE = "{prompt}\nResponse: {completion}\nScore {low}-{high}?"

torch.set_num_threads(1)
policy, out = sys.argv[1], sys.argv[2]
t = load_config(sys.argv[3]).task
splits = make_splits(t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout, seed=t.seed)
tok, model = load_tokenizer(policy), load_model(policy).eval()
ver = Verifier(answer_format=t.answer_format, reward=t.reward, extractor=t.extractor)
rng = random.Random(0)


def rows(problems, k, seed):
    ss = sample_and_score(model, tok, problems, ver, k=k, max_new_tokens=10, temperature=1.0,
                          seed=seed)  # fmt: skip
    res = []
    for p, texts, scores in zip(ss.problems, ss.texts, ss.scores, strict=True):
        for x, s in zip(texts, scores, strict=True):
            prompt = TEMPLATE.format(prompt=prompt_text(p), completion=x, low=1, high=10)
            res.append({"prompt": prompt, "completion": "Score: 10" if s >= 1.0 else "Score: 1",
                        "correct": s >= 1.0, "question": p.question, "response": x})  # fmt: skip
    return res


train = rows(splits.train[5000:7000], 8, 1)
pos = [r for r in train if r["correct"]]
neg = [r for r in train if not r["correct"]]
n = min(len(pos), len(neg))
rng.shuffle(pos)
rng.shuffle(neg)
bal = pos[:n] + neg[:n]
rng.shuffle(bal)
with open(f"{out}/judge_sft.jsonl", "w") as f:
    for r in bal:
        f.write(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n")
held = rows(splits.heldout[200:400], 4, 2)
with open(f"{out}/judge_heldout.jsonl", "w") as f:
    for r in held:
        f.write(json.dumps(r) + "\n")
print(f"train samples {len(train)} (correct {len(pos)}), balanced {2 * n}; "
      f"held-out {len(held)} (correct {sum(r['correct'] for r in held)})")  # fmt: skip
