"""Issue #41's GPU check of padding-free packing: packed = padded log-probs and gradients, per
attention implementation, one run.

    python -m bench.gpu_probe_packing                          # on a CUDA machine (~1 min)
    python -m bench.gpu_probe_packing --device cpu --shape tiny --rows 6   # smoke (float64)

A random-init Qwen3 shape (`bench.engines.QWEN3_SHAPES`, "0.6b" by default, float32 weights on
CUDA) through `rlhflab.rollout.packing_check.check_packing` (what it checks and its tolerances are
in that module; `rlhflab doctor`'s `packing` row runs the same check on a tiny shape). Exits 1
when a check fails. Writes JSON to --out (default $OUT/packing_probe.json, else bench/.cache).
Written without a GPU: it has run only in its CPU smoke mode.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from bench.engines import QWEN3_SHAPES, qwen3_model
from rlhflab.rollout.packing_check import (
    attention_implementations,
    check_packing,
    precisions_for,
    random_rollout,
    scale_weights,
)


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
    scale_weights(model)
    ro = random_rollout(args.rows, args.vocab, args.device)
    res = check_packing(model, ro, impls=attention_implementations(args.device),
                        precisions=precisions_for(args.device))  # fmt: skip
    result = {"device": torch.cuda.get_device_name() if not cpu else "cpu",
              "shape": args.shape, "rows": args.rows, **res}  # fmt: skip
    failed = not res["ok"]
    for arm in result["arms"]:
        print(json.dumps(arm))
    out = Path(args.out or Path(os.environ.get("OUT", "bench/.cache")) / "packing_probe.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'FAILED' if failed else 'ok'}: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
