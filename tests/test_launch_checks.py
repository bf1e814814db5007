"""Refusals that depend only on the config (and the number of processes) come first: before the
checkpoint is read, before any data or model is loaded, before any collective (so under torchrun
every rank refuses alike and the CLI prints the line once). The world size is faked here; the
real 2-process launches are in tests/distributed/."""

from pathlib import Path

import pytest
from test_checkpoint_resume import grpo_raw, sft_raw

from rlhflab import distributed
from rlhflab.config import config_from_dict
from rlhflab.errors import ConfigError
from rlhflab.trainers import loop, policy_gradient, run_config, sft

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def two_ranks_nothing_loaded(monkeypatch):
    """World size 2, and any step past the config checks fails the test."""
    for module in (distributed, distributed.group):  # the face and the module that defines it
        monkeypatch.setattr(module, "world_size", lambda: 2)

    def too_late(*args, **kwargs):
        raise AssertionError("got past the config-only checks (checkpoint, data or model read)")

    for module in (loop, policy_gradient, sft):  # wherever the names are looked up
        monkeypatch.setattr(module, "resume_point", too_late, raising=False)
    for module in (policy_gradient, sft):
        monkeypatch.setattr(module, "prepare_model", too_late)


def test_vllm_tensor_parallel_that_does_not_fit_the_ranks_is_refused_first(
    tmp_path, two_ranks_nothing_loaded
):
    # The vllm engine runs under torchrun (one engine per rank, or one per group of
    # tensor_parallel_size ranks); a TP size that does not divide the ranks is refused before
    # any model load or collective.
    raw = grpo_raw(tmp_path, tmp_path / "no-such-model")
    raw["rollout"]["engine"] = "vllm"
    raw["rollout"]["vllm"] = {"tensor_parallel_size": 3}
    with pytest.raises(
        ConfigError, match=r"^rollout\.vllm\.tensor_parallel_size: 3 does not divide the 2"
    ):
        run_config(config_from_dict(raw))
    assert not distributed.collectives_started()


def test_vllm_under_torchrun_passes_the_launch_checks(tmp_path, two_ranks_nothing_loaded):
    # Before: refused ("runs in one process"). Now it goes on to the model load (here: stopped).
    raw = grpo_raw(tmp_path, tmp_path / "no-such-model")
    raw["rollout"]["engine"] = "vllm"
    with pytest.raises(AssertionError, match="got past the config-only checks"):
        run_config(config_from_dict(raw))


@pytest.mark.parametrize(
    "family, key, value, msg",
    [
        ("sft", "train.batch_size", 7, r"^train\.batch_size: 7 rows do not split over 2 ranks"),
        ("grpo", "rollout.prompts_per_step", 3, r"^rollout\.prompts_per_step: 3 prompts do not"),
    ],
)
def test_batch_that_does_not_split_is_refused_first(
    tmp_path, two_ranks_nothing_loaded, family, key, value, msg
):
    raw = sft_raw(tmp_path) if family == "sft" else grpo_raw(tmp_path, tmp_path / "no-model")
    section, name = key.split(".")
    raw[section][name] = value
    if family == "sft":
        raw["train"]["micro_batch_size"] = 7
    with pytest.raises(ConfigError, match=msg):
        run_config(config_from_dict(raw))


def test_one_process_is_not_refused(tmp_path, monkeypatch):
    # The same vLLM config in one process passes the launch checks (it fails later, on the model).
    raw = grpo_raw(tmp_path, tmp_path / "no-such-model")
    raw["rollout"]["engine"] = "vllm"
    loop.check_launch(config_from_dict(raw))


def test_main_then_share_in_one_process_is_the_call():
    assert distributed.main_then_share(lambda: 41 + 1) == 42
    with pytest.raises(ConfigError, match="locked"):
        distributed.main_then_share(lambda: (_ for _ in ()).throw(ConfigError("locked")))


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("kind", ["config", "oserror"])
def test_a_refusal_rank_0_shared_is_printed_by_rank_0_alone(monkeypatch, capsys, rank, kind):
    """What each rank's CLI does with `main_then_share`'s outcome: rank 0 prints its reason
    (unprefixed, even after collectives started), the others exit quietly; both exit 2."""
    import rlhflab.trainers
    from rlhflab.cli import main
    from rlhflab.errors import PeerRefused

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for module in (distributed, distributed.group):
        monkeypatch.setattr(module, "collectives_started", lambda: True)

    def refused(cfg):
        if rank != "0":
            raise PeerRefused("rank 0 refused to start (ConfigError: locked)")
        exc = (
            ConfigError("run directory x is locked")
            if kind == "config"
            else PermissionError(13, "Permission denied", "/runs/x")
        )
        exc.shared = True
        raise exc

    monkeypatch.setattr(rlhflab.trainers, "run_config", refused)
    sft_yaml = str(ROOT / "configs/sft/tiny_scratch.yaml")
    assert main(["train", sft_yaml]) == 2
    err = capsys.readouterr().err
    if rank == "0":
        assert err.count("error: ") == 1 and err.startswith("error: ") and "rank" not in err
    else:
        assert err == ""
