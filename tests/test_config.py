"""Config loading: presets, overrides, unknown keys with did-you-mean, argument checks."""

import typing
from pathlib import Path

import pytest

from rlhflab.config import (
    CONFIG_CLASSES,
    PGConfig,
    SFTConfig,
    apply_overrides,
    config_from_dict,
    load_config,
)
from rlhflab.errors import ConfigError
from rlhflab.quickstart import build_configs

ROOT = Path(__file__).resolve().parents[1]
# pipeline files and replication configs (tests/test_replications.py) are not single trainer configs
PRESETS = sorted(
    p
    for p in (ROOT / "configs").rglob("*.yaml")
    if "pipeline" not in p.parts and "replications" not in p.parts
)


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_preset_loads(path):
    cfg = load_config(path)
    assert cfg.trainer in CONFIG_CLASSES


def test_presets_exist():
    assert len(PRESETS) >= 3


def test_quickstart_presets_validate(tmp_path):
    for fast in (False, True):
        sft, grpo = build_configs(fast=fast, root=tmp_path)
        assert isinstance(sft, SFTConfig) and isinstance(grpo, PGConfig)
        assert sft.task == grpo.task  # one task feeds both stages: same splits, same held-out set


def test_quickstart_stage_configs_are_the_embedded_preset(tmp_path):
    # configs/sft/quickstart.yaml and configs/pg/quickstart_grpo.yaml (for sweeps) must not drift
    # from the quickstart: same resolved config but for the run name, root and start model.
    sft, grpo = build_configs(fast=False, root=tmp_path)
    for path, preset in (
        ("configs/sft/quickstart.yaml", sft),
        ("configs/pg/quickstart_grpo.yaml", grpo),
    ):
        got = load_config(ROOT / path).model_dump(mode="json")
        want = preset.model_dump(mode="json")
        for d in (got, want):
            d.pop("run")
            d["model"].pop("name_or_path")
            d["tracking"].pop("console", None)
        assert got == want, path


def test_overrides_apply_and_parse_yaml_scalars():
    cfg = load_config(
        ROOT / "configs/pg/grpo.yaml", ["rollout.group_size=16", "optim.lr=1e-5", "kl.coef=0.04"]
    )
    assert cfg.rollout.group_size == 16
    assert cfg.optim.lr == 1e-5
    assert cfg.kl.coef == 0.04


def test_unknown_key_names_full_path_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/pg/grpo.yaml", ["rollout.grop_size=4"])
    msg = str(err.value)
    assert "rollout.grop_size" in msg and "did you mean 'group_size'" in msg
    assert "\n" not in msg


def test_unknown_top_level_key():
    with pytest.raises(ConfigError, match=r"unknown config key 'optimm'.*did you mean 'optim'"):
        load_config(ROOT / "configs/pg/grpo.yaml", ["optimm.lr=1"])


def test_surrogate_args_checked_against_signature():
    with pytest.raises(
        ConfigError,
        match=r"loss.surrogate_args.eps_hi: not an argument of ppo_clip.*did you mean 'eps_high'",
    ):
        load_config(ROOT / "configs/pg/grpo.yaml", ["loss.surrogate_args={eps_hi: 0.3}"])


def test_unknown_loss_names():
    with pytest.raises(
        ConfigError, match=r"loss.surrogate: unknown name 'ppo_clp'.*did you mean 'ppo_clip'"
    ):
        load_config(ROOT / "configs/pg/grpo.yaml", ["loss.surrogate=ppo_clp"])
    with pytest.raises(ConfigError, match=r"kl.estimator: unknown name 'k4'"):
        load_config(ROOT / "configs/pg/grpo.yaml", ["kl.estimator=k4"])


def test_group_size_below_two_for_group_advantage():
    with pytest.raises(ConfigError, match=r"rollout.group_size must be >= 2"):
        load_config(ROOT / "configs/pg/grpo.yaml", ["rollout.group_size=1"])


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match=r"train.update_epochs"):
        load_config(ROOT / "configs/pg/grpo.yaml", ["train.update_epochs=0"])
    with pytest.raises(
        ConfigError, match=r"train.micro_batch_size \(48\) must divide train.batch_size"
    ):
        load_config(ROOT / "configs/sft/tiny_scratch.yaml", ["train.micro_batch_size=48"])


def test_trainer_key_required():
    with pytest.raises(ConfigError, match="'trainer' must be one of"):
        config_from_dict({"model": {"name_or_path": "x"}})


def test_trainer_that_is_not_a_name_is_a_config_error():
    # a list or mapping under `trainer` (unhashable) was a TypeError traceback
    for trainer in (["sft"], {"name": "sft"}):
        with pytest.raises(
            ConfigError,
            match=r"^S: 'trainer' must be one of sft, policy_gradient, direct_alignment, "
            r"reward_model, distill \(got ",
        ):
            config_from_dict({"trainer": trainer, "model": {"name_or_path": "x"}}, source="S")


def test_config_classes_are_the_discriminated_union():
    """One family table: CONFIG_CLASSES is read off AnyConfig's tags; each tag is its class's
    `trainer` value, and config_from_dict returns that class."""
    from rlhflab.config import AnyConfig

    members = typing.get_args(typing.get_args(AnyConfig)[0])
    tags = {typing.get_args(m)[1].tag: typing.get_args(m)[0] for m in members}
    assert tags == CONFIG_CLASSES
    assert list(CONFIG_CLASSES) == [
        "sft", "policy_gradient", "direct_alignment", "reward_model", "distill",
    ]  # fmt: skip
    for name, cls in CONFIG_CLASSES.items():
        assert cls.model_fields["trainer"].default == name
        raw = {"trainer": name, "model": {"name_or_path": "x"}}
        if name == "policy_gradient":
            raw["rollout"] = {"group_size": 2}
        if name == "distill":
            raw["teacher"] = {"name_or_path": "y"}
        assert type(config_from_dict(raw)) is cls


def test_model_needs_exactly_one_source():
    with pytest.raises(ConfigError, match=r"exactly one of model\.name_or_path and model\.build"):
        config_from_dict({"trainer": "sft", "model": {}})


def test_missing_file_and_bad_override_form(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(ROOT / "configs/pg/grpo.yaml", ["rollout.group_size"])


def test_quickstart_overrides_task_for_both_stages(tmp_path):
    sft, grpo = build_configs(
        fast=True, root=tmp_path, overrides=["task.name=chain_sum", "grpo.optim.lr=5e-5"]
    )
    assert sft.task.name == grpo.task.name == "chain_sum"
    assert grpo.optim.lr == 5e-5
    with pytest.raises(ConfigError, match=r"must start with 'task\.', 'sft\.' or 'grpo\.'"):
        build_configs(fast=True, root=tmp_path, overrides=["optim.lr=1"])


def test_override_values_that_are_not_yaml_are_text():
    # issue 23: `data.template=Q: {prompt} A:` was a YAML error; `Q: x` would be a mapping
    grpo = ROOT / "configs/pg/grpo.yaml"
    assert load_config(grpo, ["data.template=Q: {prompt} A:"]).data.template == "Q: {prompt} A:"
    assert load_config(grpo, ["data.template=Q: {prompt}"]).data.template == "Q: {prompt}"
    assert load_config(grpo, ["data.template={prompt} #1"]).data.template == "{prompt} #1"
    assert load_config(grpo, ["data.template={prompt}"]).data.template == "{prompt}"
    assert load_config(grpo, ["data.template='{prompt} '"]).data.template == "{prompt} "
    # structured and typed YAML values keep working
    raw = apply_overrides(
        {},
        ["a={eps_high: 0.3}", "b=[1, 2]", "c=2.5", "d=true", "e=null", "f='7'", "g=- x", "h={}"],
    )
    assert raw == {
        "a": {"eps_high": 0.3},
        "b": [1, 2],
        "c": 2.5,
        "d": True,
        "e": None,
        "f": "7",
        "g": "- x",
        "h": {},
    }


@pytest.mark.parametrize("item", ["data.template=", "data.template=  "])
def test_override_without_a_value_names_the_key(item):
    with pytest.raises(ConfigError, match=r"override 'data\.template=' has no value"):
        load_config(ROOT / "configs/pg/grpo.yaml", [item])


def test_yaml_syntax_error_names_file_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: sft\nmodel:\n  name_or_path: x\n  bad: [1, 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(bad)
    msg = str(err.value)
    assert msg.startswith(f"{bad}: invalid YAML at line 5, column 1: ")
    assert msg.endswith("(while parsing a flow sequence started at line 4, column 8)")
    assert "\n" not in msg
    bad.write_text("trainer: sft\nmodel: {name_or_path: x}\n  oops: 1\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML at line 3, column 3: "):
        load_config(bad)


@pytest.mark.parametrize(
    "override, field",
    [
        ("optim.betas=[1.5, 0.9]", "optim.betas"),
        ("optim.betas=[0.9, 1.0]", "optim.betas"),  # beta2 = 1: bias correction divides by 0
        ("optim.betas=[-0.1, 0.9]", "optim.betas"),
        ("optim.betas=[.nan, 0.9]", "optim.betas"),
        ("optim.eps=0", "optim.eps"),
        ("optim.eps=-1e-8", "optim.eps"),
        ("optim.weight_decay=-0.1", "optim.weight_decay"),
        ("optim.weight_decay=.inf", "optim.weight_decay"),
        ("optim.lr=0", "optim.lr"),
        ("optim.lr=.inf", "optim.lr"),
        ("optim.max_grad_norm=.nan", "optim.max_grad_norm"),
        ("value.optim.betas=[0.9, 2]", "value.optim.betas"),
    ],
)
def test_invalid_adamw_values_rejected_at_load_naming_the_field(override, field):
    # Before: betas / infinite values reached torch.optim.AdamW and ended in a traceback.
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs/pg/ppo.yaml", [override])
    msg = str(err.value)
    assert f": {field}: " in msg and "\n" not in msg


@pytest.mark.parametrize("betas", ["[0.0, 0.0]", "[0.9, 0.999]", "[0.999999, 0.5]"])
def test_valid_adamw_betas_accepted(betas):
    cfg = load_config(ROOT / "configs/pg/ppo.yaml", [f"optim.betas={betas}"])
    assert all(0.0 <= b < 1.0 for b in cfg.optim.betas)
