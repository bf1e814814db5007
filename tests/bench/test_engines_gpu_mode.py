"""The engines bench's GPU mode runs in its tiny CPU mode and writes its JSON and markdown table
(every side, every batch, the card named); no timing is asserted."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.engines import GPU_SIDES, main


@pytest.mark.slow
def test_gpu_mode_runs_on_cpu_and_writes_its_table(tmp_path, capsys):
    out, table = tmp_path / "gpu.json", tmp_path / "gpu.md"
    main(["--gpu", "--device", "cpu", "--shapes", "tiny", "--batches", "4", "16",
          "--max-new", "3", "--reps", "1", "--out", str(out), "--table-out", str(table)])  # fmt: skip
    data = json.loads(out.read_text())
    assert data["machine"]["card"].startswith("CPU")
    batches = data["shapes"]["tiny"]["batches"]
    assert sorted(int(b) for b in batches) == [4, 16]
    for res in batches.values():
        assert set(res) == set(GPU_SIDES)
        for v in res.values():
            assert v["tokens"] > 0 and v["tokens_per_s"] > 0 and v["gpu_util_pct"] is None
    text = table.read_text()
    assert "Card: **CPU" in text
    rows = [line for line in text.splitlines() if line.startswith("| tiny |")]
    assert len(rows) == 2 * len(GPU_SIDES)
    assert all(f"`{s}`" in text for s in GPU_SIDES)
