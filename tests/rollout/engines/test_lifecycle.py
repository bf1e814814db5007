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
