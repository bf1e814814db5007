"""Where a step's time goes: the stage timer, model FLOPs, MFU, tokens/s/GPU and the peak table.

One step of any trainer is split into named stages (`STAGES`); every second of the step is in
exactly one of them, `other` being the explicit remainder (metrics reductions, advantages, data
selection...). The harness (`rlhflab.trainers.loop.run`) opens a step with `StageTimer.begin`,
the trainers name their phases with `with timer.stage("rollout"): ...`, and the harness closes
the step with `StageTimer.end`, which returns the `perf/*` keys (docs/metrics.md).

FLOPs are *model* FLOPs from the shape (`rlhflab.plan.ModelShape`), the convention of PaLM
(Chowdhery et al. 2022, arXiv:2204.02311, appendix B: 6N + 12·L·H·Q·T per trained token) as
torchtitan and nanochat implement it (`6 * (nparams - nparams_embedding) + 12 * l * h * q * t`):
N counts every parameter but the input embedding (a table lookup, no matmul); the LM head is a
matmul and counts, tied or not. Attention has no causal discount (the convention) and
recomputation (activation checkpointing) is not counted. A forward-only pass is a third of it:
2N + 4·L·H·Q·T. MFU = achieved model FLOP/s ÷ peak FLOP/s of the card(s).

Pure arithmetic but `StageTimer` and `measure_matmul_tflops`; public so that other modules
(`rlhflab doctor`) can use the peak table and the matmul probe.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from typing import Any

#: The stages of a step, in the order of the plot's stacked bars. Each is a `perf/<stage>_s` key.
STAGES: tuple[str, ...] = (
    "rollout",  # sampling + reward scoring (policy gradient, distillation's sampling)
    "logp_old",  # log-probs of the pre-update policy, without gradients
    "ref",  # reference / teacher / initial-policy log-probs, without gradients
    "values",  # the critic's values at rollout time (PPO), without gradients
    "update",  # forward + backward + optimizer steps
    "weight_sync",  # pushing the new weights to the rollout engine / behaviour copy
    "eval",  # the harness's periodic held-out evaluation after the step
    "other",  # everything else: data selection, advantages, metrics reductions, samples
)

#: Dense (no sparsity) bf16/fp16 tensor-core peak TFLOP/s per card, FP32 accumulate, boost clock:
#: the vendor's "with sparsity" figure halved where the sheet gives only that. Sources (NVIDIA):
#: H100 SXM / PCIe / NVL and H200 SXM / NVL: H100 and H200 datasheets ("BFLOAT16 Tensor Core
#: 1,979 / 1,513 / 1,671 TFLOPS*", "* with sparsity"); A100: A100 datasheet (312, 624 sparse);
#: RTX A6000: datasheet ("Peak BF16 Tensor TFLOPS with FP32 Accumulate 154.8 | 309.7");
#: L40S: datasheet ("BF16 Tensor Core 362.05 | 733"); L4: datasheet (121, 242 sparse);
#: A10: datasheet ("BF16 Tensor Core 125 | 250"); RTX 4090: Ada Lovelace architecture whitepaper
#: appendix (FP16/BF16 tensor with FP32 accumulate 165.2, 330.4 sparse); RTX 3090: Ampere GA102
#: whitepaper (FP16/BF16 tensor with FP32 accumulate 71, 142 sparse).
#: Patterns are matched in order against `torch.cuda.get_device_name()` (case-insensitive).
PEAK_TFLOPS: tuple[tuple[str, str, float], ...] = (
    (r"H100.*PCIe", "H100 PCIe", 756.0),
    (r"H100.*NVL", "H100 NVL", 835.0),
    (r"H100", "H100 SXM", 989.0),
    (r"H200.*NVL", "H200 NVL", 835.0),
    (r"H200", "H200 SXM", 989.0),
    (r"A100", "A100", 312.0),
    (r"A6000", "RTX A6000", 154.8),
    (r"L40S", "L40S", 362.05),
    (r"\bL4\b", "L4", 121.0),
    (r"\bA10\b", "A10", 125.0),
    (r"4090", "RTX 4090", 165.2),
    (r"3090", "RTX 3090", 71.0),
)


def peak_tflops_of(device_name: str) -> float | None:
    """Dense bf16/fp16 tensor-core peak TFLOP/s of one card named `device_name` (as
    `torch.cuda.get_device_name()` spells it, e.g. "NVIDIA H100 80GB HBM3"), from `PEAK_TFLOPS`
    (vendor figures, no sparsity); None for a card not in the table (then MFU is only logged
    with `perf.peak_tflops`)."""
    for pattern, _, tflops in PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return tflops
    return None


def measure_matmul_tflops(
    n: int = 1024, repeats: int = 5, device: str = "cpu", dtype: Any = None
) -> float:
    """Measured matmul throughput in TFLOP/s: the best of `repeats` timed (n, n) @ (n, n)
    products (2·n³ FLOPs each) after one warm-up, in `dtype` (default float32) on `device`
    (CUDA: synchronized around each product). A *measured* peak, not the vendor's: on CPU it
    depends on the threads torch uses and on what else runs. Not used by the trainers (MFU on
    CPU needs `perf.peak_tflops`); for `rlhflab doctor`."""
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    a @ b
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


# -- Model FLOPs ------------------------------------------------------------------------------
def shape_from_hf_config(config: Any, name: str = "model"):
    """A `rlhflab.plan.ModelShape` from a transformers config object (or its dict), read the way
    `rlhflab plan` reads a config.json (`rlhflab.plan.shapes.shape_from_config`). Raises
    ValueError (one line) when a field is missing or not a positive integer, or for a
    mixture-of-experts model (whose FLOPs 6N does not describe)."""
    from rlhflab.plan.shapes import shape_from_config

    cfg = config if isinstance(config, dict) else config.to_dict()
    return shape_from_config(cfg, name=name, where="model config")


def dense_params(shape, *, lm_head: bool = True) -> int:
    """N of the FLOPs formulas: the parameters of every decoder block, the final norm and the LM
    head (V·h, a matmul, counted whether or not it is tied to the embedding), without the input
    embedding (a lookup). `lm_head=False`: a reward model / critic, whose head is a single
    h → 1 projection (h parameters) instead."""
    head = shape.vocab_size * shape.hidden_size if lm_head else shape.hidden_size
    return shape.num_hidden_layers * shape.layer_params() + shape.hidden_size + head


def attention_flops(shape, context: float) -> float:
    """Attention-score FLOPs of one token's forward pass at `context` tokens: 2 matmuls (q·kᵀ and
    the weighted sum of v) of 2·H·Q·T FLOPs per layer, i.e. 4·L·H·Q·T (PaLM appendix B's
    12·L·H·Q·T is forward + backward). No causal discount."""
    return 4.0 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim * context


def train_flops(shape, tokens: float, context: float, *, lm_head: bool = True) -> float:
    """Model FLOPs of training (forward + backward) on `tokens` tokens of sequences `context`
    tokens long: tokens · (6N + 12·L·H·Q·T) (PaLM, arXiv:2204.02311 appendix B)."""
    return tokens * (
        6.0 * dense_params(shape, lm_head=lm_head) + 3 * attention_flops(shape, context)
    )


def forward_flops(shape, tokens: float, context: float, *, lm_head: bool = True) -> float:
    """Model FLOPs of a forward pass without gradients (old / reference log-probs, values) or of
    decoding (one token at a time against a KV cache `context` tokens long): tokens · (2N +
    4·L·H·Q·T)."""
    return tokens * (2.0 * dense_params(shape, lm_head=lm_head) + attention_flops(shape, context))


def mfu(flops: float, seconds: float, peak_tflops: float, devices: int = 1) -> float | None:
    """Model FLOPs utilization: `flops` done in `seconds` by `devices` cards ÷ their peak
    (`peak_tflops` each, TFLOP/s). None when `seconds` or the peak is not positive."""
    if seconds <= 0 or not peak_tflops or peak_tflops <= 0:
        return None
    return flops / seconds / (peak_tflops * 1e12 * devices)


def tokens_per_s_per_gpu(tokens: float, step_seconds: float, gpus: int) -> float | None:
    """NeMo-RL's tokens/s/GPU: the step's total tokens ÷ step time ÷ number of GPUs. NeMo-RL
    (NVIDIA-NeMo/RL, nemo_rl/algorithms/grpo.py) logs
    `valid_tokens_per_sec_per_gpu = metrics["global_valid_toks"] / total_time / total_num_gpus`
    (global_valid_toks: the tokens the loss counts, over every rank; total_time: the whole
    step); its docs/about/performance-summary.md: "Tokens/sec/GPU = Total Tokens Processed /
    (Time for Stage × Number of GPUs)". `gpus`: the processes of the run (CPU ranks on CPU).
    None when the step time is not positive."""
    if step_seconds <= 0 or gpus < 1:
        return None
    return tokens / step_seconds / gpus


# -- The stage timer --------------------------------------------------------------------------
class StageTimer:
    """Wall seconds per stage of one step, FLOPs per stage, and on CUDA the peak memory per stage.

    The timer always has one active stage; `stage(name)` makes `name` active for its block and
    gives the time back to the stage around it when it ends (nested blocks are not counted twice:
    the outer stage is paused). Time in no named block goes to `other`. So the stages partition
    the interval from `begin()` to `end()`; the harness measures the step with its own clock, and
    `perf/step_s` is that measurement, not the stages' sum.

    On CUDA every stage boundary calls `torch.cuda.synchronize()` so that kernels queued by one
    stage are counted in it, not in the next (a few microseconds per boundary, and it stops the
    host running ahead of the GPU across a boundary), and reads and resets the peak allocated
    memory (`torch.cuda.max_memory_allocated` / `reset_peak_memory_stats`): `peak_gib[stage]` is
    the largest allocation seen while that stage was active. On CPU there is neither.

    `enabled=False` (`perf.stage_timers: false`, or the environment variable
    `RLHFLAB_STAGE_TIMERS=0`): `stage` is a no-op and `end` returns {} — for measuring the
    timers' own cost (bench/stage_timer_overhead.py).
    """

    def __init__(self, device: Any = "cpu", *, enabled: bool = True) -> None:
        self.cuda = str(device).startswith("cuda")
        self.enabled = enabled and os.environ.get("RLHFLAB_STAGE_TIMERS", "1") != "0"
        self.seconds: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self.generated_tokens = 0.0
        self.trained_tokens = 0.0
        self._stack: list[str] = ["other"]
        self._t = 0.0
        self.shape = None  # the trained model's ModelShape (set by the harness); None: no FLOPs
        self.lm_head = True  # False for a reward model (a score head instead of the LM head)

    def synchronize(self) -> None:
        """Wait for the device's queued work (CUDA, timers enabled; else nothing): the harness
        calls it before each read of its own step clock, so that the step and its stages see the
        same work."""
        if self.enabled and self.cuda:
            import torch

            torch.cuda.synchronize()

    def begin(self) -> None:
        """Open a step: every stage at zero, `other` active (on CUDA: peak memory reset; call
        `synchronize` first)."""
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.flops, self.peak_bytes = {}, {}
        self.generated_tokens = self.trained_tokens = 0.0
        self._stack = ["other"]
        if self.enabled and self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        self._t = time.perf_counter()

    def _switch(self) -> None:
        """Charge the time (and on CUDA the peak memory) since the last switch to the active stage."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            name = self._stack[-1]
            peak = torch.cuda.max_memory_allocated()
            self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)
            torch.cuda.reset_peak_memory_stats()
        now = time.perf_counter()
        name = self._stack[-1]
        self.seconds[name] = self.seconds.get(name, 0.0) + (now - self._t)
        self._t = now

    @contextmanager
    def stage(self, name: str):
        """Charge the block's time to stage `name` (one of `STAGES`)."""
        if not self.enabled:
            yield
            return
        if name not in STAGES:
            raise ValueError(f"stage {name!r} is not one of {', '.join(STAGES)}")
        self._switch()
        self._stack.append(name)
        try:
            yield
        finally:
            self._switch()
            self._stack.pop()

    def add_flops(self, stage: str, flops: float) -> None:
        """Model FLOPs done in `stage` by this rank (for its achieved TFLOP/s and MFU)."""
        if self.enabled:
            self.flops[stage] = self.flops.get(stage, 0.0) + float(flops)

    def train(self, stage: str, tokens: float, context: float) -> None:
        """`tokens` tokens of sequences `context` long trained (forward + backward) in `stage`:
        adds `train_flops` (nothing without a shape)."""
        if self.enabled and self.shape is not None:
            self.add_flops(stage, train_flops(self.shape, tokens, context, lm_head=self.lm_head))

    def forward(self, stage: str, tokens: float, context: float) -> None:
        """`tokens` tokens forwarded without gradients (or decoded against a KV cache) at
        `context` tokens in `stage`: adds `forward_flops` (nothing without a shape)."""
        if self.enabled and self.shape is not None:
            self.add_flops(stage, forward_flops(self.shape, tokens, context, lm_head=self.lm_head))

    def count(self, *, generated: float = 0, trained: float = 0) -> None:
        """Tokens of the step over every rank: `generated` by the rollout, `trained` (the tokens
        the loss counts, NeMo-RL's valid tokens)."""
        if self.enabled:
            self.generated_tokens += float(generated)
            self.trained_tokens += float(trained)

    def end(self, step_s: float, *, devices: int = 1, peak_tflops: float | None = None) -> dict:
        """Close the step and return its `perf/` keys. `step_s`: the step's wall time as the
        harness measured it; `devices`: processes of the run; `peak_tflops`: one card's peak
        (None: no MFU). Keys: `perf/<stage>_s` for every stage, `perf/gen_tokens_per_s`
        (generated tokens ÷ rollout seconds), `perf/train_tokens_per_s_per_gpu`,
        `perf/<stage>_tflops` (achieved model TFLOP/s per device, stages with FLOPs), with a
        peak `perf/mfu_<stage>`, on CUDA `perf/peak_mem_<stage>_gib`."""
        if not self.enabled:
            return {}
        self._switch()
        out = {f"perf/{name}_s": self.seconds.get(name, 0.0) for name in STAGES}
        rollout_s = self.seconds.get("rollout", 0.0)
        if self.generated_tokens and rollout_s > 0:
            out["perf/gen_tokens_per_s"] = self.generated_tokens / rollout_s
        per_gpu = tokens_per_s_per_gpu(self.trained_tokens, step_s, devices)
        if self.trained_tokens and per_gpu is not None:
            out["perf/train_tokens_per_s_per_gpu"] = per_gpu
        for name, flops in self.flops.items():
            seconds = self.seconds.get(name, 0.0)
            if seconds <= 0:
                continue
            out[f"perf/{name}_tflops"] = flops / seconds / 1e12
            if peak_tflops:
                out[f"perf/mfu_{name}"] = mfu(flops, seconds, peak_tflops)
        for name, nbytes in self.peak_bytes.items():
            out[f"perf/peak_mem_{name}_gib"] = nbytes / 2**30
        if self.peak_bytes:
            out["perf/peak_mem_gib"] = max(self.peak_bytes.values()) / 2**30
        return out


def planned_peak_gib(cfg, shape, *, gpus: int, gpu_memory_gib: float,
                     prompt_len: int | None = None) -> float | None:  # fmt: skip
    """`rlhflab plan`'s predicted per-GPU peak (GiB) for run config `cfg` on model `shape`
    (`rlhflab.plan.inputs_from_config` + `estimate`: resident state + the largest phase), or None
    when the plan does not cover the run (a trainer it does not plan, a bad field).
    `prompt_len`: prompt tokens where the config does not bound them (a run passes its longest
    training prompt); None: the plan's default (256)."""
    from rlhflab.plan import estimate, inputs_from_config

    try:
        inputs, _ = inputs_from_config(cfg, shape, gpus=gpus, gpu_memory_gib=gpu_memory_gib,
                                       prompt_len=prompt_len)  # fmt: skip
        return float(estimate(shape, inputs)["per_gpu_gib"])
    except (ValueError, AttributeError, KeyError, TypeError):
        return None
