"""LoRA (`model.lora`, rlhflab.models.lora) in the trainers, on a tiny Qwen3-shape model.

What is checked, and against what:
    * a LoRA GRPO step and a LoRA DPO step change the adapters (lora_A / lora_B) and leave every
      other tensor bitwise equal to the base checkpoint;
    * the optimizer holds exactly the adapters (parameters and state);
    * the reference policy (`Reference`, and DPO's cached reference) is the base model: log-probs
      equal a freshly loaded base model's, before and after training, with no second copy;
    * a LoRA checkpoint holds the adapters only, and a run stopped by SIGTERM and resumed ends
      with bitwise the same adapters and metrics as an uninterrupted run;
    * the adapter directory loads with `PeftModel.from_pretrained(base, dir)` and the merged
      directory with `AutoModelForCausalLM.from_pretrained(dir)`, both with the trained logits.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from factories import tiny_task
from safetensors.torch import load_file

from rlhflab.config import LoRAConfig, config_from_dict
from rlhflab.errors import ConfigError
from rlhflab.trainers import run_config

pytest.importorskip("peft")

TASK = tiny_task(n_train=40, n_heldout=8)
LORA = {"r": 4, "alpha": 8.0}
# A reward that varies between the samples of a tiny random model, so that group advantages are
# not all zero and a step has a gradient.
REWARD_FN = """
def digit_count(prompts, completions, **kwargs):
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]
"""


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny random base model saved as a Hugging Face directory."""
    from rlhflab.models.build import build_model, save_pretrained

    path = tmp_path_factory.mktemp("base") / "model"
    model = build_model(tiny_tokenizer, size="tiny", max_position_embeddings=128, seed=0)
    save_pretrained(model, tiny_tokenizer, path)
    return path


@pytest.fixture(scope="module")
def reward_fn(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARD_FN)
    return f"{path}:digit_count"


def load_base(base_dir):
    from rlhflab.models.loading import load_model

    return load_model(str(base_dir))


def load_tokenizer(path):
    from rlhflab.models.loading import load_tokenizer

    return load_tokenizer(str(path))


def grpo_raw(root, base_dir, reward_fn, *, name="grpo", steps=1, save="adapter", **extra):
    return {
        "trainer": "policy_gradient",
        "model": {"name_or_path": str(base_dir), "lora": {**LORA, "save": save}},
        "task": TASK,
        "precision": {"threads": 1},
        "tracking": {"console": False, "samples_every": 2},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
        "reward": {"components": [{"function": reward_fn}]},
        "loss": {"advantage": "group_zscore", "surrogate": "ppo_clip"},
        "kl": {"coef": 0.05},
        "train": {"steps": steps, "micro_batch_size": 4, "update_epochs": 2, "minibatches": 2},
        "optim": {"lr": 1e-2, "warmup_steps": 1, "schedule": "linear"},
        "eval": {"n": 4, "max_new_tokens": 4},
        "run": {"name": name, "root": str(root)},
        **extra,
    }


def dpo_raw(root, base_dir, *, name="dpo", steps=1, save="adapter", **extra):
    return {
        "trainer": "direct_alignment",
        "model": {"name_or_path": str(base_dir), "lora": {**LORA, "save": save}},
        "task": TASK,
        "precision": {"threads": 1},
        "tracking": {"console": False, "samples_every": 2},
        "data": {"source": "verifiable", "heldout_pairs": 4},
        "verifiable": {
            "n_prompts": 8,
            "samples_per_prompt": 2,
            "chosen": "gold",
            "max_new_tokens": 4,
        },
        "loss": {"name": "dpo", "args": {"beta": 0.1}},
        "train": {"steps": steps, "batch_size": 4, "micro_batch_size": 2},
        "optim": {"lr": 1e-2},
        "eval": {"n": 4, "max_new_tokens": 4, "pref_every": 0},
        "run": {"name": name, "root": str(root)},
        **extra,
    }


def run_captured(monkeypatch, module, raw):
    """Run a trainer in-process; returns (results, the trained model object, its optimizer)."""
    from rlhflab.trainers import common, loop

    seen = {}
    # a trainer on the run harness (rlhflab.trainers.loop) saves through the harness's import
    saver = module if hasattr(module, "save_final_model") else loop
    save, make_opt = saver.save_final_model, module.make_optimizer

    def capture_save(model, tokenizer, path, lora=None):
        seen["model"], seen["tokenizer"] = model, tokenizer
        save(model, tokenizer, path, lora)

    def capture_opt(model, optim):
        seen.setdefault("optimizer", make_opt(model, optim))
        return seen["optimizer"]

    monkeypatch.setattr(saver, "save_final_model", capture_save)
    monkeypatch.setattr(module, "make_optimizer", capture_opt)
    assert saver.save_final_model is not common.save_final_model
    res = run_config(config_from_dict(raw))
    return res, seen["model"], seen["optimizer"]


def adapter_names(model) -> set[str]:
    return {n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def assert_only_adapters_changed(model, base_dir):
    """Every non-adapter tensor bitwise equal to the base checkpoint's; every lora_B moved away
    from its zero initialisation."""
    base = load_base(base_dir).state_dict()
    names = adapter_names(model)
    assert names, "no adapters were injected"
    trained = model.state_dict()
    for key, value in trained.items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        assert torch.equal(value, base[plain]), key
    assert {k.replace(".base_layer.", ".") for k in trained if ".lora_" not in k} == set(base)
    lora_b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert all(p.abs().sum() > 0 for p in lora_b)  # B starts at exactly 0


def assert_optimizer_holds_adapters_only(model, optimizer):
    params = dict(model.named_parameters())
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert held == {id(params[n]) for n in adapter_names(model)}
    assert {id(p) for p in optimizer.state} == held
    assert all(p.requires_grad == (n in adapter_names(model)) for n, p in params.items())


def batch(tokenizer):
    """A fixed (prompt, completion) rollout to score."""
    from rlhflab.rollout.sampler import pack

    prompts = [tokenizer.encode("3 + 4 ="), tokenizer.encode("12 + 5 = ?")]
    completions = [tokenizer.encode(" 7"), tokenizer.encode(" 17 ok")]
    return pack(prompts, completions, tokenizer.pad_token_id)


def logps(model, rollout):
    from rlhflab.rollout.sampler import completion_logps

    with torch.no_grad():
        return completion_logps(model, rollout)[0]


# ---------------------------------------------------------------------------------------------


def test_apply_lora_starts_at_the_base_model_and_disabling_is_exact(tiny_model, tiny_tokenizer):
    from rlhflab.models.lora import adapters_disabled, apply_lora, block_linear_names

    ro = batch(tiny_tokenizer)
    before = logps(tiny_model, ro)
    # all-linear: the 7 projections of each of the 2 blocks, not the (tied) LM head
    targets = block_linear_names(tiny_model)
    assert len(targets) == 14 and all(".layers." in n for n in targets)
    apply_lora(tiny_model, LoRAConfig(**LORA))
    assert adapter_names(tiny_model) == {
        f"{t}.lora_{ab}.default.weight" for t in targets for ab in "AB"
    }
    assert torch.equal(logps(tiny_model, ro), before)  # B = 0: the base model exactly
    with torch.no_grad():
        for n, p in tiny_model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.1)
    moved = logps(tiny_model, ro)
    assert (moved - before).abs().max() > 1e-3
    with adapters_disabled(tiny_model):
        assert torch.equal(logps(tiny_model, ro), before)
    assert torch.equal(logps(tiny_model, ro), moved)  # re-enabled on exit
    assert {n for n, p in tiny_model.named_parameters() if p.requires_grad} == adapter_names(
        tiny_model
    )


def test_merged_state_is_w_plus_scaled_ba(tiny_model):
    """W' = W + (alpha / r) · B A on one layer, by hand."""
    from rlhflab.models.lora import apply_lora, merged_state

    w = tiny_model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    apply_lora(tiny_model, LoRAConfig(r=2, alpha=6.0, target_modules=["q_proj"]))
    q = tiny_model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q.lora_B["default"].weight.normal_()
    a, b = q.lora_A["default"].weight, q.lora_B["default"].weight
    merged = merged_state(tiny_model)
    expected = w + 3.0 * (b @ a)  # alpha / r = 6 / 2
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], expected)
    assert not any(".lora_" in k or ".base_layer." in k for k in merged)
    assert set(merged) == set(tiny_model.state_dict()) - {
        k for k in tiny_model.state_dict() if ".lora_" in k or ".base_layer." in k
    } | {k.replace(".base_layer.", ".") for k in tiny_model.state_dict() if ".base_layer." in k}


def test_bad_target_modules_are_one_line_config_errors(tiny_model):
    from rlhflab.models.lora import apply_lora

    with pytest.raises(ConfigError, match=r"model.lora.target_modules: .*nope"):
        apply_lora(tiny_model, LoRAConfig(target_modules=["nope"]))
    with pytest.raises(ConfigError, match=r"model.lora.target_modules: .*Embedding"):
        apply_lora(tiny_model, LoRAConfig(target_modules=["embed_tokens"]))


def test_lora_config_is_typed():
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        config_from_dict({"trainer": "sft", "model": {"build": {}, "lora": {"rank": 8}}})
    with pytest.raises(ConfigError, match=r"model\.lora\.save"):
        config_from_dict({"trainer": "sft", "model": {"build": {}, "lora": {"save": "both"}}})
    with pytest.raises(ConfigError, match=r"model\.lora\.save"):
        config_from_dict(
            {
                "trainer": "reward_model",
                "model": {"build": {}, "lora": {"save": "adapter"}},
                "data": {"source": "preference", "path": "x.jsonl"},
            }
        )


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, base_dir, reward_fn):
    """One LoRA GRPO step (KL to the reference on), checkpointed, saved as an adapter."""
    from rlhflab.trainers import policy_gradient

    root = tmp_path_factory.mktemp("grpo")
    raw = grpo_raw(root, base_dir, reward_fn, checkpoint={"every": 1})
    with pytest.MonkeyPatch.context() as mp:
        return run_captured(mp, policy_gradient, raw)


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, base_dir):
    """One LoRA DPO step on verifiable pairs, saved merged."""
    from rlhflab.trainers import direct_alignment

    root = tmp_path_factory.mktemp("dpo")
    with pytest.MonkeyPatch.context() as mp:
        return run_captured(mp, direct_alignment, dpo_raw(root, base_dir, save="merged"))


@pytest.mark.parametrize("run", ["grpo_run", "dpo_run"])
def test_a_step_changes_only_the_adapters(run, request, base_dir):
    res, model, optimizer = request.getfixturevalue(run)
    assert res["steps"] == 1
    assert_only_adapters_changed(model, base_dir)
    assert_optimizer_holds_adapters_only(model, optimizer)


def test_dpo_reference_is_the_initial_policy(dpo_run):
    """At step 1 the LoRA policy equals π_ref (B = 0), so every pair's DPO loss is ln 2."""
    res, _, _ = dpo_run
    lines = Path(res["run_dir"], "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    (first,) = [r for r in rows if "train/loss" in r]
    assert abs(first["train/loss"] - math.log(2)) < 1e-6


@pytest.mark.parametrize("run", ["grpo_run", "dpo_run"])
def test_reference_logps_are_the_base_models(run, request, base_dir, tiny_tokenizer):
    """π_ref of a LoRA run (`Reference.scoring`, `adapters_disabled`) after a step equals a base
    model loaded afresh from the original weights, and holds no second copy of them."""
    from rlhflab.models.lora import adapters_disabled
    from rlhflab.trainers.common import Reference

    _, model, _ = request.getfixturevalue(run)
    model.eval()
    ro = batch(tiny_tokenizer)
    base = logps(load_base(base_dir).eval(), ro)
    trained = logps(model, ro)
    assert (trained - base).abs().max() > 1e-4  # the step moved the policy
    reference = Reference(model, parallel=None)
    assert reference.copy is None  # no second copy of the weights
    with reference.scoring() as ref_model:
        assert ref_model is model
        assert torch.equal(logps(ref_model, ro), base)
    with adapters_disabled(model):
        assert torch.equal(logps(model, ro), base)
    assert torch.equal(logps(model, ro), trained)  # adapters back on


def test_full_fine_tune_reference_is_a_frozen_copy(tiny_model, tiny_tokenizer):
    from rlhflab.config import ParallelConfig
    from rlhflab.trainers.common import Reference

    reference = Reference(tiny_model, ParallelConfig())
    assert reference.copy is not None and reference.copy is not tiny_model
    assert not any(p.requires_grad for p in reference.copy.parameters())
    ro = batch(tiny_tokenizer)
    with reference.scoring() as ref_model:
        assert torch.equal(logps(ref_model, ro), logps(tiny_model, ro))


def test_lora_checkpoint_holds_the_adapters_only(grpo_run):
    res, model, _ = grpo_run
    ckpt = f"{res['run_dir']}/checkpoints/step-00000001"
    saved = load_file(f"{ckpt}/model.safetensors")
    assert set(saved) == adapter_names(model)
    params = dict(model.named_parameters())
    assert all(torch.equal(saved[n], params[n].detach()) for n in saved)
    moments = load_file(f"{ckpt}/optimizer.safetensors")
    assert len(moments) == 3 * len(saved)  # exp_avg, exp_avg_sq, step of each adapter


def test_saved_adapter_loads_with_peft_and_gives_the_trained_logits(grpo_run, base_dir):
    from peft import PeftModel

    res, model, _ = grpo_run
    model.eval()
    ids = batch(load_tokenizer(res["model_dir"])).input_ids
    peft_model = PeftModel.from_pretrained(load_base(base_dir), res["model_dir"]).eval()
    with torch.no_grad():
        assert (peft_model(ids).logits - model(ids).logits).abs().max() < 1e-6
    # rlhflab's own loader (`rlhflab eval`) reads it too: transformers loads base + adapter
    loaded = load_base(res["model_dir"]).eval()
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids).logits).abs().max() < 1e-6
    saved = json.loads(Path(res["model_dir"], "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"]) == (4, 8.0)
    assert saved["base_model_name_or_path"] == str(base_dir)


def test_lora_step_checkpoint_is_a_peft_adapter_directory(grpo_run, base_dir):
    """A LoRA checkpoint's model.safetensors holds adapters only, so the step directory is an
    adapter directory (never a config.json that would load the base with missing weights)."""
    from peft import PeftModel

    res, model, _ = grpo_run
    model.eval()
    ckpt = Path(res["run_dir"], "checkpoints", "step-00000001")
    assert not (ckpt / "config.json").exists()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(
        manifest["files"]
    )
    ids = batch(load_tokenizer(str(ckpt))).input_ids
    peft_model = PeftModel.from_pretrained(load_base(base_dir), str(ckpt)).eval()
    with torch.no_grad():
        assert (peft_model(ids).logits - model(ids).logits).abs().max() < 1e-6


@pytest.mark.parametrize("run", ["grpo_run", "dpo_run"])
def test_merged_save_gives_the_trained_logits(run, request, tmp_path):
    """`model.lora.save: merged` (the DPO run's own `<run>/model`; the GRPO model saved merged
    here by the same function) is a plain model with the trained model's logits."""
    from transformers import AutoModelForCausalLM

    from rlhflab.trainers.common import save_final_model

    res, model, _ = request.getfixturevalue(run)
    path = res["model_dir"]
    if run == "grpo_run":
        path = tmp_path / "merged"
        save_final_model(model, load_tokenizer(res["model_dir"]), path, LoRAConfig(save="merged"))
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    assert not any(".lora_" in n or "base_layer" in n for n in plain.state_dict())
    model.eval()
    ids = batch(load_tokenizer(path)).input_ids
    with torch.no_grad():
        diff = (plain(ids).logits - model(ids).logits).abs().max().item()
    assert diff < 1e-5, diff


def test_lora_grpo_stopped_mid_run_resumes_exactly(tmp_path, monkeypatch, base_dir, reward_fn):
    """SIGTERM after step 2 (step 3 is finished and checkpointed, then the run stops), then
    `run.resume`: the same metrics, samples and, bit for bit, the same final adapters as an
    uninterrupted run; the frozen base is rebuilt from the config, the adapters come from the
    checkpoint. (In-process; the SIGKILL variants of tests/test_checkpoint_resume.py exercise
    the same restore path for full fine-tuning.)"""
    from test_checkpoint_resume import assert_same_run, run_dir_of

    from rlhflab.errors import Interrupted

    def raw(root, **run):
        cfg = grpo_raw(root, base_dir, reward_fn, steps=5, checkpoint={"every": 2})
        cfg["run"].update(run)
        return config_from_dict(cfg)

    ref = run_config(raw(tmp_path / "ref"))["run_dir"]
    monkeypatch.setenv("RLHFLAB_FAULT", "step_end@2=sigterm")
    with pytest.raises(Interrupted):
        run_config(raw(tmp_path / "runs"))
    monkeypatch.delenv("RLHFLAB_FAULT")
    run_dir = run_dir_of(tmp_path / "runs", "grpo")
    assert (run_dir / "checkpoints/step-00000003/model.safetensors").exists()
    run_config(raw(tmp_path / "runs", resume=str(run_dir)))
    assert_same_run(ref, run_dir, "model/adapter_model.safetensors")


def test_ppo_critic_shares_the_frozen_base_and_has_its_own_adapter(tiny_model):
    from rlhflab.models.lora import apply_lora, trainable_names
    from rlhflab.models.value import ValueModel

    apply_lora(tiny_model, LoRAConfig(**LORA))
    critic = ValueModel.from_policy(tiny_model)
    policy_params = dict(tiny_model.model.named_parameters())
    for name, p in critic.backbone.named_parameters():
        if p.requires_grad:  # its own adapters: copies, not the policy's tensors
            assert ".lora_" in name and p is not policy_params[name]
            assert torch.equal(p, policy_params[name])
        else:  # the frozen base: the policy's tensors themselves (in memory once)
            assert p is policy_params[name], name
    assert set(trainable_names(critic)) == {
        f"backbone.{n}" for n in policy_params if ".lora_" in n
    } | {"head.weight", "head.bias"}


def test_lora_ppo_saves_a_plain_value_model_and_adapter_checkpoints(tmp_path, base_dir, reward_fn):
    from rlhflab.models.value import ValueModel

    raw = grpo_raw(tmp_path, base_dir, reward_fn, name="ppo", steps=2, save="merged")
    raw["rollout"] = {"prompts_per_step": 4, "group_size": 1, "max_new_tokens": 6}
    raw["loss"] = {
        "advantage": "gae",
        "advantage_args": {"gamma": 1.0, "lam": 0.95},
        "surrogate": "ppo_clip",
        "aggregation": "token_mean",
    }
    raw["kl"] = {"coef": 0.05, "estimator": "k1", "placement": "reward_token"}
    raw["value"] = {"optim": {"lr": 1e-2}}
    raw["checkpoint"] = {"every": 2}
    res = run_config(config_from_dict(raw))
    run = Path(res["run_dir"])
    critic = load_file(str(run / "checkpoints/step-00000002/value_model.safetensors"))
    assert {k for k in critic if ".lora_" not in k} == {"head.weight", "head.bias"}
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in critic.items())
    value_model = ValueModel.load(run / "value_model")  # a plain backbone + head
    assert not any(".lora_" in n for n in value_model.state_dict())
    assert torch.equal(value_model.head.weight, critic["head.weight"])


def test_lora_sft_and_reward_model_runs(tmp_path, base_dir):
    """SFT: the merged model differs from the base only by the LoRA layers' weights. Reward
    model: adapters and the score head are trained and checkpointed; the merged RM loads."""
    from test_checkpoint_resume import rm_raw
    from transformers import AutoModelForSequenceClassification

    sft = {
        "trainer": "sft",
        "model": {"name_or_path": str(base_dir), "lora": LORA},
        "task": TASK,
        "precision": {"threads": 1},
        "train": {"steps": 2, "batch_size": 8, "micro_batch_size": 4, "max_len": 48},
        "optim": {"lr": 1e-2},
        "eval": {"n": 2, "max_new_tokens": 4},
        "tracking": {"console": False},
        "run": {"name": "sft", "root": str(tmp_path)},
    }
    res = run_config(config_from_dict(sft))
    merged, base = (
        load_file(f"{res['model_dir']}/model.safetensors"),
        load_file(f"{base_dir}/model.safetensors"),
    )
    assert set(merged) == set(base)
    changed = {k for k in base if not torch.equal(merged[k], base[k])}
    assert changed and all(".layers." in k and k.endswith("proj.weight") for k in changed)

    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"{i} + 1 =", "chosen": str(i + 1), "rejected": str(i + 3)} for i in range(8)
    ]
    pairs.write_text("\n".join(json.dumps(r) for r in rows))
    raw = rm_raw(tmp_path / "rm", base_dir, pairs)
    raw["model"]["lora"] = LORA
    raw["train"]["steps"] = 2
    raw["checkpoint"] = {"every": 2}
    res = run_config(config_from_dict(raw))
    ckpt = load_file(f"{res['run_dir']}/checkpoints/step-00000002/model.safetensors")
    assert {k for k in ckpt if ".lora_" not in k} == {"score.weight"}
    rm = AutoModelForSequenceClassification.from_pretrained(res["model_dir"])
    assert torch.equal(rm.score.weight, ckpt["score.weight"])


def test_adapters_are_float32_on_a_bfloat16_base(tiny_model, tiny_tokenizer):
    from rlhflab.models.lora import adapters_disabled, apply_lora

    model = tiny_model.to(torch.bfloat16)
    ro = batch(tiny_tokenizer)
    before = logps(model, ro)
    apply_lora(model, LoRAConfig(**LORA))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if ".lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if ".lora_" not in n)
    assert torch.equal(logps(model, ro), before)
    with adapters_disabled(model):
        assert torch.equal(logps(model, ro), before)
