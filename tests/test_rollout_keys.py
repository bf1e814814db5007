"""A `rollout` setting a trainer would not read is refused at config load, in one line naming the
key, never silently ignored (issue 36): keys a family does not implement (`ROLLOUT_KEYS`), and
keys read under one setting of another key only (`RolloutConfig.ONLY_WITH`)."""

from pathlib import Path

import pytest

from rlhflab.cli import main
from rlhflab.config import CONFIG_CLASSES, RolloutConfig, config_from_dict, dump_config, load_config
from rlhflab.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PRESET = {  # a preset of every family that has a rollout section
    "policy_gradient": ROOT / "configs/pg/grpo.yaml",
    "distill": ROOT / "configs/distill/sdpo.yaml",
}
#: a value other than the default for each rollout key some family does not implement
NOT_DEFAULT = {
    "mode": ("async", "async"),
    "max_staleness": ("2", "2"),
    "behav_correction": ("none", "none"),
    "behav_cap": ("3.0", "3.0"),
    "dynamic_sampling.enabled": ("true", "true"),
    "dynamic_sampling.max_rounds": ("3", "3"),
}


def _families():
    return {t: c for t, c in CONFIG_CLASSES.items() if "rollout" in c.model_fields}


def test_every_family_with_a_rollout_section_has_a_preset_here():
    assert set(_families()) == set(PRESET)


def _unimplemented():
    for trainer, cls in _families().items():
        for key in NOT_DEFAULT:
            if not any(key == k or key.startswith(k + ".") for k in cls.ROLLOUT_KEYS):
                yield trainer, key


def test_the_table_covers_every_key_a_family_leaves_out():
    fields = set(RolloutConfig.model_fields)
    for trainer, cls in _families().items():
        assert fields >= cls.ROLLOUT_KEYS, trainer  # declared names are real keys
        left_out = fields - cls.ROLLOUT_KEYS
        assert left_out <= {k.split(".")[0] for k in NOT_DEFAULT}, (trainer, left_out)
    distill = CONFIG_CLASSES["distill"].ROLLOUT_KEYS  # every sampling mode (issue #40) ...
    assert {"mode", "max_staleness", "dynamic_sampling"} <= distill
    assert {"behav_correction", "behav_cap"} <= fields - distill  # ... no PG loss reweighting


@pytest.mark.parametrize("trainer, key", list(_unimplemented()))
def test_a_key_the_family_does_not_implement_is_refused_at_load(trainer, key):
    text, shown = NOT_DEFAULT[key]
    with pytest.raises(ConfigError) as exc:
        load_config(PRESET[trainer], [f"rollout.{key}={text}"])
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg == (
        f"{PRESET[trainer]}: rollout.{key}: {shown} is not implemented for trainer {trainer} "
        "(policy_gradient only)"
    )


def test_distill_samples_in_every_mode_but_sdpo_draws_its_own_batches():
    # Distillation draws through the experience layer's sampler (issue #40): async and dynamic
    # sampling load for a teacher model; SDPO, which refills its batch itself, refuses them in
    # one line naming the key.
    on_policy = ROOT / "configs/distill/on_policy.yaml"
    assert load_config(on_policy, ["rollout.mode=async"]).rollout.mode == "async"
    cfg = load_config(on_policy, ["rollout.dynamic_sampling.enabled=true", "rollout.group_size=2"])
    assert cfg.rollout.dynamic_sampling.enabled
    for over, key in (("rollout.mode=async", "rollout.mode 'async'"),
                      ("rollout.dynamic_sampling.enabled=true", "rollout.dynamic_sampling")):  # fmt: skip
        with pytest.raises(ConfigError) as exc:
            load_config(PRESET["distill"], [over])
        assert "\n" not in str(exc.value)
        assert f"{key}: teacher.source 'self' (SDPO) draws its own batches" in str(exc.value)


@pytest.mark.parametrize("trainer", list(PRESET))
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.vllm.gpu_memory_utilization=0.5"],
         "rollout.vllm.gpu_memory_utilization: 0.5 is read with rollout.engine vllm only "
         "(rollout.engine is hf)"),
        (["rollout.engine=vllm", "rollout.decode=static"],
         "rollout.decode: static is read with rollout.engine hf only (rollout.engine is vllm)"),
        (["rollout.engine=vllm", "rollout.half_weights=true"],
         "rollout.half_weights: true is read with rollout.engine hf only (rollout.engine is vllm)"),
        (["rollout.sync_every=4"],
         "rollout.sync_every: 4 is read with rollout.decode static only (rollout.decode is eager)"),
        (["rollout.cuda_graph=false"],
         "rollout.cuda_graph: false is read with rollout.decode static only "
         "(rollout.decode is eager)"),
    ],
)  # fmt: skip
def test_a_key_another_setting_switches_off_is_refused(trainer, overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(PRESET[trainer], overrides)
    assert str(exc.value) == f"{PRESET[trainer]}: {message}"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.max_staleness=2"],
         "rollout.max_staleness: 2 is read with rollout.mode async only (rollout.mode is sync)"),
        (["rollout.behav_correction=none"],
         "rollout.behav_correction: none is read with rollout.mode async only "
         "(rollout.mode is sync)"),
        (["rollout.behav_cap=3"],
         "rollout.behav_cap: 3.0 is read with rollout.mode async only (rollout.mode is sync)"),
        (["rollout.dynamic_sampling.max_rounds=3"],
         "rollout.dynamic_sampling.max_rounds: 3 is read with rollout.dynamic_sampling.enabled "
         "true only (rollout.dynamic_sampling.enabled is false)"),
    ],
)  # fmt: skip
def test_policy_gradient_keys_of_another_mode_are_refused(overrides, message):
    with pytest.raises(ConfigError) as exc:
        load_config(PRESET["policy_gradient"], overrides)
    assert str(exc.value) == f"{PRESET['policy_gradient']}: {message}"


@pytest.mark.parametrize(
    "trainer, overrides",
    [
        ("policy_gradient", ["rollout.mode=async", "rollout.max_staleness=2",
                             "rollout.behav_correction=none", "rollout.behav_cap=3"]),
        ("policy_gradient", ["rollout.dynamic_sampling.enabled=true",
                             "rollout.dynamic_sampling.max_rounds=3"]),
        ("policy_gradient", ["rollout.engine=vllm", "rollout.vllm.gpu_memory_utilization=0.5"]),
        ("distill", ["rollout.engine=vllm", "rollout.vllm.sleep=true"]),
        ("distill", ["rollout.decode=static", "rollout.sync_every=2", "rollout.cuda_graph=false"]),
        ("distill", ["rollout.half_weights=true", "rollout.top_k=5", "rollout.stop_token_ids=[3]"]),
    ],
)  # fmt: skip
def test_settings_that_are_read_still_load(trainer, overrides):
    load_config(PRESET[trainer], overrides)


@pytest.mark.parametrize("trainer", list(PRESET))
def test_a_saved_config_with_every_default_written_loads_again(trainer):
    # a run's config.yaml writes every key (defaults included): resuming must still load it
    import yaml

    cfg = load_config(PRESET[trainer])
    assert config_from_dict(yaml.safe_load(dump_config(cfg))) == cfg


def test_cli_prints_the_refusal_in_one_line_and_exits_2(tmp_path, capsys):
    root = tmp_path / "runs"
    code = main(["train", str(PRESET["distill"]), "rollout.behav_cap=3", f"run.root={root}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [
        f"error: {PRESET['distill']}: rollout.behav_cap: 3.0 is not implemented for trainer "
        "distill (policy_gradient only)"
    ]
    assert not root.exists() or not any(root.iterdir())


@pytest.mark.parametrize(
    "trainer, overrides, message",
    [
        ("policy_gradient", ["rollout.mode=async", "rollout.dynamic_sampling.enabled=true"],
         "rollout.mode 'async' does not support rollout.dynamic_sampling yet"),
        ("distill", ["rollout.mode=async", "rollout.dynamic_sampling.enabled=true"],
         "rollout.mode 'async' does not support rollout.dynamic_sampling yet"),
        ("policy_gradient", ["rollout.mode=async", "rollout.engine=vllm"],
         "rollout.mode 'async' needs rollout.engine 'hf' (vllm: not yet)"),
        ("distill", ["rollout.mode=async", "rollout.engine=vllm"],
         "rollout.mode 'async' needs rollout.engine 'hf' (vllm: not yet)"),
    ],
)  # fmt: skip
def test_one_mode_check_for_every_family_that_samples(trainer, overrides, message):
    # `check_sampling_modes`: the combinations of sync / async / dynamic / episodes the sampler
    # does not implement are refused alike in both families (distillation from its on-policy
    # preset, a teacher model: SDPO refuses the modes itself).
    path = (
        PRESET[trainer] if trainer == "policy_gradient" else ROOT / "configs/distill/on_policy.yaml"
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path, [*overrides, "rollout.group_size=2"])
    assert "\n" not in str(exc.value) and message in str(exc.value)
