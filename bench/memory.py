"""Benchmark 5: peak memory (RSS) of a policy-gradient training step with a 49k vocabulary.

Each measurement runs in a fresh subprocess: load the SmolLM2-135M-shape model, take one warm-up
step (so gradients and AdamW state exist), reset the process's peak-RSS counter (Linux
/proc/self/clear_refs = 5), take the measured step, and read VmHWM. Reported: the step's peak
RSS above the resident set just before it (model, gradients, optimizer state, Python), and the
absolute peak.

The step: a batch of B sequences of P prompt + T completion tokens; per-token log-probs of the
completion tokens; loss = −Σ A·logp·mask / Σ mask; backward; AdamW step. Variants:
    ours       rlhflab.rollout.sampler.completion_logps (logits only for the completion
               positions, chunked selective log-softmax, no float32 log-softmax copy)
    naive      logits for every position, torch.log_softmax(logits.float()) over the whole
               batch, gather the sampled tokens
    trl_fused  TRL 1.16's fused LM head (`add_fused_lm_head`, `fused_lm_head=True`), for reference
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from bench import common

SHAPE = dict(B=2, P=8, T=8) if common.SMOKE else dict(B=4, P=32, T=224)
VARIANTS = ("ours", "naive", "trl_fused")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) * 1024


def worker(variant: str, checkpointing: bool) -> dict:
    import torch

    from bench import common

    common.setup()
    from bench.ours import set_checkpointing
    from rlhflab.rollout.sampler import Rollout, completion_logps

    _tok, model = common.load(common.model_dir(common.SMOL))
    set_checkpointing(model, checkpointing)  # explicit both ways, the same for every variant
    if checkpointing:
        model.config.use_cache = False
    if variant == "trl_fused":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
    B, P, T = SHAPE["B"], SHAPE["P"], SHAPE["T"]
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, V, (B, P), generator=g)
    comp = torch.randint(2, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    adv = torch.randn(B, generator=g)
    ro = Rollout(
        prompt,
        torch.ones(B, P, dtype=torch.long),
        comp,
        mask,
        torch.zeros(B, T),
        torch.zeros(B, dtype=torch.bool),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def step():
        opt.zero_grad(set_to_none=True)
        if variant == "ours":
            logp, _ = completion_logps(model, ro)
        else:
            ids = ro.input_ids
            am = ro.attention_mask
            pos = (am.cumsum(-1) - 1).clamp(min=0)
            if variant == "naive":
                logits = model(
                    input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False
                ).logits
                logp_all = torch.log_softmax(logits.float(), dim=-1)  # (B, P+T, V)
                logp = logp_all[:, P - 1 : -1].gather(-1, comp[..., None]).squeeze(-1)
            else:
                labels = ids.masked_fill(am == 0, -100)
                labels[:, :P] = -100
                out = model(
                    input_ids=ids,
                    attention_mask=am,
                    position_ids=pos,
                    labels=labels,
                    fused_lm_head=True,
                )
                logp = out.log_probs[:, P - 1 :]
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum()
        loss.backward()
        opt.step()

    step()  # warm-up: gradients and optimizer state now exist
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    t0 = time.perf_counter()
    step()
    dt = time.perf_counter() - t0
    peak = _status("VmHWM")
    return {
        "variant": variant,
        "before": before,
        "peak": peak,
        "step_peak": peak - before,
        "step_s": dt,
    }


def measure(variant: str, checkpointing: bool) -> dict:
    cmd = [sys.executable, "-m", "bench.memory", variant] + (
        ["--checkpointing"] if checkpointing else []
    )
    # Allocations >= 1 MiB go straight to mmap and back to the OS when freed, so RSS follows the
    # live tensors instead of what glibc keeps cached (the same setting for every variant).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=str(_root()), env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _root():
    from bench.common import BENCH_DIR

    return BENCH_DIR.parent


def run(*, reps: int, checkpointing: bool = False, variants=VARIANTS) -> dict:
    """Alternate the variants, each rep in fresh subprocesses; returns {variant: [results]}.
    Smoke mode (`common.SMOKE`): the first variant without checkpointing in a fresh subprocess,
    the others in this process (the same step, without a process start each; the numbers are
    not results)."""
    res: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(reps):
        for v in variants:
            fresh = not common.SMOKE or (v == variants[0] and not checkpointing)
            res[v].append(measure(v, checkpointing) if fresh else worker(v, checkpointing))
    return res


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], "--checkpointing" in sys.argv)))
