"""`rlhflab pipeline` end to end on a real-schema HH-RLHF fixture with tiny models: RM on the
pairs, PPO and GRPO against it on the prompts, DPO on the pairs, one comparison."""

import json
from pathlib import Path

import pytest
import yaml

from rlhflab.cli import main
from rlhflab.config import config_from_dict
from rlhflab.pipeline import build_configs, load_pipeline
from rlhflab.trainers import run_config

ROOT = Path(__file__).resolve().parents[1]
HH = str(ROOT / "tests/data/fixtures/prompts/hh_rlhf_pipeline.jsonl")
SMALL_PG = ["train.steps=2", "train.micro_batch_size=8", "rollout.max_new_tokens=6"]


@pytest.mark.parametrize("name", ["hh", "hh_small"])
def test_pipeline_files_validate(tmp_path, name):
    path = ROOT / f"configs/pipeline/{name}.yaml"
    cfgs = build_configs(load_pipeline(path), tmp_path, base=path)
    assert set(cfgs) == {"rm", "ppo", "grpo", "dpo"}
    assert cfgs["grpo"].data.prompt_format == "hh_transcript"
    assert cfgs["ppo"].reward.components[0].name == "reward_model"
    assert cfgs["dpo"].data.source == "file" and cfgs["dpo"].data.format == "hh_rlhf"


def test_pipeline_yaml_syntax_error_names_file_line_and_column(tmp_path):
    from rlhflab.errors import ConfigError

    bad = tmp_path / "p.yaml"
    bad.write_text("sft_model: x\ndata: {path: a\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: invalid YAML at line 3, column 1: "):
        load_pipeline(bad)


@pytest.mark.slow
def test_pipeline_end_to_end_on_hh_fixture(tmp_path, capsys):
    sft = run_config(
        config_from_dict(
            {
                "trainer": "sft",
                "model": {
                    "build": {
                        "size": "tiny",
                        "vocab_size": 300,
                        "max_position_embeddings": 256,
                        "tokenizer_texts": 300,
                    }
                },
                "task": {
                    "name": "chain_sum",
                    "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
                    "n_train": 100,
                    "n_heldout": 4,
                },
                "train": {"steps": 2, "batch_size": 8, "micro_batch_size": 8, "max_len": 48},
                "eval": {"n": 0},
                "tracking": {"console": False},
                "run": {"name": "sft", "root": str(tmp_path / "sft")},
            }
        )
    )
    pipeline = {
        "name": "hh-tiny",
        "sft_model": sft["model_dir"],
        "threads": 1,
        "data": {"path": HH, "format": "hh_rlhf", "heldout_frac": 0.25},
        "rm": {
            "data": {"max_len": 160, "heldout_frac": 0.2},
            "train": {"steps": 3, "batch_size": 4, "micro_batch_size": 4},
            "tracking": {"console": False},
        },
        "methods": {
            "ppo": {
                "preset": "configs/pg/ppo.yaml",
                "overrides": [*SMALL_PG, "rollout.prompts_per_step=4", "tracking.console=false"],
            },
            "grpo": {
                "preset": "configs/pg/grpo.yaml",
                "overrides": [
                    *SMALL_PG,
                    "rollout.prompts_per_step=2",
                    "rollout.group_size=4",
                    "tracking.console=false",
                ],
            },
            "dpo": {
                "preset": "configs/dpo/dpo.yaml",
                "overrides": [
                    "train.steps=2",
                    "train.batch_size=4",
                    "train.micro_batch_size=4",
                    "data.heldout_pairs=2",
                    "tracking.console=false",
                ],
            },
        },
        "eval": {"max_new_tokens": 6, "batch_size": 8},
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    assert main(["pipeline", str(path), "--root", str(tmp_path / "runs")]) == 0
    res = json.loads(capsys.readouterr().out)
    out = Path(res["out_dir"])
    for name in ("comparison.md", "comparison.png", "results.json", "pipeline.yaml"):
        assert (out / name).exists(), name
    assert list(res["methods"]) == ["sft", "ppo", "grpo", "dpo"]
    assert res["heldout_prompts"] == 6  # round(0.25 · 24); no held-out prompt is a training one
    assert res["methods"]["sft"]["kl_to_sft"] == 0.0  # same model: log-ratio exactly 0
    for name in ("ppo", "grpo", "dpo"):
        r = res["methods"][name]
        assert r["wall_s"] > 0 and Path(r["run_dir"]).is_dir()
        assert r["response_len"] >= 1
    table = (out / "comparison.md").read_text()
    assert "| grpo |" in table and "| dpo |" in table
    # Every RL run was rewarded by the pipeline's RM.
    grpo_cfg = yaml.safe_load((Path(res["methods"]["grpo"]["run_dir"]) / "config.yaml").read_text())
    assert grpo_cfg["reward"]["components"][0]["args"]["path"] == str(
        Path(res["rm"]["run_dir"]) / "model"
    )
