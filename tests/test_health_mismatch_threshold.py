"""The `logp_mismatch` threshold by precision (issue #26): unset `health.logp_mismatch_max`
takes LOGP_MISMATCH_MAX of the run's precision (fp32 1e-3, bf16 0.05); a set value wins."""

import pytest
import torch

from rlhflab.config import HealthConfig, RolloutConfig, VLLMConfig, config_from_dict
from rlhflab.errors import ConfigError
from rlhflab.health import HealthMonitor
from rlhflab.health.checks import LOGP_MISMATCH_MAX, resolved_health, run_precision


def _pg(**over):
    raw = {"trainer": "policy_gradient", "model": {"name_or_path": "x"}, **over}
    return config_from_dict(raw)


def test_precision_of_a_run():
    assert run_precision(_pg(), None) == "fp32"
    assert run_precision(_pg(), torch.bfloat16) == "bf16"  # autocast
    assert run_precision(_pg(parallel={"mixed_precision": "bf16"}), None) == "bf16"
    assert run_precision(_pg(model={"name_or_path": "x", "dtype": "bfloat16"}), None) == "bf16"
    vllm_bf16 = {"engine": "vllm", "vllm": {"dtype": "bfloat16"}}
    assert run_precision(_pg(rollout=vllm_bf16), None) == "bf16"
    with pytest.raises(ConfigError, match=r"rollout.vllm.dtype: bfloat16 is read with rollout"):
        _pg(rollout={"vllm": {"dtype": "bfloat16"}})  # the hf engine would ignore it


def test_threshold_by_precision_unless_set():
    assert resolved_health(_pg(), None).logp_mismatch_max == LOGP_MISMATCH_MAX["fp32"] == 1e-3
    assert resolved_health(_pg(), torch.bfloat16).logp_mismatch_max == 0.05
    assert resolved_health(_pg(health={"logp_mismatch_max": 0.2}), None).logp_mismatch_max == 0.2
    assert _pg().health.logp_mismatch_max is None  # the config keeps "unset"


@pytest.mark.parametrize("precision, flagged", [("fp32", True), ("bf16", False)])
def test_a_mean_mismatch_of_001_nats(precision, flagged):
    """0.01 nats/token: far above fp32 rounding (flagged), within bf16's (not). Before, one
    threshold (0.05) let the fp32 case pass."""
    autocast = torch.bfloat16 if precision == "bf16" else None
    h = HealthMonitor(resolved_health(_pg(health={"patience": 1}), autocast), None,
                      print_fn=lambda _: None)  # fmt: skip
    out = h.check(1, {"train/loss": 1.0, "rollout/logp_diff_mean": 0.01})
    assert out["health/logp_mismatch"] == float(flagged)


def test_monitor_without_resolution_uses_the_fp32_default():
    h = HealthMonitor(HealthConfig(patience=1), None, print_fn=lambda _: None)
    assert h.check(1, {"train/loss": 1.0, "rollout/logp_diff_mean": 2e-3})["health/logp_mismatch"]
    assert RolloutConfig().vllm == VLLMConfig()
