"""make_engine and its inputs: the stop set, the default engine, one-line errors."""

import importlib.util

import pytest

from rlhflab.config import RolloutConfig
from rlhflab.errors import ConfigError
from rlhflab.rollout.engines import SamplingParams, make_engine, stop_ids_for


def test_stop_set_is_eos_then_the_models_then_the_configs(tiny_model, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    tiny_model.generation_config.eos_token_id = [eos, 5]  # Llama-3 style: several end ids
    assert stop_ids_for(tiny_model, tiny_tokenizer, [7, 5]) == (eos, 5, 7)
    engine = make_engine(RolloutConfig(stop_token_ids=[9]), tiny_model, tiny_tokenizer)
    assert engine.name == "hf" and engine.stop_token_ids == (eos, 5, 9)
    assert make_engine(None, tiny_model, tiny_tokenizer).name == "hf"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_engine_without_vllm_is_one_config_error(tiny_model, tiny_tokenizer):
    with pytest.raises(ConfigError, match=r"rollout.engine 'vllm' needs vLLM.*rlhflab\[vllm\]"):
        make_engine(RolloutConfig(engine="vllm"), tiny_model, tiny_tokenizer)


def test_sampling_params_are_checked():
    with pytest.raises(ValueError, match="n and max_new_tokens"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="temperature > 0"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.0)


def test_tensor_parallel_needs_torchrun_ranks():
    """A TP group is a group of torchrun ranks: one process runs TP 1; under torchrun the size
    divides the ranks (checked before vLLM is touched, so with or without it)."""
    from rlhflab.rollout.engines.vllm import check_parallel

    check_parallel(1, 1)
    check_parallel(2, 4)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 2 needs 2 torchrun ranks"):
        check_parallel(2, 1)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 2 does not divide the 3"):
        check_parallel(2, 3)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: 2 with rollout.dynamic_samp"):
        check_parallel(2, 2, dynamic=True)
    check_parallel(1, 2, dynamic=True)


def test_the_engine_table_is_the_one_list_of_engines(monkeypatch, tiny_model, tiny_tokenizer):
    """`rollout.engine`'s choices, the CLI's `--engine` choices and `make_engine` all come from
    `ENGINES`: an engine added there is accepted everywhere; a name not in it is refused in one
    line naming the key."""
    import typing

    from rlhflab.cli import build_parser
    from rlhflab.rollout.engines import ENGINES, engine_class, registry
    from rlhflab.rollout.engines.hf import HFEngine

    assert typing.get_args(RolloutConfig.model_fields["engine"].annotation) == tuple(ENGINES)
    (engine_opt,) = [a for a in build_parser()._subparsers._group_actions[0].choices["eval"]
                     ._actions if "--engine" in a.option_strings]  # fmt: skip
    assert engine_opt.choices == list(ENGINES)
    assert engine_class("hf") is HFEngine
    with pytest.raises(ConfigError, match=r"^rollout\.engine: unknown engine 'nope'; choose one"):
        engine_class("nope")

    class Recorder(HFEngine):  # a new engine: one row in the table
        name = "recorder"

    monkeypatch.setitem(registry.ENGINES, "recorder", f"{__name__}:Recorder")
    monkeypatch.setitem(globals(), "Recorder", Recorder)
    cfg = RolloutConfig.model_construct(engine="recorder", stop_token_ids=[])
    assert type(make_engine(cfg, tiny_model, tiny_tokenizer)) is Recorder
