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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
