"""Direct-alignment trainer: concatenated forward, cached reference, smoke runs of every preset."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from factories import spy_micro_batches, tiny_task
from safetensors.torch import load_file

from rlhflab.config import config_from_dict, load_config
from rlhflab.data.preference import PreferencePair, tokenize_pairs
from rlhflab.trainers import run_config
from rlhflab.trainers.direct_alignment import cache_reference, paired_rows, sequence_logps

PRESETS = sorted(Path(__file__).parents[2].glob("configs/dpo/*.yaml"))
TASK = tiny_task()


def _pairs(tok):
    from rlhflab.data.formatting import render_prompt

    qs = ["What is 2 + 3?", "What is 7 + 1? Answer briefly.", "9 + 9 = ?"]
    return [
        PreferencePair(render_prompt(tok, q), c, r)
        for q, c, r in zip(qs, ["5", "8", "18"], ["6", "81", "1"], strict=True)
    ]


def _close(a, b):
    """Equal to float64 rounding (1e4·eps relative to b's magnitude): the compared computations
    add in other orders, which in float32 moves results by ~1e-7 relative, per CPU kernels."""
    assert a.dtype == b.dtype == torch.float64
    atol = 1e4 * torch.finfo(torch.float64).eps * max(b.abs().max().item(), 1e-30)
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def test_concatenated_forward_equals_separate_forwards(tiny_model64, tiny_tokenizer):
    tiny_model = tiny_model64
    tok = tiny_tokenizer
    rows = paired_rows(tokenize_pairs(tok, _pairs(tok))[0])
    prompts = [r["prompt"] for r in rows]
    pad = tok.pad_token_id
    tiny_model.eval()
    both, lens = sequence_logps(
        tiny_model, prompts * 2, [r["chosen"] for r in rows] + [r["rejected"] for r in rows], pad
    )
    chosen, lc = sequence_logps(tiny_model, prompts, [r["chosen"] for r in rows], pad)
    rejected, lr = sequence_logps(tiny_model, prompts, [r["rejected"] for r in rows], pad)
    _close(both, torch.cat([chosen, rejected]))
    assert torch.equal(lens, torch.cat([lc, lr]))
    # one row alone (no padding at all) gives the same log-prob too
    alone, _ = sequence_logps(tiny_model, prompts[:1], [rows[0]["chosen"]], pad)
    _close(alone[0], chosen[0])


def test_cached_reference_equals_on_the_fly(tiny_model64, tiny_tokenizer):
    tiny_model = tiny_model64
    tok = tiny_tokenizer
    rows = paired_rows(tokenize_pairs(tok, _pairs(tok))[0])
    ref_model = copy.deepcopy(tiny_model)  # what a trainer with a live reference model would use
    cache_reference(
        tiny_model, rows, tok.pad_token_id, unpaired=False, chunk=2, autocast_dtype=None
    )
    assert tiny_model.training  # the pass restores train mode
    ref_model.eval()
    with torch.no_grad():
        fly, _ = sequence_logps(
            ref_model,
            [r["prompt"] for r in rows] * 2,
            [r["chosen"] for r in rows] + [r["rejected"] for r in rows],
            tok.pad_token_id,
        )
    cached = torch.tensor(
        [r["ref_chosen"] for r in rows] + [r["ref_rejected"] for r in rows], dtype=torch.float64
    )
    _close(cached, fly)  # chunks of 2 pairs vs all rows at once


@pytest.fixture(scope="module")
def sft_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    cfg = config_from_dict(
        {
            "trainer": "sft",
            "model": {
                "build": {
                    "size": "tiny",
                    "vocab_size": 300,
                    "max_position_embeddings": 64,
                    "tokenizer_texts": 300,
                }
            },
            "task": TASK,
            "train": {"steps": 30, "batch_size": 8, "micro_batch_size": 8, "max_len": 48},
            "optim": {"lr": 3e-3},
            "eval": {"n": 0},
            "tracking": {"console": False},
            "run": {"name": "sft", "root": str(root)},
        }
    )
    return run_config(cfg)["model_dir"]


SMOKE = [
    "data.heldout_pairs=8",
    "verifiable.n_prompts=12",
    "verifiable.samples_per_prompt=4",
    "verifiable.max_new_tokens=6",
    "verifiable.chosen=gold",
    "train.steps=2",
    "train.batch_size=4",
    "train.micro_batch_size=2",
    "eval.n=4",
    "eval.max_new_tokens=6",
    "eval.pref_every=1",
    "tracking.console=false",
    "tracking.samples_every=1",
    "optim.lr=1e-3",
]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_smoke(preset, sft_model_dir, tmp_path):
    over = [f"model.name_or_path={sft_model_dir}", f"run.root={tmp_path}", *SMOKE]
    over += [f"task.{k}={json.dumps(v)}" for k, v in TASK.items()]
    if "rounds: 1" not in preset.read_text():
        over.append("verifiable.rounds=2")  # online: 2 rounds of 1 step
    cfg = load_config(preset, over)
    res = run_config(cfg)
    run_dir = Path(res["run_dir"])
    for name in ["config.yaml", "metrics.jsonl", "final_results.json", "samples.jsonl"]:
        assert (run_dir / name).exists(), name
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    train_rows = [r for r in rows if "train/loss" in r]
    assert len(train_rows) == 2
    for r in train_rows:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["optim/grad_norm"])
    first = train_rows[0]
    if cfg.loss.name == "kto":
        assert "kto/kl" in first
    else:
        assert {"dpo/chosen_reward", "dpo/margin", "dpo/accuracy", "logps/chosen"} <= set(first)
    if cfg.loss.name == "orpo":
        assert {"orpo/sft_loss", "orpo/or_loss"} <= set(first)
    if cfg.loss.name in ("dpo", "cdpo") and cfg.verifiable.rounds == 1:
        # step 1: policy == reference, so rewards and margin are 0 and DPO's loss is log 2
        assert abs(first["dpo/margin"]) < 1e-4
        if cfg.loss.name == "dpo":
            assert first["train/loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert any("eval/pref_accuracy" in r for r in rows)
    if cfg.loss.name not in ("simpo", "orpo"):  # π_θ = π_ref before training: every pair a tie
        assert res["heldout_pref_accuracy_before"] == 0.5
    for key in ("heldout_accuracy", "heldout_accuracy_before", "heldout_pref_accuracy"):
        assert res[key] is not None
    # the task accuracy has the majority-answer baseline beside it
    assert 0.0 <= res["heldout_majority_baseline"] <= 1.0
    evals = [r for r in rows if "eval/accuracy" in r]
    assert evals and all(
        r["eval/majority_baseline"] == res["heldout_majority_baseline"] for r in evals
    )
    before, after = (
        load_file(f"{sft_model_dir}/model.safetensors"),
        load_file(run_dir / "model" / "model.safetensors"),
    )
    assert any(not torch.equal(before[k], after[k]) for k in after)


def test_file_pairs_and_unpaired_kto(sft_model_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    unp = tmp_path / "unpaired.jsonl"
    with open(pairs, "w") as f, open(unp, "w") as g:
        for i in range(12):
            f.write(
                json.dumps(
                    {"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i)}
                )
                + "\n"
            )
            g.write(json.dumps({"prompt": f"What is {i} + 1?", "completion": str(i + i % 2), "label": i % 2 == 0}) + "\n")  # fmt: skip
    base = {
        "trainer": "direct_alignment",
        "model": {"name_or_path": sft_model_dir},
        "task": TASK,
        "train": {"steps": 2, "batch_size": 4, "micro_batch_size": 4},
        "optim": {"lr": 1e-3},
        "eval": {"n": 0, "pref_every": 1},
        "tracking": {"console": False, "samples_per_step": 0},
        "run": {"root": str(tmp_path)},
    }
    res = run_config(
        config_from_dict(
            {
                **base,
                "data": {
                    "source": "file",
                    "path": str(pairs),
                    "heldout_pairs": 4,
                    "max_completion_len": 2,
                },
            }
        )
    )
    assert res["train_rows"] == 8 and res["heldout_pref_n"] == 4
    assert res["heldout_pref_accuracy"] is not None
    res = run_config(
        config_from_dict(
            {
                **base,
                "data": {"source": "file", "path": str(unp), "format": "unpaired"},
                "loss": {"name": "kto"},
            }
        )
    )
    assert res["train_rows"] == 12 and math.isfinite(res["final_loss"])
    # A preference file without a task section: eval.n > 0 must not report the accuracy of the
    # default reasoning_gym task, which has nothing to do with these pairs.
    no_task = {k: v for k, v in base.items() if k != "task"}
    res = run_config(
        config_from_dict(
            {
                **no_task,
                "eval": {"n": 4, "pref_every": 0, "max_new_tokens": 4},
                "data": {"source": "file", "path": str(pairs), "heldout_pairs": 4},
            }
        )
    )
    assert res["heldout_accuracy"] is None and res["heldout_n"] == 0
    assert res["heldout_pref_accuracy"] is not None


def test_bad_config_fails_before_run_dir(tmp_path):
    from rlhflab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"loss\.args\.bta"):
        config_from_dict(
            {
                "trainer": "direct_alignment",
                "model": {"name_or_path": "x"},
                "loss": {"name": "dpo", "args": {"bta": 0.1}},
            }
        )
    with pytest.raises(ConfigError, match=r"needs loss\.name 'kto'"):
        config_from_dict(
            {
                "trainer": "direct_alignment",
                "model": {"name_or_path": "x"},
                "data": {"source": "file", "path": "a.jsonl", "format": "unpaired"},
            }
        )


@pytest.mark.parametrize(
    "loss,split", [("dpo", "rows"), ("simpo", "rows"), ("kto", "rows"), ("dpo", "tokens")]
)
def test_micro_batches_match_one_batch(sft_model_dir, tmp_path, loss, split, monkeypatch):
    """k micro-batches give the update of one batch (the loss is divided by the step's pairs):
    one pair each, or grouped by length under `train.max_tokens_per_micro_batch`.

    In float64 (`model.dtype`): the two add the same terms in other orders, which in float32
    moves results by ~1e-7 relative, differently with each CPU's kernels."""
    eps = torch.finfo(torch.float64).eps
    path = tmp_path / "pairs.jsonl"
    with open(path, "w") as f:
        for i in range(8):
            row = {"prompt": f"What is {i} + 2?", "chosen": str(i + 2), "rejected": str(3 * i + 1)}
            f.write(json.dumps(row) + "\n")
    results = []
    splits = spy_micro_batches(monkeypatch)
    for micro in (4, 1):
        monkeypatch.setenv("RLHFLAB_GRAD_DUMP", str(tmp_path / f"grads-{micro}"))
        budget = 150 if micro == 1 and split == "tokens" else None
        cfg = config_from_dict(
            {
                "trainer": "direct_alignment",
                "model": {"name_or_path": sft_model_dir, "dtype": "float64"},
                "data": {"source": "file", "path": str(path), "heldout_pairs": 0},
                "loss": {"name": loss},
                "train": {
                    "steps": 1,
                    "batch_size": 4,
                    "micro_batch_size": micro,
                    "max_tokens_per_micro_batch": budget,
                },
                "optim": {"lr": 1e-3},
                "eval": {"n": 0, "pref_every": 0},
                "tracking": {"console": False, "samples_per_step": 0},
                "run": {"root": str(tmp_path / str(micro))},
            }
        )
        results.append(run_config(cfg))
    a, b = results
    if split == "tokens":  # several micro-batches, not all of one size
        assert len(splits[-1]) > 1 and len({len(rows) for rows in splits[-1]}) > 1, splits[-1]
    if loss != "kto":  # KTO's z₀ is estimated per micro-batch (documented), so the loss differs
        assert a["final_loss"] == pytest.approx(b["final_loss"], rel=1e4 * eps)
        (ga,), (gb,) = (
            [load_file(p) for p in (tmp_path / f"grads-{m}").glob("*.safetensors")] for m in (4, 1)
        )
        g_max = max(g.abs().max().item() for g in ga.values())
        assert g_max > 0
        for k in ga:
            assert ga[k].dtype == torch.float64
            torch.testing.assert_close(gb[k], ga[k], atol=1e4 * eps * g_max, rtol=0, msg=k)
        # Adam's first step moves a weight by lr·g/(|g| + eps_adam): a gradient difference δ
        # moves it by at most lr·δ/eps_adam (where g ≈ 0), with δ bounded as above.
        atol = cfg.optim.lr / cfg.optim.eps * 1e4 * eps * g_max
        wa, wb = (load_file(f"{r['model_dir']}/model.safetensors") for r in results)
        for k in wa:
            torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0)


def test_compare_direct_alignment_presets(sft_model_dir, tmp_path):
    from rlhflab.compare import run_compare
    from rlhflab.errors import ConfigError

    root = Path(__file__).parents[2]
    over = [f"model.name_or_path={sft_model_dir}", *SMOKE]
    over += [f"task.{k}={json.dumps(v)}" for k, v in TASK.items()]
    dpo, ipo = str(root / "configs/dpo/dpo.yaml"), str(root / "configs/dpo/ipo.yaml")
    # every config is validated before any run starts (no preset has rollout.grop_size)
    with pytest.raises(ConfigError, match=r"no preset has the config key 'rollout\.grop_size'"):
        run_compare(
            [dpo, str(root / "configs/pg/grpo.yaml")],
            seeds=1,
            overrides=[f"model.name_or_path={sft_model_dir}", "rollout.grop_size=2"],
            root=str(tmp_path / "bad"),
        )
    assert not (tmp_path / "bad").exists()
    res = run_compare([dpo, ipo], seeds=1, overrides=over, root=str(tmp_path))
    out = Path(res["out_dir"])
    results = json.loads((out / "results.json").read_text())
    assert results["family"] == "direct_alignment" and results["signal"] == "dpo/margin"
    assert results["presets"]["dpo"]["heldout_pref_accuracy_before"] == [0.5]
    assert results["presets"]["ipo"]["composition"].startswith("ipo(")
    table = (out / "comparison.md").read_text()
    assert "held-out pref. acc. before" in table and "| dpo | dpo(" in table
    assert (out / "comparison.png").exists()


def test_compare_grpo_beside_dpo(sft_model_dir, tmp_path):
    """Families side by side: one table, held-out accuracy for both, each with its own signal."""
    from rlhflab.compare import run_compare

    root = Path(__file__).parents[2]
    over = [f"model.name_or_path={sft_model_dir}", "train.steps=2", "eval.n=4"]
    over += ["eval.max_new_tokens=6", "tracking.console=false", "optim.lr=1e-3"]
    over += [f"task.{k}={json.dumps(v)}" for k, v in TASK.items()]
    dpo = str(root / "configs/dpo/dpo.yaml")
    grpo = str(root / "configs/pg/grpo.yaml")
    res = run_compare(
        [grpo, dpo],
        seeds=1,
        overrides=[*over, "train.micro_batch_size=4"],
        root=str(tmp_path),
    )
    results = json.loads((Path(res["out_dir"]) / "results.json").read_text())
    assert results["family"] == "mixed"
    assert results["presets"]["grpo"]["signal"] == "rollout/reward_mean"
    assert results["presets"]["dpo"]["signal"] == "dpo/margin"
    for name in ("grpo", "dpo"):
        assert results["presets"][name]["heldout_accuracy"][0] is not None
    table = (Path(res["out_dir"]) / "comparison.md").read_text()
    assert "| grpo | policy_gradient: " in table and "| dpo | direct_alignment: " in table


class _FakeVerifier:
    """Scores completions 1, 0, 1, 0, ... (binary) or 0.5 each (partial)."""

    def __init__(self, reward):
        self.reward = reward

    def score_batch(self, texts, rows):
        if self.reward == "partial":
            return [0.5] * len(texts)
        return [float(i % 2 == 0) for i in range(len(texts))]


@pytest.mark.parametrize(
    ("reward", "components", "key", "value"),
    [
        ("binary", None, "sample_accuracy", 0.5),  # 1, 0, 1, 0, ...: half correct
        ("partial", None, "sample_verifier_score_mean", 0.5),
        ("binary", "rm", "sample_reward_mean", 0.25),  # the components' total, 0.25 each
    ],
)
def test_pair_sampling_names_the_mean_label_for_what_it_is(
    tiny_model, tiny_tokenizer, monkeypatch, reward, components, key, value
):
    # A reward model's (or any reward components') mean score is a mean reward, not an accuracy.
    import random
    from types import SimpleNamespace

    from rlhflab.data.tasks import make_splits
    from rlhflab.experience import pairs

    monkeypatch.setattr(
        pairs,
        "score_components",
        lambda comps, supplied, **kw: (torch.full((len(supplied["texts"]),), 0.25), {}),
    )
    problems = make_splits(
        "chain_sum", config={"min_terms": 2, "max_terms": 2}, n_train=3, n_heldout=0
    ).train
    vcfg = SimpleNamespace(
        samples_per_prompt=4, max_new_tokens=3, temperature=1.0, chosen="sampled",
        reward=[object()] if components else None,
    )  # fmt: skip
    _, counts = pairs.verifiable_pairs(
        tiny_model, tiny_tokenizer, problems, _FakeVerifier(reward), vcfg,
        SimpleNamespace(answer_format="plain"), generator=torch.Generator().manual_seed(0),
        rng=random.Random(0), chunk=8, autocast_dtype=None,
    )  # fmt: skip
    names = {"sample_accuracy", "sample_verifier_score_mean", "sample_reward_mean"}
    assert names & set(counts) == {key}
    assert counts[key] == value


def _file_pairs_raw(tmp_path, model_dir, loss, name="pairs"):
    path = tmp_path / "pairs.jsonl"
    if not path.exists():
        with open(path, "w") as f:
            for i in range(10):
                row = {"prompt": f"What is {i} + 3?", "chosen": str(i + 3), "rejected": str(i + 13)}
                f.write(json.dumps(row) + "\n")
    return {
        "trainer": "direct_alignment",
        "model": {"name_or_path": model_dir},
        "data": {"source": "file", "path": str(path), "heldout_pairs": 2},
        "loss": loss,
        "train": {"steps": 2, "batch_size": 4, "micro_batch_size": 2},
        "optim": {"lr": 1e-3},
        "eval": {"n": 0, "pref_every": 1},
        "precision": {"threads": 1},
        "tracking": {"console": False, "samples_per_step": 0},
        "run": {"name": name, "root": str(tmp_path / "runs")},
    }


@pytest.mark.parametrize("reference_free", [True, False])
def test_the_registry_declares_what_the_trainer_does(
    sft_model_dir, tmp_path, monkeypatch, reference_free
):
    """A loss registered under a new name gets what its entry declares, not what its name or its
    signature suggest: reference-free → no reference pass over the training rows and None
    references; lengths → the completion lengths."""
    from rlhflab.losses import preference as P
    from rlhflab.trainers import direct_alignment

    calls, seen = [], []

    def my_loss(pc, pr, rc, rr, *, chosen_lengths=None, rejected_lengths=None, beta=2.0):
        seen.append((rc is None, rr is None, chosen_lengths is None))
        return P.simpo(
            pc, pr, rc, rr, chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths,
            beta=beta,
        )  # fmt: skip

    def recording_cache_reference(model, rows, pad_id, **kw):
        calls.append((len(rows), kw["unpaired"]))
        return cache_reference(model, rows, pad_id, **kw)

    loss = P.PreferenceLoss(my_loss, reference_free=reference_free, lengths=True)
    monkeypatch.setitem(P.PREFERENCE_LOSSES, "my_loss", loss)
    monkeypatch.setattr(direct_alignment, "cache_reference", recording_cache_reference)
    cfg = config_from_dict(_file_pairs_raw(tmp_path, sft_model_dir, {"name": "my_loss"}))
    res = run_config(cfg)
    assert res["train_rows"] == 8 and res["heldout_pref_n"] == 2
    # the held-out pairs are always scored against the initial model; the 8 training rows only
    # for a loss that reads references
    assert calls == ([(2, False)] if reference_free else [(8, False), (2, False)])
    assert seen and all(s == (reference_free, reference_free, False) for s in seen)
    if reference_free:  # π_θ vs itself: the held-out margin is the average log-prob margin
        assert res["heldout_pref_accuracy_before"] != 0.5
    else:  # π_θ = π_ref at step 0: every held-out pair a tie
        assert res["heldout_pref_accuracy_before"] == 0.5


@pytest.mark.parametrize(("alias", "ours", "args"), [
    ("sigmoid", "dpo", {"beta": 0.2}),
    ("sigmoid_norm", "dpo_norm", {"beta": 2.0}),
])  # fmt: skip
def test_trl_loss_names_give_exactly_our_losses(sft_model_dir, tmp_path, alias, ours, args):
    """`loss.name: sigmoid` (TRL's name) is `dpo`: the config resolves it (config.yaml records
    ours), and the run's metrics and weights are those of `dpo`, bit for bit."""
    runs = {}
    for name in (alias, ours):
        cfg = config_from_dict(
            _file_pairs_raw(tmp_path, sft_model_dir, {"name": name, "args": args}, name=name)
        )
        assert cfg.loss.name == ours
        runs[name] = run_config(cfg)

    def metrics(res):  # everything but wall-clock timings
        lines = Path(res["run_dir"], "metrics.jsonl").read_text().splitlines()
        rows = [json.loads(x) for x in lines]
        return [{k: v for k, v in r.items() if k != "time_s" and "perf/" not in k} for r in rows]

    a, b = runs[alias], runs[ours]
    assert metrics(a) == metrics(b) and len(metrics(a)) >= 3
    assert a["loss"] == b["loss"] == ours and a["final_loss"] == b["final_loss"]
    saved = yaml.safe_load(Path(a["run_dir"], "config.yaml").read_text())
    assert saved["loss"]["name"] == ours
    wa, wb = (load_file(f"{r['model_dir']}/model.safetensors") for r in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
