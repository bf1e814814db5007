"""Short runs through the trainers on TRL-format files: SFT on `text` rows and on multi-turn
`messages` (the first step's loss is the masked NLL computed from its definition), DPO on
implicit-prompt string pairs."""

import json
import math
from pathlib import Path

import pytest
import torch

from rlhflab.config import config_from_dict
from rlhflab.data.sft import IGNORE_INDEX, load_sft_data, tokenize_sft
from rlhflab.errors import DataError
from rlhflab.trainers import run_config

TEXTS = [f"{a} + {b} = {a + b}" for a in range(6) for b in range(2)]
CONVERSATIONS = [
    [
        {"role": "user", "content": f"{a} + 1?"},
        {"role": "assistant", "content": str(a + 1)},
        {"role": "user", "content": "Times 2?"},
        {"role": "assistant", "content": str(2 * (a + 1))},
    ]
    for a in range(6)
]


@pytest.fixture
def model_dir(tiny_model, tiny_tokenizer, tmp_path):
    from rlhflab.models.build import save_pretrained

    path = tmp_path / "init"
    save_pretrained(tiny_model, tiny_tokenizer, path)
    return path


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _sft_cfg(model_dir, root, data_path, **data):
    return config_from_dict(
        {
            "trainer": "sft",
            "model": {"name_or_path": str(model_dir)},
            "data": {"source": "dataset", "path": str(data_path), **data},
            "train": {"steps": 3, "batch_size": 12, "micro_batch_size": 4, "max_len": 48},
            "optim": {"lr": 1e-3},
            "eval": {"n": 0},
            "precision": {"autocast": "none"},
            "tracking": {"console": False, "log_every": 1},
            "run": {"name": "sft", "root": str(root)},
        }
    )


def _first_loss(run_dir) -> float:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, lines) if r.get("step") == 1)["train/loss"]


def _masked_nll(model, rows) -> float:
    """−Σ log p(label_t | ids_<t) over trained labels / their count: the SFT loss, by definition."""
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            for t, label in enumerate(row["labels"][1:]):
                if label != IGNORE_INDEX:
                    total -= float(logp[t, label])
                    count += 1
    return total / count


@pytest.mark.parametrize("fmt", ["text", "messages", "messages_last"])
def test_sft_first_step_loss_is_the_masked_nll(
    fmt, model_dir, tiny_model, tiny_tokenizer, tmp_path
):
    if fmt == "text":
        path, rows, kw = tmp_path / "lm.jsonl", [{"text": t} for t in TEXTS], {}
    else:
        path = tmp_path / "chat.jsonl"
        rows = [{"messages": m} for m in CONVERSATIONS * 2]
        kw = {"assistant_turns": "last"} if fmt == "messages_last" else {}
    _write_jsonl(path, rows)
    res = run_config(_sft_cfg(model_dir, tmp_path / "runs", path, **kw))
    assert res["examples"] == 12 and res["steps"] == 3 and math.isfinite(res["final_loss"])
    examples, _ = load_sft_data(path, tiny_tokenizer, **kw)
    features = tokenize_sft(tiny_tokenizer, examples, max_len=48)
    n_trained = [sum(label != IGNORE_INDEX for label in f["labels"]) for f in features]
    if fmt == "messages":  # two assistant turns of 1-2 tokens + eos each
        assert all(n >= 4 for n in n_trained)
    elif fmt == "messages_last":
        assert all(n <= 3 for n in n_trained)
    # batch_size = all 12 rows: step 1's loss is the token mean over every trained token
    expected = _masked_nll(tiny_model, features)
    assert _first_loss(Path(res["run_dir"])) == (pytest.approx(expected, abs=1e-5))


def test_sft_from_parquet_through_the_trainer(model_dir, tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"text": t} for t in TEXTS]).to_parquet(tmp_path / "lm.parquet")
    res = run_config(_sft_cfg(model_dir, tmp_path / "runs", tmp_path / "lm.parquet"))
    assert res["examples"] == 12
    bad = [{"text": TEXTS[0], "messages": None}, {"text": None, "messages": [{"role": "user"}]}]
    Dataset.from_list(bad).to_parquet(tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"bad\.parquet row 1: field 'messages\[0\]\.content' is"):
        run_config(_sft_cfg(model_dir, tmp_path / "runs2", tmp_path / "bad.parquet"))
    assert not (tmp_path / "runs2").exists()  # nothing written


def test_dpo_on_implicit_string_pairs(model_dir, tmp_path):
    rows = [
        {"chosen": f"Q: {a} + {b} = {a + b}", "rejected": f"Q: {a} + {b} = {a + b + 1}"}
        for a in range(4)
        for b in range(3)
    ]
    path = _write_jsonl(tmp_path / "implicit.jsonl", rows)
    base = {
        "trainer": "direct_alignment",
        "model": {"name_or_path": str(model_dir)},
        "data": {"source": "file", "path": str(path), "heldout_pairs": 4},
        "train": {"steps": 2, "batch_size": 4, "micro_batch_size": 2},
        "optim": {"lr": 1e-3},
        "eval": {"n": 0, "pref_every": 1},
        "precision": {"autocast": "none"},
        "tracking": {"console": False, "samples_per_step": 0},
        "run": {"root": str(tmp_path / "runs")},
    }
    res = run_config(config_from_dict(base))
    assert res["train_rows"] == 8 and res["heldout_pref_n"] == 4
    assert math.isfinite(res["final_loss"]) and res["heldout_pref_accuracy"] is not None
    # unpaired rows detected in a file need the KTO loss: an error before anything is written
    unp = _write_jsonl(
        tmp_path / "unp.jsonl", [{"prompt": "1 + 1?", "completion": "2", "label": True}] * 4
    )
    bad = {
        **base,
        "data": {"source": "file", "path": str(unp)},
        "run": {"root": str(tmp_path / "r2")},
    }
    with pytest.raises(DataError, match=r"holds unpaired rows .*need loss\.name 'kto', not 'dpo'"):
        run_config(config_from_dict(bad))
    assert not (tmp_path / "r2").exists()


def test_reward_model_rejects_detected_unpaired_rows(model_dir, tmp_path):
    unp = _write_jsonl(
        tmp_path / "unp.jsonl", [{"prompt": "1 + 1?", "completion": "2", "label": True}] * 4
    )
    cfg = config_from_dict(
        {
            "trainer": "reward_model",
            "kind": "preference",
            "model": {"name_or_path": str(model_dir)},
            "data": {"source": "preference", "path": str(unp)},
            "tracking": {"console": False},
            "run": {"root": str(tmp_path / "runs")},
        }
    )
    with pytest.raises(DataError, match=r"holds unpaired rows .*needs chosen/rejected pairs"):
        run_config(cfg)
    assert not (tmp_path / "runs").exists()
