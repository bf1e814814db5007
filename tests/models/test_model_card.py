"""The model card a run writes into its model directory says what the model is (issue #36):
base model, data, trainer and algorithm, steps, the held-out result under its honest name, the
seed and the versions, with the run's own values (read back from final_results.json)."""

import json
from pathlib import Path

import pytest
from factories import tiny_pg, tiny_sft

from rlhflab import __version__
from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config


def _card(res: dict) -> str:
    return (Path(res["model_dir"]) / "README.md").read_text()


def _field(card: str, name: str) -> str:
    """The text of the card's `- **name**: ...` line."""
    lines = [x for x in card.splitlines() if x.startswith(f"- **{name}**: ")]
    assert len(lines) == 1, (name, card)
    return lines[0].split(": ", 1)[1]


@pytest.mark.slow
def test_a_runs_model_card_says_what_the_model_is(tmp_path):
    sft = run_config(config_from_dict(tiny_sft(tmp_path, seed=3, eval={"n": 8})))
    pg_raw = tiny_pg(tmp_path, sft["model_dir"], train={"steps": 2, "micro_batch_size": 16},
                     eval={"n": 6}, kl={"coef": 0.05})  # fmt: skip
    pg = run_config(config_from_dict(pg_raw))
    for res, raw in ((sft, tiny_sft(tmp_path, seed=3)), (pg, pg_raw)):
        card = _card(res)
        final = json.loads((Path(res["run_dir"]) / "final_results.json").read_text())
        task = raw["task"]
        assert card.startswith("---\nlibrary_name: transformers\n")
        assert f"tags: [rlhflab, {final['trainer']}]" in card
        assert f"`{task['name']}` ({json.dumps(task['config'])}" in _field(card, "Training data")
        assert f"`trainer: {final['trainer']}`" in _field(card, "Trainer")
        assert _field(card, "Steps") == f"{final['steps']} of {raw['train']['steps']} (complete)"
        head = final["headline"]
        held = _field(card, "Held-out result")
        assert held.startswith("held-out accuracy, greedy decoding (correct: the task's verifier")
        assert f"{head['value']:.3f} ± {head['stderr']:.3f} (n = {head['n']}" in held
        assert f"{head['before']:.3f} before training" in held
        assert f"majority-answer baseline {final['heldout_majority_baseline']:.3f}" in held
        assert _field(card, "Seed") == str(raw.get("seed", 0))
        assert _field(card, "Versions").startswith(f"rlhflab {__version__}, transformers ")
        assert Path(res["run_dir"]).name in _field(card, "Run")
    assert _field(_card(sft), "Base model").startswith("none: built from scratch")
    assert _field(_card(pg), "Base model") == f"`{sft['model_dir']}` (a local directory)"
    algo = _field(_card(pg), "Algorithm")
    assert algo.startswith("advantage `group_zscore`, surrogate `ppo_clip`")
    assert "KL coefficient 0.05" in algo
