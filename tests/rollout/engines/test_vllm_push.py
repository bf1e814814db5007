"""The vllm engine's weight push without vLLM (a recording stand-in for `LLM`): buckets of whole
decoder layers in the engine's dtype, embeddings and LM head together, and LoRA layers merged
(W + s·B A) under the base model's names. Runs in the main environment."""

import copy

import pytest
import torch

from rlhflab.rollout.engines.vllm import VLLMEngine


class RecordingLLM:
    """Keeps what each `collective_rpc("reload_weights", ...)` call would load."""

    def __init__(self):
        self.pushes: list[list[tuple[str, torch.Tensor]]] = []

        self.calls: list[str] = []

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights"
        self.pushes.append(list(kwargs["weights_iterator"]))
        self.calls.append(method)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


def _engine(dtype, bucket_bytes, tied, lora=None):
    llm = RecordingLLM()
    engine = VLLMEngine(llm, pad_token_id=0, stop_token_ids=(1,), tied=tied, dtype=dtype,
                        bucket_bytes=bucket_bytes, lora_scalings=lora)  # fmt: skip
    return engine, llm


def _layer(name):
    parts = name.split(".")
    return parts[parts.index("layers") + 1] if "layers" in parts else None


@pytest.mark.parametrize("bucket_bytes, n_layer_buckets", [(1, None), (2**40, 1)])
def test_buckets_hold_whole_layers_in_the_engine_dtype(tiny_model, bucket_bytes, n_layer_buckets):
    assert tiny_model.config.tie_word_embeddings
    engine, llm = _engine(torch.bfloat16, bucket_bytes, tied=True)
    engine.update_weights(tiny_model.named_parameters())
    assert llm.pushes == []  # not sharded: pushed before the next generate
    engine._push_pending()
    n_layers = tiny_model.config.num_hidden_layers
    *layer_pushes, rest = llm.pushes
    assert len(layer_pushes) == (n_layer_buckets or n_layers)  # 1 byte: one layer per bucket
    seen = [{_layer(n) for n, _ in push} for push in layer_pushes]
    assert all(None not in s for s in seen)
    assert sum(len(s) for s in seen) == n_layers  # no layer split over two pushes
    assert {_layer(n) for n, _ in rest} == {None}
    names = {n for n, _ in rest}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
    params = dict(tiny_model.named_parameters())
    for push in llm.pushes:
        for name, t in push:
            assert t.dtype == torch.bfloat16
            src = params["model.embed_tokens.weight" if name == "lm_head.weight" else name]
            assert torch.equal(t, src.detach().to(torch.bfloat16))
    assert engine.last_push_buckets == len(llm.pushes) and engine.n_pushes == 1
    # then the prefix cache goes: its KV blocks were computed with the old weights
    assert llm.calls == ["reload_weights"] * len(llm.pushes) + ["reset_prefix_cache"]


def test_lora_layers_are_merged_under_the_base_names(tiny_model):
    """The push of a LoRA policy is the merged model (`merged_state`, what `model.lora.save:
    merged` writes), in float64 here so the comparison is exact to rounding."""
    pytest.importorskip("peft")
    from rlhflab.config import LoRAConfig
    from rlhflab.models.lora import apply_lora, lora_scalings, merged_state

    model = apply_lora(copy.deepcopy(tiny_model).double(), LoRAConfig(r=2, alpha=8))
    with torch.no_grad():  # B = 0 at the start: make the adapters count
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    engine, llm = _engine(torch.float64, 2**40, tied=True, lora=lora_scalings(model))
    engine.update_weights(model.named_parameters())
    engine._push_pending()
    pushed = dict(p for push in llm.pushes for p in push)
    merged = {k.removeprefix("base_model.model."): v for k, v in merged_state(model).items()}
    plain = dict(tiny_model.named_parameters())
    assert set(pushed) == set(plain) | {"lm_head.weight"}  # the base model's names, no lora_*
    for name, t in pushed.items():
        want = merged["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        torch.testing.assert_close(t, want, atol=1e-12, rtol=0)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(pushed[q], plain[q].double())  # the adapters changed W
