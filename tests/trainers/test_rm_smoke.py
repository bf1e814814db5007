"""Smoke runs of the reward-model trainer (preference, ORM, PRM) and RM-as-reward inside GRPO."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

TASK = {
    "name": "chain_sum",
    "config": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1},
    "n_train": 200,
    "n_heldout": 16,
    "seed": 0,
    "answer_format": "tags",
}
BUILD = {"size": "tiny", "vocab_size": 300, "max_position_embeddings": 96, "tokenizer_texts": 300}
RUN_FILES = [
    "config.yaml",
    "metrics.jsonl",
    "final_results.json",
    "model/config.json",
    "model/model.safetensors",
    "model/tokenizer.json",
]


def _rm_cfg(root, kind, data, model=None, **extra):
    raw = {
        "trainer": "reward_model",
        "kind": kind,
        "model": model or {"build": BUILD},
        "task": TASK,
        "data": {"max_len": 96, **data},
        "train": {"steps": 3, "batch_size": 8, "micro_batch_size": 4},
        "optim": {"lr": 1e-3},
        "eval": {"n_problems": 8, "max_new_tokens": 8},
        "tracking": {"console": False},
        "run": {"name": f"rm-{kind}", "root": str(root)},
    }
    raw.update(extra)
    return config_from_dict(raw)


def _check_run(res):
    run_dir = Path(res["run_dir"])
    for name in RUN_FILES:
        assert (run_dir / name).exists(), name
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == res["steps"] and all(math.isfinite(v) for v in losses)
    cfg = json.loads((run_dir / "model/config.json").read_text())
    assert cfg["architectures"][0].endswith("ForSequenceClassification")


@pytest.mark.parametrize("num_classes", [2, 3])
def test_prm_worked_solutions_smoke(tmp_path, num_classes):
    res = run_config(
        _rm_cfg(
            tmp_path,
            "prm",
            {"source": "worked_solutions", "n_prompts": 32},
            loss={"num_classes": num_classes},
        )
    )
    _check_run(res)
    assert res["data"]["train"]["planted"] > 0 and res["eval_examples"] == 8
    assert 0.0 <= res["eval"]["step_accuracy"] <= 1.0 and res["eval"]["steps"] > 0


def test_orm_worked_solutions_smoke(tmp_path):
    res = run_config(
        _rm_cfg(
            tmp_path,
            "orm",
            {"source": "worked_solutions", "n_prompts": 32},
            loss={"orm_loss": "orm_seq_bce"},
        )
    )
    _check_run(res)
    assert set(res["eval"]) >= {"accuracy", "auc", "ece"}


@pytest.fixture(scope="module")
def backbone(tmp_path_factory, tiny_tokenizer):
    from rlhflab.models.build import build_model, save_pretrained

    path = tmp_path_factory.mktemp("lm") / "lm"
    save_pretrained(
        build_model(tiny_tokenizer, size="tiny", max_position_embeddings=128), tiny_tokenizer, path
    )
    return str(path)


def test_preference_pairs_file_smoke(tmp_path, backbone):
    rows = [
        {"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i + 2)}
        for i in range(20)
    ]
    rows.append({"prompt": "x", "chosen": "same", "rejected": "same"})  # dropped: identical
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    res = run_config(
        _rm_cfg(
            tmp_path,
            "preference",
            {
                "source": "preference",
                "path": str(path),
                "format": "pairs",
                "on_invalid": "drop",
                "heldout_frac": 0.2,
            },
            model={"name_or_path": backbone},
            loss={"margin": 0.1, "center_coef": 0.01},
        )
    )
    _check_run(res)
    assert res["data"]["dropped"]["identical"] == 1
    assert res["train_examples"] == 16 and res["eval_examples"] == 4
    assert set(res["eval"]) >= {"accuracy", "margin", "chosen_mean", "rejected_mean", "ece"}
    before, after = (
        load_file(f"{backbone}/model.safetensors"),
        load_file(f"{res['model_dir']}/model.safetensors"),
    )
    assert any(
        not torch.equal(before[k], after["model." + k.removeprefix("model.")])
        for k in before
        if k.startswith("model.") and "model." + k.removeprefix("model.") in after
    )


def test_orm_task_samples_and_grpo_with_rm_reward(tmp_path, backbone):
    res = run_config(
        _rm_cfg(
            tmp_path,
            "orm",
            {
                "source": "task_samples",
                "n_prompts": 8,
                "samples_per_prompt": 2,
                "max_new_tokens": 6,
            },
            model={"name_or_path": backbone},
            eval={"n_problems": 4, "best_of_n": [1, 2], "max_new_tokens": 6},
        )
    )
    _check_run(res)
    assert res["train_examples"] == 16 and res["eval_examples"] == 8
    assert set(res["best_of_n"]["orm"]) == {1, 2}

    # RM as a reward component of a 3-step GRPO run, the gold verifier logged beside it.
    pg = config_from_dict(
        {
            "trainer": "policy_gradient",
            "model": {"name_or_path": backbone},
            "task": TASK,
            "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
            "reward": {
                "components": [
                    {
                        "name": "reward_model",
                        "weight": 1.0,
                        "args": {"path": res["model_dir"], "kind": "orm", "normalize": "batch"},
                    },
                    {"name": "correctness", "weight": 0.0},
                ]
            },
            "train": {"steps": 3, "micro_batch_size": 4},
            "optim": {"lr": 1e-3},
            "eval": {"n": 4, "max_new_tokens": 6},
            "tracking": {"console": False},
            "run": {"name": "grpo-rm", "root": str(tmp_path)},
        }
    )
    out = run_config(pg)
    rows = [
        json.loads(x) for x in (Path(out["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    rows = [r for r in rows if "rollout/reward/reward_model_mean" in r]
    assert len(rows) == 3
    for r in rows:
        assert "rollout/reward/correctness_mean" in r
        assert abs(r["rollout/reward/reward_model_mean"]) < 1e-5  # batch-normalised RM score

    # best-of-n --write-sft: rejection sampling draws from the training split only.
    from rlhflab.data.tasks import make_splits
    from rlhflab.eval.best_of_n import run_best_of_n_command

    sft_path = tmp_path / "rejection.jsonl"
    summary = run_best_of_n_command(
        backbone,
        [f"{res['model_dir']}:orm"],
        task=TASK["name"],
        task_config=TASK["config"],
        problems=6,
        exclude_train=200,
        ns=[2],
        max_new_tokens=6,
        write_sft=str(sft_path),
    )
    splits = make_splits(TASK["name"], config=TASK["config"], n_train=200, n_heldout=6, seed=0)
    train_q = {p.question for p in splits.train}
    heldout_q = {p.question for p in splits.heldout}
    written = [json.loads(x)["prompt"] for x in sft_path.read_text().splitlines()]
    assert summary["problems"] == 6 and summary["sft_rows"] == len(written) > 0
    assert summary["sft_source"] == "training split (6 problems)"
    assert all(q in train_q and q not in heldout_q for q in written)

    # Online DPO with pairs labelled by the reward model instead of the task verifier.
    dpo = config_from_dict(
        {
            "trainer": "direct_alignment",
            "model": {"name_or_path": backbone},
            "task": TASK,
            "data": {"source": "verifiable", "heldout_pairs": 2},
            "verifiable": {
                "n_prompts": 6,
                "samples_per_prompt": 3,
                "max_new_tokens": 6,
                "chosen": "sampled",
                "reward": [
                    {"name": "reward_model", "args": {"path": res["model_dir"], "kind": "orm"}}
                ],
            },
            "train": {"steps": 2, "batch_size": 2, "micro_batch_size": 2},
            "eval": {"n": 2, "max_new_tokens": 4, "pref_every": 0},
            "tracking": {"console": False},
            "run": {"name": "odpo-rm", "root": str(tmp_path), "save_model": False},
        }
    )
    out = run_config(dpo)
    # Continuous RM scores almost never tie: every prompt gives a best-vs-worst pair.
    assert out["pairs"]["round_1"]["pairs"] == 6 and math.isfinite(out["final_loss"])


def test_rm_retokenize_equals_token_scoring_and_two_labelled_rms(tmp_path, backbone):
    """An RM scoring re-tokenised text gives the scores of the same tokens scored directly (the
    third-party-RM path, checked with a shared tokenizer), and two RMs log under their labels."""
    from rlhflab.config import RewardComponentConfig
    from rlhflab.data.formatting import encode_prompt
    from rlhflab.data.prompts import PromptRow, render_row
    from rlhflab.models.loading import load_tokenizer
    from rlhflab.rewards.shaping import score_components
    from rlhflab.rollout.sampler import pack

    rm = run_config(
        _rm_cfg(
            tmp_path,
            "preference",
            {
                "source": "preference",
                "path": str(Path(__file__).parents[1] / "data/fixtures/pref_pairs.jsonl"),
                "heldout_frac": 0.0,
                "on_invalid": "drop",
            },
            model={"name_or_path": backbone},
        )
    )
    tok = load_tokenizer(backbone)
    rows = [PromptRow("What is 2 + 3?", {}), PromptRow([{"role": "user", "content": "Hi"}], {})]
    texts = ["5", "Hello there"]
    prompts = [encode_prompt(tok, render_row(tok, r)) for r in rows]
    completions = [
        [*tok(t, add_special_tokens=False)["input_ids"], tok.eos_token_id] for t in texts
    ]
    rollout = pack(prompts, completions, tok.pad_token_id)
    comps = [
        RewardComponentConfig(
            name="reward_model", label="rm_tokens", args={"path": rm["model_dir"]}
        ),
        RewardComponentConfig(
            name="reward_model",
            label="rm_text",
            weight=0.0,
            args={"path": rm["model_dir"], "retokenize": True},
        ),
    ]
    _, parts = score_components(comps, {"texts": texts, "problems": rows, "rollout": rollout})
    assert set(parts) == {"rm_tokens", "rm_text"}
    assert torch.allclose(parts["rm_tokens"], parts["rm_text"], atol=1e-5)
    assert parts["rm_tokens"].std() > 0  # two different scores, not a constant

    # best-of-n on a prompt dataset: curves on its held-out rows, judged by a reward function;
    # rejection sampling from its training rows only.
    from rlhflab.config import PromptDataConfig
    from rlhflab.data.prompts import load_prompt_source
    from rlhflab.eval.best_of_n import run_best_of_n_command

    fix = Path(__file__).parents[1] / "data/fixtures/prompts"
    data = {"path": str(fix / "brevity.jsonl"), "heldout_frac": 0.25}
    sft_path = tmp_path / "rejection.jsonl"
    summary = run_best_of_n_command(
        backbone,
        [f"{rm['model_dir']}:preference"],
        task=None,
        data=data,
        reward_fns=[f"{fix}/user_rewards.py:brevity"],
        problems=4,
        ns=[1, 2],
        max_new_tokens=4,
        write_sft=str(sft_path),
    )
    splits = load_prompt_source(PromptDataConfig(source="dataset", **data), seed=0)
    written = [json.loads(x)["prompt"] for x in sft_path.read_text().splitlines()]
    assert summary["problems"] == 4 and set(summary["curves"]["preference"]) == {1, 2}
    assert summary["sft_rows"] == len(written) > 0
    train_q = {r.question for r in splits.train}
    assert all(q in train_q for q in written)
    assert not set(written) & {r.question for r in splits.heldout}


def test_rm_trained_with_pad_eos_tokenizer_scores_the_same_in_transformers(
    tmp_path, tiny_tokenizer
):
    """A backbone whose tokenizer has no pad token (load_tokenizer pads with eos): the RM run's
    final model and its step checkpoint score like rlhflab in plain transformers."""
    import copy

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhflab.models.build import build_model, save_pretrained
    from rlhflab.rewards.reward_model import RewardModelScorer

    tok = copy.deepcopy(tiny_tokenizer)
    lm = build_model(tok, size="tiny", max_position_embeddings=128)
    tok.pad_token = None
    save_pretrained(lm, tok, tmp_path / "lm")
    rows = [{"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i + 2)}
            for i in range(16)]  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    data = {"source": "preference", "path": str(tmp_path / "pairs.jsonl"), "format": "pairs"}
    model = {"name_or_path": str(tmp_path / "lm")}
    res = run_config(_rm_cfg(tmp_path, "preference", data, model=model, checkpoint={"every": 3}))
    step = Path(res["run_dir"]) / "checkpoints" / "step-00000003"
    text = "What is 4 + 1?5"
    scorer = RewardModelScorer.from_pretrained(res["model_dir"], kind="preference")
    assert scorer.tokenizer.pad_token_id != scorer.tokenizer.eos_token_id
    ids = scorer.tokenizer(text, add_special_tokens=False)["input_ids"]
    ours = scorer.score([ids[:4]], [[*ids[4:], scorer.tokenizer.eos_token_id]])
    for path in (res["model_dir"], step):
        hf_tok = AutoTokenizer.from_pretrained(path)
        hf_rm = AutoModelForSequenceClassification.from_pretrained(path).eval()
        assert hf_rm.config.pad_token_id == hf_tok.pad_token_id != hf_tok.eos_token_id
        batch = hf_tok([text + hf_tok.eos_token, "1 + 1"], padding=True, return_tensors="pt",
                       add_special_tokens=False)  # fmt: skip
        with torch.no_grad():
            theirs = hf_rm(**batch).logits[0, 0]
        torch.testing.assert_close(theirs, ours[0], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["orm", "prm"])
def test_step_labelled_file_trains_orm_and_prm(tmp_path, backbone, kind):
    # `data.source: step_labelled` (e.g. Monte-Carlo step labels): the ORM learns each row's
    # outcome, the PRM its ratings on the separators.
    rows = [
        {"prompt": f"{a}+{b}+1?", "steps": [f"{a}+{b} = {a + b}", f"{a + b}+1 = {a + b + w}"],
         "ratings": [1, 1 if w == 1 else -1], "final": f"<answer>{a + b + w}</answer>",
         "outcome": int(w == 1)}
        for a in range(4) for b in range(3) for w in (1, 2)
    ]  # fmt: skip
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_config(
        _rm_cfg(
            tmp_path,
            kind,
            {"source": "step_labelled", "path": str(path), "heldout_frac": 0.25},
            model={"name_or_path": backbone},
        )
    )
    _check_run(res)
    assert res["eval_examples"] == 6 and res["train_examples"] == 18
