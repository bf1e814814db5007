"""The packing GPU probe runs in its CPU smoke mode (float64): every arm within its tolerance,
both layouts taken, the boundary check holds, and its JSON is written."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gpu_probe_packing import main


def test_packing_probe_smoke_passes_on_cpu(tmp_path):
    out = tmp_path / "probe.json"
    assert main(["--device", "cpu", "--shape", "tiny", "--rows", "6", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    arms = data["arms"]
    assert all(a["ok"] for a in arms)
    layouts = {lay.split(" ")[0] for a in arms for lay in a["layout"]}
    assert layouts == {"tree", "varlen"}
    assert {a["attn"] for a in arms if a.get("check") == "boundaries"} == {"sdpa", "eager"}
    assert data["logp_spread"] > 0.1  # log-probs that depend on the context
