"""vLLM sleep mode (`rollout.vllm.sleep`): the engine sleeps after a rollout and wakes before the
next (weights offloaded, KV cache freed, level 1), and is refused where vLLM has no sleep mode."""

import importlib.util
import os

import pytest

from rlhflab.config import VLLMConfig
from rlhflab.errors import ConfigError
from rlhflab.rollout.engines import stop_ids_for
from rlhflab.rollout.engines.vllm import VLLMEngine

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


class RecordingLLM:
    """Stands in for vllm.LLM: records the sleep-mode calls the engine makes."""

    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, len(list(kwargs["weights_iterator"]))))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", None))


def _engine(sleep_mode: bool) -> tuple[VLLMEngine, RecordingLLM]:
    llm = RecordingLLM()
    engine = VLLMEngine(llm, pad_token_id=0, stop_token_ids=(1,), tied=True, dtype=None,
                        sleep_mode=sleep_mode)  # fmt: skip
    return engine, llm


def test_sleep_then_wake_calls_vllm_once_each():
    engine, llm = _engine(sleep_mode=True)
    engine.sleep()
    engine.sleep()  # already asleep: no second call
    assert llm.calls == [("sleep", 1)] and engine.asleep
    engine.wake()
    engine.wake()  # already awake
    assert llm.calls == [("sleep", 1), ("wake_up", None)] and not engine.asleep


def test_a_push_into_a_sleeping_engine_wakes_the_weights_first(tiny_model):
    """As TRL does: a weight push wakes only the weights (`tags=["weights"]`), and the KV cache
    is woken before the next generation."""
    engine, llm = _engine(sleep_mode=True)
    engine.sleep()
    engine.update_weights(tiny_model.named_parameters())
    engine._push_pending()
    engine.wake()
    names = [c[0] for c in llm.calls]
    assert names == ["sleep", "wake_up", "reload_weights", "reload_weights",
                     "reset_prefix_cache", "wake_up"]  # fmt: skip
    assert llm.calls[1] == ("wake_up", ["weights"]) and llm.calls[-1] == ("wake_up", ["kv_cache"])
    assert not engine.asleep


def test_without_sleep_mode_the_engine_keeps_its_memory():
    engine, llm = _engine(sleep_mode=False)
    engine.sleep()
    engine.wake()
    assert llm.calls == [] and not engine.asleep


@pytest.mark.vllm
def test_sleep_mode_is_refused_on_cpu(contract_model, tiny_tokenizer):
    if not HAVE_VLLM:
        if os.environ.get("RLHFLAB_REQUIRE_VLLM"):
            pytest.fail("RLHFLAB_REQUIRE_VLLM is set but vllm is not installed")
        pytest.skip("vllm is not installed (pip install rlhflab[vllm])")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: vLLM's sleep mode is available")
    stops = stop_ids_for(contract_model, tiny_tokenizer)
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.sleep: .*needs a CUDA or ROCm GPU"):
        VLLMEngine.from_model(
            contract_model, tiny_tokenizer, VLLMConfig(sleep=True), stop_token_ids=stops
        )
