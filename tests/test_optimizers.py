"""Low-memory optimizers (`optim.name`, rlhflab.optimizers): the bytes of state each keeps
against the planner's formula, refusals, the checkpoint round trip of a quantized state, and
exact resume. Closeness to fp32 AdamW over whole runs is a benchmark (bench/lowmem_optim.py)."""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhflab import optimizers
from rlhflab.config import config_from_dict
from rlhflab.errors import ConfigError, Interrupted
from rlhflab.trainers import run_config

# torchao is the `lowmem` extra. CI runs this file again with it installed and
# RLHFLAB_REQUIRE_TORCHAO=1, where a missing torchao fails instead of skipping.
if importlib.util.find_spec("torchao") is None:
    if os.environ.get("RLHFLAB_REQUIRE_TORCHAO"):
        raise RuntimeError("RLHFLAB_REQUIRE_TORCHAO is set but torchao is not installed")
    pytest.skip("needs torchao (the lowmem extra)", allow_module_level=True)

# the task and tiny model of the exact-resume tests; in the tiny model the 64 x 64 attention and
# 64 x 128 MLP matrices (4096+ values) get 8-bit states, the norms (64 values) float32 ones
from test_checkpoint_resume import BUILD, TASK


def sft_raw(root, name, optim, dtype="float32", steps=12):
    return {
        "trainer": "sft",
        "model": {"build": BUILD, "dtype": dtype},
        "task": TASK,
        "precision": {"threads": 1},
        "tracking": {"console": False},
        "train": {"steps": steps, "batch_size": 8, "micro_batch_size": 4, "max_len": 48},
        "optim": {
            "name": optim,
            "lr": 1e-3,
            "warmup_steps": 2,
            "schedule": "cosine",
            "weight_decay": 0.01,
        },
        "eval": {"n": 0},
        "checkpoint": {"every": 5, "keep_last": 2},
        "run": {"name": name, "root": str(root)},
    }


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(300, 64),  # 19,200 values: quantized
        torch.nn.Linear(64, 128),  # weight 8,192: quantized; bias 128: not
        torch.nn.LayerNorm(128),  # 128 + 128: not
        torch.nn.Linear(128, 3, bias=False),  # 384: not (< 4096)
    ).to(dtype)


def _one_step(model, opt):
    x = torch.randint(0, 300, (4, 5))
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize(
    ("name", "dtype", "param_bytes"),
    [
        ("adamw", torch.float32, 4),
        ("adamw_8bit", torch.float32, 4),
        ("adamw_bf16", torch.bfloat16, 2),
    ],
)
def test_state_bytes_measured_equal_the_formula(name, dtype, param_bytes):
    model = _model(dtype)
    params = list(model.parameters())
    opt = optimizers.build(name, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    _one_step(model, opt)
    measured = optimizers.measured_state_bytes(opt)
    numels = [p.numel() for p in params]
    # by hand: 8-bit on the embedding (19,200) and the first weight (8,192): codes 1 B + one
    # float32 scale per 256 values, for m and v, plus two 256-entry float32 maps per tensor
    by_hand = {
        "adamw": 8 * sum(numels),
        "adamw_bf16": 4 * sum(numels),
        "adamw_8bit": sum(2 * (n + 4 * n // 256) + 2 * 1024 for n in (19_200, 8_192))
        + 8 * (128 + 128 + 128 + 384),
    }[name]
    assert optimizers.state_bytes(name, numels, param_bytes) == by_hand
    assert measured == by_hand
    # the planner's per-parameter limit: within 5% on a model whose values sit in big matrices
    big = [4096 * 4096] * 4
    per = optimizers.state_bytes(name, big, param_bytes) / sum(big)
    assert per == pytest.approx(optimizers.bytes_per_param(name, param_bytes), rel=0.05)


def test_adamw_bf16_refuses_float32_weights():
    with pytest.raises(ValueError, match=r"adamw_bf16.*float32"):
        optimizers.build("adamw_bf16", list(_model().parameters()), lr=1e-3,
                         betas=(0.9, 0.999), eps=1e-8, weight_decay=0)  # fmt: skip


def test_config_refuses_adamw_bf16_without_bf16_weights(tmp_path):
    with pytest.raises(ConfigError, match=r"optim\.name: adamw_bf16 .*model\.dtype: float32"):
        config_from_dict(sft_raw(tmp_path, "x", "adamw_bf16"))


def test_quantized_state_round_trips_through_the_checkpoint_format():
    from rlhflab.checkpoint.state import _load_optimizer_state, _optimizer_state

    model = _model()
    kw = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0}
    opt = optimizers.build("adamw_8bit", list(model.parameters()), **kw)
    _one_step(model, opt)
    tensors, meta = _optimizer_state(opt)
    assert all(type(t) is torch.Tensor for t in tensors.values())  # plain, for safetensors
    assert meta["quantized"]  # the two big tensors' m and v
    meta = json.loads(json.dumps(meta))  # as state.json stores it
    other = optimizers.build("adamw_8bit", list(model.parameters()), **kw)
    _load_optimizer_state(other, tensors, meta)
    for p in model.parameters():
        for k, v in opt.state[p].items():
            w = other.state[p][k]
            assert type(w) is type(v), k
            if hasattr(v, "codes"):
                assert torch.equal(w.codes, v.codes) and torch.equal(w.scale, v.scale)
            else:
                assert torch.equal(w, v)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype"), [("adamw_8bit", "float32"),
                                             ("adamw_bf16", "bfloat16")])  # fmt: skip
def test_stopped_and_resumed_run_equals_the_uninterrupted_one(tmp_path, monkeypatch, name, dtype):
    """SIGTERM sent at the end of step 7 (the run stops after step 8 and checkpoints there), then
    resume: the same metrics and bitwise-identical weights as the run never stopped (stochastic
    rounding's random bits come back with the RNG state)."""
    ref = run_config(config_from_dict(sft_raw(tmp_path / "ref", "sft", name, dtype)))
    raw = sft_raw(tmp_path / "runs", "sft", name, dtype)
    with monkeypatch.context() as m, pytest.raises(Interrupted, match="stopped by SIGTERM"):
        m.setenv("RLHFLAB_FAULT", "step_end@7=sigterm")
        run_config(config_from_dict(raw))
    [run_dir] = sorted((tmp_path / "runs").glob("sft-*"))
    assert not (run_dir / "final_results.json").exists()
    run_config(config_from_dict({**raw, "run": {**raw["run"], "resume": str(run_dir)}}))

    def rows(d):
        lines = (Path(d) / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("perf/")
                 and k != "time_s"} for x in lines]  # fmt: skip

    assert rows(ref["run_dir"]) == rows(run_dir)
    wa = load_file(str(Path(ref["run_dir"]) / "model/model.safetensors"))
    wb = load_file(str(run_dir / "model/model.safetensors"))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype"), [("adamw_8bit", "float32"),
                                             ("adamw_bf16", "bfloat16")])  # fmt: skip
def test_sharded_adamw_state_resumes_bitwise_at_the_same_world_size(tmp_path, name, dtype):
    """Under FSDP2 on 2 ranks (torchrun, gloo): a 4-step run checkpointed at every step, resumed
    from step 2 on 2 ranks, ends with the same metrics and bitwise-identical weights. adamw_8bit's
    m and v are quantized in blocks of each rank's shard, so the checkpoint keeps each rank's
    codes and scales as they are (`...@rank<r>.codes`), and a resume on another number of
    processes is refused in one line instead of re-quantizing."""
    import shutil
    import subprocess
    import sys

    import yaml
    from factories import worker_env

    raw = sft_raw(tmp_path / "runs", "sft", name, dtype, steps=4)
    raw["checkpoint"] = {"every": 1, "keep_last": None}
    raw["parallel"] = {"strategy": "fsdp2", "timeout_s": 120}
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(yaml.safe_dump(raw))

    def train(nproc, root, *extra):
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd = [sys.executable, *(launch if nproc > 1 else []), "-m", "rlhflab", "train",
               str(cfg), f"run.root={root}", *extra]  # fmt: skip
        return subprocess.run(cmd, env=worker_env(), capture_output=True, text=True,
                              timeout=600, check=False)  # fmt: skip

    res = train(2, tmp_path / "runs")
    assert res.returncode == 0, res.stderr[-3000:]
    [run] = sorted((tmp_path / "runs").glob("sft-*"))
    step2 = "checkpoints/step-00000002"
    index = json.loads((run / step2 / "optimizer.shards.json").read_text())["tensors"]
    codes = [k for k in index if k.endswith(".codes")]
    if name == "adamw_8bit":  # both ranks' own 8-bit states, each whole in its own file
        assert {k.split("@")[1].split(".")[0] for k in codes} == {"rank00000", "rank00001"}
        assert all(len(index[k]["shards"]) == 1 for k in codes)
    else:
        assert not codes and not any("@rank" in k for k in index)
    copy = tmp_path / "resumed" / run.name
    shutil.copytree(run, copy)
    res = train(2, tmp_path / "resumed", "--resume", str(copy / step2))
    assert res.returncode == 0, res.stderr[-3000:]

    def rows(d):
        lines = (Path(d) / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("perf/")
                 and k != "time_s"} for x in lines]  # fmt: skip

    assert rows(run) == rows(copy)
    wa, wb = (load_file(str(d / "model/model.safetensors")) for d in (run, copy))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    if name == "adamw_8bit":
        other = tmp_path / "one" / run.name
        shutil.copytree(run, other)
        res = train(1, tmp_path / "one", "--nproc", "1", "--resume", str(other / step2))
        assert res.returncode == 2
        last = res.stderr.strip().splitlines()[-1]
        assert last == (
            "error: this checkpoint's optimizer state was quantized per rank by 2 "
            "ranks (adamw_8bit under fsdp2); resume it with 2 processes, not 1"
        ), last


STATE_BYTES_WORKER = """
import json, sys
import torch
from rlhflab import distributed, optimizers
from rlhflab.config import ParallelConfig
from rlhflab.errors import ConfigError
from rlhflab.models.loading import load_model

path, uneven, name, out = sys.argv[1:5]
distributed.setup("fsdp2", timeout_s=120)
rank = distributed.rank()
dtype = "bfloat16" if name == "adamw_bf16" else "float32"
kw = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
result = {}
if name == "adamw_8bit":  # a vocabulary of 319 rows: shards of 160 and 159 rows
    odd = distributed.wrap(load_model(uneven, dtype=dtype), ParallelConfig(strategy="fsdp2"))
    try:
        optimizers.build(name, list(odd.parameters()), **kw)
    except ConfigError as exc:
        result["refused"] = str(exc)
model = distributed.wrap(load_model(path, dtype=dtype), ParallelConfig(strategy="fsdp2"))
opt = optimizers.build(name, list(model.parameters()), **kw)
ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(rank))
model(input_ids=ids, labels=ids).loss.backward()
opt.step()
result["bytes"] = optimizers.measured_state_bytes(opt)
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(result, f)
distributed.teardown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "adamw_bf16"])
def test_fsdp2_optimizer_state_bytes_per_rank_match_the_planner(name, tmp_path, tiny_tokenizer):
    """Under FSDP2 on 2 ranks (torchrun, gloo) the bytes each rank's optimizer state holds after
    one step of the built base model (hidden 256, vocabulary padded to 320 rows: every shard of a
    matrix has 4096 values or more, so torchao quantizes it) against the planner's per-GPU
    optimizer-state term for fsdp2 over 2 GPUs: within 5%. adamw_8bit over uneven shards (319
    rows over 2 ranks), which fails inside torchao's compiled step, is refused in one line."""
    import subprocess
    import sys

    from factories import worker_env

    from rlhflab.models.build import build_model
    from rlhflab.plan import GIB, PlanInputs, estimate, resolve_shape

    dtype = getattr(torch, "bfloat16" if name == "adamw_bf16" else "float32")
    model = build_model(tiny_tokenizer, size="base", max_position_embeddings=64).to(dtype)
    model.resize_token_embeddings(319)
    model.save_pretrained(tmp_path / "uneven")
    model.resize_token_embeddings(320)
    model.save_pretrained(tmp_path / "model")
    script = tmp_path / "worker.py"
    script.write_text(STATE_BYTES_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(script), str(tmp_path / "model"), str(tmp_path / "uneven"), name, str(tmp_path)]  # fmt: skip
    res = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=600,
                         check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    inputs = PlanInputs(trainer="sft", gpus=2, strategy="fsdp2", model_dtype=str(dtype)[6:],
                        optimizer=name, autocast=False)  # fmt: skip
    planned = estimate(resolve_shape(str(tmp_path / "model")), inputs)["components"]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert planned["optimizer_state"] * GIB == pytest.approx(got["bytes"], rel=0.05), rank
        if name == "adamw_8bit":
            assert got["refused"] == (
                "optim.name: adamw_8bit under fsdp2 needs every parameter's first dimension "
                "divisible by the 2 ranks; one of shape [319, 256] is not (torchao's 8-bit step "
                "fails on uneven shards): use adamw_bf16, adamw, or a number of ranks that "
                "divides it"
            )
