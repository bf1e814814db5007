"""Loading under FSDP2 without full copies: torchrun with 2 gloo processes (CPU).

Ranks other than 0 build the model on the meta device and receive their shards from rank 0
(`distributed.wrap`), so their peak host memory stays near one shard, not one model; the loaded
weights, buffers (RoPE's non-persistent `inv_freq`) and outputs equal a plain 1-process load,
for a saved model and for a model built from scratch (`model.build`). With
`parallel.mixed_precision: bf16` the policy keeps fp32 weights and gradients while the frozen
reference is stored in bf16, and both compute the same logits at the start.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from factories import saved_qwen3_105m, worker_env
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

TEXTS = [f"{i} + {i % 7} = {i + i % 7}" for i in range(300)]
BUILD = {"size": "tiny", "vocab_size": 300, "max_position_embeddings": 64}

WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from rlhflab import distributed
    from rlhflab.config import BuildConfig, ModelConfig, ParallelConfig
    from rlhflab.trainers.common import prepare_model

    model_dir, out, texts = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    build = json.loads(sys.argv[4])

    def status_kb(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])

    distributed.setup("fsdp2", timeout_s=120)
    # Import what loading imports lazily (modelling code, DCP), so that code is not counted.
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    parallel = ParallelConfig(strategy="fsdp2")
    result = {}
    for name, cfg in (
        ("saved", ModelConfig(name_or_path=model_dir, dtype="float32")),
        ("built", ModelConfig(build=BuildConfig(**build), dtype="float64")),
    ):
        distributed.barrier()
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here on
            f.write("5")
        start = status_kb("VmRSS")
        _, model = prepare_model(
            cfg, device=distributed.device(), seed=3, tokenizer_texts=lambda: texts,
            sharded_later=True,
        )
        model = distributed.wrap(model, parallel)
        peak = status_kb("VmHWM") - start
        ids = (torch.arange(24).reshape(2, 12) * 7 + 1) % model.config.vocab_size
        with torch.no_grad(), distributed.gathered(model):
            logits = model(input_ids=ids).logits
        sd = distributed.full_model_state(model)
        peaks = distributed.all_gather_object(peak * 1024)
        if distributed.is_main():
            save_file({**sd, "__logits__": logits.contiguous()}, str(out / f"{name}.safetensors"))
            result[name] = peaks
        del model, sd
    # Mixed precision as users run it: fp32 master weights and gradients, bf16 compute; the
    # frozen reference stored in bf16 (the dtype it computes in), sharded, loaded from rank 0.
    from rlhflab.trainers.common import Reference

    mixed = ParallelConfig(strategy="fsdp2", mixed_precision="bf16")
    _, policy = prepare_model(
        ModelConfig(build=BuildConfig(**build)), device=distributed.device(), seed=3,
        tokenizer_texts=lambda: texts, sharded_later=True,
    )
    reference = Reference(policy, mixed)
    policy = distributed.wrap(policy, mixed)
    ids = (torch.arange(24).reshape(2, 12) * 7 + 1) % policy.config.vocab_size
    with torch.no_grad(), reference.scoring() as ref, distributed.gathered(policy):
        same = torch.equal(ref(input_ids=ids).logits, policy(input_ids=ids).logits)
    policy(input_ids=ids).logits.float().square().mean().backward()
    result["mixed"] = {
        "policy": sorted({str(p.dtype) for p in policy.parameters()}),
        "grads": sorted({str(p.grad.dtype) for p in policy.parameters()}),
        "reference": sorted({str(p.dtype) for p in reference.copy.parameters()}),
        "reference_sharded": distributed.is_sharded(reference.copy),
        "same_logits": same,
    }
    if distributed.is_main():
        (out / "peaks.json").write_text(json.dumps(result))
    distributed.teardown()
    """
)


def _one_process(cfg, input_ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
    from rlhflab.trainers.common import prepare_model

    _, model = prepare_model(cfg, device=torch.device("cpu"), seed=3, tokenizer_texts=lambda: TEXTS)
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    return model.state_dict(), logits


def test_fsdp2_load_rank1_holds_no_full_copy(tmp_path):
    from rlhflab.config import BuildConfig, ModelConfig

    model_dir = tmp_path / "model"
    nbytes = saved_qwen3_105m(model_dir)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(script), str(model_dir), str(tmp_path), json.dumps(TEXTS), json.dumps(BUILD)]
    res = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]

    # Memory: rank 0 reads the model once (one full copy); rank 1 holds its half of the shards
    # plus one tensor in flight, never the whole model. Rank 0's peak shows that the measure
    # sees a full copy when there is one.
    peaks = json.loads((tmp_path / "peaks.json").read_text())["saved"]
    print(f"model {nbytes / 2**20:.0f} MiB; peak host memory while loading, by rank (MiB): "
          f"{[round(p / 2**20) for p in peaks]}")  # fmt: skip
    assert peaks[0] > 0.9 * nbytes, (peaks, nbytes)
    assert peaks[1] < 0.65 * nbytes, (peaks, nbytes)

    mixed = json.loads((tmp_path / "peaks.json").read_text())["mixed"]
    assert mixed == {
        "policy": ["torch.float32"], "grads": ["torch.float32"], "reference": ["torch.bfloat16"],
        "reference_sharded": True, "same_logits": True,
    }  # fmt: skip

    # Weights (gathered) and outputs equal a plain 1-process load, exactly: every parameter came
    # from rank 0, and the RoPE buffers (not in any state dict) were sent too.
    for name, cfg in (
        ("saved", ModelConfig(name_or_path=str(model_dir), dtype="float32")),
        ("built", ModelConfig(build=BuildConfig(**BUILD), dtype="float64")),
    ):
        got = load_file(tmp_path / f"{name}.safetensors")
        logits = got.pop("__logits__")
        ids = (torch.arange(24).reshape(2, 12) * 7 + 1) % logits.shape[-1]
        want, want_logits = _one_process(cfg, ids)
        assert set(got) <= set(want) and len(got) >= len(want) - 1, name  # tied: one name
        for k, v in got.items():
            assert v.dtype == want[k].dtype and torch.equal(v, want[k]), (name, k)
        # (outputs to the dtype's rounding: the two processes may use different thread counts)
        torch.testing.assert_close(logits, want_logits, msg=name)
