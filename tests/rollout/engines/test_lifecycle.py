"""The engine's life cycle around a generation (`rlhflab.rollout.engines.generating` / `awake`):
the order of the calls, a frozen teacher left in eval mode, and the engine put to sleep when the
generation raises."""

import pytest
import torch

from rlhflab.rollout.engines import awake, generating


class Recorder:
    """An engine and a model that write what is done to them into one list."""

    def __init__(self, log):
        self.log = log

    def wake(self):
        self.log.append("wake")

    def sleep(self):
        self.log.append("sleep")


class Model(torch.nn.Linear):
    def __init__(self, log):
        super().__init__(2, 2)
        self.log = log

    def train(self, mode=True):
        self.log.append("train" if mode else "eval")
        return super().train(mode)


def test_generating_puts_the_model_in_eval_and_the_engine_awake_for_the_body():
    log = []
    model, engine = Model(log), Recorder(log)
    with generating(model, engine) as e:
        assert e is engine and not model.training
        log.append("generate")
    assert log == ["eval", "wake", "generate", "sleep", "train"] and model.training


def test_a_frozen_teacher_stays_in_eval_mode():
    log = []
    model, engine = Model(log), Recorder(log)
    with generating(model, engine, train_after=False):
        log.append("generate")
    assert log == ["eval", "wake", "generate", "sleep"] and not model.training


def test_a_generation_that_raises_still_puts_the_engine_to_sleep():
    log = []
    model, engine = Model(log), Recorder(log)
    with pytest.raises(RuntimeError, match="out of memory"), generating(model, engine):
        raise RuntimeError("out of memory")
    assert log == ["eval", "wake", "sleep"]  # freed for whoever handles the error; no train()
    log.clear()
    with pytest.raises(KeyError), awake(engine):
        raise KeyError("x")
    assert log == ["wake", "sleep"]


def test_sample_chunks_equals_one_loop_of_generate_calls_and_restores_the_mode(
    tiny_model64, tiny_tokenizer
):
    # `sample_chunks` is the loop it replaced: chunk after chunk through `generate` with one
    # generator, decoded with the engine's stop ids; the model's mode is back as it was.
    from rlhflab.rollout.engines import SamplingParams, make_engine, sample_chunks
    from rlhflab.rollout.sampler import decode_completions

    prompts = [tiny_tokenizer(f"{i} + {i % 3} =")["input_ids"] for i in range(5)]
    engine = make_engine(None, tiny_model64, tiny_tokenizer)
    params = SamplingParams(n=2, max_new_tokens=5, temperature=1.0)
    tiny_model64.train()
    got = sample_chunks(tiny_model64, engine, tiny_tokenizer, prompts, params, chunk=2,
                        generator=torch.Generator().manual_seed(7))  # fmt: skip
    assert tiny_model64.training  # restored
    gen = torch.Generator().manual_seed(7)
    tiny_model64.eval()
    for (start, ro, texts), s in zip(got, range(0, 5, 2), strict=True):
        ref = engine.generate(prompts[s : s + 2], params, generator=gen)
        assert start == s and torch.equal(ro.completion_ids, ref.completion_ids)
        assert torch.equal(ro.logp, ref.logp)
        assert texts == decode_completions(tiny_tokenizer, ref, engine.stop_token_ids)
    assert [len(t) for _, _, t in got] == [4, 4, 2]  # n = 2 completions per prompt
