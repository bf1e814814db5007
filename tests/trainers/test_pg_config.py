"""Policy-gradient config errors at load time, each naming the field."""

from pathlib import Path

import pytest

from rlhflab.config import load_config
from rlhflab.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PG = sorted((ROOT / "configs/pg").glob("*.yaml"))


def load(name, *overrides):
    return load_config(ROOT / f"configs/pg/{name}.yaml", list(overrides))


@pytest.mark.parametrize("path", PG, ids=lambda p: p.stem)
def test_every_pg_preset_loads_and_cites_its_paper(path):
    cfg = load_config(path)
    assert cfg.trainer == "policy_gradient"
    header = path.read_text().split("trainer:")[0]
    assert "arXiv" in header or "Williams 1992" in header
    assert "Departures" in header


def test_all_methods_have_presets():
    names = {p.stem for p in PG}
    assert {"reinforce", "rloo", "ppo", "grpo", "dr_grpo", "gspo", "cispo", "dapo"} <= names
    assert {"reinforce_pp", "remax", "opo", "gpg", "sapo", "gmpo"} <= names  # issue #29


@pytest.mark.parametrize(
    ("preset", "overrides", "match"),
    [
        ("grpo", ["rollout.group_size=1"], r"rollout.group_size must be >= 2 .*group_zscore"),
        ("rloo", ["rollout.group_size=1"], r"rollout.group_size must be >= 2 .*rloo"),
        ("dr_grpo", ["rollout.group_size=1"], r"rollout.group_size .*group_mean"),
        (
            "dapo",
            ["rollout.group_size=1", "loss.advantage=batch_mean", "loss.advantage_args={}"],
            r"dynamic_sampling",
        ),
        (
            "grpo",
            ["kl.estimator=k4"],
            r"kl.estimator: unknown name 'k4'.*valid: abs, abs\+, k1, k1\+, k2, k3",
        ),
        ("grpo", ["kl.placement=reward"], r"kl.placement"),
        ("grpo", ["kl.placement=reward_token"], r"kl.placement 'reward_token' needs a per-token"),
        ("grpo", ["kl.controller=adaptive"], r"kl.controller 'adaptive' needs kl.target"),
        ("grpo", ["train.update_epochs=0"], r"train.update_epochs"),
        ("grpo", ["train.minibatches=0"], r"train.minibatches"),
        (
            "grpo",
            ["loss.surrogate_args={eps_low: -0.1, eps_high: 0.2}"],
            r"clip bounds out of order",
        ),
        (
            "grpo",
            ["loss.surrogate_args={eps_low: 0.2, eps_high: -0.3}"],
            r"clip bounds out of order",
        ),
        (
            "grpo",
            ["loss.surrogate_args={eps_low: 1.5, eps_high: 0.2}"],
            r"clip bounds out of order",
        ),
        (
            "grpo",
            ["loss.advantage=gae", "loss.advantage_args={gamma: 1, lam: 1}"],
            r"needs a value model",
        ),
        ("ppo", ["loss.advantage_args={gamma: 1.0}"], r"loss.advantage_args: gae needs lam"),
        ("grpo", ["value={clip_range: 0.2}"], r"does not use one"),
        ("ppo", ["value.clip_range=0"], r"value.clip_range"),
        ("grpo", ["loss.aggregation=token_meen"], r"did you mean 'token_mean'"),
        ("grpo", ["reward.components=[{name: corectness}]"], r"did you mean 'correctness'"),
        (
            "dapo",
            ["reward.components=[{name: overlong, args: {cach: 4}}]"],
            r"cach.*did you mean 'cache'",
        ),
        ("grpo", ["reward.components=[]"], r"at least one component"),
        ("dapo", ["rollout.dynamic_sampling.max_rounds=0"], r"max_rounds"),
        # issue #29
        (
            "grpo",
            ["loss.tis.enabled=true", "loss.rollout_correction.is_level=token"],
            r"loss.tis and loss.rollout_correction.is_level",
        ),
        ("grpo", ["loss.rollout_correction.batch_normalize=true"], r"batch_normalize needs"),
        (
            "grpo",
            ["loss.rollout_correction={reject: token, reject_low: 3, reject_high: 2}"],
            r"reject_low \(3.0\) must be <= reject_high",
        ),
        ("grpo", ["loss.rollout_correction.reject=tokens"], r"rollout_correction.reject"),
        (
            "grpo",
            ["loss.surrogate=clip_cov", "loss.surrogate_args={selected: null}"],
            r"loss.surrogate_args.selected: not an argument of clip_cov",
        ),
        (
            "remax",
            ["loss.advantage_args={baseline: 0}"],
            r"loss.advantage_args.baseline: not an argument of remax",
        ),
        ("gpg", ["loss.entropy_coef=-1"], r"loss.entropy_coef"),
        ("sapo", ["loss.surrogate_args={tau_pos: 1.0, tau_ne: 1.0}"], r"did you mean 'tau_neg'"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_field(preset, overrides, match):
    with pytest.raises(ConfigError, match=match) as err:
        load(preset, *overrides)
    assert "\n" not in str(err.value)


def test_good_variants_load():
    cfg = load("ppo", "kl.controller=adaptive", "kl.target=6", "kl.horizon=10000")
    assert cfg.kl.controller == "adaptive" and cfg.value.optim.lr == 1e-4
    cfg = load("cispo", "loss.surrogate_args={eps_low: null, eps_high: 4.0}")
    assert cfg.loss.surrogate_args["eps_low"] is None
    cfg = load("rloo", "kl.placement=loss")
    assert cfg.kl.placement == "loss"


@pytest.mark.parametrize(
    ("override", "field", "ours"),
    [
        # verl's actor.loss_agg_mode
        ("loss.aggregation=seq-mean-token-mean", "aggregation", "seq_mean_token_mean"),
        ("loss.aggregation=token-mean", "aggregation", "token_mean"),
        ("loss.aggregation=seq-mean-token-sum", "aggregation", "seq_mean_token_sum"),
        # TRL's GRPOConfig.loss_type
        ("loss.aggregation=dr_grpo", "aggregation", "seq_mean_token_sum_norm"),
        ("loss.aggregation=dapo", "aggregation", "token_mean"),
        # verl's algorithm.adv_estimator
        ("loss.advantage=grpo", "advantage", "group_zscore"),
        ("loss.advantage=reinforce_plus_plus", "advantage", "reinforce_pp"),
        ("loss.advantage=reinforce_plus_plus_baseline", "advantage", "reinforce_pp_baseline"),
        ("loss.advantage=grpo_passk", "advantage", "pass_k"),
        # verl's actor.policy_loss.loss_mode
        ("loss.surrogate=vanilla", "surrogate", "ppo_dual_clip"),
        ("loss.surrogate=geo_mean", "surrogate", "gmpo"),
    ],
)
def test_other_libraries_names_resolve_to_ours(tmp_path, override, field, ours):
    cfg = load("dr_grpo", override)
    assert getattr(cfg.loss, field) == ours
    # the run's config.yaml (cfg.model_dump) records our name
    assert cfg.model_dump(mode="json")["loss"][field] == ours


def test_kl_estimator_alias_and_our_names_unchanged():
    assert load("grpo", "kl.estimator=kl").kl.estimator == "k1"  # verl's kl_loss_type
    assert load("grpo", "kl.estimator=mse").kl.estimator == "k2"
    assert load("grpo", "kl.estimator=kl+").kl.estimator == "k1+"  # verl's straight-through
    assert load("gpg", "loss.surrogate=gpg").loss.surrogate == "reinforce"  # verl's loss_mode
    cfg = load("dr_grpo")
    assert (cfg.loss.advantage, cfg.loss.aggregation) == ("group_mean", "seq_mean_token_sum_norm")
    with pytest.raises(ConfigError, match=r"loss\.aggregation: unknown name 'bnpo'"):
        load("dr_grpo", "loss.aggregation=bnpo")  # TRL's per-micro-batch mode: no counterpart


def test_advantage_capabilities_are_declared_not_sniffed(monkeypatch):
    """The config reads what the registry entry declares: an estimator registered with
    needs_groups refuses group_size 1, whatever its signature."""
    from rlhflab.losses.advantages import ADVANTAGES, Advantage, batch_mean

    def any_kwargs(rewards, **kwargs):  # nothing to sniff
        return batch_mean(rewards)

    monkeypatch.setitem(ADVANTAGES, "grouped", Advantage(any_kwargs, needs_groups=True))
    with pytest.raises(ConfigError, match=r"rollout.group_size must be >= 2 .*'grouped'"):
        load("grpo", "loss.advantage=grouped", "loss.advantage_args={}", "rollout.group_size=1")
    monkeypatch.setitem(ADVANTAGES, "critic", Advantage(any_kwargs, needs_values=True))
    with pytest.raises(ConfigError, match=r"value: loss.advantage 'critic' needs a value model"):
        load("grpo", "loss.advantage=critic", "loss.advantage_args={}")


@pytest.mark.parametrize(
    "override, match",
    [
        # verl's seq-mean-token-sum-norm has no mean over sequences; ours is Dr. GRPO's
        ("loss.aggregation=seq-mean-token-sum-norm", r"^loss\.aggregation: verl's .*num_seqs"),
        # verl's low_var_kl is a clamped k3
        ("kl.estimator=low_var_kl", r"^kl\.estimator: verl's 'low_var_kl' is k3 clamped"),
        ("kl.estimator=low_var_kl+", r"^kl\.estimator: verl's 'low_var_kl\+' is k3 clamped"),
    ],
)
def test_names_that_look_like_ours_but_differ_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load("grpo", override)
