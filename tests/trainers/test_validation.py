"""Dataset validation before step 1: invalid rows are an error naming row and field, or dropped
and counted per reason with on_invalid: drop; a dataset empty after filtering is an error; nothing
is written when validation fails."""

import json

import pytest
from factories import tiny_build

from rlhflab.config import config_from_dict
from rlhflab.errors import DataError
from rlhflab.trainers import run_config

BUILD = tiny_build(tokenizer_texts=100)


def _cfg(root, path, on_invalid):
    return config_from_dict(
        {
            "trainer": "sft",
            "model": {"build": BUILD},
            "task": {"name": "chain_sum", "n_train": 50, "n_heldout": 4},
            "data": {"source": "jsonl", "path": str(path), "on_invalid": on_invalid},
            "train": {"steps": 1, "batch_size": 2, "micro_batch_size": 2, "max_len": 24},
            "eval": {"n": 0},
            "precision": {"threads": 1},
            "tracking": {"console": False},
            "run": {"name": "v", "root": str(root)},
        }
    )


ROWS = [
    {"prompt": "1 + 1 =", "completion": "2"},
    {"prompt": "2 + 2 ="},  # missing completion
    {"prompt": 3, "completion": "3"},  # wrong type
    {"prompt": "5 + 5 =", "completion": ""},  # empty completion
    {"prompt": "7 " * 40, "completion": "7"},  # prompt longer than max_len
    {"prompt": "4 + 4 =", "completion": "8"},
]


def _write(tmp_path, rows):
    path = tmp_path / "sft.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_invalid_rows_error_names_line_and_field(tmp_path):
    path = _write(tmp_path, ROWS)
    with pytest.raises(DataError, match=r"sft\.jsonl line 2: .*completion"):
        run_config(_cfg(tmp_path / "runs", path, "error"))
    assert not (tmp_path / "runs").exists()  # nothing written


def test_invalid_rows_dropped_and_counted_per_reason(tmp_path):
    res = run_config(_cfg(tmp_path / "runs", _write(tmp_path, ROWS), "drop"))
    dropped = {k: v for k, v in res["dropped"].items() if v}
    assert res["examples"] == 2
    assert sum(dropped.values()) == 4 and dropped["prompt_too_long"] == 1
    assert len(dropped) == 4  # missing field, wrong type, empty completion, prompt too long


def test_empty_after_filtering_is_an_error(tmp_path):
    path = _write(tmp_path, ROWS[1:5])
    with pytest.raises(DataError, match=r"no (valid )?example"):
        run_config(_cfg(tmp_path / "runs", path, "drop"))
    assert not (tmp_path / "runs").exists()
