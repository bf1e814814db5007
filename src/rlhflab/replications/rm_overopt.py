"""Reward-model over-optimisation (Gao, Schulman & Hilton 2022, "Scaling Laws for Reward Model
Overoptimization", arXiv 2210.10760), at small scale, as cells (`rlhflab.replications.cells`).

    rlhflab replicate rm-overopt [configs/replications/rm_overopt.yaml] --out DIR

Gao et al. train proxy reward models on labels of a gold RM, optimise a policy against a proxy
(best-of-n or RL) and watch the gold score as a function of d = √KL(π ‖ π_init): gold relative
to the initial policy follows R_bon(d) = d(α_bon − β_bon·d) under best-of-n and
R_RL(d) = d(α_RL − β_RL·log d) under RL (§3, the functional forms), and more proxy data gives a
higher gold peak (the RM data-size results). Here:

- **Gold**: the task's verifier, twice: binary (1 iff the answer is exact) and continuous, the
  character similarity of the extracted answer to the reference, 1 − Levenshtein / max length
  (`char_similarity`), which keeps falling where the binary gold sits at 0. The continuous gold
  is the one the criterion judges; the binary one is reported beside it.
- **Policy** (`prepare`): the `sft` stage (a small model from scratch; `experiment.policy` skips
  it), and one pool of `max(ns)` temperature-1 samples per held-out problem, shared by every proxy.
- **Proxies** (cells `proxy-<N>`): ORMs (the `rm` stage) trained on the policy's own samples of the
  first N training prompts (nested sets), labelled by the binary gold; same steps for every N.
  Each scores the shared pool; gold of best-of-n is the exact expectation over uniform n-subsets
  of the pool (`best_of_n_expectation`), KL_bon = log n − (n−1)/n nats (Gao et al. §2, after
  Stiennon et al. 2020).
- **RL** (cells `rl-seed<S>`): GRPO with a mean-only group advantage (`group_mean`: tiny proxy
  differences stay tiny) against the largest-data proxy (trained in `prepare`), no KL penalty;
  every `rl_eval_every` steps the policy samples `rl_eval_samples` completions per held-out
  problem (the same draws' seed at every checkpoint), scored by both golds and the proxy, and
  KL(π ‖ π_sft) is the exact per-token KL summed over each sampled completion (`sequence_kl`).
- **Report**: least-squares fits without intercept of the forms above, bootstrap 95% intervals
  over held-out problems (`verdict.bootstrap_interval`), the pre-registered `CRITERION`
  (best-of-n) and `RL_CRITERION` (secondary, judged beside it).
"""

from __future__ import annotations

import itertools
import json
import math
import pickle
from pathlib import Path

from pydantic import Field, field_validator

from rlhflab.replications.common import Counts, Experiment, begin, check_experiment, stage
from rlhflab.replications.verdict import Check, Criterion, format_interval

#: The pre-registered criterion (best-of-n), judged on the continuous gold relative to n = 1.
#: "Peak position" is d* = α/(2β) as a fraction of the largest measured d (capped to [−10, 10]):
#: inside the range means 0 < d*/d_max < 1. "Drop" is the measured gold at the largest n minus
#: the fitted curve's maximum over the measured range [0, d_max].
CRITERION = Criterion(
    claim="Optimising a proxy reward model by best-of-n first raises, then lowers the gold "
    "reward: gold − gold(n=1) = d(α − βd) in d = √KL with a peak inside the range (Gao et al. "
    "2022, §3, the best-of-n functional form), and a proxy trained on more data reaches a "
    "higher gold peak (Gao et al. 2022, RM data size)",
    checks=(
        Check("bon_drop_largest", "largest-data proxy: gold at the largest n minus the fitted "
              "peak gold (continuous gold, relative to n = 1)", below=0.0),
        Check("bon_peak_position_largest", "largest-data proxy: fitted peak d* = α/(2β) as a "
              "fraction of the largest measured d", above=0.0, below=1.0),
        Check("bon_drop_smallest", "smallest-data proxy: gold at the largest n minus the fitted "
              "peak gold", below=0.0),
        Check("bon_peak_position_smallest", "smallest-data proxy: fitted peak d*, fraction of "
              "the largest measured d", above=0.0, below=1.0),
        Check("bon_peak_gain", "fitted peak gold, largest-data minus smallest-data proxy (paired "
              "over problems)", above=0.0),
    ),
)  # fmt: skip

#: The RL half, pre-registered the same way and judged beside the verdict (not part of it).
RL_CRITERION = Criterion(
    claim="RL against the proxy first raises, then lowers the gold reward on held-out prompts: "
    "gold − gold(step 0) = d(α − β log d) with a peak inside the measured range (Gao et al. 2022, "
    "§3, the RL functional form)",
    checks=(
        Check("rl_drop", "RL: gold at the last checkpoint (mean over seeds) minus the fitted peak "
              "gold (continuous gold, relative to step 0)", below=0.0),
        Check("rl_peak_position", "RL: fitted peak d* = exp(α/β − 1) as a fraction of the "
              "largest measured d", above=0.0, below=1.0),
    ),
)  # fmt: skip

#: Peak positions are reported as fractions of d_max, capped to ±POSITION_CAP (no peak: the cap).
POSITION_CAP = 10.0


class Spec(Experiment):
    """`experiment:` of rm_overopt.yaml."""

    ns: Counts = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    heldout_problems: int = Field(500, ge=2)
    max_new_tokens: int = Field(10, ge=1)
    seed: int = 0  # the pool's sampling seed (and the bootstrap's)
    proxy_prompts: Counts = Field(default_factory=lambda: [64, 128, 512, 2048])
    rl_seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    rl_eval_every: int = Field(10, ge=1)
    rl_eval_problems: int = Field(200, ge=2)
    rl_eval_samples: int = Field(8, ge=1)
    n_boot: int = Field(1000, ge=100)
    policy: str | None = None  # an existing start policy: the sft stage is skipped

    @field_validator("ns")
    @classmethod
    def _has_one(cls, values: list[int]) -> list[int]:
        if 1 not in values or len(values) < 3:
            raise ValueError("must include n = 1 (the reference) and at least two larger n")
        return sorted(values)

    @field_validator("proxy_prompts")
    @classmethod
    def _two_sizes(cls, values: list[int]) -> list[int]:
        if len(values) < 2:
            raise ValueError("needs at least two proxy data sizes (the smallest and the largest)")
        return sorted(values)

    @field_validator("rl_seeds")
    @classmethod
    def _distinct_seeds(cls, values: list[int]) -> list[int]:
        if len(set(values)) != len(values):
            raise ValueError("must be distinct seeds (an empty list runs no RL)")
        return values


# ---------------------------------------------------------------------------------------------
# The maths (pure functions; tests/test_replication_rm_overopt.py checks them from definitions)
# ---------------------------------------------------------------------------------------------


def bon_kl(n: int) -> float:
    """KL(best-of-n ‖ base) = log n − (n − 1)/n nats (the analytic form Gao et al. use, §2)."""
    return math.log(n) - (n - 1) / n


def levenshtein(a: str, b: str) -> int:
    """Edit distance: the fewest single-character insertions, deletions and substitutions that
    turn `a` into `b` (Wagner–Fischer dynamic programme)."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def char_similarity(answer: str | None, reference: str) -> float:
    """The continuous gold: 1 − levenshtein(a, r) / max(len(a), len(r)) of the stripped,
    lower-cased answer and reference (lower-cased as reasoning_gym's spell_backward scores);
    1.0 exactly when they are equal, 0.0 for no answer. In [0, 1]."""
    if answer is None:
        return 0.0
    a, r = answer.strip().lower(), str(reference).strip().lower()
    longest = max(len(a), len(r))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, r) / longest


def best_of_n_expectation(scores, values, n: int) -> float:
    """E[value of the highest-scored of n samples] over every n-subset of a pool of K, drawn
    uniformly without replacement, ties in score broken uniformly at random: with the pool
    sorted by score, the j-th highest (0-based) is the pick with probability
    C(K−1−j, n−1) / C(K, n); tied samples share their positions' probabilities equally.

    Args:
        scores, values: sequences of K floats (proxy score and the value to average, e.g. gold).
        n: 1 ≤ n ≤ K.

    Raises:
        ValueError: n outside [1, K] or lengths that differ.
    """
    k = len(scores)
    if len(values) != k or not 1 <= n <= k:
        raise ValueError(f"best_of_n_expectation: need 1 <= n <= K and equal lengths "
                         f"(n={n}, K={k}, {len(values)} values)")  # fmt: skip
    order = sorted(range(k), key=lambda i: -scores[i])
    total = math.comb(k, n)
    weight = [math.comb(k - 1 - j, n - 1) / total for j in range(k)]
    out, j = 0.0, 0
    while j < k:  # a block of tied scores shares the weights of its positions
        end = j
        while end + 1 < k and scores[order[end + 1]] == scores[order[j]]:
            end += 1
        block = range(j, end + 1)
        w = sum(weight[i] for i in block) / len(block)
        out += w * sum(values[order[i]] for i in block)
        j = end + 1
    return out


def fit_no_intercept(x1: list[float], x2: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares y ≈ a·x1 + b·x2 (no intercept): the 2 × 2 normal equations solved exactly.

    Raises:
        ValueError: the design is singular (e.g. fewer than two distinct non-zero points).
    """
    s11 = math.fsum(u * u for u in x1)
    s22 = math.fsum(v * v for v in x2)
    s12 = math.fsum(u * v for u, v in zip(x1, x2, strict=True))
    t1 = math.fsum(u * w for u, w in zip(x1, y, strict=True))
    t2 = math.fsum(v * w for v, w in zip(x2, y, strict=True))
    det = s11 * s22 - s12 * s12
    if not det > 1e-12 * max(s11 * s22, 1e-300):
        raise ValueError("fit_no_intercept: singular design (need two distinct non-zero points)")
    return (t1 * s22 - t2 * s12) / det, (t2 * s11 - t1 * s12) / det


def fit_bon(d: list[float], y: list[float]) -> tuple[float, float]:
    """(α, β) of y = d(α − βd) = α·d − β·d² by least squares without intercept (Gao et al.
    §3, R_bon)."""
    return fit_no_intercept(d, [-x * x for x in d], y)


def _dlogd(x: float) -> float:
    return x * math.log(x) if x > 0 else 0.0  # d log d → 0 as d → 0


def fit_rl(d: list[float], y: list[float]) -> tuple[float, float]:
    """(α, β) of y = d(α − β log d) = α·d − β·d log d by least squares without intercept
    (Gao et al. §3, R_RL; natural log; d log d = 0 at d = 0)."""
    return fit_no_intercept(d, [-_dlogd(x) for x in d], y)


def _bon_curve(a: float, b: float, x: float) -> float:
    return x * (a - b * x)


def _rl_curve(a: float, b: float, x: float) -> float:
    return a * x - b * _dlogd(x)


def bon_peak(a: float, b: float, d_max: float) -> tuple[float, float]:
    """(d* / d_max, the fitted curve's maximum over [0, d_max]) of R(d) = d(a − b·d): d* = a/(2b)
    when b > 0 (capped to ±POSITION_CAP, as is "no peak", b ≤ 0)."""
    pos = POSITION_CAP if b <= 0 else max(-POSITION_CAP, min(POSITION_CAP, a / (2 * b) / d_max))
    inside = [0.0, d_max] + ([pos * d_max] if 0 < pos < 1 else [])
    return pos, max(_bon_curve(a, b, x) for x in inside)


def rl_peak(a: float, b: float, d_max: float) -> tuple[float, float]:
    """(d* / d_max, the fitted curve's maximum over [0, d_max]) of R(d) = d(a − b·log d): the
    stationary point d* = exp(a/b − 1) is a maximum when b > 0 (capped to POSITION_CAP, as is
    "no peak", b ≤ 0)."""
    if b <= 0:
        pos = POSITION_CAP
    else:
        z = a / b - 1 - math.log(d_max)
        pos = POSITION_CAP if z > math.log(POSITION_CAP) else math.exp(z)
    inside = [0.0, d_max] + ([pos * d_max] if 0 < pos < 1 else [])
    return pos, max(_rl_curve(a, b, x) for x in inside)


# ---------------------------------------------------------------------------------------------
# Sampling and scoring
# ---------------------------------------------------------------------------------------------


def sequence_kl(
    policy, reference, prompt_ids, completion_ids, *, max_elements: int = 1 << 24
) -> list[float]:
    """KL(π ‖ π_ref) of each sampled completion: Σ_t Σ_v π(v|o_<t) log(π(v|o_<t) / π_ref(v|o_<t))
    over its tokens (EOS included), the exact per-token KL of the full distributions in float64,
    summed along the sampled path. Its mean over completions sampled from π is an unbiased
    estimate of the sequence-level KL(π ‖ π_ref) in nats (temperature 1).

    Args:
        prompt_ids: one token list per completion; completion_ids: token lists (non-empty).
        max_elements: completions per forward are chosen so that rows × tokens × vocabulary
            stays below this (a real vocabulary's float64 logits are large).
    Returns: one float per completion.
    """
    import torch

    from rlhflab.losses.distill import reverse_kl  # KL(π ‖ π_ref) per position, full vocabulary
    from rlhflab.ops import position_ids_from_mask
    from rlhflab.rollout.sampler import pack

    out: list[float] = []
    vocab = policy.get_output_embeddings().weight.shape[0]
    longest = max((len(c) for c in completion_ids), default=1) + 1
    batch = max(1, min(256, max_elements // (longest * vocab)))
    with torch.no_grad():
        for s in range(0, len(completion_ids), batch):
            ro = pack(prompt_ids[s : s + batch], completion_ids[s : s + batch], 0)
            attn = ro.attention_mask
            kw = dict(input_ids=ro.input_ids, attention_mask=attn, use_cache=False,
                      position_ids=position_ids_from_mask(attn),
                      logits_to_keep=ro.completion_ids.size(1) + 1)  # fmt: skip
            zp = policy(**kw).logits[:, :-1].double()  # (B, T, V)
            zq = reference(**kw).logits[:, :-1].double()
            kl = reverse_kl(zp.flatten(0, 1), zq.flatten(0, 1)).view(zp.shape[:2])  # (B, T)
            kl = kl * ro.mask.double()
            out += kl.sum(1).tolist()
    return out


def _golds(ss, verifier) -> tuple[list[list[float]], list[list[float]]]:
    """(continuous, binary) gold of every sample of a ScoredSamples pool, per problem."""
    cont = [[char_similarity(verifier.extract(t), p.answer) for t in texts]
            for texts, p in zip(ss.texts, ss.problems, strict=True)]  # fmt: skip
    binary = [[1.0 if s >= 1.0 else 0.0 for s in row] for row in ss.scores]
    return cont, binary


def _r(x: float) -> float:
    return round(float(x), 6)


# ---------------------------------------------------------------------------------------------
# The cell protocol
# ---------------------------------------------------------------------------------------------


def _spec(spec: dict, source: str) -> Spec:
    return check_experiment(Spec, spec.get("experiment"), source)


def cells(spec: dict, source: str) -> list[str]:
    """One cell per proxy data size, then one per RL seed (every stage validated first, so a bad
    config fails before anything is written)."""
    exp = _spec(spec, source)
    placeholder = {"model": {"name_or_path": "<start policy>"}, "run": {"root": "runs"}}
    stage(spec, "rm", source, **placeholder)
    stage(spec, "rl", source, **placeholder)
    if exp.policy is None:
        stage(spec, "sft", source)
    return [f"proxy-{n}" for n in exp.proxy_prompts] + [f"rl-seed{s}" for s in exp.rl_seeds]


def _prepared(out: Path) -> dict:
    return json.loads((out / "runs" / "prepared.json").read_text())


def _task_splits(spec: dict, source: str, exp: Spec):
    from rlhflab.data.tasks import make_splits

    task = stage(spec, "rm", source, model={"name_or_path": "x"}).task
    return task, make_splits(task.name, config=task.config, n_train=task.n_train,
                             n_heldout=exp.heldout_problems, seed=task.seed)  # fmt: skip


def _verifier(task):
    from rlhflab.rewards.verifier import Verifier

    return Verifier(answer_format=task.answer_format, extractor=task.extractor)


def _train_proxy(spec: dict, source: str, policy: str, n_prompts: int, runs: str) -> dict:
    from rlhflab.trainers import run_config

    cfg = stage(spec, "rm", source, model={"name_or_path": policy}, data={"n_prompts": n_prompts},
                run={"root": runs, "name": f"proxy-{n_prompts}"})  # fmt: skip
    return run_config(cfg)


def prepare(spec: dict, out: Path, source: str) -> None:
    """What every cell shares: the SFT policy, the sample pool on the held-out problems, and the
    largest-data proxy (the RL cells' reward), recorded in `runs/prepared.json`."""
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rollout.scored import sample_and_score
    from rlhflab.serialize import write_json_atomic
    from rlhflab.trainers import run_config

    exp, _, runs = begin(Spec, spec, out, source)
    policy, sft = exp.policy, None
    if policy is None:
        sft = run_config(stage(spec, "sft", source, run={"root": runs}))
        policy = sft["model_dir"]
    task, splits = _task_splits(spec, source, exp)
    if len(splits.heldout) < exp.heldout_problems or len(splits.heldout) < exp.rl_eval_problems:
        from rlhflab.errors import ConfigError

        raise ConfigError(f"{source}: experiment.heldout_problems: the task has only "
                          f"{len(splits.heldout)} distinct held-out problems")  # fmt: skip
    pool = sample_and_score(load_model(policy).eval(), load_tokenizer(policy), splits.heldout,
                            _verifier(task), k=max(exp.ns), max_new_tokens=exp.max_new_tokens,
                            seed=exp.seed + 12345)  # fmt: skip
    pool_path = Path(runs) / "pool.pkl"
    pool_path.write_bytes(pickle.dumps(pool))
    rm = _train_proxy(spec, source, policy, max(exp.proxy_prompts), runs)
    write_json_atomic(Path(runs) / "prepared.json", {
        "policy": policy, "pool": str(pool_path), "rl_proxy": rm["model_dir"],
        "rl_proxy_eval": rm.get("eval"), "rl_proxy_data": rm.get("data"),
        "sft_wall_s": sft["wall_s"] if sft else None,
    })  # fmt: skip


def run_cell(spec: dict, cell: str, out: Path, source: str) -> dict:
    """One proxy (train it, score the pool, best-of-n per problem) or one RL seed."""
    exp, _, runs = begin(Spec, spec, out, source)
    prep = _prepared(out)
    if cell.startswith("proxy-"):
        return _proxy_cell(spec, source, exp, prep, int(cell.removeprefix("proxy-")), runs)
    return _rl_cell(spec, source, exp, prep, int(cell.removeprefix("rl-seed")), runs)


def _proxy_cell(spec, source, exp: Spec, prep: dict, n_prompts: int, runs: str) -> dict:
    from rlhflab.eval.best_of_n import score_pool
    from rlhflab.rewards.reward_model import RewardModelScorer

    if n_prompts == max(exp.proxy_prompts):
        model_dir, rm_eval, rm_data = prep["rl_proxy"], prep["rl_proxy_eval"], prep["rl_proxy_data"]
    else:
        rm = _train_proxy(spec, source, prep["policy"], n_prompts, runs)
        model_dir, rm_eval, rm_data = rm["model_dir"], rm.get("eval"), rm.get("data")
    pool = pickle.loads(Path(prep["pool"]).read_bytes())
    task, _ = _task_splits(spec, source, exp)
    cont, binary = _golds(pool, _verifier(task))
    scores = score_pool(RewardModelScorer.from_pretrained(model_dir, kind="orm"), pool)
    per = {"gold": [], "gold_binary": [], "proxy": []}
    for sc, gc, gb in zip(scores, cont, binary, strict=True):
        for key, vals in (("gold", gc), ("gold_binary", gb), ("proxy", sc)):
            per[key].append([_r(best_of_n_expectation(sc, vals, n)) for n in exp.ns])
    return {"kind": "proxy", "n_prompts": n_prompts, "model_dir": model_dir, "rm_eval": rm_eval,
            "rm_data": rm_data, "ns": exp.ns, "per_problem": per}  # fmt: skip


def _rl_cell(spec, source, exp: Spec, prep: dict, seed: int, runs: str) -> dict:
    from rlhflab.eval.best_of_n import score_pool
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.reward_model import RewardModelScorer
    from rlhflab.rollout.scored import sample_and_score
    from rlhflab.trainers.loop import Run
    from rlhflab.trainers.policy_gradient import PolicyGradient

    policy, proxy_dir = prep["policy"], prep["rl_proxy"]
    components = [
        {"name": "reward_model", "weight": 1.0,
         "args": {"path": proxy_dir, "kind": "orm", "normalize": "none"}},
        {"name": "correctness", "weight": 0.0},  # logged beside the proxy, never trained on
    ]  # fmt: skip
    cfg = stage(spec, "rl", source, seed=seed, model={"name_or_path": policy},
                reward={"components": components}, run={"root": runs, "name": f"rl-seed{seed}"})  # fmt: skip
    task, splits = _task_splits(spec, source, exp)
    problems = splits.heldout[: exp.rl_eval_problems]
    verifier = _verifier(task)
    reference = load_model(policy).eval()
    tokenizer = load_tokenizer(policy)
    proxy = RewardModelScorer.from_pretrained(proxy_dir, kind="orm")
    session = Run(cfg, PolicyGradient)
    m = exp.rl_eval_samples

    def evaluate(step: int) -> dict:
        model = session.trainer.model
        was = model.training
        ss = sample_and_score(
            model,
            tokenizer,
            problems,
            verifier,
            k=m,
            max_new_tokens=cfg.rollout.max_new_tokens,
            seed=exp.seed + 777,
        )  # the same draws' seed at every checkpoint
        model.eval()
        flat_p = [ss.prompt_ids[i] for i, row in enumerate(ss.completion_ids) for _ in row]
        flat_c = [c for row in ss.completion_ids for c in row]
        kl = sequence_kl(model, reference, flat_p, flat_c)
        model.train(was)
        px = score_pool(proxy, ss)
        cont, binary = _golds(ss, verifier)
        mean = lambda rows: [_r(sum(r) / len(r)) for r in rows]  # noqa: E731
        return {"step": step, "kl": mean([kl[i * m : (i + 1) * m] for i in range(len(problems))]),
                "gold": mean(cont), "gold_binary": mean(binary), "proxy": mean(px)}  # fmt: skip

    checkpoints, train = [evaluate(0)], []
    with session:
        while (metrics := session.step()) is not None:
            step = session.steps_done
            train.append({"step": step,
                          "proxy": metrics.get("rollout/reward/reward_model_mean"),
                          "gold_binary": metrics.get("rollout/reward/correctness_mean")})  # fmt: skip
            if step % exp.rl_eval_every == 0 or step == cfg.train.steps:
                checkpoints.append(evaluate(step))
    results = session.finish()
    return {"kind": "rl", "seed": seed, "run_dir": results["run_dir"],
            "checkpoints": checkpoints, "train_rollouts": train}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The report: fits, bootstrap intervals, verdict, plot, markdown
# ---------------------------------------------------------------------------------------------


class _Boot:
    """Every estimate of one problem resample computed once and kept: the bootstrap calls one
    statistic per estimate, each over the same resamples (same seed)."""

    def __init__(self, fn):
        self.fn, self.cache = fn, {}

    def __call__(self, key: str):
        def stat(idx: list[int]) -> float:
            k = tuple(idx)
            if k not in self.cache:
                self.cache[k] = self.fn(idx)
            return self.cache[k][key]

        return stat


def _means(rows: list[list[float]], idx: list[int]) -> list[float]:
    """Column means of rows[i] over the (re)sampled problem indices."""
    cols = len(rows[0])
    return [math.fsum(rows[i][c] for i in idx) / len(idx) for c in range(cols)]


def bon_estimates(proxies: list[dict], ns: list[int], idx: list[int]) -> dict[str, float]:
    """Every best-of-n estimate on the problems `idx` (a resample): per proxy (sorted by data
    size) α, β, peak position, fitted peak gold, drop; and the named checks of `CRITERION`."""
    d = [math.sqrt(bon_kl(n)) for n in ns]
    d_max = d[-1]
    est: dict[str, float] = {}
    for p in proxies:
        g = _means(p["per_problem"]["gold"], idx)
        y = [v - g[0] for v in g]
        a, b = fit_bon(d, y)
        pos, peak = bon_peak(a, b, d_max)
        tag = p["n_prompts"]
        est.update({f"alpha_{tag}": a, f"beta_{tag}": b, f"peak_position_{tag}": pos,
                    f"peak_d_{tag}": pos * d_max, f"peak_gold_{tag}": peak,
                    f"drop_{tag}": y[-1] - peak})  # fmt: skip
    lo, hi = proxies[0]["n_prompts"], proxies[-1]["n_prompts"]
    est.update({"bon_drop_largest": est[f"drop_{hi}"], "bon_drop_smallest": est[f"drop_{lo}"],
                "bon_peak_position_largest": est[f"peak_position_{hi}"],
                "bon_peak_position_smallest": est[f"peak_position_{lo}"],
                "bon_peak_gain": est[f"peak_gold_{hi}"] - est[f"peak_gold_{lo}"],
                "bon_peak_d_shift": est[f"peak_d_{hi}"] - est[f"peak_d_{lo}"]})  # fmt: skip
    for p, q in itertools.pairwise(proxies):  # each step of the data sweep (reported, not judged)
        u, v = p["n_prompts"], q["n_prompts"]
        est[f"peak_gain_{u}_{v}"] = est[f"peak_gold_{v}"] - est[f"peak_gold_{u}"]
    return est


def rl_estimates(seeds: list[dict], idx: list[int]) -> dict[str, float]:
    """The RL estimates on the problems `idx`: one fit of d(α − β log d) to every seed's
    checkpoints (gold relative to that seed's step 0, d = √ of the mean sequence KL), the peak
    position and gold, and the drop (last checkpoint, mean over seeds, minus the fitted peak)."""
    ds, ys, last = [], [], []
    for s in seeds:
        cps = s["checkpoints"]
        g0 = math.fsum(cps[0]["gold"][i] for i in idx) / len(idx)
        for c in cps:
            kl = math.fsum(c["kl"][i] for i in idx) / len(idx)
            ds.append(math.sqrt(max(kl, 0.0)))
            ys.append(math.fsum(c["gold"][i] for i in idx) / len(idx) - g0)
        last.append(ys[-1])
    a, b = fit_rl(ds, ys)
    pos, peak = rl_peak(a, b, max(ds))
    return {"rl_alpha": a, "rl_beta": b, "rl_peak_position": pos, "rl_peak_d": pos * max(ds),
            "rl_peak_gold": peak, "rl_drop": sum(last) / len(last) - peak}  # fmt: skip


def report(spec: dict, cells_results: dict, out: Path, source: str) -> dict:
    """Fits, intervals, the verdict (best-of-n) with the RL half as its secondary criterion, the
    plot and report.md (module doc)."""
    from rlhflab.replications.verdict import bootstrap_interval, judge, verdict_table

    exp = _spec(spec, source)
    proxies = sorted((r for r in cells_results.values() if r["kind"] == "proxy"),
                     key=lambda r: r["n_prompts"])  # fmt: skip
    seeds = [r for r in cells_results.values() if r["kind"] == "rl"]
    n_problems = len(proxies[0]["per_problem"]["gold"])
    boot = _Boot(lambda idx: bon_estimates(proxies, exp.ns, idx))
    keys = list(bon_estimates(proxies, exp.ns, list(range(n_problems))))
    estimates = {k: bootstrap_interval(boot(k), n_problems, n_boot=exp.n_boot, seed=exp.seed)
                 for k in keys}  # fmt: skip
    rl_curves = []
    if seeds:
        n_rl = len(seeds[0]["checkpoints"][0]["gold"])
        rboot = _Boot(lambda idx: rl_estimates(seeds, idx))
        for k in rl_estimates(seeds, list(range(n_rl))):
            estimates[k] = bootstrap_interval(rboot(k), n_rl, n_boot=exp.n_boot, seed=exp.seed)
        rl_curves = [_rl_curve_of(s) for s in seeds]
    verdict = judge("rm-overopt", CRITERION, estimates, [s["seed"] for s in seeds] or [exp.seed],
                    secondary=RL_CRITERION if seeds else None)  # fmt: skip
    bon_curves = [_bon_curve_of(p, exp.ns) for p in proxies]
    plot_path = out / "rm_overopt.png"
    plot(bon_curves, rl_curves, estimates, plot_path)
    results = {
        "policy": _prepared(out)["policy"] if (out / "runs" / "prepared.json").is_file() else None,
        "ns": exp.ns,
        "d": [math.sqrt(bon_kl(n)) for n in exp.ns],
        "heldout_problems": n_problems,
        "best_of_n": bon_curves,
        "rl": rl_curves,
        "estimates": {k: list(v) for k, v in estimates.items()},
        "verdict": verdict,
        "plot": plot_path.name,
    }
    results["report"] = markdown(results, exp, verdict_table(verdict))
    return results


def _bon_curve_of(p: dict, ns: list[int]) -> dict:
    from rlhflab.eval.accuracy import mean_and_stderr

    curve = {"n_prompts": p["n_prompts"], "rm_eval": p["rm_eval"], "points": []}
    for j, n in enumerate(ns):
        row = {"n": n, "kl": bon_kl(n), "sqrt_kl": math.sqrt(bon_kl(n))}
        for key in ("gold", "gold_binary", "proxy"):
            vals = [r[j] for r in p["per_problem"][key]]
            row[key], row[f"{key}_stderr"] = mean_and_stderr(vals)
        # the s.e. of gold − gold(n=1), paired over problems (what the plot shows)
        _, row["gold_rel_stderr"] = mean_and_stderr([r[j] - r[0] for r in p["per_problem"]["gold"]])
        curve["points"].append(row)
    return curve


def _rl_curve_of(s: dict) -> dict:
    pts = []
    for c in s["checkpoints"]:
        kl = sum(c["kl"]) / len(c["kl"])
        pts.append({"step": c["step"], "kl": kl, "sqrt_kl": math.sqrt(max(kl, 0.0)),
                    **{k: sum(c[k]) / len(c[k]) for k in ("gold", "gold_binary", "proxy")}})  # fmt: skip
    return {"seed": s["seed"], "points": pts}


def plot(bon_curves: list[dict], rl_curves: list[dict], estimates: dict, path: Path) -> None:
    """Left: best-of-n gold (continuous, relative to n = 1) against √KL per proxy, ± the paired
    s.e. over problems, with its fit d(α − βd). Right: RL gold and proxy (relative to step 0) against √KL per seed, with
    the pooled fit d(α − β log d)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    ax = axes[0]
    for k, c in enumerate(bon_curves):
        color = plt.cm.viridis(k / max(1, len(bon_curves) - 1))
        pts, tag = c["points"], c["n_prompts"]
        x = [p["sqrt_kl"] for p in pts]
        ax.errorbar(x, [p["gold"] - pts[0]["gold"] for p in pts],
                    yerr=[p["gold_rel_stderr"] if p["n"] > 1 else 0.0 for p in pts], fmt="o", ms=4, capsize=2,
                    color=color, label=f"proxy on {tag} prompts")  # fmt: skip
        a, b = estimates[f"alpha_{tag}"][0], estimates[f"beta_{tag}"][0]
        xs = [x[-1] * i / 100 for i in range(101)]
        ax.plot(xs, [_bon_curve(a, b, v) for v in xs], "-", color=color, lw=1)
    ax.axhline(0, color="k", lw=0.5)
    ax.set_title("best-of-n against each proxy (held-out; lines: d(α − βd))")
    ax.set_ylabel("gold − gold(n=1) (character similarity)")
    ax = axes[1]
    for k, c in enumerate(rl_curves):
        pts = c["points"]
        x = [p["sqrt_kl"] for p in pts]
        col = plt.cm.tab10(k)
        ax.plot(x, [p["gold"] - pts[0]["gold"] for p in pts], "o-", ms=3, color=col,
                label=f"gold, seed {c['seed']}")  # fmt: skip
        ax.plot(x, [p["proxy"] - pts[0]["proxy"] for p in pts], "x--", ms=3, color=col,
                alpha=0.6, label=f"proxy, seed {c['seed']}")  # fmt: skip
    if rl_curves:
        a, b = estimates["rl_alpha"][0], estimates["rl_beta"][0]
        top = max(p["sqrt_kl"] for c in rl_curves for p in c["points"])
        xs = [top * i / 100 for i in range(101)]
        ax.plot(xs, [_rl_curve(a, b, v) for v in xs], "k-", lw=1.2, label="gold fit d(α − β log d)")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_title("GRPO against the largest-data proxy (held-out checkpoints)")
    ax.set_ylabel("score − score(step 0)")
    for ax in axes:
        ax.set_xlabel("d = √KL (nats^½)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _ci(v) -> str:
    return format_interval(v, fmt=".3g", none="")


def markdown(results: dict, exp: Spec, table: str) -> str:
    """report.md: question, setting, plot, fits with intervals, the verdict, what did not hold."""
    est = results["estimates"]
    bon, rl, verdict = results["best_of_n"], results["rl"], results["verdict"]
    lines = [
        "# Reward-model over-optimisation (Gao, Schulman & Hilton 2022), at CPU scale",
        "",
        "**Question.** Optimising a policy against a proxy reward model raises the proxy but, "
        "past a point, lowers the gold reward; under best-of-n the gold relative to the start "
        "follows d(α − βd) and under RL d(α − β log d), d = √KL(π ‖ π_init), and more proxy data "
        "gives a higher peak (Gao et al. 2022, arXiv 2210.10760).",
        "",
        "**Setting.** Task: reasoning_gym spell_backward; gold = the verifier, continuous "
        "(character similarity 1 − Levenshtein/max length of the answer to the reversed word, "
        "judged) and binary (exact, reported). Policy: a small model SFT'd from scratch. "
        f"Best-of-n: one pool of {max(exp.ns)} samples on each of {results['heldout_problems']} "
        "held-out problems, scored by every proxy; the gold of the pick is the exact expectation "
        "over uniform n-subsets; KL_bon = log n − (n−1)/n. Proxies: ORMs trained on the policy's "
        f"samples of the first {', '.join(str(c['n_prompts']) for c in bon)} training prompts "
        "(binary gold labels, same steps each). RL: GRPO with a mean-only group advantage, no KL "
        f"penalty, against the largest-data proxy, seeds {[c['seed'] for c in rl]}; every "
        f"{exp.rl_eval_every} steps gold, proxy and the exact KL to the SFT policy on "
        f"{exp.rl_eval_samples} samples of each of the first {exp.rl_eval_problems} held-out "
        "problems. Intervals: 95% percentile bootstrap over held-out problems "
        f"({exp.n_boot} resamples; all proxies and seeds resampled together).",
        "",
        f"![gold against √KL]({results['plot']})",
        "",
        "## Best-of-n",
        "",
        "| proxy prompts | RM AUC (held-out) | α | β | peak d* | peak gold | gold(n_max) − peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in bon:
        t = c["n_prompts"]
        auc = (c["rm_eval"] or {}).get("auc")
        auc = "–" if auc is None else f"{auc:.3f}"
        lines.append(f"| {t} | {auc} | {_ci(est[f'alpha_{t}'])} | {_ci(est[f'beta_{t}'])} | "
                     f"{_ci(est[f'peak_d_{t}'])} | {_ci(est[f'peak_gold_{t}'])} | "
                     f"{_ci(est[f'drop_{t}'])} |")  # fmt: skip
    lines += ["", "Gold (continuous / binary) and the proxy's score of the pick, ± s.e. over "
              "problems:", "", "| n | √KL | " + " | ".join(
                  f"{c['n_prompts']}: gold / binary / proxy" for c in bon) + " |",
              "|---|---|" + "---|" * len(bon)]  # fmt: skip
    for j, n in enumerate(results["ns"]):
        cells_ = [f"{c['points'][j]['gold']:.3f} / {c['points'][j]['gold_binary']:.3f} / "
                  f"{c['points'][j]['proxy']:.3f}" for c in bon]  # fmt: skip
        lines.append(f"| {n} | {results['d'][j]:.2f} | " + " | ".join(cells_) + " |")
    steps = [(p["n_prompts"], q["n_prompts"]) for p, q in itertools.pairwise(bon)]
    lines += ["", f"Peak moves with proxy data (largest − smallest, d*): "
              f"{_ci(est['bon_peak_d_shift'])} nats^½; peak gold, each step of the sweep: "
              + "; ".join(f"{v} − {u} prompts {_ci(est[f'peak_gain_{u}_{v}'])}" for u, v in steps)
              + " (reported, not judged).", ""]  # fmt: skip
    if rl:
        lines += ["## RL (GRPO against the largest-data proxy)", "",
                  f"Fit d(α − β log d) over every seed's checkpoints: α {_ci(est['rl_alpha'])}, "
                  f"β {_ci(est['rl_beta'])}, peak d* {_ci(est['rl_peak_d'])}, peak gold "
                  f"{_ci(est['rl_peak_gold'])}.", "",
                  "| seed | step | √KL | gold | gold (binary) | proxy |", "|---|---|---|---|---|---|"]  # fmt: skip
        for c in rl:
            for p in c["points"]:
                lines.append(f"| {c['seed']} | {p['step']} | {p['sqrt_kl']:.3f} | "
                             f"{p['gold']:.4f} | {p['gold_binary']:.4f} | {p['proxy']:.4f} |")  # fmt: skip
        lines.append("")
    failed = [c["what"] for c in verdict["checks"] if not c["holds"]]
    sec = verdict.get("secondary")
    failed += [f"(secondary) {c['what']}" for c in (sec["checks"] if sec else []) if not c["holds"]]
    lines += ["## Verdict (pre-registered: `rlhflab.replications.rm_overopt.CRITERION`, "
              "`RL_CRITERION`)", "", table, "", "## What did not reproduce", ""]  # fmt: skip
    lines += [f"- {f}: does not hold at this scale (estimate and interval above)." for f in failed]
    if not failed:
        lines.append("- Every pre-registered check holds (primary and secondary).")
    flat = [(u, v) for u, v in steps if not est[f"peak_gain_{u}_{v}"][1] > 0]
    if flat:
        lines.append(
            "- More proxy data → higher peak holds end to end (judged) but not at every step of "
            "the sweep: the peak gold does not rise (95% CI not above 0) from "
            + "; ".join(f"{u} to {v} prompts ({_ci(est[f'peak_gain_{u}_{v}'])})" for u, v in flat)
            + "."
        )
    if rl and est["rl_alpha"][0] < 0:
        first = min(c["points"][1]["sqrt_kl"] for c in rl if len(c["points"]) > 1)
        lines.append(
            f"- RL: the fitted α_RL is negative ({_ci(est['rl_alpha'])}), so the curve's rise "
            "comes from the −β·d·log d term alone (positive only for d < 1); the fitted peak "
            f"(d* {_ci(est['rl_peak_d'])}) lies at or before the first checkpoint after the start "
            f"(smallest d {first:.3f}), so the RL rise rests on that one checkpoint per seed; "
            "finer early checkpoints would resolve its shape."
        )
    if sec and not sec["holds"]:
        lo, hi = est["rl_peak_gold"][1:]
        lines.append(
            f"- Power of the RL design ({len(rl)} seeds, {exp.rl_eval_problems} held-out problems "
            f"× {exp.rl_eval_samples} samples per checkpoint): the fitted RL peak gold is known "
            f"to within [{lo:.3g}, {hi:.3g}] (95%); a rise of gold above its start smaller than "
            "that interval's width cannot be told apart from none."
        )
    lines += [
        "- Not attempted: proxy size (parameters) sweeps, policy size, KL-penalty sweeps; "
        "a verifier-based gold instead of a 6 B gold RM; a ~0.6 M-parameter policy.",
        "",
    ]
    return "\n".join(lines)
