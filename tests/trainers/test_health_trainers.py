"""Health checks inside the trainers: each check fires on an injected fault, and `on_fail: stop`
ends the run with a committed checkpoint and exit code 3."""

import json
import math
from pathlib import Path

import pytest
import torch
from factories import tiny_build, tiny_dpo, tiny_pg, tiny_sft, tiny_task

from rlhflab.checkpoint import committed_checkpoints
from rlhflab.config import config_from_dict
from rlhflab.errors import HealthStop
from rlhflab.trainers import run_config

TASK = tiny_task()
BUILD = tiny_build()
QUIET = {"console": False}


def _sft(root, steps=6, **over):
    train = {"steps": steps, "batch_size": 8, "micro_batch_size": 8, "max_len": 48}
    return config_from_dict(tiny_sft(root, **({"train": train} | over)))


@pytest.fixture(scope="module")
def sft_model_dir(tmp_path_factory):
    res = run_config(_sft(tmp_path_factory.mktemp("sft"), steps=40, optim={"lr": 3e-3}))
    return res["model_dir"]


def _pg(root, model_dir, steps=5, **over):
    train = {"steps": steps, "micro_batch_size": 16}
    run = {"name": "grpo", "root": str(root), "save_model": False}
    return config_from_dict(tiny_pg(root, model_dir, **({"train": train, "run": run} | over)))


def _dpo(root, model_dir, steps=8, **over):
    train = {"steps": steps, "batch_size": 4, "micro_batch_size": 4}
    run = {"name": "dpo", "root": str(root), "save_model": False}
    return config_from_dict(tiny_dpo(root, model_dir, **({"train": train, "run": run} | over)))


def _failed(res) -> dict:
    return res["health"]["failed"]


def _health_rows(res, name):
    rows = Path(res["run_dir"], "metrics.jsonl").read_text().splitlines()
    return [json.loads(r).get(f"health/{name}") for r in rows if "health/" in r]


# -- lr far too high (issue 14 item 20): flagged by every trainer -------------------------------


def test_lr_far_too_high_flagged_sft(tmp_path):
    res = run_config(_sft(tmp_path, steps=8, optim={"lr": 1e6}))
    # one normal step, then a saturated softmax: the gradient norm is exactly 0 from step 2 on
    assert _failed(res)["grad_norm_zero"]["first_step"] == 4, _failed(res)


def test_lr_far_too_high_flagged_grpo(tmp_path, sft_model_dir):
    res = run_config(_pg(tmp_path, sft_model_dir, steps=8, optim={"lr": 1e6}))
    # patience 3: flagged at step 3 when step 1's own gradient was already 0 (it depends on
    # the samples), else at step 4
    assert _failed(res)["grad_norm_zero"]["first_step"] in (3, 4), _failed(res)


def test_lr_far_too_high_flagged_dpo(tmp_path, sft_model_dir):
    res = run_config(_dpo(tmp_path, sft_model_dir, optim={"lr": 1e6}))
    assert _failed(res)["grad_norm_zero"]["first_step"] == 4, _failed(res)


def test_heldout_drop_while_the_margin_rises_flagged_dpo(tmp_path, sft_model_dir, monkeypatch):
    """The trainer feeds its held-out evaluations and dpo/margin to reward_hacking: evaluations
    at steps 0, 4 and 8 report 0.5, 0.8 (the best) and 0.2 while training raises the margin."""
    import rlhflab.trainers.direct_alignment as da

    accuracy = iter([0.5, 0.8, 0.2])
    monkeypatch.setattr(
        da, "heldout_eval", lambda *a, **kw: {"accuracy": next(accuracy), "accuracy_stderr": 0.01}
    )
    res = run_config(
        _dpo(tmp_path, sft_model_dir, eval={"n": 4, "every": 4, "pref_every": 0},
             health={"window": 2})
    )  # fmt: skip
    rows = [json.loads(r) for r in Path(res["run_dir"], "metrics.jsonl").read_text().splitlines()]
    margin = {r["step"]: r["dpo/margin"] for r in rows if "dpo/margin" in r}
    assert margin[7] + margin[8] > margin[3] + margin[4] + 0.1, margin  # the signal rose
    drop = 0.8 - 0.2 - max(0.05, 2 * math.hypot(0.01, 0.01))
    assert _failed(res) == {
        "reward_hacking": {"first_step": 8, "count": 1, "value": pytest.approx(drop)}
    }


def test_lr_far_too_high_flagged_rm(tmp_path, sft_model_dir):
    raw = {
        "trainer": "reward_model",
        "kind": "orm",
        "model": {"name_or_path": sft_model_dir},
        "task": TASK,
        "data": {"source": "worked_solutions", "n_prompts": 16, "max_len": 64},
        "train": {"steps": 8, "batch_size": 8, "micro_batch_size": 8},
        "optim": {"lr": 1e6},
        "eval": {"n_problems": 4, "best_of_n": []},
        "tracking": QUIET,
        "run": {"name": "rm", "root": str(tmp_path), "save_model": False},
    }
    res = run_config(config_from_dict(raw))
    assert _failed(res)["grad_norm_zero"]["first_step"] == 4, _failed(res)


# -- one fault, one check -------------------------------------------------------------------------


def test_frozen_parameters_flagged(tmp_path, monkeypatch):
    """An optimizer that never moves the weights: gradients flow, parameters do not change."""
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)
    res = run_config(_sft(tmp_path, steps=4))
    assert set(_failed(res)) == {"params_frozen"}, _failed(res)
    # sustained: fails from the patience-th step in a row on (3 by default), every step after it
    assert _failed(res)["params_frozen"] == {"first_step": 3, "count": 2, "value": 0.0}
    assert _health_rows(res, "params_frozen") == [0.0, 0.0, 1.0, 1.0]


def test_nan_logits_flagged(tmp_path, monkeypatch):
    """NaN in the final norm makes every logit NaN; with nan_policy skip the run goes on and the
    non-finite and probabilities-sum-to-1 checks fire at step 1."""
    import rlhflab.trainers.sft as sft_mod

    real = sft_mod.prepare_model

    def poisoned(*args, **kwargs):
        tok, model = real(*args, **kwargs)
        with torch.no_grad():
            model.model.norm.weight[0] = float("nan")
        return tok, model

    monkeypatch.setattr(sft_mod, "prepare_model", poisoned)
    res = run_config(
        _sft(tmp_path, steps=2, train={"steps": 2, "batch_size": 8, "micro_batch_size": 8,
                                       "max_len": 48, "nan_policy": "skip", "nan_max_skips": 5},
             run={"name": "sft", "root": str(tmp_path), "save_model": False})
    )  # fmt: skip
    assert _failed(res)["nonfinite"]["first_step"] == 1
    assert _failed(res)["prob_sum"]["first_step"] == 1


def test_sampler_logps_that_disagree_flagged(tmp_path, sft_model_dir, monkeypatch):
    """A sampler whose log-probs are 0.5 nats too low on every token: training-inference mismatch."""
    from rlhflab.rollout.engines.hf import HFEngine

    real = HFEngine.generate

    def skewed(*args, **kwargs):
        r = real(*args, **kwargs)
        r.logp = r.logp - 0.5 * r.mask
        return r

    monkeypatch.setattr(HFEngine, "generate", skewed)
    res = run_config(_pg(tmp_path, sft_model_dir, steps=4))
    assert _failed(res)["logp_mismatch"]["first_step"] == 3
    assert _failed(res)["logp_mismatch"]["value"] == pytest.approx(0.5, abs=1e-4)
    assert "logp_positive" not in _failed(res)


def test_all_equal_rewards_flagged(tmp_path, sft_model_dir, monkeypatch):
    """Every completion gets reward 1: every group has zero variance, every advantage is 0 and
    (no KL) no gradient flows."""
    import rlhflab.experience.scoring as pg  # the policy gradient's scorer

    real = pg.score_components

    def constant(components, supplied, **kw):
        rewards, comps = real(components, supplied, **kw)
        return torch.ones_like(rewards), {k: torch.ones_like(v) for k, v in comps.items()}

    monkeypatch.setattr(pg, "score_components", constant)
    res = run_config(_pg(tmp_path, sft_model_dir, steps=4))
    failed = _failed(res)
    assert failed["adv_zero"]["first_step"] == 3 and failed["grad_norm_zero"]["first_step"] == 3
    assert failed["adv_zero"]["value"] == 0.0


class _OneToken(torch.nn.Module):
    """An LM head that always prefers token `t` by a wide margin (a degenerate model)."""

    def __init__(self, head: torch.nn.Linear, t: int) -> None:
        super().__init__()
        self.head, self.t = head, t

    def forward(self, hidden):
        logits = self.head(hidden)
        return logits.index_add(-1, torch.tensor([self.t]), torch.full_like(logits[..., :1], 50.0))


def test_degenerate_one_token_model_flagged(tmp_path, sft_model_dir, monkeypatch):
    import rlhflab.trainers.policy_gradient as pg

    real = pg.prepare_model

    def degenerate(*args, **kwargs):
        tok, model = real(*args, **kwargs)
        model.lm_head = _OneToken(model.lm_head, tok.convert_tokens_to_ids("7"))
        return tok, model

    monkeypatch.setattr(pg, "prepare_model", degenerate)
    res = run_config(_pg(tmp_path, sft_model_dir, steps=3, checkpoint={"every": 0}))
    failed = _failed(res)
    # "7777777" every time: repeated n-grams, truncated, identical and wrong within every group
    for name in ("repetition", "identical_group", "truncation_high"):
        assert failed[name]["first_step"] == 3, failed
        assert failed[name]["value"] == 1.0


# -- on_fail: stop --------------------------------------------------------------------------------


def test_on_fail_stop_commits_a_checkpoint_and_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)
    cfg = _sft(tmp_path, steps=10, health={"on_fail": "stop"})
    with pytest.raises(HealthStop) as info:
        run_config(cfg)
    exc = info.value
    assert exc.name == "params_frozen" and exc.step == 3 and exc.exit_code == 3
    (run_dir,) = list(tmp_path.glob("sft-*"))
    assert [p.name for p in committed_checkpoints(run_dir)] == [exc.checkpoint.name]
    assert exc.checkpoint.name.endswith("00000003")
    # The stopped run still has its results and plots (issue 23).
    final = json.loads((run_dir / "final_results.json").read_text())
    assert final["status"] == "stopped_by_health"
    assert final["failed_checks"] == ["params_frozen"]
    assert final["stopped_by"]["check"] == "params_frozen" and final["stopped_by"]["step"] == 3
    assert final["steps"] == 3 and final["checkpoint"] == str(exc.checkpoint)
    assert final["health"]["failed"]["params_frozen"]["first_step"] == 3
    assert final["run_dir"] == str(run_dir)
    assert (run_dir / "plots" / "loss.png").exists()
    # --resume (the check set to warn) continues and replaces them with the finished run's.
    monkeypatch.undo()
    run = {"name": "sft", "root": str(tmp_path), "resume": str(exc.checkpoint)}
    res = run_config(_sft(tmp_path, steps=10, health={"on_fail": "warn"}, run=run))
    assert res["run_dir"] == str(run_dir) and res["steps"] == 10
    final = json.loads((run_dir / "final_results.json").read_text())
    assert final.get("status") != "stopped_by_health" and final["steps"] == 10


def test_on_fail_stop_exit_code_from_the_cli(tmp_path, monkeypatch, capsys):
    from rlhflab.cli import main

    monkeypatch.setattr(torch.optim.AdamW, "step", lambda self, closure=None: None)
    cfg = _sft(tmp_path, steps=10, health={"on_fail": "stop"})
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(cfg.model_dump(mode="json")))
    assert main(["train", str(path)]) == 3
    err = capsys.readouterr().err
    assert "health check 'params_frozen' failed at step 3" in err
    # the warning line, once (on stderr: this run's console sink is off), before the stop
    assert err.count("health: 'params_frozen' failed at step 3") == 1


def test_unknown_check_name_is_a_config_error(tmp_path):
    from rlhflab.errors import ConfigError

    with pytest.raises(ConfigError, match=r"health\.skip.*grad_norm_zero"):
        _sft(tmp_path, health={"skip": ["grad_norm_zro"]})


def test_checkpoint_every_0_and_save_model_false_write_neither(tmp_path):
    """checkpoint.every=0 writes no checkpoint at the end; run.save_model=false no model/."""
    res = run_config(
        _sft(tmp_path, steps=2, checkpoint={"every": 0},
             run={"name": "sft", "root": str(tmp_path), "save_model": False})
    )  # fmt: skip
    run_dir = Path(res["run_dir"])
    assert committed_checkpoints(run_dir) == []
    assert not (run_dir / "model").exists() and res["model_dir"] is None
    assert (run_dir / "final_results.json").exists()


def test_sft_health_summary_lists_only_the_checks_that_apply(tmp_path):
    # 7 of the checks apply to SFT: loss and gradient checks, parameter change, the sampled
    # softmax check and the log-probability bound it feeds; none of the rollout checks.
    res = run_config(_sft(tmp_path, steps=4, health={"window": 3}))
    checked = res["health"]["checked"]
    assert checked == [
        "nonfinite",
        "prob_sum",
        "logp_positive",
        "grad_norm_zero",
        "grad_norm_exploding",
        "params_frozen",
        "loss_flat",
    ]
    saved = json.loads(Path(res["run_dir"], "final_results.json").read_text())
    assert saved["health"]["checked"] == checked
