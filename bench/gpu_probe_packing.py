"""Issue #41's GPU check of padding-free packing: packed = padded log-probs and gradients, per
attention implementation, one run.

    python -m bench.gpu_probe_packing                          # on a CUDA machine (~1 min)
    python -m bench.gpu_probe_packing --device cpu --shape tiny --rows 6   # smoke (float64)

A random-init Qwen3 shape (`bench.engines.QWEN3_SHAPES`, "0.6b" by default, float32 weights)
scores --rows sequences of very different lengths (prompts of 8 to 64 tokens, completions of 1
to 256) with `rollout.sampler.completion_logps`, once in the padded layout and once in the
layout `models.packing.layout_for` picks for each attention implementation the machine has
(`sdpa`, `eager`; `flash_attention_2` when flash-attn is installed: one varlen row), and once
with the model called as if FSDP2-sharded (the varlen layout through the model's own forward).
The weights are 8× the init's, so that log-probs depend on the context (their spread is
reported). Per arm: the largest |Δ log-prob| over real tokens and the largest |Δ gradient| relative to the
largest gradient, against the padded sdpa arm, in float32 and under bf16 autocast. Also the
boundary check: changing one sequence's tokens must leave every other sequence's log-probs
unchanged, bit for bit. Exits 1 when a check fails (float32: 1e-3 nats, 1e-3 relative; bf16:
0.25 nats, 5e-2 relative; on CPU in float64: 1e-9, eager 1e-5 as its softmax is float32). Writes JSON to --out (default $OUT/
packing_probe.json, else bench/.cache). Written without a GPU: it has run only in its CPU
smoke mode.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

import torch

from bench.engines import QWEN3_SHAPES, qwen3_model


def _rollout(rows: int, vocab: int, device: str, seed: int = 0):
    from rlhflab.rollout.sampler import pack

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab - 1) for _ in range(rng.randint(8, 64))] for _ in range(rows)
    ]
    comps = [[rng.randrange(3, vocab - 1) for _ in range(rng.choice([1, 8, 64, 256]))]
             for _ in range(rows)]  # fmt: skip
    return pack(prompts, comps, 0).to(device)


def _score(model, ro, layout, autocast_dtype, sharded=False):
    """(log-probs (B, T), flat gradient) with `layout_for` forced to `layout` ("padded" or
    "auto") and, with `sharded`, the model treated as FSDP2-sharded."""
    import rlhflab.rollout.sampler as sampler
    from rlhflab import distributed

    real_layout, real_sharded = sampler.layout_for, distributed.is_sharded
    chosen = []

    def layout_for(m, r, *, sharded):
        lay = None if layout == "padded" else real_layout(m, r, sharded=sharded)
        chosen.append("padded" if lay is None else
                      "tree" if lay.attention_mask is not None else
                      f"varlen x{lay.input_ids.size(0)}")  # fmt: skip
        return lay

    sampler.layout_for = layout_for
    if sharded:
        distributed.is_sharded = lambda m: True
    try:
        model.zero_grad()
        lp, _ = sampler.completion_logps(model, ro, autocast_dtype=autocast_dtype)
        (lp.float() * ro.mask).sum().backward()
    finally:
        sampler.layout_for, distributed.is_sharded = real_layout, real_sharded
    grad = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return lp.detach().double(), grad, chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="0.6b", choices=QWEN3_SHAPES)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    dtype = torch.float64 if cpu else torch.float32
    model = qwen3_model(args.shape, args.device, dtype, vocab=args.vocab).train()
    with torch.no_grad():  # weights 8x the init's: log-probs that depend on the context (at the
        for p in model.parameters():  # init's scale they sit within float rounding of -log V)
            if p.dim() > 1:
                p.mul_(8.0)
    ro = _rollout(args.rows, args.vocab, args.device)
    impls = ["sdpa", "eager"]
    try:
        import flash_attn  # noqa: F401

        if not cpu:
            impls.append("flash_attention_2")
    except ImportError:
        pass
    precisions = [("float64" if cpu else "float32", None)]
    if not cpu:
        precisions.append(("bf16_autocast", torch.bfloat16))
    # transformers' eager attention takes its softmax in float32 whatever the weights' dtype
    tol = {"float64": 1e-9, "float64_eager": 1e-5, "float32": 1e-3, "bf16_autocast": 0.25}
    gtol = {"float64": 1e-9, "float64_eager": 1e-5, "float32": 1e-3, "bf16_autocast": 5e-2}
    result = {"device": torch.cuda.get_device_name() if not cpu else "cpu",
              "shape": args.shape, "rows": args.rows, "logp_spread": None, "real_tokens":
              int(ro.prompt_mask.sum() + ro.mask.sum()), "grid": ro.input_ids.numel(),
              "arms": []}  # fmt: skip
    failed = False
    real = ro.mask > 0
    for pname, ac in precisions:
        model.config._attn_implementation = "sdpa"
        ref_lp, ref_g, _ = _score(model, ro, "padded", ac)
        g_max = ref_g.abs().max().item()
        result["logp_spread"] = result["logp_spread"] or ref_lp[real].std().item()
        for impl in impls:
            model.config._attn_implementation = impl
            for sharded in (False, True):
                lp, g, chosen = _score(model, ro, "auto", ac, sharded=sharded)
                d_lp = (lp - ref_lp)[real].abs().max().item()
                d_g = (g - ref_g).abs().max().item() / g_max
                t = f"{pname}_eager" if f"{pname}_eager" in tol and impl == "eager" else pname
                ok = d_lp <= tol[t] and d_g <= gtol[t]
                result["arms"].append({"precision": pname, "attn": impl, "sharded": sharded,
                                       "layout": chosen, "max_dlogp": d_lp,
                                       "max_dgrad_rel": d_g, "ok": ok})  # fmt: skip
                failed |= not ok
    # boundaries: another first sequence leaves every other sequence's log-probs as they were
    other = ro.completion_ids.clone()
    other[0] = (other[0] + 1) % (args.vocab - 4) + 3
    ro2 = type(ro)(ro.prompt_ids, ro.prompt_mask, other, ro.mask, ro.logp, ro.truncated)
    for impl in impls:
        model.config._attn_implementation = impl
        a, _, chosen = _score(model, ro, "auto", None, sharded=True)
        b, _, _ = _score(model, ro2, "auto", None, sharded=True)
        ok = torch.equal(a[1:], b[1:])
        result["arms"].append({"check": "boundaries", "attn": impl, "layout": chosen, "ok": ok})
        failed |= not ok
    for arm in result["arms"]:
        print(json.dumps(arm))
    out = Path(args.out or Path(os.environ.get("OUT", "bench/.cache")) / "packing_probe.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'FAILED' if failed else 'ok'}: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
