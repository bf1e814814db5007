"""Data parallelism for real: torchrun with 2 processes on the gloo backend (CPU), against one
process on the same global batch.

What is checked, for SFT, the reward model, DPO and GRPO (micro-batches, uneven completion lengths,
every aggregation mode), under DDP and FSDP2:
- every optimizer step's gradients (summed over ranks, before clipping) equal one process's on the
  union batch (`RLHFLAB_GRAD_DUMP`), and so do the per-step metrics and the final weights;
- only rank 0 writes: one run directory, each step once in metrics.jsonl, the same files as one
  process;
- a rank killed with SIGKILL takes the job down (non-zero exit, no hang), and the resumed run ends
  bitwise equal to the uninterrupted 2-rank run;
- bad input is one error line, printed once, before any collective.

Each torchrun start costs ~8 s here, so these tests are marked slow (CI runs them).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from factories import uneven_step_rows, write_separators
from safetensors.torch import load_file

import rlhflab
from rlhflab.checkpoint.sharded import read_tensors
from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

pytestmark = pytest.mark.slow

TASK = {
    "name": "chain_sum",
    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "n_train": 300,
    "n_heldout": 16,
    "seed": 0,
    "answer_format": "plain",
    "reward": "binary",
}
COMMON = {
    "task": TASK,
    "precision": {"threads": 1},
    "tracking": {"console": False, "samples_every": 1},
    "checkpoint": {"every": 1, "keep_last": None},
    "parallel": {"timeout_s": 120},
}
# Metrics that are timings or depend on the process layout by definition.
NOT_COMPARED = ("perf/", "time_s", "world_size")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """A tiny from-scratch model after a short SFT: some answers right, so GRPO groups vary."""
    root = tmp_path_factory.mktemp("base")
    raw = {
        "trainer": "sft",
        "model": {
            "build": {
                "size": "tiny",
                "vocab_size": 300,
                "max_position_embeddings": 64,
                "tokenizer_texts": 300,
            }
        },
        **COMMON,
        "train": {"steps": 40, "batch_size": 16, "micro_batch_size": 16, "max_len": 48},
        "optim": {"lr": 3e-3},
        "eval": {"n": 0},
        "run": {"name": "base", "root": str(root)},
    }
    return run_config(config_from_dict(raw))["model_dir"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLHFLAB_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def _rlhflab(
    nproc: int, args: list[str], timeout: float = 300, **env
) -> subprocess.CompletedProcess:
    """`rlhflab <args>` in a fresh process (nproc 1) or under torchrun with nproc processes."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "rlhflab", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={nproc}", "-m", "rlhflab", *args]
    return subprocess.run(
        cmd, env=_env(**env), capture_output=True, text=True, timeout=timeout, check=False
    )


def _write_cfg(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def _run_dir(root: Path) -> Path:
    runs = [p for p in root.iterdir() if p.is_dir()]
    assert len(runs) == 1, f"expected one run directory under {root}, found {runs}"
    return runs[0]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _train(tmp: Path, name: str, raw: dict, nproc: int, strategy: str = "auto") -> Path:
    """Run a config with gradient dumps; returns the run directory (dumps in <run>/../grads)."""
    root = tmp / f"{name}-{nproc}-{strategy}"
    root.mkdir()
    cfg = _write_cfg(tmp / f"{name}-{nproc}-{strategy}.yaml", raw)
    res = _rlhflab(
        nproc,
        ["train", str(cfg), f"run.root={root / 'runs'}", f"parallel.strategy={strategy}"],
        RLHFLAB_GRAD_DUMP=str(root / "grads"),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return _run_dir(root / "runs")


def _worker_results(worker: str, tmp: Path, *args: str) -> list[dict]:
    """Run the script `worker` on 2 ranks under torchrun as `worker.py *args tmp`; each rank
    writes `tmp/rank<r>.json`: those, in rank order."""
    script = tmp / "worker.py"
    script.write_text(worker)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    res = subprocess.run([*cmd, str(script), *args, str(tmp)], env=_env(), capture_output=True,
                         text=True, timeout=300, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


# The exactness runs train in float64 (`model.dtype: float64`; AdamW's state follows the
# parameters). In float32, one process and 2 ranks x micro-batches add the same terms in other
# orders, and so do the CPU kernels torch picks (AVX-512, AVX2, scalar: ATEN_CPU_CAPABILITY):
# results legitimately differ by ~1e-7 relative, and which way depends on the machine. In float64
# that noise is ~1e-16 relative (a sum of n terms is within n·eps·Σ|terms|), so the tolerances
# below, derived from float64's eps, hold on any CPU while a real discrepancy (a term missing or
# counted twice, a wrong divisor, a float32 leak) is orders of magnitude above them.
EPS64 = torch.finfo(torch.float64).eps  # 2.2e-16
RTOL = 1e4 * EPS64  # ~2e-12: float64 rounding of sums of up to ~1e4 terms, with margin
# Metrics that are step functions of a quantity that is an exact tie in exact arithmetic at the
# first step: there π_θ = π_ref (full fine-tuning before its first update; LoRA's B = 0), so every
# DPO margin is 0 and rounding decides its sign, whatever the precision. The continuous quantity
# (`dpo/margin`) is compared at every step; the accuracy from step 2 on, away from the tie.
TIED_AT_STEP_1 = ("dpo/accuracy",)


def _scale(t: torch.Tensor) -> float:
    """Magnitude of a tensor, for absolute tolerances: its largest |element| (1 if all are 0)."""
    m = t.abs().max().item() if t.numel() else 0.0
    return m if m > 0 else 1.0


def _assert_same_run(one: Path, two: Path) -> None:
    """Gradients of every optimizer step, per-step metrics and weights agree to float64 rounding
    (both runs in float64: `model.dtype`)."""
    g1 = sorted((one.parent.parent / "grads").glob("grads-*.safetensors"))
    g2 = sorted((two.parent.parent / "grads").glob("grads-*.safetensors"))
    assert g1 and [p.name for p in g1] == [p.name for p in g2]
    g_max = []  # per optimizer step: the largest |gradient element|
    for a, b in zip(g1, g2, strict=True):
        ga, gb = load_file(a), load_file(b)
        assert ga.keys() == gb.keys(), a.name
        assert any(t.abs().max() > 0 for t in ga.values()), f"{a.name}: all gradients are zero"
        g_max.append(max(_scale(t) for t in ga.values()))
        for k in ga:
            assert ga[k].dtype == gb[k].dtype == torch.float64, (a.name, k, ga[k].dtype)
            # each element to RTOL of the tensor's largest gradient (a gradient element is a sum
            # of terms no larger than that, give or take the tensor's own cancellations)
            atol = RTOL * _scale(ga[k])
            torch.testing.assert_close(gb[k], ga[k], atol=atol, rtol=RTOL, msg=f"{a.name} {k}")
    m1, m2 = _metrics(one), _metrics(two)
    assert [r["step"] for r in m1] == [r["step"] for r in m2]
    for r1, r2 in zip(m1, m2, strict=True):
        keys = {k for k in r1 if not k.startswith(NOT_COMPARED)}
        assert keys == {k for k in r2 if not k.startswith(NOT_COMPARED)}, r1["step"]
        if r1["step"] == 1:
            keys -= set(TIED_AT_STEP_1)
        for k in keys:
            if isinstance(r1[k], float) and math.isnan(r1[k]):
                assert math.isnan(r2[k]), k
            elif isinstance(r1[k], int | float):
                # metrics are means of O(1) quantities: RTOL relative, RTOL absolute near 0
                assert r2[k] == pytest.approx(r1[k], rel=RTOL, abs=RTOL), (r1["step"], k)
            else:
                assert r2[k] == r1[k], (r1["step"], k)
    # Weights after the first optimizer step (its checkpoint) and after the last. AdamW moves a
    # weight by lr·m/(sqrt(v) + eps_adam): a gradient difference δ (<= RTOL·g_max, checked
    # above) moves it by at most lr·δ/eps_adam per step, the worst case being g ≈ 0.
    optim = yaml.safe_load((one / "config.yaml").read_text())["optim"]
    per_step = [optim["lr"] / optim["eps"] * RTOL * g for g in g_max]
    for rel, atol in (
        ("checkpoints/step-00000001/model.safetensors", per_step[0]),
        ("model/model.safetensors", sum(per_step)),
    ):
        # a checkpoint's weights whatever its layout (FSDP2's are per-rank shards)
        w1, w2 = (read_tensors((d / rel).parent, "model") for d in (one, two))
        assert w1.keys() == w2.keys()
        for k in w1:
            assert w1[k].dtype == w2[k].dtype == torch.float64, (rel, k, w1[k].dtype)
            torch.testing.assert_close(w2[k], w1[k], atol=atol, rtol=RTOL, msg=f"{rel} {k}")


def _sft(base, root_name="sft") -> dict:
    return {
        "trainer": "sft",
        "model": {"name_or_path": base, "dtype": "float64"},
        **COMMON,
        "train": {"steps": 3, "batch_size": 8, "micro_batch_size": 2, "max_len": 48},
        "optim": {"lr": 1e-3},
        "eval": {"n": 4, "max_new_tokens": 6},
        "run": {"name": root_name},
    }


def _rm(base, pairs: Path) -> dict:
    return {
        "trainer": "reward_model",
        "kind": "preference",
        "model": {"name_or_path": base, "dtype": "float64"},
        **COMMON,
        "data": {"source": "preference", "path": str(pairs), "format": "pairs", "max_len": 64},
        "train": {"steps": 3, "batch_size": 8, "micro_batch_size": 2},
        "optim": {"lr": 1e-3},
        "eval": {"n_problems": 8},
        "run": {"name": "rm"},
    }


def _dpo(base) -> dict:
    return {
        "trainer": "direct_alignment",
        "model": {"name_or_path": base, "dtype": "float64"},
        **COMMON,
        "data": {"source": "verifiable", "heldout_pairs": 8},
        "verifiable": {
            "n_prompts": 12,
            "samples_per_prompt": 4,
            "max_new_tokens": 6,
            "chosen": "gold",
            "rounds": 1,
        },
        "loss": {"name": "dpo", "args": {"beta": 0.1}},
        "train": {"steps": 3, "batch_size": 4, "micro_batch_size": 1},
        "optim": {"lr": 1e-3},
        "eval": {"n": 4, "max_new_tokens": 6, "pref_every": 1},
        "run": {"name": "dpo"},
    }


def _grpo(base, aggregation="seq_mean_token_mean", **extra) -> dict:
    raw = {
        "trainer": "policy_gradient",
        "model": {"name_or_path": base, "dtype": "float64"},
        **COMMON,
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6},
        "reward": {
            "components": [
                {"name": "correctness", "weight": 1.0},
                {"name": "length", "weight": 0.5},
            ]
        },
        "loss": {
            "advantage": "group_zscore",
            "surrogate": "ppo_clip",
            "aggregation": aggregation,
        },
        "kl": {"coef": 0.05, "estimator": "k3", "placement": "loss"},
        "train": {"steps": 2, "micro_batch_size": 3, "update_epochs": 1, "minibatches": 2},
        "optim": {"lr": 1e-3},
        "eval": {"n": 4, "max_new_tokens": 6},
        "run": {"name": "grpo"},
    }
    raw.update(extra)
    return raw


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    rows = [
        {
            "prompt": f"What is {i} + {i % 3}?",
            "chosen": str(2 * i % 7) * (1 + i % 3),
            "rejected": "x",
        }
        for i in range(24)
    ]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def _as_sharded(files: list[str], world: int) -> list[str]:
    """The files of a run under FSDP2 given one process's: in each checkpoint, a module's or
    optimizer's `<name>.safetensors` becomes one file per rank and a JSON index."""
    out = []
    for f in files:
        path = Path(f)
        if path.parts[0] == "checkpoints" and path.suffix == ".safetensors" and path.stem != "rng":
            ranks = [f"{path.stem}-rank{r:05d}-of-{world:05d}.safetensors" for r in range(world)]
            out += [str(path.parent / n) for n in [*ranks, f"{path.stem}.shards.json"]]
        else:
            out.append(f)
    return sorted(out)


# `train.max_tokens_per_micro_batch` of the FSDP2 arm: about two rows per micro-batch, so each
# rank groups its rows by length into its own number of passes (FSDP2's passes are collectives:
# the rank with fewer runs padding passes).
TOKEN_BUDGET = {"sft": 70, "rm": 110, "dpo": 150, "grpo": 110}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("family", ["sft", "rm", "dpo", "grpo"])
def test_two_ranks_equal_one_process(family, strategy, base_model, pairs_file, tmp_path):
    """One process with fixed micro-batches against 2 ranks: DDP with the same micro-batch size,
    FSDP2 with token-budget micro-batches instead (`TOKEN_BUDGET`)."""
    raw = {
        "sft": lambda: _sft(base_model),
        "rm": lambda: _rm(base_model, pairs_file),
        "dpo": lambda: _dpo(base_model),
        "grpo": lambda: _grpo(base_model),
    }[family]()
    one = _train(tmp_path, family, raw, 1, "none")
    if strategy == "fsdp2":
        raw = {**raw, "train": {**raw["train"], "max_tokens_per_micro_batch": TOKEN_BUDGET[family]}}
    two = _train(tmp_path, family, raw, 2, strategy)
    _assert_same_run(one, two)

    # Rank 0 alone wrote the run directory: the same files as one process, each step once.
    def files(d):
        return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())

    assert files(two) == (_as_sharded(files(one), 2) if strategy == "fsdp2" else files(one))
    steps = [r["step"] for r in _metrics(two) if any(k.startswith("optim/") for k in r)]
    assert steps == sorted(set(steps)) == list(range(1, raw["train"]["steps"] + 1))
    assert json.loads((two / "final_results.json").read_text())["world_size"] == 2


# A scripted tool environment (docs/multiturn.md) whose episodes need 1 to 3 model turns
# depending on what the model writes, so one rank's episodes end in other rounds than the other's.
TOOL_ENV = """
class ToolEnv:
    def reset(self, problem):
        self.n = 0
        return [{"role": "user", "content": problem.question}]

    def step(self, messages, turn):
        self.n += 1
        if self.n < 3 and len(turn) % 3 != 0:
            return f"tool: {len(turn)}", 0.0, False, {"tool_call": 1}
        return None, float(len(turn) % 2), True, {}
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_multi_turn_two_ranks_equal_one_process(strategy, base_model, tmp_path):
    """GRPO with an environment (multi-turn episodes) under torchrun: each rank runs its share of
    the episodes with the noise of their global rows, takes part in every turn round, and the
    run equals one process's: the trajectories (samples.jsonl), the per-step metrics (turns and
    tool calls included), every optimizer step's gradients and the weights (float64); the
    held-out evaluation by episodes is shared out over the ranks and equal too."""
    env_file = tmp_path / "tool_env.py"
    env_file.write_text(TOOL_ENV)
    raw = _grpo(
        base_model,
        env={"class": f"{env_file}:ToolEnv", "max_turns": 3},
        reward={"components": [{"name": "correctness", "weight": 1.0}]},
    )
    one = _train(tmp_path, "multiturn", raw, 1, "none")
    two = _train(tmp_path, "multiturn", raw, 2, strategy)
    _assert_same_run(one, two)
    turns = [r["rollout/turns_mean"] for r in _metrics(one) if "rollout/turns_mean" in r]
    assert turns and all(1 < t < 3 for t in turns), turns  # episodes end in different rounds
    assert (one / "samples.jsonl").read_text() == (two / "samples.jsonl").read_text()
    evals = [r for r in _metrics(two) if "eval/turns" in r]
    assert evals and all(r["eval/n"] == raw["eval"]["n"] for r in evals)


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_async_two_ranks_equal_one_process(base_model, tmp_path, worker):
    """rollout.mode async under torchrun (DDP): each rank's background thread samples its share
    of the next batch with a behaviour replica and gathers it on a process group of its own while
    the main thread updates; with `async_worker: process` each rank's generation process samples
    the share and the trainer scores and gathers it on the run's group. Either way the run equals
    one process's (float64: metrics, with the staleness, every step's gradients, weights). FSDP2
    is refused in one line, before any step."""
    raw = _grpo(base_model, train={"steps": 3, "micro_batch_size": 3, "update_epochs": 1,
                                   "minibatches": 2})  # fmt: skip
    raw["rollout"] = {**raw["rollout"], "mode": "async", "max_staleness": 1,
                      "async_worker": worker}  # fmt: skip
    one = _train(tmp_path, "async", raw, 1, "none")
    two = _train(tmp_path, "async", raw, 2, "ddp")
    _assert_same_run(one, two)
    stale = [r["rollout/staleness"] for r in _metrics(two) if "rollout/staleness" in r]
    assert stale == [0.0, 1.0, 1.0]
    assert (one / "samples.jsonl").read_text() == (two / "samples.jsonl").read_text()
    if worker == "process":  # the refusal below does not depend on the worker
        return
    cfg = _write_cfg(tmp_path / "async-fsdp2.yaml", raw)
    res = _rlhflab(2, ["train", str(cfg), f"run.root={tmp_path / 'fsdp2'}",
                       "parallel.strategy=fsdp2"])  # fmt: skip
    assert res.returncode != 0  # refused before any collective: one line, printed once
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert errors == [
        "error: rollout.mode 'async' under torchrun needs parallel.strategy 'ddp' (the behaviour "
        "copy is a whole replica of the policy; fsdp2: not yet)"
    ], res.stderr[-2000:]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("family", ["dpo", "grpo"])
def test_lora_two_ranks_equal_one_process(family, strategy, base_model, tmp_path):
    """`model.lora`: adapter gradients, metrics and weights (checkpointed adapters, the merged
    final model) of 2 ranks equal one process's; GRPO's KL uses the base with adapters disabled."""
    pytest.importorskip("peft")
    raw = _grpo(base_model) if family == "grpo" else _dpo(base_model)
    raw["model"]["lora"] = {"r": 4, "alpha": 8.0}
    one = _train(tmp_path, family, raw, 1, "none")
    two = _train(tmp_path, family, raw, 2, strategy)
    _assert_same_run(one, two)
    saved = load_file(two / "checkpoints/step-00000001/model.safetensors")
    assert saved and all(".lora_" in k for k in saved)


def test_fsdp2_cpu_offload_equals_no_offload(base_model, tmp_path):
    """`parallel.cpu_offload` (FSDP2's CPUOffloadPolicy; on CPU the placement is unchanged, but
    the offload code path runs): GRPO with a KL reference on 2 ranks trains, and its gradients,
    metrics and weights equal the same run without offload (float64). Before the fix, pinning
    the host shards raised "Cannot access accelerator device when none is available"."""
    raw = _grpo(base_model)
    plain = _train(tmp_path, "grpo", raw, 2, "fsdp2")
    raw["parallel"] = {**raw["parallel"], "cpu_offload": True}
    offloaded = _train(tmp_path, "grpo-offload", raw, 2, "fsdp2")
    _assert_same_run(plain, offloaded)


def test_ppo_critic_fsdp2_two_ranks_equal_one_process(base_model, tmp_path):
    """PPO (GAE) with a critic and a KL reference under FSDP2: rank 1 builds policy, reference
    and critic on the meta device and receives every shard from rank 0; gradients, metrics (the
    critic's included) and weights equal one process's (float64)."""
    raw = _grpo(base_model)
    raw["rollout"] = {"prompts_per_step": 4, "group_size": 1, "max_new_tokens": 6}
    raw["loss"] = {
        "advantage": "gae",
        "advantage_args": {"gamma": 1.0, "lam": 0.95},
        "surrogate": "ppo_clip",
        "aggregation": "token_mean",
    }
    raw["kl"] = {"coef": 0.05, "estimator": "k1", "placement": "reward_token"}
    raw["value"] = {"optim": {"lr": 1e-3}}
    _assert_same_run(
        _train(tmp_path, "ppo", raw, 1, "none"), _train(tmp_path, "ppo", raw, 2, "fsdp2")
    )


@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
def test_grpo_every_aggregation_two_ranks(aggregation, base_model, tmp_path):
    """The other aggregation modes (seq_mean_token_mean is above), DDP, whitened advantages."""
    raw = _grpo(base_model, aggregation)
    raw["loss"]["whiten_advantages"] = True
    _assert_same_run(_train(tmp_path, "g", raw, 1, "none"), _train(tmp_path, "g", raw, 2, "ddp"))


# Issue #29's methods with batch statistics, several per run (each run costs two torchrun starts):
# the advantage (global whitening / counts), the surrogate (covariance token choice over the whole
# minibatch), the rollout correction (batch-normalised IS, rejection), the entropy bonus and the
# straight-through KL. The reference is ONE process with ONE micro-batch per optimizer step.
ALGORITHM_CASES = {
    "reinforce_pp": ("ddp", "token_mean", {
        "loss": {"advantage": "reinforce_pp", "surrogate": "clip_cov",
                 "surrogate_args": {"cov_ratio": 0.3, "cov_lb": -10.0, "cov_ub": 10.0},
                 "entropy_coef": 0.01,
                 "rollout_correction": {"is_level": "sequence", "batch_normalize": True,
                                        "reject": "geometric", "reject_high": 1.5}},
        "kl": {"coef": 0.05, "estimator": "k1", "placement": "reward_token"}}),
    "gpg": ("fsdp2", "seq_mean_token_sum", {
        "loss": {"advantage": "gpg", "surrogate": "kl_cov", "surrogate_args": {"cov_ratio": 0.2},
                 "rollout_correction": {"is_level": "token", "batch_normalize": True,
                                        "reject": "token", "reject_high": 1.5}},
        "kl": {"coef": 0.05, "estimator": "k3+", "placement": "loss"}}),
    "reinforce_pp_baseline": ("fsdp2", "seq_mean_token_mean", {
        "loss": {"advantage": "reinforce_pp_baseline", "surrogate": "gmpo"},
        "kl": {"coef": 0.05, "estimator": "abs+", "placement": "loss"}}),
    # ReMax's greedy baseline rollout under FSDP2 (every rank generates for its own prompts)
    "remax": ("fsdp2", "seq_mean_token_sum", {
        "loss": {"advantage": "remax", "surrogate": "sapo"}, "kl": {"coef": 0.0}}),
    "batch_mean": ("ddp", "seq_mean_token_sum_norm", {
        "loss": {"advantage": "batch_mean", "surrogate": "ppo_dual_clip", "entropy_coef": 0.01},
        "kl": {"coef": 0.0}}),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(ALGORITHM_CASES))
def test_batch_statistics_two_ranks_micro_batches_equal_one_batch(case, base_model, tmp_path):
    strategy, aggregation, parts = ALGORITHM_CASES[case]
    raw = _grpo(base_model, aggregation, kl=parts["kl"])
    raw["loss"].update(parts["loss"])
    one = dict(raw, train={**raw["train"], "micro_batch_size": 64})  # one micro-batch
    two = dict(raw, train={**raw["train"], "micro_batch_size": 3})  # 8 rows per rank: 3 + 3 + 2
    _assert_same_run(
        _train(tmp_path, case, one, 1, "none"), _train(tmp_path, case, two, 2, strategy)
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp2-offload"])
def test_sigkill_one_rank_then_resume_is_exact(strategy, base_model, tmp_path):
    """Rank 1 is killed mid-step 3: the job exits non-zero (no hang); --resume finishes the run
    bitwise equal to an uninterrupted 2-rank run (weights, metrics except timings). With
    `parallel.cpu_offload` the optimizer state is restored into host memory before any forward."""
    raw = _grpo(base_model)
    if strategy == "fsdp2-offload":
        raw["parallel"] = {**raw["parallel"], "cpu_offload": True}
        strategy = "fsdp2"
    raw["train"]["steps"] = 4
    raw["checkpoint"] = {"every": 2, "keep_last": 2}
    cfg = _write_cfg(tmp_path / "grpo.yaml", raw)
    args = ["train", str(cfg), f"parallel.strategy={strategy}"]
    full = _rlhflab(2, [*args, f"run.root={tmp_path / 'full'}"])
    assert full.returncode == 0, full.stderr[-3000:]
    killed = _rlhflab(
        2, [*args, f"run.root={tmp_path / 'killed'}"], RLHFLAB_FAULT="rank1:step_mid@3=sigkill"
    )
    assert killed.returncode != 0
    # torchrun names the failed rank and its signal
    assert re.search(r"rank\s*:\s*1 .*\n.*exitcode\s*:\s*-9", killed.stderr), killed.stderr[-2000:]
    run = _run_dir(tmp_path / "killed")
    assert not (run / "final_results.json").exists()
    resumed = _rlhflab(2, [*args, f"run.root={tmp_path / 'killed'}", "--resume", str(run)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ref = _run_dir(tmp_path / "full")
    w1, w2 = load_file(ref / "model/model.safetensors"), load_file(run / "model/model.safetensors")
    assert all(torch.equal(w1[k], w2[k]) for k in w1)

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in rows]

    assert strip(_metrics(run)) == strip(_metrics(ref))


def test_bad_config_is_one_line_printed_once(base_model, tmp_path):
    raw = _grpo(base_model)
    raw["rollout"]["prompts_per_step"] = 3  # does not split over 2 ranks
    cfg = _write_cfg(tmp_path / "bad.yaml", raw)
    res = _rlhflab(2, ["train", str(cfg), f"run.root={tmp_path / 'runs'}"], timeout=180)
    assert res.returncode != 0
    reason = (
        "error: rollout.prompts_per_step: 3 prompts do not split over 2 ranks (whole groups "
        "go to one rank)"
    )
    # Under bare torchrun: the ranks' own line once (rank 0 prints, rank 1 does not) ...
    assert [line for line in res.stderr.splitlines() if line.startswith("error:")] == [reason]
    # ... and torchrun's failure report names it as each failed rank's root cause (from the
    # error file the ranks write), never a Python traceback of ours.
    report = [line for line in res.stderr.splitlines() if "traceback :" in line]
    assert report and all(line.split("traceback :", 1)[1].strip() == reason for line in report)
    pkg = Path(rlhflab.__file__).resolve().parent  # wherever it is installed
    assert f'File "{pkg}' not in res.stderr  # (torchrun's own traceback follows, as it always does)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_quickstart_grpo_stage_under_torchrun(tmp_path):
    """The quickstart's own GRPO stage (its preset, from its SFT model; a shorter budget) under
    torchrun with 2 processes: held-out accuracy within the run's standard error of one process.
    (The full 600-step stage is measured in the README.)"""
    from rlhflab.quickstart import build_configs
    from rlhflab.trainers import sft

    sft_cfg, grpo_cfg = build_configs(fast=True, root=tmp_path / "sft")
    sft_model = sft.train(sft_cfg)["model_dir"]
    raw = grpo_cfg.model_dump(mode="json")
    raw["model"]["name_or_path"] = sft_model
    raw["train"]["steps"] = 40
    raw["eval"].update({"every": 0, "n": 300})
    raw["checkpoint"] = {"every": 0}
    cfg = _write_cfg(tmp_path / "grpo.yaml", raw)
    results = {}
    for nproc in (1, 2):
        root = tmp_path / f"grpo-{nproc}"
        res = _rlhflab(nproc, ["train", str(cfg), f"run.root={root}"], timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        results[nproc] = json.loads((_run_dir(root) / "final_results.json").read_text())
    one, two = results[1], results[2]
    assert one["heldout_n"] == two["heldout_n"] == 300 and two["world_size"] == 2
    assert one["heldout_accuracy_before"] == two["heldout_accuracy_before"]
    assert abs(two["heldout_accuracy"] - one["heldout_accuracy"]) <= one["heldout_accuracy_stderr"]


@pytest.fixture(scope="module")
def rm_dir(base_model, tmp_path_factory) -> str:
    """A sequence-classification reward model saved as a trained one is (`save_reward_model`):
    the base model's backbone with a fresh random head, so its scores vary by completion."""
    from rlhflab.models.loading import load_tokenizer
    from rlhflab.models.reward import load_reward_model, save_reward_model

    path = tmp_path_factory.mktemp("rm") / "model"
    save_reward_model(load_reward_model(base_model), load_tokenizer(base_model), path)
    return str(path)


def _grpo_against_rm(base, rm) -> dict:
    raw = _grpo(base)
    raw["reward"]["components"] = [
        {"name": "reward_model", "weight": 1.0, "args": {"path": rm, "dtype": "float64"}},
        {"name": "correctness", "weight": 0.0},
    ]
    # the gold-vs-proxy frontier (on by default for a reward model) is measured with one process
    # only, so one process would log metrics two ranks do not: off for the comparison
    raw["eval"] = {**raw["eval"], "frontier": False}
    return raw


def test_grpo_against_reward_model_fsdp2_two_ranks_equal_one_process(base_model, rm_dir, tmp_path):
    """GRPO scored by a reward-model component (configs/rm/grpo_against_rm.yaml's setup) under
    FSDP2: the RM is sharded from rank 0 and every rank scores its own rows; gradients, per-step
    metrics (the RM's mean score included) and weights equal one process's (float64)."""
    raw = _grpo_against_rm(base_model, rm_dir)
    one = _train(tmp_path, "grpo-rm", raw, 1, "none")
    two = _train(tmp_path, "grpo-rm", raw, 2, "fsdp2")
    _assert_same_run(one, two)
    scores = [r["rollout/reward/reward_model_mean"] for r in _metrics(one) if "optim/lr" in r]
    assert len(scores) == 2 and all(s != 0 for s in scores)


@pytest.fixture(scope="module")
def dense_policy_and_prm(base_model, tmp_path_factory) -> tuple[str, str]:
    """The base model made to write the step separator "\\n" often (`write_separators`), and a
    2-class PRM on its backbone with a fresh head: (policy directory, PRM directory)."""
    from rlhflab.models.build import save_pretrained
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.models.reward import reward_model_from_causal_lm, save_reward_model

    root = tmp_path_factory.mktemp("dense")
    tok = load_tokenizer(base_model)
    policy = load_model(base_model)
    write_separators(policy, tok, "\n")
    save_pretrained(policy, tok, root / "policy")
    prm = reward_model_from_causal_lm(
        load_model(base_model), num_labels=2, pad_token_id=tok.pad_token_id
    )
    save_reward_model(prm, tok, root / "prm")
    return str(root / "policy"), str(root / "prm")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_dense_prm_credit_two_ranks_equal_one_process(dense_policy_and_prm, strategy, tmp_path):
    """GRPO with process supervision (`credit: dense` PRM, `process_group_zscore`, an outcome
    mixed by weight): each rank scores its rows' steps (FSDP2: the PRM sharded), the per-token
    rewards and group statistics stay within whole groups; gradients (hence advantages ×
    weights), per-step metrics and weights equal one process's in float64."""
    policy, prm = dense_policy_and_prm
    raw = _grpo(policy)
    raw["reward"]["components"] = [
        {"name": "reward_model", "weight": 1.0,
         "args": {"path": prm, "kind": "prm", "credit": "dense", "dtype": "float64"}},
        {"name": "correctness", "weight": 0.5},
    ]  # fmt: skip
    raw["loss"]["advantage"] = "process_group_zscore"
    raw["eval"] = {**raw["eval"], "frontier": False}  # measured by one process only
    one = _train(tmp_path, "dense", raw, 1, "none")
    two = _train(tmp_path, "dense", raw, 2, strategy)
    _assert_same_run(one, two)
    steps = [r["rollout/steps_mean"] for r in _metrics(one) if "optim/lr" in r]
    assert len(steps) == 2 and all(s > 0 for s in steps)  # step rewards were given


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_prime_two_ranks_equal_one_process(base_model, strategy, tmp_path):
    """PRIME (`prime:`, `prime_rloo`): each rank scores its rows with the implicit PRM (FSDP2:
    sharded, its own frozen reference too with kl.coef 0), the PRM's CE gradient is summed over
    ranks with the global batch size as denominator; the policy's gradients, the per-step
    metrics (prime/* included) and the weights of the policy and of the PRM equal one
    process's in float64."""
    raw = _grpo(base_model)
    raw["loss"] = {"advantage": "prime_rloo", "surrogate": "ppo_clip", "aggregation": "token_mean",
                   "whiten_advantages": True}  # fmt: skip
    raw["kl"] = {"coef": 0.0}
    raw["prime"] = {"beta": 0.5, "optim": {"lr": 1e-3}}
    one = _train(tmp_path, "prime", raw, 1, "none")
    two = _train(tmp_path, "prime", raw, 2, strategy)
    _assert_same_run(one, two)
    rows = [r for r in _metrics(one) if "optim/lr" in r]
    assert len(rows) == 2 and rows[1]["prime/score_mean"] != 0.0  # the PRM moved
    w1, w2 = (read_tensors(d / "prime_model", "model") for d in (one, two))
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-9, rtol=1e-9, msg=k)


JUDGE_TEMPLATE = "{prompt} = {completion}? Score {low}-{high}"


@pytest.fixture(scope="module")
def judge_dir(base_model, tmp_path_factory) -> str:
    """A tiny judge with its own opinion (`opinionated_judge`): its greedy "Score: d" varies
    with the completion, on the task's questions with digit-string completions."""
    import random

    from factories import opinionated_judge

    from rlhflab.data.tasks import make_splits
    from rlhflab.models.loading import load_tokenizer

    spec = {k: TASK[k] for k in ("config", "n_train", "n_heldout", "seed")}
    questions = [p.question for p in make_splits(TASK["name"], **spec).train[:24]]
    rng = random.Random(0)
    contexts = [(q, "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3))))
                for q in questions]  # fmt: skip
    path = tmp_path_factory.mktemp("judge") / "model"
    targets = opinionated_judge(load_tokenizer(base_model), path, contexts,
                                template=JUDGE_TEMPLATE)  # fmt: skip
    assert len(set(targets)) >= 2, targets  # an opinion that varies
    return str(path)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_judge_reward_two_ranks_equal_one_process(base_model, judge_dir, strategy, tmp_path):
    """GRPO rewarded by an LLM judge alone (the verifier logged with weight 0): each rank's
    judge scores its own rows (its own cache, greedy, float64); gradients, per-step metrics —
    the judge's mean score and parse-failure rate included — and weights equal one process's.
    A judge that gave every completion of a group the same score would give zero gradients,
    which `_assert_same_run` refuses."""
    raw = _grpo(base_model)
    raw["reward"]["components"] = [
        {"name": "judge", "weight": 1.0,
         "args": {"path": judge_dir, "template": JUDGE_TEMPLATE, "low": 1, "high": 9,
                  "on_parse_failure": "min", "dtype": "float64", "judge_max_new_tokens": 16}},
        {"name": "correctness", "weight": 0.0},
    ]  # fmt: skip
    raw["eval"] = {**raw["eval"], "frontier": False}  # measured by one process only
    one = _train(tmp_path, "judge", raw, 1, "none")
    two = _train(tmp_path, "judge", raw, 2, strategy)
    _assert_same_run(one, two)
    rows = [r for r in _metrics(one) if "optim/lr" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/reward/judge/parse_failed_mean"] < 0.5
        assert 1.0 < r["rollout/reward/judge_mean"] < 9.0 and r["rollout/reward/judge_std"] > 0


RM_WORKER = """
import json, sys
import torch
from rlhflab import distributed
from rlhflab.config import ParallelConfig
import rlhflab.models.reward as reward
from rlhflab.rewards import reward_model as rm
from rlhflab.rollout.sampler import pack

paths, out = json.loads(sys.argv[1]), sys.argv[2]
distributed.setup("fsdp2", timeout_s=120)
loads = []
real = reward.load_reward_model
reward.load_reward_model = lambda *a, **k: (loads.append(a[0]), real(*a, **k))[1]
rank, world = distributed.rank(), distributed.world_size()
prompts = [[1 + (3 * i + j) % 50 for j in range(4 + i % 3)] for i in range(8)]
completions = [[2 + (5 * i + j) % 60 for j in range(1 + i % 5)] for i in range(8)]
mine = slice(rank * 4, rank * 4 + 4)
result = {"loads": loads}
for name, path in paths.items():
    ro = pack(prompts[mine], completions[mine], 0)
    scores = rm.reward_model_component(
        rollout=ro, path=path, dtype="float64", parallel=ParallelConfig(strategy="fsdp2")
    )
    scorer = next(s for k, s in rm._SCORERS.items() if k[0] == path)
    params = list(scorer.model.parameters())
    result[name] = {
        "scores": scores.tolist(),
        "all_dtensor": all(hasattr(p, "to_local") for p in params),
        "local": sum(p.to_local().numel() for p in params if hasattr(p, "to_local")),
        "full": sum(p.numel() for p in params),
        "frozen": not any(p.requires_grad for p in params) and not scorer.model.training,
    }
# A round where rank 1 has no rows (more ranks than prompts): it takes part in the loading and
# unsharding without scoring, and rank 0 scores all rows.
from rlhflab.config import RewardComponentConfig
args = {"path": paths["seq_cls"], "dtype": "float64", "micro_batch_size": 3}
comps = [RewardComponentConfig(name="reward_model", args=args)]
fsdp2 = ParallelConfig(strategy="fsdp2")
if rank == 0:
    result["alone"] = rm.reward_model_component(
        rollout=pack(prompts, completions, 0), parallel=fsdp2, **args
    ).tolist()
else:
    rm.take_part_without_rows(comps, fsdp2, distributed.device())
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
distributed.teardown()
"""


def test_reward_model_component_fsdp2_rank1_holds_no_full_copy(base_model, rm_dir, tmp_path):
    """Under FSDP2 the reward-model component is sharded: rank 1 never loads the RM's weights
    (its model is built on the meta device and filled from rank 0), each rank keeps about half
    of the parameters as DTensor shards (frozen, eval), and the scores of each rank's rows equal
    one process's — for a saved sequence-classification RM and for an RM made from a causal LM.
    A rank without rows in a round (`take_part_without_rows`) keeps the others from hanging."""
    from rlhflab.rewards.reward_model import RewardModelScorer

    paths = {"seq_cls": rm_dir, "causal_lm": base_model}
    ranks = _worker_results(RM_WORKER, tmp_path, json.dumps(paths))
    # rank 0 loads each scorer once (the rowless round's is a third); rank 1 never
    assert sorted(ranks[0]["loads"]) == sorted([*paths.values(), rm_dir])
    assert ranks[1]["loads"] == []
    prompts = [[1 + (3 * i + j) % 50 for j in range(4 + i % 3)] for i in range(8)]
    completions = [[2 + (5 * i + j) % 60 for j in range(1 + i % 5)] for i in range(8)]
    for name, path in paths.items():
        got = [ranks[r][name] for r in range(2)]
        for g in got:
            assert g["all_dtensor"] and g["frozen"], name
            assert g["local"] <= 0.55 * g["full"], (name, g["local"], g["full"])
        scorer = RewardModelScorer.from_pretrained(path, kind="preference", dtype="float64")
        want = scorer.score(prompts, completions)
        scores = torch.tensor(got[0]["scores"] + got[1]["scores"], dtype=torch.float64)
        assert want.std() > 0
        torch.testing.assert_close(scores, want.double(), rtol=RTOL, atol=RTOL, msg=name)
        if name == "seq_cls":
            alone = torch.tensor(ranks[0]["alone"], dtype=torch.float64)
            torch.testing.assert_close(alone, want.double(), rtol=RTOL, atol=RTOL)


HALF_WORKER = """
import json, sys
import torch
from rlhflab import distributed
from rlhflab.config import ParallelConfig
from rlhflab.models.loading import load_model
from rlhflab.rollout.engines.base import SamplingParams
from rlhflab.rollout.engines.hf import HFEngine
from rlhflab.rollout.engines.lifecycle import generating

path, out = sys.argv[1], sys.argv[2]
distributed.setup("fsdp2", timeout_s=120)
rank = distributed.rank()
model = distributed.wrap(load_model(path), ParallelConfig(strategy="fsdp2"))
want = {n: p.full_tensor().to(torch.bfloat16) for n, p in model.named_parameters()}
engine = HFEngine(model, pad_token_id=0, stop_token_ids=(1,), autocast_dtype=torch.bfloat16,
                  half_weights=True)
gathers, real = [], distributed.gathered
distributed.gathered = lambda m: (gathers.append(1), real(m))[1]
with generating(model, engine) as eng:
    sharded = all(hasattr(p, "to_local") for p in model.parameters())
    ro = eng.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(n=2, max_new_tokens=5),
                      generator=torch.Generator().manual_seed(rank))
result = {
    "gathers": len(gathers), "sharded_while_sampling": sharded,
    "copy_is_the_policy": all(torch.equal(p, want[n]) for n, p in engine.half.named_parameters()),
    "completion_ids": ro.completion_ids.tolist(),
}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
distributed.teardown()
"""


def test_half_weights_rollout_never_gathers_the_fsdp2_policy(base_model, tmp_path):
    """`rollout.half_weights` under FSDP2: the rollout runs on the bf16 copy, filled one
    parameter at a time, while the float32 policy stays sharded (never gathered whole); the copy
    equals the policy cast to bf16, and each rank's completions equal one process's from the
    same weights and seed."""
    from rlhflab.models.loading import load_model
    from rlhflab.rollout.engines.base import SamplingParams
    from rlhflab.rollout.engines.hf import HFEngine

    ranks = _worker_results(HALF_WORKER, tmp_path, base_model)
    engine = HFEngine(load_model(base_model).eval(), pad_token_id=0, stop_token_ids=(1,),
                      autocast_dtype=torch.bfloat16, half_weights=True)  # fmt: skip
    for rank, got in enumerate(ranks):
        assert got["gathers"] == 0 and got["sharded_while_sampling"], got
        assert got["copy_is_the_policy"]
        ro = engine.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(n=2, max_new_tokens=5),
                             generator=torch.Generator().manual_seed(rank))  # fmt: skip
        assert got["completion_ids"] == ro.completion_ids.tolist()


VARLEN_WORKER = """
import json, random, sys
import torch
from rlhflab import distributed
from rlhflab.config import ParallelConfig
from rlhflab.models.loading import load_model
from rlhflab.models.reward import reward_head, reward_model_from_causal_lm, score_rollout
import rlhflab.models.packing as packing
import rlhflab.rollout.sampler as sampler

path, out = sys.argv[1], sys.argv[2]
distributed.setup("fsdp2", timeout_s=120)
rank = distributed.rank()
layouts = []
real = packing.packed_layout
packing.packed_layout = lambda *a, **k: (lambda lay: layouts.append(lay) or lay)(real(*a, **k))
rng = random.Random(rank)  # each rank its own rows of very uneven lengths
prompts = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 10))] for _ in range(6)]
comps = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 16))] for _ in range(6)]
ro = sampler.pack(prompts, comps, 0)
lm = load_model(path, dtype="float64")
rm = reward_model_from_causal_lm(load_model(path, dtype="float64"), num_labels=1, seed=0,
                                 pad_token_id=0)
policy = distributed.wrap(lm, ParallelConfig(strategy="fsdp2"))
lp, ent = sampler.completion_logps(policy, ro, with_entropy=True)
(lp.sum() + (lp * lp).sum()).backward()
rm = distributed.wrap(rm, ParallelConfig(strategy="fsdp2"), roots=[rm.base_model, reward_head(rm)])
scores = score_rollout(rm, ro)
(scores * scores).sum().backward()
grads = {f"policy.{n}": p.grad.full_tensor().tolist() for n, p in policy.named_parameters()}
grads.update({f"rm.{n}": p.grad.full_tensor().tolist() for n, p in rm.named_parameters()})
result = {
    "prompts": prompts, "completions": comps, "logp": lp.tolist(), "entropy": ent.tolist(),
    "scores": scores.tolist(), "grads": grads if rank == 0 else {},
    "varlen": [lay is not None and lay.attention_mask is None for lay in layouts],
}
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
distributed.teardown()
"""


def test_fsdp2_ranks_pack_varlen_and_equal_one_padded_process(base_model, tmp_path):
    """Under FSDP2 the policy's log-probs (through its own forward, fused head) and a sharded
    reward model's scores are computed in the varlen packed layout (sequences whole in shared
    rows, boundaries in the position ids, transformers' mask); against one process in the padded
    layout, in float64: each rank's log-probs, entropies and scores, and the summed gradients of
    both models."""
    import rlhflab.rollout.sampler as sampler
    from rlhflab.models.loading import load_model
    from rlhflab.models.reward import reward_model_from_causal_lm, score_rollout

    ranks = _worker_results(VARLEN_WORKER, tmp_path, base_model)
    lm = load_model(base_model, dtype="float64")
    rm = reward_model_from_causal_lm(load_model(base_model, dtype="float64"), num_labels=1,
                                     seed=0, pad_token_id=0)  # fmt: skip
    real = sampler.layout_for
    sampler.layout_for = lambda *a, **k: None
    import rlhflab.models.packing as packing

    real_rm = packing.layout_for
    packing.layout_for = lambda *a, **k: None
    try:
        for got in ranks:
            assert got["varlen"] and all(got["varlen"]), got["varlen"]  # both models packed
            ro = sampler.pack(got["prompts"], got["completions"], 0)
            lp, ent = sampler.completion_logps(lm, ro, with_entropy=True)
            (lp.sum() + (lp * lp).sum()).backward()
            scores = score_rollout(rm, ro)
            (scores * scores).sum().backward()
            for name, want in (("logp", lp), ("entropy", ent), ("scores", scores)):
                torch.testing.assert_close(torch.tensor(got[name], dtype=torch.float64),
                                           want.detach(), rtol=RTOL, atol=RTOL, msg=name)  # fmt: skip
    finally:
        sampler.layout_for, packing.layout_for = real, real_rm
    want = {f"policy.{n}": p.grad for n, p in lm.named_parameters()}
    want.update({f"rm.{n}": p.grad for n, p in rm.named_parameters()})
    assert ranks[0]["grads"].keys() == want.keys()
    for name, g in want.items():
        got = torch.tensor(ranks[0]["grads"][name], dtype=torch.float64)
        torch.testing.assert_close(got, g, rtol=0, atol=RTOL * g.abs().max().item(), msg=name)


# `rlhflab` with the packed layouts counted (each process appends one line per packed pass to
# PACK_LOG.<pid>: "tree" or "varlen"), with packing off (PACKING=off: no layout saves enough) or
# wherever a layout exists (PACKING=always: however little it saves).
COUNTING_MAIN = """
import os, runpy, sys
import rlhflab.models.packing as packing

packing.MIN_SAVING = {"off": 1.0, "always": float("-inf")}.get(os.environ.get("PACKING"), 0.15)
real = packing.packed_layout


def counted(*args, **kwargs):
    lay = real(*args, **kwargs)
    if lay is not None:
        with open(f"{os.environ['PACK_LOG']}.{os.getpid()}", "a") as f:
            f.write("tree\\n" if lay.attention_mask is not None else "varlen\\n")
    return lay


packing.packed_layout = counted
sys.argv = ["rlhflab", *sys.argv[1:]]
runpy.run_module("rlhflab", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(scope="module")
def uneven_files(tmp_path_factory) -> Path:
    """Rows of very different lengths: `sft.jsonl` (1 to 30 completion characters) and
    `pairs.jsonl` (1 to 12 characters a side)."""
    d = tmp_path_factory.mktemp("uneven")
    sft = [{"prompt": f"Say {i}.", "completion": "y" * (1 + (7 * i) % 30)} for i in range(24)]
    (d / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in sft))
    pairs = [
        {"prompt": f"What is {i} + {i % 3}?", "chosen": str(i) * (1 + i % 4),
         "rejected": "x" * (1 + (5 * i) % 12)}
        for i in range(24)
    ]  # fmt: skip
    (d / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in pairs))
    steps = uneven_step_rows()  # a PRM's data
    (d / "steps.jsonl").write_text("\n".join(json.dumps(r) for r in steps))
    return d


@pytest.fixture(scope="module")
def teacher_model(base_model) -> str:
    """A model with the base's tokenizer and other weights (its SFT continued 20 steps), to
    distil from."""
    root = Path(base_model).parent.parent / "teacher"
    raw = {"trainer": "sft", "model": {"name_or_path": base_model}, **COMMON,
           "train": {"steps": 20, "batch_size": 16, "micro_batch_size": 16, "max_len": 48},
           "optim": {"lr": 3e-3}, "eval": {"n": 0}, "checkpoint": {"every": 0},
           "run": {"name": "teacher", "root": str(root)}}  # fmt: skip
    return run_config(config_from_dict(raw))["model_dir"]


def _distill(base, teacher) -> dict:
    """GKD (full-distribution generalized JSD; student and teacher batches), one completion a
    prompt."""
    return {
        "trainer": "distill", "model": {"name_or_path": base, "dtype": "float64"}, **COMMON,
        "teacher": {"source": "model", "name_or_path": teacher, "dtype": "float64"},
        "rollout": {"prompts_per_step": 8, "group_size": 1, "max_new_tokens": 8},
        "loss": {"divergence": "generalized_jsd", "divergence_args": {"beta": 0.5}, "lmbda": 0.5},
        "train": {"steps": 3, "micro_batch_size": 4}, "optim": {"lr": 1e-3},
        "eval": {"n": 4, "max_new_tokens": 6}, "run": {"name": "distill"},
    }  # fmt: skip


@pytest.mark.parametrize(
    "family", ["sft", "rm", "prm", "dpo", "grpo", "grpo_entropy", "ppo", "distill"]
)
def test_fsdp2_packed_equals_one_padded_process(family, base_model, uneven_files, tmp_path,
                                                request):  # fmt: skip
    """Per trainer, on rows of very different lengths: 2 FSDP2 ranks whose micro-batches are
    scored in the varlen packed layout (counted: every rank packs, never in the tree layout;
    packing wherever a layout exists, however little it saves) against one process with packing
    off: every step's gradients and metrics and the weights after 3 steps agree in float64.
    (SFT, RM, PRM and DPO read files of uneven rows; GRPO's and distillation's completions stop at
    different lengths; distillation scores the full distribution, student and teacher; GRPO
    with an entropy bonus holds the scored tokens' logits with gradients; PPO's critic is a
    sharded backbone scored packed.)"""
    gae = {"advantage": "gae", "advantage_args": {"gamma": 1.0, "lam": 0.95},
           "surrogate": "ppo_clip", "aggregation": "token_mean"}  # fmt: skip
    micro = {"micro_batch_size": 4}
    sft_data = {"source": "dataset", "path": str(uneven_files / "sft.jsonl")}
    dpo_data = {"source": "file", "format": "pairs", "path": str(uneven_files / "pairs.jsonl"),
                "heldout_pairs": 4}  # fmt: skip
    raw = {
        "sft": lambda: {**_sft(base_model), "data": sft_data},
        "rm": lambda: _rm(base_model, uneven_files / "pairs.jsonl"),
        "prm": lambda: {**_rm(base_model, uneven_files / "pairs.jsonl"), "kind": "prm",
                        "loss": {"num_classes": 2}, "eval": {},
                        "data": {"source": "step_labelled", "heldout_frac": 0.25, "max_len": 96,
                                 "path": str(uneven_files / "steps.jsonl")}},
        "dpo": lambda: {**_dpo(base_model), "data": dpo_data},
        "grpo": lambda: _grpo(base_model),
        "grpo_entropy": lambda: _grpo(base_model, loss={**_grpo(base_model)["loss"],
                                                        "entropy_coef": 0.05}),
        "ppo": lambda: _grpo(base_model, loss=gae,
                             value={"clip_range": 0.2, "optim": {"lr": 1e-3}}),
        "distill": lambda: _distill(base_model, request.getfixturevalue("teacher_model")),
    }[family]()  # fmt: skip
    raw["train"] = {**raw["train"], **micro, "steps": 3}
    if family == "dpo":
        raw.pop("verifiable")
        raw["eval"] = {"n": 4, "max_new_tokens": 6}
    main = tmp_path / "counting_main.py"
    main.write_text(COUNTING_MAIN)
    runs = {}
    for arm, nproc, strategy in (("padded", 1, "none"), ("packed", 2, "fsdp2")):
        root = tmp_path / arm
        root.mkdir()
        cfg = _write_cfg(tmp_path / f"{arm}.yaml", raw)
        cmd = [sys.executable, str(main)] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(main)]  # fmt: skip
        res = subprocess.run(
            [*cmd, "train", str(cfg), f"run.root={root / 'runs'}", f"parallel.strategy={strategy}"],
            env=_env(RLHFLAB_GRAD_DUMP=str(root / "grads"), PACK_LOG=str(root / "packs"),
                     PACKING="off" if arm == "padded" else "always"),
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        runs[arm] = _run_dir(root / "runs")
    assert not list((tmp_path / "padded").glob("packs.*")), "the padded arm packed"
    logs = [p.read_text().split() for p in (tmp_path / "packed").glob("packs.*")]
    assert len(logs) == 2 and all(logs), "each FSDP2 rank must pack"
    assert {kind for log in logs for kind in log} == {"varlen"}
    _assert_same_run(runs["padded"], runs["packed"])
