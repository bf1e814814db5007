"""Re-measure a run's first and last frontier points with the verifier beside the judge: the
frontier's own samples (same held-out problems, same seeded draws, `eval.frontier.frontier_point`)
of the start policy and of the run's saved final policy, scored by the judge (checked against the
run's logged frontier/gold) and by the task verifier (not logged by the run: its frontier gold is
the judge).

    python frontier_check.py RUN_DIR [RUN_DIR ...]    # runs with run.save_model: true
prints one JSON line per run: {"run", "step0": {...}, "end": {...}} with judge, verifier, sqrt_kl,
the logged frontier/gold, frontier/proxy of that step, and the judge's agreement with the verifier
on those samples (judge >= 6 against verifier correct: accuracy, Cohen's kappa, both counts).
"""

import contextlib
import json
import sys
from pathlib import Path

import torch

from rlhflab.config import load_config
from rlhflab.eval.agreement import accuracy, cohen_kappa
from rlhflab.eval.frontier import frontier_point
from rlhflab.experience.prompts import PromptSet
from rlhflab.experience.scoring import RewardComponents, VerifierOnly
from rlhflab.models.loading import load_model, load_tokenizer
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.engines import make_engine

torch.set_num_threads(1)


class Recorded:
    """A scorer that keeps every total it returns (per sample, in order)."""

    def __init__(self, inner):
        self.inner, self.values = inner, []

    def score(self, *args, **kwargs):
        total, parts = self.inner.score(*args, **kwargs)
        self.values += [float(v) for v in total.tolist()]
        return total, parts


def measure(run: Path) -> dict:
    cfg = load_config(run / "config.yaml")
    t = cfg.task
    prompts = PromptSet(cfg, seed=cfg.seed)
    problems = prompts.splits.heldout[: cfg.eval.n][: cfg.eval.frontier_n]
    verifier = Verifier(answer_format=t.answer_format, reward=t.reward, extractor=t.extractor)
    judge = RewardComponents([cfg.eval.frontier_gold.model_copy(update={"weight": 1.0})], verifier,
                             max_new_tokens=cfg.rollout.max_new_tokens)  # fmt: skip
    start = cfg.model.name_or_path
    tok = load_tokenizer(start)
    initial = load_model(start).eval()
    logged = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "frontier/gold" in r:
            logged[r["step"]] = r
    out = {"run": run.name}
    for name, path, step in (("step0", start, 0), ("end", run / "model", max(logged))):
        policy = load_model(str(path)).eval()
        j, v = Recorded(judge), Recorded(VerifierOnly(verifier))
        point = frontier_point(
            policy, lambda: contextlib.nullcontext(initial), tok, problems, j, v, engine=make_engine(None, policy, tok), system=prompts.system,
            instruction=prompts.instruction, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, seed=cfg.seed,
        )  # fmt: skip
        said, truth = [x >= 6 for x in j.values], [x >= 1 for x in v.values]
        out[name] = {"step": step, "judge": point["proxy"], "judge_stderr": point["proxy_stderr"],
                     "verifier": point["gold"], "verifier_stderr": point["gold_stderr"],
                     "sqrt_kl": point["sqrt_kl"], "logged_gold": logged[step]["frontier/gold"],
                     "logged_proxy": logged[step]["frontier/proxy"],
                     "logged_sqrt_kl": logged[step]["frontier/sqrt_kl"],
                     "judge_says_high": sum(x >= 6 for x in j.values),
                     "verifier_correct": sum(x >= 1 for x in v.values),
                     "accuracy": accuracy(said, truth)["accuracy"],
                     "kappa": cohen_kappa(said, truth)["kappa"]}  # fmt: skip
    return out


for arg in sys.argv[1:]:
    print(json.dumps(measure(Path(arg))))
