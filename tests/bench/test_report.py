"""The benchmark results writer (bench/report.py): issue-format JSON and the markdown table."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common import Pair, summary
from bench.report import markdown_table, results_json, write


def test_summary_median_min_max():
    s = summary([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)


def test_pair_ratio_and_target_direction():
    slower = Pair("x", [2.0, 2.0, 2.0], [4.0, 4.0, 4.0], "s/step", target=0.5).to_dict()
    assert slower["ratio"] == 0.5 and slower["met"] is True
    faster = Pair("g", [300.0], [100.0], "tok/s", higher_is_better=True, target=2.0).to_dict()
    assert faster["ratio"] == 3.0 and faster["met"] is True
    missed = Pair("g", [150.0], [100.0], "tok/s", higher_is_better=True, target=2.0).to_dict()
    assert missed["met"] is False


def test_results_json_and_table(tmp_path):
    results = {
        "a": Pair("a", [1.0, 2.0, 3.0], [4.0, 4.0, 4.0], "s/step", target=0.5).to_dict(),
        "b": Pair("b", [10.0], [5.0], "tok/s", higher_is_better=True).to_dict(),
    }
    j = results_json(results)
    assert j["a"] == {"ours": 2.0, "theirs": 4.0, "unit": "s/step", "ratio": 0.5}
    table = markdown_table(results).splitlines()
    assert len(table) == 4  # header, rule, two rows
    assert table[2] == "| a | 2.00 (1.00–3.00) | 4.00 (4.00–4.00) | s/step | 0.500 | ≤ 0.5 | yes |"
    assert table[3].endswith("| 2.00 | – | – |")
    write(results, {"cpu": "x"}, tmp_path)
    assert json.loads((tmp_path / "results.json").read_text()) == j
    assert json.loads((tmp_path / "results_full.json").read_text())["machine"] == {"cpu": "x"}
