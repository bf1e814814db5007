"""Per-stage timing and throughput (`rlhflab.throughput`, issue #38): the FLOPs formulas against
hand arithmetic, MFU and tokens/s/GPU from their definitions, the peak table, and on a tiny run of
every trainer family the `perf/<stage>_s` keys, summing to the harness's own `perf/step_s`.

No assertion depends on how fast this machine is: the sums compare two clocks that read the same
interval, and the tolerance (below) covers only the few statements between their reads.
"""

import json
from pathlib import Path

import pytest
import yaml
from factories import tiny_build, tiny_dpo, tiny_pg, tiny_sft, tiny_task

from rlhflab import throughput
from rlhflab.config import config_from_dict
from rlhflab.plan import ModelShape
from rlhflab.trainers import run_config

STAGE_KEYS = [f"perf/{s}_s" for s in throughput.STAGES]

# A tiny dense shape for hand arithmetic: h=8, 2 layers, f=16, 2 heads × head_dim 4, 2 kv heads,
# vocab 10, untied, no qk-norm.
SHAPE = ModelShape("t", 8, 2, 16, 2, 2, 4, 10, False)


def test_dense_params_by_hand():
    # one block: q,k,v,o 8·8 each = 256; gate,up 8·16 = 128 each, down 16·8 = 128 → 384;
    # two RMSNorms 2·8 = 16  → 656 per block; 2 blocks 1312; final norm 8; LM head 10·8 = 80
    assert throughput.dense_params(SHAPE) == 1312 + 8 + 80
    # a reward model: an h → 1 score head (8) instead of the LM head
    assert throughput.dense_params(SHAPE, lm_head=False) == 1312 + 8 + 8
    # tying the LM head to the embedding does not remove its matmul
    tied = ModelShape("t", 8, 2, 16, 2, 2, 4, 10, True)
    assert throughput.dense_params(tied) == 1400


def test_flops_formulas_by_hand():
    N, T = 1400, 12
    attn_fwd = 4 * 2 * 2 * 4 * T  # 4·L·H·Q·T = 768
    # PaLM appendix B: 6N + 12·L·H·Q·T per trained token; 3 tokens
    assert throughput.train_flops(SHAPE, 3, T) == 3 * (6 * N + 3 * attn_fwd)
    assert throughput.train_flops(SHAPE, 3, T) == 3 * (8400 + 2304)
    # forward only (log-probs, decode): 2N + 4·L·H·Q·T per token; 5 tokens
    assert throughput.forward_flops(SHAPE, 5, T) == 5 * (2800 + 768)


def test_mfu_and_tokens_per_gpu_from_their_definitions():
    # 2e12 FLOPs in 0.5 s on 2 cards of 4 TFLOP/s: 4e12 FLOP/s achieved of 8e12 → 0.5
    assert throughput.mfu(2e12, 0.5, 4.0, devices=2) == pytest.approx(0.5, rel=1e-12)
    assert throughput.mfu(1.0, 0.0, 4.0) is None and throughput.mfu(1.0, 1.0, None) is None
    # NeMo-RL: tokens / step time / GPUs: 1200 tokens in 2 s on 3 GPUs → 200
    assert throughput.tokens_per_s_per_gpu(1200, 2.0, 3) == pytest.approx(200.0, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA RTX A6000", 154.8),
        ("NVIDIA L40S", 362.05),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA GeForce RTX 4090", 165.2),
        ("NVIDIA GeForce RTX 3090", 71.0),
        ("Some Unknown Card", None),
    ],
)
def test_peak_table_lookup(name, tflops):
    assert throughput.peak_tflops_of(name) == tflops


def test_timer_partitions_the_step_and_logs_mfu_from_a_given_peak(monkeypatch):
    """The stages partition [begin, end]: with a fake clock every second is where it was spent;
    nested stages pause the outer one; MFU uses the given peak."""
    now = [0.0]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: now[0])
    timer = throughput.StageTimer("cpu")
    timer.shape = SHAPE
    timer.begin()
    now[0] += 1.0  # other
    with timer.stage("rollout"):
        now[0] += 2.0
        with timer.stage("ref"):  # nested: ref, not rollout
            now[0] += 3.0
        now[0] += 4.0
    with timer.stage("update"):
        timer.train("update", 100, 12)
        now[0] += 5.0
    timer.count(generated=30, trained=60)
    now[0] += 0.5  # other
    out = timer.end(15.5, devices=2, peak_tflops=1e-6)
    assert out["perf/other_s"] == 1.5 and out["perf/rollout_s"] == 6.0
    assert out["perf/ref_s"] == 3.0 and out["perf/update_s"] == 5.0
    assert sum(out[k] for k in STAGE_KEYS) == 15.5
    assert out["perf/gen_tokens_per_s"] == 30 / 6.0
    assert out["perf/train_tokens_per_s_per_gpu"] == 60 / 15.5 / 2
    flops = 100 * (6 * 1400 + 3 * 768)
    assert out["perf/update_tflops"] == pytest.approx(flops / 5.0 / 1e12, rel=1e-12)
    assert out["perf/mfu_update"] == pytest.approx(flops / 5.0 / 1e6, rel=1e-12)
    assert not any(k.startswith("perf/peak_mem") for k in out)  # CPU: no memory keys


def test_timer_off_logs_no_stage(monkeypatch):
    monkeypatch.setenv("RLHFLAB_STAGE_TIMERS", "0")
    timer = throughput.StageTimer("cpu")
    timer.begin()
    with timer.stage("rollout"):
        pass
    assert timer.end(1.0) == {}


def test_planned_peak_of_a_config():
    cfg = config_from_dict(tiny_pg("/tmp/unused", "/tmp/unused"))
    gib = throughput.planned_peak_gib(cfg, SHAPE, gpus=1, gpu_memory_gib=80.0)
    assert gib is not None and gib > 0


def test_the_runs_plan_takes_its_longest_prompt():
    # issue: on a GPU, a GRPO run with ~40-token prompts logged perf/plan_peak_gib 78.4 beside a
    # measured 49.3 GiB: the plan had assumed its default 256-token prompts
    from types import SimpleNamespace

    from rlhflab.trainers.loop import longest_prompt

    cfg = config_from_dict(tiny_pg("/tmp/unused", "/tmp/unused"))

    def plan(n):
        return throughput.planned_peak_gib(cfg, SHAPE, gpus=1, gpu_memory_gib=80.0, prompt_len=n)

    assert plan(None) == plan(256)  # the plan's default
    assert plan(16) < plan(256)
    assert longest_prompt(SimpleNamespace(prompts=[[5, 6, 7], [1] * 7, [2]])) == 7
    assert longest_prompt(SimpleNamespace()) is None  # SFT, RM, DPO: their configs bound it


# -- Every trainer family on a tiny run ---------------------------------------------------------
# Tolerance of the sum check: the stages and perf/step_s read two clocks a few statements apart
# at each end of the step, so they differ by microseconds — unless the process is descheduled
# between those reads, which a loaded machine can do for a scheduler slice (~10 ms). Per step:
# 2% or 20 ms, whichever is larger; over the run's steps too (a run of six 25-ms steps lost
# 4 ms, 2.8% of its total, on a machine loaded with other jobs).
def _check_stage_sums(run_dir, n_min):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "perf/step_s" in r]
    assert len(rows) >= n_min
    total_stages = total_step = 0.0
    for r in rows:
        assert all(k in r for k in STAGE_KEYS), sorted(set(STAGE_KEYS) - set(r))
        stages = sum(r[k] for k in STAGE_KEYS)
        assert abs(stages - r["perf/step_s"]) <= max(0.02 * r["perf/step_s"], 0.02)
        total_stages += stages
        total_step += r["perf/step_s"]
    assert abs(total_stages - total_step) <= max(0.02 * total_step, 0.02)
    return rows


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("thr_sft")
    build = {"build": tiny_build(max_position_embeddings=160)}
    res = run_config(
        config_from_dict(
            tiny_sft(root, model=build, eval={"n": 4, "max_new_tokens": 4, "every": 1})
        )
    )
    rows = _check_stage_sums(res["run_dir"], 6)
    assert all(r["perf/update_s"] > 0 for r in rows)
    assert all(r["perf/update_tflops"] > 0 for r in rows)  # a Qwen3-shape model: FLOPs known
    # the periodic evaluation after steps 1..5 is in the step's eval stage, logged before its line
    assert all(r["perf/eval_s"] > 0 for r in rows[:-1]) and rows[-1]["perf/eval_s"] == 0
    return res


def test_sft_stage_split(sft_model):
    assert sft_model["steps"] == 6


@pytest.mark.parametrize("variant", ["grpo", "ppo"])
def test_policy_gradient_stage_split(tmp_path, sft_model, variant):
    extra = {}
    if variant == "ppo":
        extra = {
            "rollout": {"prompts_per_step": 4, "group_size": 1, "max_new_tokens": 6},
            "loss": {"advantage": "gae", "advantage_args": {"gamma": 1.0, "lam": 0.95},
                     "surrogate": "ppo_clip", "aggregation": "token_mean"},
            "kl": {"coef": 0.05, "estimator": "k1", "placement": "reward_token"},
            "value": {"clip_range": 0.2},
            "train": {"steps": 2, "micro_batch_size": 4, "update_epochs": 2, "minibatches": 2},
        }  # fmt: skip
    raw = tiny_pg(tmp_path, sft_model["model_dir"], **extra)
    raw["train"] = {**raw["train"], "steps": 2}
    res = run_config(config_from_dict(raw))
    rows = _check_stage_sums(res["run_dir"], 2)
    for r in rows:
        assert r["perf/rollout_s"] > 0 and r["perf/update_s"] > 0
        assert r["perf/gen_tokens_per_s"] > 0 and r["perf/train_tokens_per_s_per_gpu"] > 0
        if variant == "ppo":  # reference, critic and old log-probs (two epochs) all ran
            assert r["perf/ref_s"] > 0 and r["perf/values_s"] > 0 and r["perf/logp_old_s"] > 0


def test_dpo_stage_split(tmp_path, sft_model):
    raw = tiny_dpo(tmp_path, sft_model["model_dir"])
    raw["train"] = {**raw["train"], "steps": 2}
    rows = _check_stage_sums(run_config(config_from_dict(raw))["run_dir"], 2)
    assert all(r["perf/update_s"] > 0 and r["perf/update_tflops"] > 0 for r in rows)


def test_reward_model_stage_split(tmp_path):
    raw = {
        "trainer": "reward_model",
        "kind": "orm",
        "model": {"build": tiny_build(max_position_embeddings=128)},
        "task": tiny_task(),
        "data": {"max_len": 96, "source": "worked_solutions", "n_prompts": 32},
        "loss": {"orm_loss": "orm_seq_bce"},
        "train": {"steps": 2, "batch_size": 8, "micro_batch_size": 4},
        "eval": {"n_problems": 8, "max_new_tokens": 8},
        "tracking": {"console": False},
        "run": {"name": "rm", "root": str(tmp_path)},
    }
    rows = _check_stage_sums(run_config(config_from_dict(raw))["run_dir"], 2)
    assert all(r["perf/update_s"] > 0 for r in rows)


def test_distill_stage_split(tmp_path, sft_model):
    preset = Path(__file__).resolve().parents[1] / "configs" / "distill" / "on_policy.yaml"
    raw = yaml.safe_load(preset.read_text())
    raw.update(
        model={"name_or_path": sft_model["model_dir"]},
        task=tiny_task(),
        train={"steps": 2, "micro_batch_size": 4},
        eval={"n": 0},
        tracking={"console": False},
        run={"name": "distill", "root": str(tmp_path)},
        teacher={**raw["teacher"], "name_or_path": sft_model["run_dir"],
                 "allow_same_as_student": True},
    )  # fmt: skip
    raw["rollout"] = {**raw["rollout"], "prompts_per_step": 8 // raw["rollout"]["group_size"],
                      "max_new_tokens": 6}  # fmt: skip
    rows = _check_stage_sums(run_config(config_from_dict(raw))["run_dir"], 2)
    assert all(r["perf/rollout_s"] > 0 and r["perf/update_s"] > 0 for r in rows)


def test_stage_split_plot(tmp_path):
    from rlhflab.plots import plot_run, plot_stage_split

    rows = [
        {"step": s, "perf/step_s": 1.0, **{k: 1.0 / len(STAGE_KEYS) for k in STAGE_KEYS}}
        for s in range(1, 31)
    ]
    stages = throughput.STAGES
    assert plot_stage_split([{"step": 1, "perf/step_s": 1.0}], tmp_path, stages) is None
    written = plot_run(rows, tmp_path / "plots", stages=stages)
    assert tmp_path / "plots" / "stage_split.png" in written


def test_cuda_peak_memory_per_stage_with_a_fake_device(monkeypatch):
    """The CUDA bookkeeping, without a GPU: torch.cuda's peak-memory calls replaced by a fake
    allocator whose peak is reset at each stage boundary; each stage gets the largest peak seen
    while it was active, and every boundary synchronizes."""
    import torch

    state = {"peak": 0, "syncs": 0}
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda: state.__setitem__("syncs", state["syncs"] + 1)
    )
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.__setitem__("peak", 0))
    timer = throughput.StageTimer("cuda:0")
    timer.begin()
    state["peak"] = 1 * 2**30  # other
    with timer.stage("rollout"):
        state["peak"] = 3 * 2**30
    with timer.stage("update"):
        state["peak"] = 5 * 2**30
    with timer.stage("rollout"):
        state["peak"] = 2 * 2**30  # a second rollout block: its peak is the larger of the two
    out = timer.end(1.0)
    assert out["perf/peak_mem_rollout_gib"] == 3.0 and out["perf/peak_mem_update_gib"] == 5.0
    assert out["perf/peak_mem_other_gib"] == 1.0 and out["perf/peak_mem_gib"] == 5.0
    assert state["syncs"] == 7  # two per block, one at the end
