"""The distillation trainer (`trainer: distill`) on tiny models: the hidden states it takes the
divergence from are those of the trained log-probs, each preset runs (finite metrics, the
parameters move, the KL falls), bad teachers and configs are one-line errors, SDPO's bounded
refill, and exact resume after SIGKILL."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from factories import force_layout, tiny_build, tiny_sft, tiny_task
from test_checkpoint_resume import assert_same_run, run_cli, run_dir_of

from rlhflab.config import config_from_dict
from rlhflab.errors import ConfigError, DataError
from rlhflab.trainers import run_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "distill"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A weak student (SFT 6 steps) and a stronger teacher (SFT 40 steps) with one tokenizer,
    and a model with another tokenizer (vocab 280)."""
    root = tmp_path_factory.mktemp("distill_models")
    build = {"build": tiny_build(max_position_embeddings=160)}  # room for SDPO's demonstration
    student = run_config(
        config_from_dict(tiny_sft(root, model=build, run={"name": "s", "root": str(root)}))
    )
    teacher = run_config(
        config_from_dict(
            tiny_sft(
                root,
                model=build,
                train={"steps": 40, "batch_size": 8, "micro_batch_size": 8, "max_len": 48},
                run={"name": "t", "root": str(root)},
            )
        )
    )
    other = run_config(
        config_from_dict(
            tiny_sft(
                root,
                model={"build": tiny_build(vocab_size=280, max_position_embeddings=160)},
                train={"steps": 1, "batch_size": 8, "micro_batch_size": 8, "max_len": 48},
                run={"name": "o", "root": str(root)},
            )
        )
    )
    return {"student": student["model_dir"], "teacher": teacher["run_dir"], "other": other}


def preset(name: str, root, models, **sections) -> dict:
    """configs/distill/<name>.yaml on the tiny task and models: 4 steps of 8 completions."""
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    raw.update(
        model={"name_or_path": models["student"]},
        task=tiny_task(),
        train={"steps": 4, "micro_batch_size": 4},
        eval={"n": 4, "max_new_tokens": 6},
        tracking={"console": False},
        run={"name": name, "root": str(root)},
    )
    raw["rollout"] = {**raw["rollout"], "prompts_per_step": 8 // raw["rollout"]["group_size"],
                      "max_new_tokens": 6}  # fmt: skip
    if raw["teacher"]["source"] == "model":
        raw["teacher"] = {**raw["teacher"], "name_or_path": models["teacher"]}
    raw.update(sections)
    return raw


@pytest.mark.parametrize("layout", ["padded", "tree", "varlen"])
def test_forward_head_hidden_states_give_the_trained_log_probs(tiny_model64, monkeypatch, layout):
    # The divergence is taken from the hidden states `_forward_head` selects; here they are
    # checked against `completion_logps` (the log-probs every other trainer trains), in the
    # padded layout and packed (rows of very different lengths; a scored token inside left out
    # of the selection): a shift by one position, the padding, the position ids, a packed row's
    # boundaries or the selection order would break the equality.
    import rlhflab.trainers.distill as distill
    from rlhflab.rollout.sampler import completion_logps, pack

    prompts = [[5, 6, 7, 8], [9, 10], [12], [13, 14, 15, 16, 17, 18]]
    completions = [[11, 12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22], [23], [24, 25]]
    rollout = pack(prompts, completions, pad_token_id=0)
    sel = rollout.mask > 0
    sel[1, 4] = False
    want, _ = completion_logps(tiny_model64, rollout)
    chosen = force_layout(monkeypatch, layout)  # completion_head's layout
    hidden = distill._forward_head(tiny_model64, rollout, contextlib.nullcontext(), lambda h: h,
                                   sel)  # fmt: skip
    assert all(lay is not None for lay in chosen) and len(chosen) == (layout != "padded")
    head = tiny_model64.get_output_embeddings()
    logp = torch.log_softmax(head(hidden), -1)  # (N, V)
    got = logp.gather(-1, rollout.completion_ids[sel][:, None])[:, 0]
    torch.testing.assert_close(got, want[sel], rtol=1e-12, atol=1e-12)


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open()]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["on_policy", "gkd", "sdpo"])
def test_preset_smoke(name, tmp_path, models):
    sections = {}
    if name == "sdpo":  # the stronger model teaches itself (the weak one rarely solves a sum)
        sections["model"] = {"name_or_path": models["teacher"] + "/model"}
        sections["sdpo"] = {"max_rounds": 40}
        sections["optim"] = {"lr": 1e-4}
    if name == "gkd":  # both kinds of batch within 4 steps (seed 0 draws student, teacher, ...)
        sections["loss"] = {"divergence": "generalized_jsd", "divergence_args": {"beta": 0.5},
                            "lmbda": 0.5}  # fmt: skip
    raw = preset(name, tmp_path, models, **sections)
    if name == "sdpo":  # one prompt of 8 samples a step: a correct sibling is found sooner
        raw["rollout"].update(prompts_per_step=1, group_size=8)
    res = run_config(config_from_dict(raw))
    assert res["status"] == "complete" and res["steps"] == 4
    assert res["heldout_n"] == 4 and res["heldout_accuracy"] is not None
    rows = [r for r in _metrics(res["run_dir"]) if "distill/kl" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert math.isfinite(r["train/loss"]) and r["distill/kl"] >= 0
        assert 0 <= r["distill/argmax_agree"] <= 1
        assert (
            r["distill/kl_p50"] <= r["distill/kl_p90"] <= r["distill/kl_p99"] <= r["distill/kl_max"]
        )
        assert r["optim/grad_norm"] > 0
    if name == "gkd":
        assert {r["distill/on_policy"] for r in rows} == {0.0, 1.0}
    if name == "sdpo":
        assert all(r["sdpo/rounds"] >= 1 for r in rows)
    assert (Path(res["run_dir"]) / "model" / "model.safetensors").exists()


@pytest.mark.slow
def test_on_policy_distillation_lowers_the_kl(tmp_path, models):
    # 12 steps of full-distribution reverse KL at a high learning rate: the student's exact KL to
    # the teacher on its own samples falls (the first 3 steps' mean against the last 3's; measured
    # 0.76x here).
    raw = preset("on_policy", tmp_path, models, train={"steps": 12, "micro_batch_size": 8},
                 optim={"lr": 3e-3}, eval={"n": 0})  # fmt: skip
    raw["rollout"]["prompts_per_step"] = 16
    res = run_config(config_from_dict(raw))
    kl = [r["distill/kl"] for r in _metrics(res["run_dir"]) if "distill/kl" in r]
    assert sum(kl[-3:]) < 0.9 * sum(kl[:3]), kl


@pytest.mark.slow
def test_lora_student(tmp_path, models):
    # A LoRA student: only the adapters train (the base weights in model/ are the merged ones).
    raw = preset("on_policy", tmp_path, models, eval={"n": 0})
    raw["model"] = {"name_or_path": models["student"], "lora": {"r": 4, "alpha": 8.0}}
    res = run_config(config_from_dict(raw))
    rows = [r for r in _metrics(res["run_dir"]) if "distill/kl" in r]
    assert len(rows) == 4 and all(r["optim/grad_norm"] > 0 for r in rows)
    assert res["health"]["ok"] or "params_frozen" not in res["health"]["failed"]


# Every sampling mode of the experience layer (rlhflab.experience.Sampler), with no code of its
# own in trainers/distill.py: async (a behaviour copy samples ahead), dynamic sampling (groups
# whose verifier scores vary), and episodes with an environment (the teacher scores the model's
# tokens of the trajectory; observations attended, never trained on).
MODES = {
    "async": ({"mode": "async", "max_staleness": 1}, {}, "rollout/staleness"),
    # partial credit (reasoning_gym's score): the weak models' groups vary often enough
    "dynamic": (
        {"dynamic_sampling": {"enabled": True, "max_rounds": 16}},
        {"task": tiny_task(reward="partial")},
        "rollout/rounds",
    ),
    "env": (
        {},
        {"env": {"class": "fixtures_envs:ScriptEnv", "max_turns": 3}},
        "rollout/turns_mean",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_every_sampling_mode_runs(mode, tmp_path, models):
    rollout, sections, key = MODES[mode]
    raw = preset("on_policy", tmp_path, models, **sections)
    raw["model"] = {"name_or_path": models["teacher"] + "/model"}  # solves some sums: groups vary
    raw["teacher"] = {"source": "model", "name_or_path": models["student"]}
    raw["rollout"].update(group_size=4, prompts_per_step=2, **rollout)
    res = run_config(config_from_dict(raw))
    assert res["status"] == "complete" and res["steps"] == 4
    rows = [r for r in _metrics(res["run_dir"]) if "distill/kl" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["train/loss"]) and r["optim/grad_norm"] > 0 for r in rows)
    assert all(key in r for r in rows), rows[0].keys()
    if mode == "async":  # step 1 from the initial weights, then one update behind
        assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    if mode == "dynamic":  # every kept group's verifier scores vary
        assert all(r["rollout/rounds"] >= 1 for r in rows)
    if mode == "env":  # ScriptEnv: up to three model turns (limits may cut one), tool calls
        assert all(1 < r["rollout/turns_mean"] <= 3 and r["rollout/tool_calls_mean"] > 0
                   for r in rows)  # fmt: skip
        assert all(0 <= r["rollout/reward_mean"] <= 1 for r in rows)
        assert "rollout/accuracy" not in rows[0]
    assert res["heldout_n"] == 4


@pytest.mark.slow
def test_async_killed_mid_run_resumes_exactly(tmp_path, models):
    # rollout.mode async: the queued batch (sampled ahead by the behaviour copy) is part of the
    # checkpoint; SIGKILL in step 3, resume, and the run equals an uninterrupted one bit for bit.
    sections = {
        "checkpoint": {"every": 2, "keep_last": 2},
        "precision": {"threads": 1},
        "train": {"steps": 4, "micro_batch_size": 4},
        "eval": {"n": 2, "max_new_tokens": 4},
    }
    runs = {}
    for name in ("ref", "killed"):
        raw = preset("on_policy", tmp_path / name, models, **sections)
        raw["rollout"].update(mode="async", max_staleness=1)
        raw["run"]["name"] = name
        runs[name] = raw
    run_config(config_from_dict(runs["ref"]))
    killed = runs["killed"]
    assert run_cli(tmp_path, killed, fault="step_mid@3=sigkill", check=False).returncode == -9
    run_cli(tmp_path, killed, "--resume")
    assert_same_run(run_dir_of(tmp_path / "ref", "ref"), run_dir_of(tmp_path / "killed", "killed"))


def test_teacher_with_another_tokenizer_is_refused(tmp_path, models):
    raw = preset("on_policy", tmp_path, models)
    raw["teacher"]["name_or_path"] = models["other"]["run_dir"]
    with pytest.raises(ConfigError) as exc:
        run_config(config_from_dict(raw))
    msg = str(exc.value)
    assert "\n" not in msg and "teacher.name_or_path" in msg
    assert models["other"]["run_dir"] in msg and models["student"] in msg
    assert not list(tmp_path.glob("on_policy-*"))  # refused before anything is written


def test_reward_model_teacher_is_refused(tmp_path, models):
    """A reward model made from the student (`...ForSequenceClassification`, the student's
    tokenizer and vocabulary): AutoModelForCausalLM would load its body with a random LM head."""
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.models.reward import reward_model_from_causal_lm

    rm_dir = tmp_path / "rm"
    rm = reward_model_from_causal_lm(load_model(models["student"]))
    rm.save_pretrained(rm_dir)
    load_tokenizer(models["student"]).save_pretrained(rm_dir)
    assert rm.config.architectures is None or "ForSequenceClassification" in str(
        json.loads((rm_dir / "config.json").read_text())["architectures"]
    )
    raw = preset("on_policy", tmp_path / "runs", models)
    raw["teacher"]["name_or_path"] = str(rm_dir)
    with pytest.raises(ConfigError) as exc:
        run_config(config_from_dict(raw))
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"teacher.name_or_path: {rm_dir} is a ")
    assert "ForSequenceClassification, not a causal LM" in msg
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_teacher_with_the_students_weights_is_refused_unless_allowed(tmp_path, models):
    """The student's model directory copied elsewhere (another path, the same tensors) as the
    teacher: refused in one line; with teacher.allow_same_as_student a one-line warning."""
    import shutil
    import warnings

    same = shutil.copytree(models["student"], tmp_path / "copy")
    raw = preset("on_policy", tmp_path / "runs", models, train={"steps": 1, "micro_batch_size": 4},
                 eval={"n": 0})  # fmt: skip
    raw["teacher"]["name_or_path"] = str(same)
    with pytest.raises(ConfigError) as exc:
        run_config(config_from_dict(raw))
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith(f"teacher.name_or_path: the teacher ({same}) has the student's own "
                          f"weights ({models['student']})")  # fmt: skip
    assert msg.endswith("set teacher.allow_same_as_student: true to run it anyway")
    raw["teacher"]["allow_same_as_student"] = True
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        res = run_config(config_from_dict(raw))
    assert res["steps"] == 1
    notes = [str(w.message) for w in record if "own weights" in str(w.message)]
    assert len(notes) == 1 and "\n" not in notes[0]
    assert notes[0].endswith("(teacher.allow_same_as_student is set)")


def test_same_weights_compares_in_the_teachers_dtype(tiny_model):
    """`same_weights`: a copy is the same, in bf16 too (the student's cast to the teacher's
    dtype); one element changed, or another model, is not."""
    import copy

    from rlhflab.trainers.distill import same_weights

    twin = copy.deepcopy(tiny_model)
    assert same_weights(tiny_model, twin)
    assert same_weights(tiny_model, copy.deepcopy(tiny_model).to(torch.bfloat16))
    with torch.no_grad():
        name, p = sorted(twin.named_parameters())[len(list(twin.parameters())) // 3]
        p.view(-1)[0] += 1.0
    assert not same_weights(tiny_model, twin), name


def test_sdpo_with_no_correct_sibling_stops_with_a_clear_error(tmp_path, models):
    # A model built from scratch never solves a sum: after sdpo.max_rounds draws, a DataError.
    raw = preset("sdpo", tmp_path, models, model={"build": tiny_build()},
                 sdpo={"max_rounds": 2}, eval={"n": 0})  # fmt: skip
    with pytest.raises(DataError, match=r"only 0 of the 2 prompts .* after 2 draws"):
        run_config(config_from_dict(raw))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"teacher": {"source": "model"}}, "teacher.name_or_path is required"),
        ({"teacher": {"source": "self", "name_or_path": "x"}}, "must be unset"),
        ({"loss": {"divergence": "reverse_kl_sampled", "lmbda": 0.5}}, "student samples only"),
        ({"loss": {"divergence": "generalized_jsd", "divergence_args": {"beta": 2}}}, "beta"),
        ({"loss": {"divergence": "topk_kl", "divergence_args": {"k": 3}}}, "divergence_args"),
        ({"loss": {"divergence": "reverse_kll"}}, "reverse_kl"),
        ({"teacher": {"source": "self"}, "rollout": {"group_size": 1}}, "group_size must be >= 2"),
        # the sampling modes a distillation family cannot use (one line naming the key)
        (
            {"teacher": {"source": "self"}, "rollout": {"group_size": 4, "mode": "async"}},
            "rollout.mode 'async': teacher.source 'self'",
        ),
        (
            {
                "loss": {"divergence": "generalized_jsd", "lmbda": 0.5},
                "env": {"class": "fixtures_envs:ScriptEnv"},
            },
            "env: loss.lmbda < 1",
        ),
        (
            {
                "data": {"source": "dataset", "path": "x.jsonl"},
                "rollout": {"group_size": 2, "dynamic_sampling": {"enabled": True}},
            },
            "rollout.dynamic_sampling: distillation keeps",
        ),
        ({"rollout": {"group_size": 2, "behav_cap": 3.0, "mode": "async"}}, "behav_cap"),
        (
            {"rollout": {"group_size": 2, "mode": "async", "engine": "vllm"}},
            "needs rollout.engine 'hf'",
        ),
    ],
)
def test_config_errors_are_one_line(tmp_path, models, change, match):
    raw = preset("on_policy", tmp_path, models)
    raw.update(change)
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw)
    assert "\n" not in str(exc.value)
    assert match in str(exc.value)


@pytest.mark.slow
def test_killed_mid_run_resumes_exactly(tmp_path, models):
    # GKD with λ = 0.5 (student and teacher batches; its λ RNG is checkpointed), checkpoints
    # every 2 steps, SIGKILL in the middle of step 3 (after the backward pass): the resumed run
    # redoes step 3 and must match an uninterrupted run bit for bit (metrics, samples, weights).
    # seed 3: the λ draws of steps 1-4 are teacher, student, teacher, teacher, so a resume that
    # restarted the λ RNG (student at step 4) would differ
    sections = {
        "seed": 3,
        "checkpoint": {"every": 2, "keep_last": 2},
        "precision": {"threads": 1},
        "train": {"steps": 4, "micro_batch_size": 4},
        "eval": {"n": 2, "max_new_tokens": 4},
        "loss": {"divergence": "generalized_jsd", "divergence_args": {"beta": 0.5}, "lmbda": 0.5},
    }
    ref = preset("gkd", tmp_path / "ref", models, **sections)
    ref["run"]["name"] = "ref"
    run_config(config_from_dict(ref))  # uninterrupted, in this process
    raw = preset("gkd", tmp_path / "killed", models, **sections)
    raw["run"]["name"] = "killed"
    assert run_cli(tmp_path, raw, fault="step_mid@3=sigkill", check=False).returncode == -9
    run_cli(tmp_path, raw, "--resume")
    ref_dir, killed_dir = (
        run_dir_of(tmp_path / "ref", "ref"),
        run_dir_of(tmp_path / "killed", "killed"),
    )
    assert {r.get("distill/on_policy") for r in _metrics(ref_dir)} >= {0.0, 1.0}
    assert_same_run(ref_dir, killed_dir)


def test_distill_kl_flat_health_check():
    # window 4, patience 2: judged from step 8 (the last window against the first, disjoint);
    # a KL that falls passes, a flat one fails after `patience` judged steps in a row.
    from rlhflab.config import HealthConfig
    from rlhflab.health import HealthMonitor

    cfg = HealthConfig(window=4, patience=2, skip=["nonfinite"])
    falling, flat = (
        HealthMonitor(cfg, print_fn=lambda *_: None),
        HealthMonitor(cfg, print_fn=lambda *_: None),
    )
    out_falling = [falling.check(s, {"distill/kl": 1.0 / s}) for s in range(1, 11)]
    out_flat = [flat.check(s, {"distill/kl": 1.0 + 0.01 * (s % 2)}) for s in range(1, 11)]
    assert all(o.get("health/distill_kl_flat", 0.0) == 0.0 for o in out_falling)
    assert "health/distill_kl_flat" not in out_flat[6]  # step 7: not judged yet
    assert [o["health/distill_kl_flat"] for o in out_flat[7:]] == [0.0, 1.0, 1.0]
    # its memory survives a checkpoint
    again = HealthMonitor(cfg, print_fn=lambda *_: None)
    again.load(json.loads(json.dumps(flat.state())))
    assert again.check(11, {"distill/kl": 1.0})["health/distill_kl_flat"] == 1.0


@pytest.mark.slow
def test_two_ranks_fsdp2_match_one_process(tmp_path, models):
    # torchrun, 2 processes on gloo, FSDP2 (the teacher sharded like the student; its head is
    # gathered through the backward passes, which recompute the chunks' teacher logits): the
    # per-step loss and KL equal those of one process, GKD with student and teacher batches,
    # fixed micro-batches in the one process, token-budget ones on the 2 ranks.
    import subprocess
    import sys

    from factories import worker_env

    raw = preset("gkd", tmp_path / "one", models, eval={"n": 0}, train={"steps": 3, "micro_batch_size": 4},
                 loss={"divergence": "generalized_jsd", "divergence_args": {"beta": 0.5}, "lmbda": 0.5},
                 precision={"threads": 1})  # fmt: skip
    one = run_config(config_from_dict(raw))["run_dir"]
    raw["run"] = {"name": "two", "root": str(tmp_path / "two")}
    # the 2 ranks group their rows by length into micro-batches of at most 100 padded tokens
    # (about two completions each) instead of 4 rows: the same update
    raw["train"] = {**raw["train"], "max_tokens_per_micro_batch": 100}
    cfg = tmp_path / "two.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "rlhflab", "train", str(cfg), "parallel.strategy=fsdp2"]  # fmt: skip
    res = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    two = run_dir_of(tmp_path / "two", "two")
    a = [r for r in _metrics(one) if "train/loss" in r]
    b = [r for r in _metrics(two) if "train/loss" in r]
    assert [r["distill/on_policy"] for r in a] == [r["distill/on_policy"] for r in b]
    assert {r["distill/on_policy"] for r in a} == {0.0, 1.0}
    for x, y in zip(a, b, strict=True):
        for key in ("train/loss", "distill/kl", "distill/argmax_agree"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (x["step"], key)
