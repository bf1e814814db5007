"""Peak memory of scoring a batch's completion tokens: the fused LM head against whole logits.

`rlhflab.rollout.sampler.completion_logps` forward + backward on a random-init Qwen3-shape model
with a V = 32,768 vocabulary (untied head, 2 layers, hidden 256), B sequences of P prompt +
T completion tokens, loss = −Σ A·logp·mask. Variants, each in a fresh process:
    fused    the default: hidden states from the backbone, the head applied per row-chunk
             inside `ops.linear_selective_log_softmax` (no (B, T, V) logits)
    padded   `can_pack` patched to False: the model's forward returns (B, T+1, V) logits, upcast
             to float32, `ops.selective_log_softmax`
each in fp32 and under bf16 autocast. Reported: the step's peak above the memory in use just
before it (a warm-up step first, so gradients exist): on CUDA `torch.cuda.max_memory_allocated`,
on CPU the process's peak RSS (VmHWM after /proc/self/clear_refs = 5; glibc serves allocations
>= 1 MiB with mmap, so RSS follows live tensors, as in bench/memory.py). Not part of the tests.

    .venv/bin/python bench/fused_head_memory.py [--device cuda] [--B 8] [--T 256]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def worker(variant: str, amp: bool, device: str, B: int, P: int, T: int) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import rlhflab.rollout.sampler as sampler
    from rlhflab.rollout.sampler import Rollout, completion_logps

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=32768, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False,
        max_position_embeddings=P + T + 8,
    )  # fmt: skip
    model = Qwen3ForCausalLM(cfg).to(device)
    if variant == "padded":
        sampler.can_pack = lambda model: False
    g = torch.Generator().manual_seed(0)
    ro = Rollout(
        prompt_ids=torch.randint(2, cfg.vocab_size, (B, P), generator=g),
        prompt_mask=torch.ones(B, P, dtype=torch.long),
        completion_ids=torch.randint(2, cfg.vocab_size, (B, T), generator=g),
        mask=torch.ones(B, T),
        logp=torch.zeros(B, T),
        truncated=torch.zeros(B, dtype=torch.bool),
    ).to(device)
    adv = torch.randn(B, 1, generator=g).to(device)
    dtype = torch.bfloat16 if amp else None

    def step() -> None:
        lp, _ = completion_logps(model, ro, autocast_dtype=dtype, with_entropy=True)
        (-(adv * lp * ro.mask).sum()).backward()

    step()  # gradients exist from here on
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        before = _rss("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        step()
        peak = _rss("VmHWM")
    logits_fp32 = B * (T + 1) * cfg.vocab_size * 4
    return {
        "variant": variant,
        "autocast": "bf16" if amp else "none",
        "step_peak_mib": (peak - before) / 2**20,
        "fp32_logits_mib": logits_fp32 / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--P", type=int, default=32)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--worker", nargs=2, metavar=("VARIANT", "AMP"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        out = worker(a.worker[0], a.worker[1] == "1", a.device, a.B, a.P, a.T)
        print(json.dumps(out))
        return
    rows = []
    for amp in (False, True):
        for variant in ("fused", "padded"):
            cmd = [sys.executable, __file__, "--worker", variant, str(int(amp)),
                   "--device", a.device, "--B", str(a.B), "--P", str(a.P), "--T", str(a.T)]  # fmt: skip
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}  # RSS follows tensors
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"B={a.B} P={a.P} T={a.T} V=32768 on {a.device}; (B, T+1, V) fp32 logits = "
          f"{rows[0]['fp32_logits_mib']:.0f} MiB")  # fmt: skip
    print(f"{'autocast':<9} {'variant':<8} {'step peak above start (MiB)':>28}")
    for r in rows:
        print(f"{r['autocast']:<9} {r['variant']:<8} {r['step_peak_mib']:>28.0f}")


if __name__ == "__main__":
    main()
