"""`rollout.packing_check` (the doctor's `packing` row, the GPU probe): it passes on this CPU with
every attention implementation the CPU has, and it fails — in the numbers and in the boundary
check — when the packed layout lets attention cross a sequence boundary."""

import pytest
import torch

from rlhflab.models import packing
from rlhflab.rollout import packing_check


@pytest.fixture(scope="module")
def model_and_rollout():
    model = packing_check.tiny_model("cpu", vocab=256)
    return model, packing_check.random_rollout(6, 256, "cpu")


def test_packed_equals_padded_on_this_cpu(model_and_rollout):
    model, ro = model_and_rollout
    res = packing_check.check_packing(model, ro, impls=packing_check.attention_implementations("cpu"),
                                      precisions=packing_check.precisions_for("cpu"))  # fmt: skip
    assert res["ok"]
    assert {a["attn"] for a in res["arms"]} == {"sdpa", "eager"}
    assert any(a.get("check") == "boundaries" for a in res["arms"])
    assert res["logp_spread"] > 0.1  # log-probs that depend on the context
    assert model.config._attn_implementation == "sdpa"  # restored


def test_a_leaking_layout_fails_the_check(model_and_rollout, monkeypatch):
    """Varlen rows whose position ids never restart: transformers sees one long sequence per
    row, so attention crosses boundaries; every sharded arm and the boundary check fail."""
    import rlhflab.rollout.sampler as sampler

    def leaky(model, rollout, *, sharded):
        lay = packing.packed_layout(rollout, share_prompts=False)
        lay.position_ids = torch.arange(lay.input_ids.size(1)).expand_as(lay.input_ids)
        return lay

    monkeypatch.setattr(sampler, "layout_for", leaky)
    model, ro = model_and_rollout
    res = packing_check.check_packing(model, ro, impls=["sdpa"],
                                      precisions=packing_check.precisions_for("cpu"))  # fmt: skip
    assert not res["ok"]
    bounds = [a for a in res["arms"] if a.get("check") == "boundaries"]
    assert bounds and not any(a["ok"] for a in bounds)
    assert any(a["max_dlogp"] > 1e-3 for a in res["arms"] if "check" not in a)
