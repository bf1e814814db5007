"""Generation throughput of the rollout engines against `model.generate` (one process, A B C ...).

    python -m bench.engines                       # tiny and smol, the defaults below
    python -m bench.engines --models tiny --reps 5
    python -m bench.engines --smoke               # 4 prompts x 2 x 8 tokens, seconds

Runs in the vLLM environment (README "Rollout engines"). For each model (`tiny`: 4.2 M, `smol`:
SmolLM2-135M's shape, random init; built and loaded as `bench/common.py` does, one model object
for every side) it generates `prompts` distinct prompts (all of one token length) × `group`
samples × `max_new` new tokens at temperature 1 and fixed length (no side can stop at EOS) with:

- `generate`  — `model.generate(do_sample=True, num_return_sequences=group)`, HF's standard way to
                draw several samples per prompt (it repeats each prompt `group` times before the
                prefill; TRL's GRPO does the same with a repeated batch);
- `hf`        — our engine, `make_engine(None, model, tokenizer)`, with prefix sharing (each
                prompt prefilled once, its KV cache copied to its group);
- `hf_noshare`— the same sampler call with `share_prefix=False` (every row prefilled): what
                prefix sharing alone buys (the engine has no switch, so this calls `sample`
                directly with the arguments `HFEngine.generate` passes);
- `vllm`      — the `vllm` engine as `make_engine` builds it for the trainer (fp32, prefix
                caching on, in-process engine core, `enforce_eager`), its start-up not timed.

GPU mode (`--gpu`, bench/RESULTS.md "Rollout engines on a GPU"): random-init Qwen3 shapes
(0.6B / 1.7B / 4B configs, no Hub) × batches of 64 / 256 / 1024 sequences, `--max-new` new tokens
at a fixed length, sides side by side in one run: `generate` (plain HF generate, default cache),
`generate_static` (HF generate with `cache_implementation="static"`), `hf_eager` (our engine's
eager decode loop: the engine before issue #26) and `hf_static` (its static decode: static KV
cache, device-side stop checks, CUDA-graph step). Weights in `--dtype` (bf16 on CUDA). Reports
generated tokens/s, the mean GPU utilisation sampled during each timed call
(`torch.cuda.utilization()`, else nvidia-smi) and peak memory; writes JSON and a markdown table
naming the card. `--device cpu --shapes tiny --batches 4 --max-new 4` is the CPU smoke mode:

    python -m bench.engines --gpu                                 # on a CUDA machine
    python -m bench.engines --gpu --device cpu --shapes tiny --batches 4 --max-new 4

Sides alternate per rep after one warm-up call each. Threads: one. torch.set_num_threads(1) and
OMP_NUM_THREADS=1 before torch loads; vLLM's engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, as the engine sets it), where vLLM binds no OpenMP threads of
its own (its OMP binding, VLLM_CPU_OMP_THREADS_BIND, is applied only to worker processes of the
multiprocess executor), so its kernels run on the caller's single-thread pool. Every timed call
also records process CPU time / wall time, which shows the threads actually used (≈ 1.0).
Defaults: tiny 64 prompts × 8 × 256, 3 reps; smol 8 prompts × 8 × 256, 2 reps, without
`hf_noshare` (64 × 8 on the 135M shape is ~12 min per side and rep on one core). vLLM's
`max_num_batched_tokens` is raised so that no prefill is chunked (vLLM 0.32's CPU runner crashes
on a chunked prefill of a seeded request; bench/README.md). Results: `bench/engines_results.json`;
`--table` prints RESULTS.md's table from it.
"""

from __future__ import annotations

import os

# Before torch (and vLLM) load: one OpenMP thread for everything in this process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import argparse
import contextlib
import functools
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from bench import common

SIDES = ("generate", "hf", "hf_noshare", "vllm")
TARGET = 2.0  # the target: the best engine >= 2x generate


def _kv_gib(model, rows: int, tokens: int) -> int:
    """GiB of fp32 KV cache for `rows` sequences of `tokens` tokens (+25%, at least 1)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4
    return max(1, math.ceil(1.25 * rows * tokens * per_token / 2**30))


def _fixed_length_vllm(engine) -> None:
    """Bench-side hook: the engine has no switch for "never stop at EOS", so its stop set is
    emptied (-1 never matches, as `sample`'s eos in bench/ours.py) and every request it sends
    gets vLLM's `ignore_eos=True` (EOS, and the generation config's EOS ids, stop nothing)."""
    engine.stop_token_ids = (-1,)
    llm_generate = engine.llm.generate

    def generate(prompts, params, **kwargs):
        for p in params if isinstance(params, list) else [params]:
            p.ignore_eos = True
        return llm_generate(prompts, params, **kwargs)

    engine.llm.generate = generate


@contextlib.contextmanager
def _llm_kwargs(**kwargs):
    """Bench-side hook: extra `vllm.LLM(...)` arguments (None: vLLM's default) while the engine
    is built; the trainer's engine passes none of these."""
    import vllm

    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    llm = vllm.LLM
    if kwargs:
        vllm.LLM = functools.partial(llm, **kwargs)
    try:
        yield
    finally:
        vllm.LLM = llm


def _timed(fn) -> tuple[object, float, float]:
    """(result, wall s, process CPU s / wall s)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    return out, wall, (time.process_time() - c0) / wall


def run_model(
    scale: str, *, prompts_n: int, group: int, max_new: int, reps: int, warmup_tokens: int,
    sides: tuple[str, ...], log, vllm_max_num_seqs: int | None = None,
    vllm_max_num_batched_tokens: int | None = -1,
) -> dict:  # fmt: skip
    from rlhflab.config import RolloutConfig, VLLMConfig
    from rlhflab.data.formatting import encode_prompt
    from rlhflab.rollout.engines import SamplingParams, make_engine
    from rlhflab.rollout.sampler import left_pad, sample

    path = common.model_dir(scale)
    tok, model = common.load(path)
    model.eval()
    plen = common.modal_prompt_length(tok)
    prompts = [
        encode_prompt(tok, p) for p in common.prompt_texts(tok, prompts_n, seed=2, length=plen)
    ]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    rows = prompts_n * group

    engines = {}
    if "hf" in sides or "hf_noshare" in sides:
        hf = make_engine(None, model, tok)
        hf.stop_token_ids = (-1,)  # fixed length: a stop id that never occurs (bench/ours.py)
        engines["hf"] = hf
    startup_s = None
    if "vllm" in sides:
        rcfg = RolloutConfig(
            engine="vllm",
            vllm=VLLMConfig(
                dtype="float32",
                enable_prefix_caching=True,
                # room for the whole batch at once (the default 1 GiB holds ~23k smol tokens)
                cpu_kvcache_space_gb=_kv_gib(model, rows, plen + max_new),
            ),
        )
        if vllm_max_num_batched_tokens == -1:
            # Every prompt's prefill in one step: with vLLM's CPU default (4096) the prefill of
            # 512 rows x 18 tokens is chunked, and a chunked prefill of a seeded request crashes
            # vLLM 0.32's CPU runner ("CPU Generator does not use offset": it rewinds the
            # request's generator with set_offset, which only CUDA generators have).
            vllm_max_num_batched_tokens = max(4096, rows * plen)
        t0 = time.perf_counter()
        with _llm_kwargs(
            max_num_seqs=vllm_max_num_seqs, max_num_batched_tokens=vllm_max_num_batched_tokens
        ):
            engines["vllm"] = make_engine(rcfg, model, tok)
        startup_s = time.perf_counter() - t0
        _fixed_length_vllm(engines["vllm"])
        torch.set_num_threads(1)  # vLLM's worker makes this a no-op afterwards; check it held
    log(f"[{scale}] torch threads after engine start-up: {torch.get_num_threads()}")

    gens = {s: torch.Generator().manual_seed(i) for i, s in enumerate(SIDES)}

    def call(side: str, new: int) -> int:
        """One generation of `new` tokens per row; returns completion tokens generated."""
        if side == "generate":
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gens[side])))
            out = common.generate_sampled(
                model, ids, mask, pad_token_id=tok.pad_token_id, max_new=new, n=group
            )
            assert out.shape == (rows, plen + new), out.shape
            return out.size(0) * (out.size(1) - plen)
        params = SamplingParams(n=group, max_new_tokens=new, temperature=1.0)
        if side == "hf_noshare":
            hf = engines["hf"]
            ro = sample(
                model,
                [p for p in prompts for _ in range(group)],
                max_new_tokens=new,
                eos_token_id=hf.stop_token_ids[0],
                pad_token_id=hf.pad_token_id,
                temperature=1.0,
                generator=gens[side],
                share_prefix=False,
            )
        else:
            ro = engines[side].generate(prompts, params, generator=gens[side])
        assert ro.completion_ids.shape == (rows, new) and int(ro.mask.sum()) == rows * new
        return int(ro.mask.sum())

    res = {s: {"tokens_per_s": [], "wall_s": [], "cpu_per_wall": []} for s in sides}
    for s in sides:  # warm-up: one short generation each
        _, wall, cpu = _timed(lambda s=s: call(s, warmup_tokens))
        log(f"[{scale}] warm-up {s}: {wall:.1f} s ({warmup_tokens} tokens), cpu/wall {cpu:.2f}")
    for r in range(reps):
        for s in sides:
            n, wall, cpu = _timed(lambda s=s: call(s, max_new))
            res[s]["tokens_per_s"].append(n / wall)
            res[s]["wall_s"].append(round(wall, 3))
            res[s]["cpu_per_wall"].append(round(cpu, 3))
            res[s]["tokens"] = n
            log(f"[{scale}] rep {r} {s}: {n / wall:.0f} tok/s ({wall:.1f} s), cpu/wall {cpu:.2f}")

    base = res["generate"]["tokens_per_s"] if "generate" in res else None
    for v in res.values():
        v.update(common.summary(v.pop("tokens_per_s")))
        v["values"] = [round(x, 2) for x in v["values"]]
        if base is not None:
            v["ratio_vs_generate"] = v["median"] / res["generate"]["median"]
            v["pair_ratios_vs_generate"] = [
                round(a / b, 4) for a, b in zip(v["values"], res["generate"]["values"], strict=True)
            ]
    if "hf" in res and "hf_noshare" in res:
        res["hf"]["pair_ratios_vs_hf_noshare"] = [
            round(a / b, 4)
            for a, b in zip(res["hf"]["values"], res["hf_noshare"]["values"], strict=True)
        ]
    best = max(
        (s for s in res if s in ("hf", "vllm")), key=lambda s: res[s]["median"], default=None
    )
    out = {
        "settings": {
            "prompts": prompts_n, "group": group, "rows": rows, "prompt_tokens": plen,
            "max_new_tokens": max_new, "temperature": 1.0, "fixed_length": True, "reps": reps,
            "warmup_tokens": warmup_tokens, "order": list(sides),
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "sides": res,
        "vllm_startup_s": startup_s,
        "vllm_max_num_seqs": vllm_max_num_seqs or "vLLM default (256 on CPU)",
        "vllm_max_num_batched_tokens": vllm_max_num_batched_tokens or "vLLM default (4096 on CPU)",
        "best_engine": best,
    }  # fmt: skip
    if best and base is not None:
        out["best_ratio_vs_generate"] = res[best]["ratio_vs_generate"]
        out["target"] = TARGET
        out["met"] = res[best]["ratio_vs_generate"] >= TARGET
    if "vllm" in engines:
        engines["vllm"].close()
    return out


def machine() -> dict:
    """common.machine() without TRL (not part of this benchmark), plus vLLM and the threads."""
    from importlib.metadata import PackageNotFoundError, version

    info = {k: v for k, v in common.machine().items() if k != "trl"}
    info["threads"] = torch.get_num_threads()
    try:
        info["vllm"] = version("vllm-cpu")
    except PackageNotFoundError:
        try:
            info["vllm"] = version("vllm")
        except PackageNotFoundError:
            info["vllm"] = None
    info["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    info["vllm_enable_v1_multiprocessing"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    return info


def _per_cpu_s(v: dict) -> list[float]:
    """Tokens per second of process CPU time, per rep: tokens/s ÷ (CPU s / wall s). Other jobs
    taking the core lower tokens/s but not this (up to cache and memory-bandwidth effects)."""
    return [t / c for t, c in zip(v["values"], v["cpu_per_wall"], strict=True)]


def table(path: Path) -> str:
    """The markdown table of RESULTS.md ("Rollout engines: generation") from a results file:
    tokens/s median (min–max), ratio vs generate (medians; per-rep pairs), the same per CPU
    second, and whether the best engine meets the target."""
    data = json.loads(path.read_text())
    lines = [
        "| model | prompts×n × new | side | tokens/s: median (min–max) | ratio vs generate "
        "| per-rep ratios | tokens per CPU-s: median | ratio (CPU) | target ≥ 2× met? |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    runs = [("", data), *((f" ({tag})", run) for tag, run in data.get("runs", {}).items())]
    for label, run in runs:
        for m, r in run["models"].items():
            st = r["settings"]
            shape = f"{st['prompts']}×{st['group']} × {st['max_new_tokens']}"
            gen_cpu = statistics.median(_per_cpu_s(r["sides"]["generate"]))
            for side, v in r["sides"].items():
                cpu = statistics.median(_per_cpu_s(v))
                met = ""
                if side == r.get("best_engine") and "met" in r and not label:
                    met = "yes" if r["met"] else "**no**"
                gen = side == "generate"
                pairs = ", ".join(f"{x:.2f}" for x in v.get("pair_ratios_vs_generate", []))
                ratio = "—" if gen else f"{v['ratio_vs_generate']:.2f}"
                ratio_cpu = "—" if gen else f"{cpu / gen_cpu:.2f}"
                lines.append(
                    f"| {m}{label} | {shape} | `{side}` | {v['median']:,.0f} "
                    f"({v['min']:,.0f}–{v['max']:,.0f}) | {ratio} | {'' if gen else pairs} | "
                    f"{cpu:,.0f} | {ratio_cpu} | {met} |"
                )
    return "\n".join(lines)


# Qwen3 configurations (Hugging Face Qwen/Qwen3-*: config.json), random-init; "tiny" for the CPU
# smoke mode; "probe" the 1.41 B shape of issue #26 (vocabulary set by --probe-vocab).
QWEN3_SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512),
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=151936),
    "4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, intermediate_size=9728, vocab_size=151936),
    "probe": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, intermediate_size=6144, vocab_size=8192),
}  # fmt: skip
GPU_SIDES = ("generate", "generate_static", "hf_eager", "hf_static")


def qwen3_model(shape: str, device: str, dtype: torch.dtype, vocab: int | None = None):
    """A random-init Qwen3ForCausalLM of `QWEN3_SHAPES[shape]` built directly on `device` in
    `dtype` (no float32 copy on the host), eval mode, tied embeddings, EOS = vocab − 1."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = dict(QWEN3_SHAPES[shape])
    if vocab:
        kw["vocab_size"] = vocab
    cfg = Qwen3Config(**kw, max_position_embeddings=4096, tie_word_embeddings=True,
                      eos_token_id=kw["vocab_size"] - 1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None  # fixed length: generate never stops
    return model.eval()


class UtilSampler:
    """Samples GPU utilisation (%) every `period_s` in a thread between `start()` and `stop()`:
    `torch.cuda.utilization()` (NVML), else `nvidia-smi`; `mean()` is None where neither works
    (CPU, no NVML)."""

    def __init__(self, device: str, period_s: float = 0.1) -> None:
        import threading

        self.device, self.period_s, self.samples = device, period_s, []
        self.source = None
        self._stop = threading.Event()
        self._thread = None
        if device.startswith("cuda"):
            try:
                torch.cuda.utilization()
                self.source = "torch.cuda.utilization"
            except Exception:  # no NVML binding: try nvidia-smi
                import shutil

                self.source = "nvidia-smi" if shutil.which("nvidia-smi") else None

    def _read(self) -> float | None:
        if self.source == "torch.cuda.utilization":
            return float(torch.cuda.utilization())
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
             "-i", str(torch.cuda.current_device())],
            capture_output=True, text=True, timeout=5,
        )  # fmt: skip
        return float(out.stdout.split()[0]) if out.returncode == 0 else None

    def start(self) -> None:
        import threading

        self.samples, self._stop = [], threading.Event()
        if self.source is None:
            return

        def loop() -> None:
            while not self._stop.wait(self.period_s):
                v = self._read()
                if v is not None:
                    self.samples.append(v)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return statistics.mean(self.samples) if self.samples else None


def gpu_run_shape(shape: str, batches: list[int], *, device: str, dtype: torch.dtype, group: int,
                  prompt_len: int, max_new: int, reps: int, sides: tuple[str, ...], sync_every: int,
                  log, vocab: int | None = None) -> dict:  # fmt: skip
    """Every side on every batch of one shape; a side that runs out of memory is recorded as
    such and the others go on. Returns {batch: {side: {...}}} plus the parameter count."""
    from rlhflab.rollout.engines import SamplingParams
    from rlhflab.rollout.engines.hf import HFEngine

    model = qwen3_model(shape, device, dtype, vocab)
    V = model.config.vocab_size
    engines = {
        "hf_eager": HFEngine(model, pad_token_id=0, stop_token_ids=(-1,), decode="eager"),
        "hf_static": HFEngine(model, pad_token_id=0, stop_token_ids=(-1,), decode="static",
                              sync_every=sync_every, cuda_graph=True),
    }  # fmt: skip
    cuda = device.startswith("cuda")
    util = UtilSampler(device)
    out = {"parameters": sum(p.numel() for p in model.parameters()), "vocab": V, "batches": {}}
    for rows in batches:
        grp = min(group, rows)  # samples per prompt; rows = n_prompts × grp
        n_prompts = max(1, rows // grp)
        g = torch.Generator().manual_seed(rows)
        prompts = torch.randint(1, V - 2, (n_prompts, prompt_len), generator=g)
        ids = prompts.to(device)
        mask = torch.ones_like(ids)
        lists = prompts.tolist()
        gens = {s: torch.Generator(device=device).manual_seed(i) for i, s in enumerate(GPU_SIDES)}

        def call(side: str, new: int, ids=ids, mask=mask, lists=lists, gens=gens,
                 n_prompts=n_prompts, grp=grp) -> int:  # fmt: skip
            if side.startswith("generate"):
                extra = {"cache_implementation": "static"} if side == "generate_static" else {}
                with torch.no_grad():
                    o = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                       num_return_sequences=grp, temperature=1.0, top_p=1.0,
                                       top_k=0, max_new_tokens=new, min_new_tokens=new,
                                       pad_token_id=0, **extra)  # fmt: skip
                return o.size(0) * (o.size(1) - prompt_len)
            params = SamplingParams(n=grp, max_new_tokens=new, temperature=1.0)
            ro = engines[side].generate(lists, params, generator=gens[side])
            return int(ro.mask.sum())

        res = {}
        for side in sides:
            try:
                call(side, min(4, max_new))  # warm-up
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                vals, utils = [], []
                for _ in range(reps):
                    util.start()
                    t0 = time.perf_counter()
                    n = call(side, max_new)
                    if cuda:
                        torch.cuda.synchronize()
                    wall = time.perf_counter() - t0
                    u = util.stop()
                    vals.append(n / wall)
                    utils.append(u)
                    log(f"[{shape} B={n_prompts * grp}] {side}: {n / wall:,.0f} tok/s "
                        f"({wall:.2f} s, GPU util {u if u is None else round(u)}%)")  # fmt: skip
                res[side] = {
                    "tokens_per_s": statistics.median(vals), "values": [round(v, 1) for v in vals],
                    "tokens": n, "gpu_util_pct": None if None in utils else statistics.mean(utils),
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                }  # fmt: skip
            except torch.cuda.OutOfMemoryError as e:
                log(f"[{shape} B={n_prompts * grp}] {side}: out of memory ({str(e)[:120]})")
                res[side] = {"oom": True}
                if cuda:
                    torch.cuda.empty_cache()
            except Exception as e:  # one side failing (e.g. generate's auto-compile) ends no run
                msg = f"{type(e).__name__}: {str(e)[:200]}"
                log(f"[{shape} B={n_prompts * grp}] {side}: FAILED {msg}")
                res[side] = {"error": msg}
        base = res.get("generate", {}).get("tokens_per_s")
        for v in res.values():
            if base and "tokens_per_s" in v:
                v["ratio_vs_generate"] = v["tokens_per_s"] / base
        out["batches"][n_prompts * grp] = res
    engines.clear()
    model = None  # free the weights before the next shape
    if cuda:
        torch.cuda.empty_cache()
    return out


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def gpu_table(data: dict) -> str:
    """The markdown table of a GPU-mode results file: one row per shape × batch × side."""
    card = data["machine"].get("card", "?")
    st = data["settings"]
    lines = [
        f"Card: **{card}** (torch {data['machine']['torch']}, transformers "
        f"{data['machine']['transformers']}); weights {st['dtype']}, prompts of "
        f"{st['prompt_len']} tokens × {st['group']} samples, {st['max_new']} new tokens at a "
        f"fixed length, temperature 1; tokens/s = generated tokens / wall s (median of "
        f"{st['reps']}); GPU util = mean of `{data['machine'].get('util_source')}` samples "
        "during the timed calls.",
        "",
        "| shape | params | sequences | side | tokens/s | vs `generate` | GPU util % | peak GiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, r in data["shapes"].items():
        for batch, res in r["batches"].items():
            for side, v in res.items():
                if v.get("oom") or v.get("error"):
                    what = "out of memory" if v.get("oom") else f"failed: {v['error'][:80]}"
                    lines.append(f"| {shape} | {_params(r['parameters'])} | {batch} | "
                                 f"`{side}` | {what} | | | |")  # fmt: skip
                    continue
                ratio = v.get("ratio_vs_generate")
                util = v.get("gpu_util_pct")
                peak = v.get("peak_gib")
                lines.append(
                    f"| {shape} | {_params(r['parameters'])} | {batch} | `{side}` | "
                    f"{v['tokens_per_s']:,.0f} | {'—' if ratio is None else f'{ratio:.2f}'} | "
                    f"{'—' if util is None else f'{util:.0f}'} | "
                    f"{'—' if peak is None else f'{peak:.1f}'} |"
                )
    return "\n".join(lines)


def gpu_main(a) -> None:
    """`--gpu`: see the module docstring."""
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("bench.engines --gpu: --device cuda but torch sees no CUDA device")
    dtype = getattr(torch, a.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    if device == "cpu":
        torch.set_num_threads(a.threads)
    logging.getLogger("rlhflab.rollout.sampler").setLevel(logging.INFO)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t_start:7.1f}s {msg}", flush=True)

    info = {k: v for k, v in common.machine().items() if k != "trl"}
    info["card"] = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"CPU ({info.get('cpu')}, {torch.get_num_threads()} threads)"
    )
    info["util_source"] = UtilSampler(device).source
    settings = {"dtype": str(dtype).removeprefix("torch."), "group": a.group,
                "prompt_len": a.prompt_len, "max_new": a.max_new, "reps": a.reps,
                "sync_every": a.sync_every, "device": device, "sides": a.gpu_sides}  # fmt: skip
    data = {"machine": info, "settings": settings, "shapes": {}}
    out, table_out = Path(a.out), Path(a.table_out)
    for shape in a.shapes:
        data["shapes"][shape] = gpu_run_shape(
            shape, a.batches, device=device, dtype=dtype, group=a.group,
            prompt_len=a.prompt_len, max_new=a.max_new, reps=a.reps,
            sides=tuple(a.gpu_sides), sync_every=a.sync_every, log=log, vocab=a.probe_vocab
            if shape == "probe" else None,
        )  # fmt: skip
        data["total_s"] = round(time.perf_counter() - t_start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=2) + "\n")
        table_out.parent.mkdir(parents=True, exist_ok=True)
        table_out.write_text(gpu_table(data) + "\n")
    log(f"wrote {out} and {table_out}")
    print(table_out.read_text())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_argument_group("GPU mode (--gpu)")
    g.add_argument("--gpu", action="store_true", help="the GPU mode (module docstring)")
    g.add_argument("--device", help="cuda (default where available) or cpu")
    g.add_argument("--shapes", nargs="+", default=["0.6b", "1.7b", "4b"], choices=QWEN3_SHAPES)
    g.add_argument("--batches", nargs="+", type=int, default=[64, 256, 1024])
    g.add_argument("--gpu-sides", nargs="+", default=list(GPU_SIDES), choices=GPU_SIDES)
    g.add_argument("--prompt-len", type=int, default=40)
    g.add_argument("--sync-every", type=int, default=8, help="hf_static's host-check period")
    g.add_argument("--dtype", help="weights dtype (default bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--probe-vocab", type=int, default=8192, help="vocabulary of shape 'probe'")
    g.add_argument("--threads", type=int, default=1, help="torch threads in CPU mode")
    g.add_argument("--table-out", help="markdown table (default bench/.cache/engines_gpu.md)")
    ap.add_argument("--models", nargs="+", default=[common.TINY, common.SMOL])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--smol-prompts", type=int, default=8, help="prompts for smol135m")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smol-reps", type=int, default=2)
    ap.add_argument("--warmup-tokens", type=int, default=8)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    ap.add_argument("--smol-sides", nargs="+", default=["generate", "hf", "vllm"], choices=SIDES)
    ap.add_argument(
        "--vllm-max-num-seqs", type=int, default=None,
        help="vLLM's max_num_seqs (default: vLLM's, 256 on CPU, as the trainer's engine)",
    )  # fmt: skip
    ap.add_argument(
        "--vllm-max-num-batched-tokens", type=int, default=-1,
        help="vLLM's max_num_batched_tokens (default: rows x prompt tokens, at least 4096, so "
        "that no prefill is chunked; 0: vLLM's default, 4096 on CPU)",
    )  # fmt: skip
    ap.add_argument("--tag", help="add this run to --out under runs[TAG] instead of replacing it")
    ap.add_argument("--smoke", action="store_true", help="4 prompts x 2 x 8 tokens, 1 rep")
    ap.add_argument(
        "--out",
        help="results file (default bench/engines_results.json; with --smoke "
        "bench/.cache/engines_smoke.json, so a smoke run never replaces measured results)",
    )
    ap.add_argument("--table", action="store_true", help="print the markdown table of --out")
    a = ap.parse_args(argv)
    if a.gpu:
        if argv is None and "--max-new" not in sys.argv[1:]:
            a.max_new = 128
        if argv is None and "--reps" not in sys.argv[1:]:
            a.reps = 2
        a.out = a.out or str(common.BENCH_DIR / ".cache" / "engines_gpu.json")
        a.table_out = a.table_out or str(common.BENCH_DIR / ".cache" / "engines_gpu.md")
        gpu_main(a)
        return
    if a.out is None:
        name = ".cache/engines_smoke.json" if a.smoke else "engines_results.json"
        a.out = str(common.BENCH_DIR / name)
    if a.table:
        print(table(Path(a.out)))
        return
    common.setup(threads=1)
    if a.smoke:
        a.prompts, a.smol_prompts, a.group, a.max_new, a.reps, a.smol_reps = 4, 4, 2, 8, 1, 1
        a.warmup_tokens = 2
    t_start = time.perf_counter()
    info = machine()  # before the runs (vLLM's worker later no-ops torch.set_num_threads)

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t_start:7.1f}s {msg}", flush=True)

    out = Path(a.out)
    base = json.loads(out.read_text()) if a.tag and out.exists() else {}

    def save() -> None:  # after every model, so a run cut short keeps what it measured
        payload = {
            "machine": {**info, "load_avg_at_end": list(os.getloadavg())},
            "total_s": round(time.perf_counter() - t_start, 1),
            "argv": argv if argv is not None else sys.argv[1:],
            "models": results,
        }
        if a.tag:  # an extra variant: added to the existing file under "runs"
            payload = {**base, "runs": {**base.get("runs", {}), a.tag: payload}}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2) + "\n")

    results = {}
    for m in a.models:
        smol = m == common.SMOL
        results[m] = run_model(
            m,
            prompts_n=(a.smol_prompts or a.prompts) if smol else a.prompts,
            group=a.group,
            max_new=a.max_new,
            reps=a.smol_reps if smol else a.reps,
            warmup_tokens=a.warmup_tokens,
            sides=tuple(a.smol_sides or a.sides) if smol else tuple(a.sides),
            log=log,
            vllm_max_num_seqs=a.vllm_max_num_seqs,
            vllm_max_num_batched_tokens=a.vllm_max_num_batched_tokens or None,
        )
        log(f"[{m}] " + ", ".join(
            f"{s} {v['median']:.0f} tok/s ({v.get('ratio_vs_generate', float('nan')):.2f}x)"
            for s, v in results[m]["sides"].items()
        ))  # fmt: skip
        save()
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
