"""Issue #26's GPU probe of rollout speed: the built-in engine against plain `generate`, one run.

    python -m bench.gpu_probe_engine                     # on a CUDA machine (~3-5 min)
    python -m bench.gpu_probe_engine --device cpu --shape tiny --prompts 2 --max-new 4   # smoke

The rollout of the GRPO probe in issue #26: a random-init Qwen3 shape of 1.41 B parameters
(hidden 2048, 28 layers, 16 query / 8 KV heads, head dim 128, MLP 6144; vocabulary --vocab,
8192 by default, --vocab 151936 for Qwen's), 32 prompts × 8 samples, 40-token prompts, 128 new
tokens at a fixed length, temperature 1. Sides, side by side after one warm-up call each, then
--reps timed rounds in alternation:

- `generate`        — plain transformers `generate` on a bf16 copy of the weights (default cache,
                      no compile): the anchor (10.3 k tokens/s on an H200 in issue #26);
- `hf_eager`        — the engine as GRPO ran it before issue #26: float32 weights under bf16
                      autocast, the eager decode loop (2.2-2.4 k tokens/s there);
- `hf_static_half`  — the engine as GRPO runs it with `rollout.decode=static`,
                      `rollout.half_weights=true`: float32 weights, a bf16 copy for generation
                      (refreshed inside the timed call, as every step does), the static decode
                      loop with its step captured as a CUDA graph;
- `hf_static_bf16`  — the static loop on the bf16 weights themselves (no refresh): the ceiling.

Reports generated tokens/s, the mean GPU utilisation sampled during each timed call, the peak
memory, and the issue's targets: the best engine side ≥ 2× `generate` and ≥ 20 k tokens/s, with
the GPU ≥ 70 % busy. Writes JSON and a markdown table (card named) to --out-dir (default $OUT,
else bench/.cache). Written without a GPU: it has run only in its CPU smoke mode.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from bench import common
from bench.engines import QWEN3_SHAPES, UtilSampler, qwen3_model

SIDES = ("generate", "hf_eager", "hf_static_half", "hf_static_bf16")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="probe", choices=QWEN3_SHAPES)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or str(common.BENCH_DIR / ".cache"))
    a = ap.parse_args(argv)
    from rlhflab.rollout.engines import SamplingParams
    from rlhflab.rollout.engines.hf import HFEngine

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("rlhflab.rollout.sampler").setLevel(logging.INFO)
    cuda = a.device.startswith("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"{time.perf_counter() - t_start:7.1f}s {msg}", flush=True)

    vocab = a.vocab if a.shape == "probe" else None
    half_dtype = torch.bfloat16
    live = qwen3_model(a.shape, a.device, torch.float32, vocab)  # the trainer's fp32 policy
    bf16 = qwen3_model(a.shape, a.device, half_dtype, vocab)  # the same init, in bf16
    V = live.config.vocab_size
    common_kw = dict(pad_token_id=0, stop_token_ids=(-1,))  # -1 never occurs: fixed length
    engines = {
        "hf_eager": HFEngine(live, autocast_dtype=half_dtype, decode="eager", **common_kw),
        "hf_static_half": HFEngine(live, autocast_dtype=half_dtype, decode="static",
                                   sync_every=a.sync_every, half_weights=True, **common_kw),
        "hf_static_bf16": HFEngine(bf16, decode="static", sync_every=a.sync_every, **common_kw),
    }  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, V - 2, (a.prompts, a.prompt_len), generator=g)
    ids = prompts.to(a.device)
    lists = prompts.tolist()
    gens = {s: torch.Generator(device=a.device).manual_seed(i) for i, s in enumerate(SIDES)}

    def call(side: str, new: int) -> int:
        if side == "generate":
            with torch.no_grad():
                o = bf16.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  do_sample=True, num_return_sequences=a.group, temperature=1.0,
                                  top_p=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new,
                                  pad_token_id=0)  # fmt: skip
            return o.size(0) * (o.size(1) - a.prompt_len)
        params = SamplingParams(n=a.group, max_new_tokens=new, temperature=1.0)
        return int(engines[side].generate(lists, params, generator=gens[side]).mask.sum())

    util = UtilSampler(a.device)
    res = {s: {"tokens_per_s": [], "gpu_util_pct": [], "wall_s": []} for s in a.sides}
    failed = {}
    for s in a.sides:
        try:
            call(s, min(4, a.max_new))
            log(f"warm-up {s} done")
        except Exception as e:  # one side failing ends no run: it is reported
            failed[s] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"warm-up {s} FAILED {failed[s]}")
    for s in failed:
        del res[s]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for r in range(a.reps):
        for s in res:
            util.start()
            t0 = time.perf_counter()
            n = call(s, a.max_new)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            u = util.stop()
            res[s]["tokens_per_s"].append(n / wall)
            res[s]["gpu_util_pct"].append(u)
            res[s]["wall_s"].append(round(wall, 3))
            log(f"rep {r} {s}: {n / wall:,.0f} tok/s ({wall:.2f} s), GPU util {u}")
    for v in res.values():
        v["median_tokens_per_s"] = statistics.median(v["tokens_per_s"])
        us = [u for u in v["gpu_util_pct"] if u is not None]
        v["mean_gpu_util_pct"] = statistics.mean(us) if us else None
    base = res["generate"]["median_tokens_per_s"] if "generate" in res else None
    engine_sides = [s for s in res if s != "generate"]
    best = max(engine_sides, key=lambda s: res[s]["median_tokens_per_s"], default=None)
    card = torch.cuda.get_device_name() if cuda else "CPU"
    out = {
        "card": card, "torch": torch.__version__, "settings": vars(a),
        "parameters": sum(p.numel() for p in live.parameters()), "sides": res,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "best_engine_side": best, "failed": failed,
    }  # fmt: skip
    if best and base:
        b = res[best]
        out["targets"] = {
            "ratio_vs_generate": b["median_tokens_per_s"] / base,
            "ratio_met (>= 2)": b["median_tokens_per_s"] / base >= 2,
            "tokens_per_s_met (>= 20k)": b["median_tokens_per_s"] >= 20_000,
            "gpu_util_met (>= 70%)": (b["mean_gpu_util_pct"] or 0) >= 70,
        }
    lines = [
        f"Card: **{card}**; {out['parameters'] / 1e9:.2f} B-parameter Qwen3 shape "
        f"`{a.shape}` (vocabulary {V}), {a.prompts} prompts × {a.group} samples, "
        f"{a.max_new} new tokens (fixed length), median of {a.reps} rounds.",
        "",
        "| side | tokens/s | vs `generate` | GPU util % |",
        "|---|---|---|---|",
    ]
    for s, v in res.items():
        ratio = f"{v['median_tokens_per_s'] / base:.2f}" if base else "—"
        u = v["mean_gpu_util_pct"]
        lines.append(f"| `{s}` | {v['median_tokens_per_s']:,.0f} | {ratio} | "
                     f"{'—' if u is None else f'{u:.0f}'} |")  # fmt: skip
    lines += [f"| `{s}` | failed: {msg[:100]} | | |" for s, msg in failed.items()]
    d = Path(a.out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "gpu_probe_engine.json").write_text(json.dumps(out, indent=2) + "\n")
    (d / "gpu_probe_engine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(out.get("targets", {}), indent=2))


if __name__ == "__main__":
    main()
