"""LR schedule by hand."""

import math

import pytest
import torch

from rlhflab.trainers.common import lr_factor


def test_warmup_then_constant():
    f = [
        lr_factor(s, warmup_steps=3, total_steps=10, schedule="constant", min_lr_ratio=0.0)
        for s in range(5)
    ]
    assert f == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_cosine_and_linear_endpoints():
    kw = dict(warmup_steps=0, total_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, schedule="cosine", **kw) == pytest.approx(1.0)
    # halfway: 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert lr_factor(5, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_factor(10, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(5, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert math.isclose(lr_factor(20, schedule="linear", **kw), 0.1)


def test_gradient_checkpointing_flag_enables_it():
    from rlhflab.config import ModelConfig
    from rlhflab.trainers.common import prepare_model

    texts = [f"{i} + {i} = {2 * i}" for i in range(200)]
    build = {"size": "tiny", "vocab_size": 300, "max_position_embeddings": 64}
    for flag in (False, True):
        cfg = ModelConfig(build=build, gradient_checkpointing=flag)
        _, model = prepare_model(
            cfg, device=torch.device("cpu"), seed=0, tokenizer_texts=lambda: texts
        )
        # every decoder layer checkpoints (the property's own definition, on any version)
        layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        assert layers and all(m.gradient_checkpointing is flag for m in layers)


def test_activation_checkpointing_uses_the_name_this_transformers_has():
    """Older transformers (5.17 on the GPU machine) have only `gradient_checkpointing_enable`;
    newer ones add `activation_checkpointing_enable` and deprecate the old name."""
    from rlhflab.trainers.common import enable_activation_checkpointing

    class Old:  # the older API alone
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.called = ("old", gradient_checkpointing_kwargs)

    class New(Old):
        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
            self.called = ("new", activation_checkpointing_kwargs)

    old, new = Old(), New()
    enable_activation_checkpointing(old)
    enable_activation_checkpointing(new)
    assert old.called == ("old", {"use_reentrant": False})
    assert new.called == ("new", {"use_reentrant": False})


def test_adamw_is_fused_exactly_when_every_parameter_is_on_cuda():
    """The choice is made from the parameters' devices (checked here without a GPU)."""
    from rlhflab.trainers.common import adamw_implementation

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert adamw_implementation([cuda, torch.device("cuda", 1)]) == {"fused": True}
    assert adamw_implementation(["cuda"]) == {"fused": True}
    assert adamw_implementation([cpu]) == {}  # CPU, and FSDP2 shards offloaded to host memory
    assert adamw_implementation([cuda, cpu]) == {}
    assert adamw_implementation([]) == {}


def test_make_optimizer_on_cpu_is_the_default_adamw():
    from rlhflab.config import OptimConfig
    from rlhflab.trainers.common import make_optimizer

    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    opt = make_optimizer(model, OptimConfig(lr=1e-3))
    assert isinstance(opt, torch.optim.AdamW) and not opt.defaults["fused"]
    assert [p for g in opt.param_groups for p in g["params"]] == [model.weight]
