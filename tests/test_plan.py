"""`rlhflab plan`: parameter counts of the built-in shapes against the published totals, every
memory term of a tiny shape computed by hand, and issue #25's must-show verdicts for Qwen3-8B."""

import dataclasses
import json
from pathlib import Path

import pytest

from rlhflab.cli import main
from rlhflab.plan import (
    BUILTIN_SHAPES,
    GIB,
    ModelShape,
    PlanInputs,
    estimate,
    fused_head_bytes,
    plan,
    resolve_shape,
    usable_gib,
)

ROOT = Path(__file__).resolve().parents[1]
GRPO = str(ROOT / "configs/pg/grpo.yaml")

# (total, non-embedding) parameters in billions, from the model cards (Qwen3: "Number of
# Parameters" / "(Non-Embedding)"; Llama: the safetensors totals), to the cards' rounding.
PUBLISHED = {
    "qwen2.5-0.5b": (0.49, 0.36),
    "qwen2.5-0.5b-instruct": (0.49, 0.36),
    "qwen3-0.6b": (0.60, 0.44),
    "qwen3-1.7b": (1.7, 1.4),
    "qwen3-4b": (4.0, 3.6),
    "qwen3-8b": (8.19, 6.95),
    "llama-3.2-1b": (1.24, None),
    "llama-3.2-3b": (3.21, None),
    "llama-3.1-8b": (8.03, None),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_parameter_counts_match_the_published_totals(name):
    shape = BUILTIN_SHAPES[name]
    total, non_embedding = PUBLISHED[name]
    assert round(shape.params() / 1e9, _digits(total)) == pytest.approx(total)
    if non_embedding is not None:
        inside = shape.params() - shape.embedding_params()
        assert round(inside / 1e9, _digits(non_embedding)) == pytest.approx(non_embedding)


def _digits(x: float) -> int:
    return len(str(x).split(".")[1])


TINY = ModelShape("tiny", 8, 2, 16, 2, 1, 4, 10, True, qk_norm=True)


def test_qwen2_parameter_count_with_qkv_biases_equals_the_transformers_model():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhflab.plan.shapes import shape_from_config

    cfg = Qwen2Config(hidden_size=8, num_hidden_layers=2, intermediate_size=16,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=10,
                      tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    shape = shape_from_config(cfg.to_dict(), name="q2", where="test")
    assert shape.qkv_bias and sum(p.numel() for p in model.parameters()) == shape.params()
    # by hand: layer = linears 576 + biases q 8 + k 4 + v 4 + norms 16 = 608; embeddings 80
    assert shape.params() == 2 * 608 + 80 + 8


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_equals_the_transformers_model(arch, tied):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls_cfg, cls = (
        (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    )
    shape = dataclasses.replace(TINY, tie_word_embeddings=tied, qk_norm=arch == "qwen3")
    cfg = cls_cfg(
        hidden_size=8, num_hidden_layers=2, intermediate_size=16, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, vocab_size=10, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = cls(cfg)
    assert sum(p.numel() for p in model.parameters()) == shape.params()
    # by hand: layer = q 64 + k 32 + v 32 + o 64 + MLP 384 + norms 16 (+ q/k norms 8)
    layer = 592 + (8 if arch == "qwen3" else 0)
    assert shape.params() == 2 * layer + 80 * (1 if tied else 2) + 8


def test_lora_parameter_count_equals_peft():
    pytest.importorskip("peft")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlhflab.config import LoRAConfig
    from rlhflab.models.lora import apply_lora

    cfg = Qwen3Config(
        hidden_size=8, num_hidden_layers=2, intermediate_size=16, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, vocab_size=10, tie_word_embeddings=True,
    )  # fmt: skip
    model = apply_lora(Qwen3ForCausalLM(cfg), LoRAConfig(r=3))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # r · Σ(d_in + d_out) over q(8,8) k(8,4) v(8,4) o(8,8) gate(8,16) up(8,16) down(16,8), 2 layers
    assert trainable == TINY.lora_params(3) == 2 * 3 * (16 + 12 + 12 + 16 + 24 + 24 + 24)
    assert TINY.lora_params(3, ["q_proj", "v_proj"]) == 2 * 3 * (16 + 12)


def _tiny_sft(**kw) -> PlanInputs:
    base = dict(
        trainer="sft", gpus=1, gpu_memory_gib=1.0, strategy="none", model_dtype="float32",
        autocast=False, micro_batch=2, prompt_len=0, completion_len=5,
    )  # fmt: skip
    return PlanInputs(**{**base, **kw})


def test_tiny_components_by_hand():
    r = estimate(TINY, _tiny_sft())
    P = 1288  # 2 · 600 + 80 (tied embedding) + 8 (final norm)
    comps = {k: v * GIB for k, v in r["components"].items()}
    assert comps["parameters"] == pytest.approx(4 * P, rel=1e-12)
    assert comps["gradients"] == pytest.approx(4 * P, rel=1e-12)
    assert comps["optimizer_state"] == pytest.approx(8 * P, rel=1e-12)
    # fp32, no autocast (c = rs = 4), per token per layer: norms 2·(32 + 32) = 128; linear
    # inputs o 4·8 + down 4·16 = 96; q/k norms (4 + 4)·(8 + 4) = 96; attention 4·4·8 = 128;
    # SwiGLU 4·4·16 = 256 → 704. 10 tokens, 2 layers, + final norm (32 + 32)·10 + the fused
    # head's saved input, rs·h per scored row: 32·10.
    assert comps["activations"] == pytest.approx(704 * 10 * 2 + 96 * 10, rel=1e-12)
    # The fused head over N = 2 rows × 5 = 10 scored rows, chunks of min(10, 2**23 // 10) = 10
    # rows (C·V = 100 elements). Forward: 3 fp32 blocks 12·100 + lse, logp 8·10 = 1280.
    # Backward: the head's fp32 gradient accumulator 4·V·h = 320, + the larger of a chunk's
    # (12 + 4)·100 = 1600 and the weight matmul's (V, h) output 4·80 + z, grad_z 8·100 = 1120,
    # + grad of the hidden states 4·8·10 + lse, logp, grad_out 12·10: 2360.
    assert comps["logits"] == pytest.approx(320 + 1600 + 320 + 120, rel=1e-12)
    assert comps["rollout_kv_cache"] == 0 and comps["autocast_weight_copies"] == 0
    assert r["per_gpu_gib"] * GIB == pytest.approx(16 * P + 15040 + 2360, rel=1e-12)
    assert r["binding_phase"] == "train"


def test_full_logits_path_without_a_plain_linear_head():
    """A shape whose head is not a plain linear (`fused_head=False`, not `can_pack`) keeps the
    (B, T+1, V) fp32 logits of `completion_logps`' padded path."""
    full = dataclasses.replace(TINY, fused_head=False)
    r = estimate(full, _tiny_sft())
    # logits (2, 5 + 1, 10) fp32: saved 4 + gradient 4 bytes each
    assert r["components"]["logits"] * GIB == pytest.approx(8 * 2 * 6 * 10, rel=1e-12)
    # the head's input is saved as its c-byte cast for every token: 4·8·10, as the fused one
    assert r["components"]["activations"] * GIB == pytest.approx(704 * 20 + 960, rel=1e-12)
    # bf16 logits add their 2-byte copy: 10 bytes per element
    amp = estimate(full, _tiny_sft(autocast=True))
    assert amp["components"]["logits"] * GIB == pytest.approx(10 * 120)
    hot = estimate(full, _tiny_sft(trainer="policy_gradient", temperature=0.7))
    assert hot["components"]["logits"] * GIB == pytest.approx(12 * 120)


def test_autocast_checkpointing_and_temperature_terms():
    amp = estimate(TINY, _tiny_sft(autocast=True))
    # every linear weight (blocks 2·(64+32+32+64+384) + LM head 80) gets a bf16 copy (the fused
    # head casts its weight again in its backward, at the train peak)
    assert amp["components"]["autocast_weight_copies"] * GIB == pytest.approx(2 * (2 * 576 + 80))
    # fused head, bf16 matmuls (mm = 2): backward 4·80 + max((12 + 2)·100, 2·80 + 6·100)
    # + rs·h·N 4·8·10 (fp32 hidden states) + 12·10 = 2160 > forward 12·100 + 80
    assert amp["components"]["logits"] * GIB == pytest.approx(320 + 1400 + 320 + 120)
    ckpt = estimate(TINY, _tiny_sft(activation_checkpointing=True))
    # layer inputs 4·8 per token per layer + one layer recomputed + outside the layers
    assert ckpt["components"]["activations"] * GIB == pytest.approx(2 * 32 * 10 + 704 * 10 + 960)
    hot = estimate(TINY, _tiny_sft(trainer="policy_gradient", temperature=0.7))
    # the policy gradient asks for the entropy: forward 21·100 + 12·10 = 2220; backward
    # 320 + 1600 + 320 + 16·10 = 2400; τ adds no block to the fused head's peak
    assert hot["components"]["logits"] * GIB == pytest.approx(2400)


def test_fused_head_chunks_lora_and_fsdp2_rows():
    """C < N: a vocabulary of 2**21 gives chunks of 2**23 // 2**21 = 4 rows."""
    V = 2**21
    big = dataclasses.replace(TINY, vocab_size=V)
    full = estimate(big, _tiny_sft())
    # backward: 4·V·8 + max(16·(4·V), 4·V·8 + 8·(4·V)) + 4·8·10 + 12·10 = 96·V + 440
    # (> forward 48·V + 80)
    assert full["components"]["logits"] * GIB == pytest.approx(96 * V + 440, rel=1e-12)
    lora = estimate(big, _tiny_sft(lora_r=3, model_dtype="bfloat16"))
    # frozen head (no weight gradient), bf16 (c = rs = 2): backward 14·4·V + 2·8·10 + 12·10
    assert lora["components"]["logits"] * GIB == pytest.approx(56 * V + 280, rel=1e-12)
    # fsdp2 scores the kept T + 1 positions: N = 2 × 6 = 12; the head (unsharded) as above
    fsdp = estimate(big, _tiny_sft(gpus=2, strategy="fsdp2"))
    expected = 96 * V + 4 * 8 * 12 + 12 * 12
    assert fsdp["components"]["logits"] * GIB == pytest.approx(expected, rel=1e-12)
    # no-grad scoring: the forward's 3 fp32 blocks 12·4·V, lse and logp 8·10, the reshaped
    # (N, h) input 2·8·10; the policy gradient's training forward adds the entropy's blocks
    _, score = fused_head_bytes(big, 10, c=2, rs=2, head_trainable=False, entropy=False)
    assert score == 48 * V + 80 + 160
    train, _ = fused_head_bytes(big, 10, c=2, rs=2, head_trainable=False, entropy=True)
    assert train == max(21 * 4 * V + 12 * 10, 14 * 4 * V + 160 + 16 * 10) == 84 * V + 120


def test_fused_head_constants_match_the_code():
    from rlhflab import ops
    from rlhflab.models.packing import PACKABLE
    from rlhflab.plan import FUSED_BLOCK
    from rlhflab.plan.shapes import FUSED_HEAD_TYPES

    assert FUSED_BLOCK == ops._FUSED_BLOCK and FUSED_HEAD_TYPES == PACKABLE


def test_rollout_kv_cache_by_hand():
    p = _tiny_sft(trainer="policy_gradient", prompt_len=3, rollout_rows=4, rollout_rows_global=4)
    r = estimate(TINY, p)
    # 2 (k, v) · 2 layers · 1 kv head · 4 head_dim · 4 bytes, per token; 4 rows × 8 tokens
    assert r["components"]["rollout_kv_cache"] * GIB == pytest.approx(64 * 32)


def test_sharding_offload_and_lora():
    one = estimate(TINY, _tiny_sft())
    ddp = estimate(TINY, _tiny_sft(gpus=4, strategy="ddp"))
    fsdp = estimate(TINY, _tiny_sft(gpus=4, strategy="fsdp2"))
    off = estimate(TINY, _tiny_sft(gpus=4, strategy="fsdp2", cpu_offload=True))
    for key in ("parameters", "gradients", "optimizer_state"):
        assert ddp["components"][key] == one["components"][key]
        assert fsdp["components"][key] == pytest.approx(one["components"][key] / 4)
        assert off["components"][key] == 0
        assert off["host_components"][key] == pytest.approx(one["components"][key] / 4)
    lora = estimate(TINY, _tiny_sft(lora_r=3, model_dtype="bfloat16"))
    T = TINY.lora_params(3)
    assert lora["components"]["parameters"] * GIB == pytest.approx(2 * 1288 + 4 * T)
    assert lora["components"]["optimizer_state"] * GIB == pytest.approx(8 * T)


def _tiny_pg(**kw) -> PlanInputs:
    return _tiny_sft(trainer="policy_gradient", reference=True, critic=True, **kw)


def test_loading_peak_by_hand():
    # TINY: P = 1288 (tied: backbone 1288), critic P_bb + h + 1 = 1297, the largest tensor the
    # gate / up projection h·f = 128 (> the embedding V·h = 80); fp32 model (w = 4).
    P, Pc = 1288, 1297
    one = estimate(TINY, _tiny_pg())
    ddp = estimate(TINY, _tiny_pg(gpus=4, strategy="ddp"))
    for r in (one, ddp):  # the model, the reference's deep copy, the critic's backbone copy
        assert r["load_peak_gib"] * GIB == pytest.approx(4 * (P + P + Pc), rel=1e-12)
        assert r["load_host_gib"] == 0
    # fsdp2 over 4 ranks, fp32 parameters: each GPU its shards of the three + one full tensor
    fsdp = estimate(TINY, _tiny_pg(gpus=4, strategy="fsdp2"))
    assert fsdp["load_peak_gib"] * GIB == pytest.approx(4 * (P + P + Pc) / 4 + 4 * 128)
    assert fsdp["load_host_gib"] * GIB == pytest.approx(4 * P + 4 * Pc)  # policy + critic copy
    # mixed_precision bf16: the reference's shards in bf16 (2 bytes), the tensors sent in fp32
    bf16 = estimate(TINY, _tiny_pg(gpus=4, strategy="fsdp2", mixed_precision="bf16"))
    assert bf16["components"]["reference"] * GIB == pytest.approx(2 * P / 4)
    assert bf16["load_peak_gib"] * GIB == pytest.approx((2 * P + 4 * P + 4 * Pc) / 4 + 4 * 128)
    # cpu_offload: shards filled in host memory through gloo; nothing on the GPU
    off = estimate(TINY, _tiny_pg(gpus=4, strategy="fsdp2", mixed_precision="bf16",
                                  cpu_offload=True))  # fmt: skip
    assert off["load_peak_gib"] == 0
    assert off["load_host_gib"] * GIB == pytest.approx(4 * (P + Pc) + (2 * P + 4 * (P + Pc)) / 4)
    # value.init_from: the critic loads in full on the device, rank 0 holds it through its wrap
    init = estimate(TINY, _tiny_pg(gpus=4, strategy="fsdp2", critic_init_from=True))
    assert init["load_peak_gib"] * GIB == pytest.approx(4 * (P + P) / 4 + 4 * Pc + 4 * Pc / 4)
    assert init["load_host_gib"] * GIB == pytest.approx(4 * P)
    # verifiable-pairs DPO: the model on every GPU first; rank 0 keeps it until its shards fill
    dpo = estimate(TINY, _tiny_sft(trainer="direct_alignment", gpus=4, strategy="fsdp2",
                                   loads_full=True))  # fmt: skip
    assert dpo["load_peak_gib"] * GIB == pytest.approx(4 * P / 4 + 4 * P)
    assert dpo["load_host_gib"] == 0
    # a reward model: rank 0 loads the causal LM (untied here: + its LM head V·h = 80) on its host
    untied = dataclasses.replace(TINY, tie_word_embeddings=False)
    rm = estimate(untied, _tiny_sft(trainer="reward_model", gpus=4, strategy="fsdp2"))
    assert rm["load_host_gib"] * GIB == pytest.approx(4 * (P + 80))
    # its GPUs: shards of the backbone and the score head (P + h + 1) / 4 + the gate h·f
    assert rm["load_peak_gib"] * GIB == pytest.approx(4 * (P + 9) / 4 + 4 * 128)


def test_local_config_json(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="qwen3",
                hidden_size=8,
                num_hidden_layers=2,
                intermediate_size=16,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=4,
                vocab_size=10,
                tie_word_embeddings=True,
            )
        )
    )
    assert dataclasses.replace(resolve_shape(str(tmp_path)), name="tiny") == TINY
    cfg = json.loads((tmp_path / "config.json").read_text())
    for extra in ({"final_logit_softcapping": 30.0}, {"model_type": "gemma2"}):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **extra}))
        assert not resolve_shape(str(tmp_path)).fused_head  # completion_logps' padded path
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        resolve_shape(str(tmp_path))


# -- issue #25's must-show, with sensible settings: prompt 256 + 768 new tokens, micro-batch 4,
#    activation checkpointing, GRPO's preset (16 prompts × 8 samples per step).


def test_qwen3_8b_full_fine_tuning_does_not_fit_one_80gb_gpu():
    r = plan("qwen3-8b", gpus=1, gpu_memory_gib=80, overrides=[
        "trainer=sft", "train.max_len=1024", "train.micro_batch_size=1", "train.batch_size=64",
        "model.gradient_checkpointing=true",
    ])  # fmt: skip
    assert not r["fits"] and r["max_micro_batch"] == 0
    # fp32 weights + gradients + AdamW: 16 bytes per parameter alone exceed the card
    assert r["resident_gib"] == pytest.approx(16 * BUILTIN_SHAPES["qwen3-8b"].params() / GIB)
    assert r["resident_gib"] > 80


def test_qwen3_8b_lora_grpo_fits_one_48gb_gpu():
    r = plan("qwen3-8b", gpus=1, gpu_memory_gib=48, config=GRPO, prompt_len=256, overrides=[
        "rollout.max_new_tokens=768", "train.micro_batch_size=4", "kl.coef=0.04",
        "model.lora.r=16", "model.dtype=bfloat16", "model.gradient_checkpointing=true",
    ])  # fmt: skip
    assert r["fits"] and r["load_fits"] and r["max_micro_batch"] >= 4
    assert r["components"]["reference"] == 0  # the base with adapters disabled


def test_qwen3_8b_full_grpo_with_reference_fits_4x48gb_under_fsdp2_with_offload():
    over = [
        "rollout.max_new_tokens=768", "train.micro_batch_size=4", "kl.coef=0.04",
        "parallel.strategy=fsdp2", "parallel.mixed_precision=bf16",
        "model.gradient_checkpointing=true",
    ]  # fmt: skip
    kw = dict(gpus=4, gpu_memory_gib=48, config=GRPO, prompt_len=256)
    resident = plan("qwen3-8b", overrides=over, **kw)
    offload = plan("qwen3-8b", overrides=[*over, "parallel.cpu_offload=true"], **kw)
    # on the GPU: 1/4 of 16 bytes per parameter + the reference, then the rollout gathers the
    # whole bf16 policy: over 48 GB. With CPUOffloadPolicy the state lives on the host.
    assert not resident["fits"]
    assert offload["fits"] and offload["components"]["optimizer_state"] == 0
    # host: 16 bytes per parameter of the policy + the bf16 reference (2), each over 4 ranks
    P = BUILTIN_SHAPES["qwen3-8b"].params()
    assert offload["host_gib"] * GIB == pytest.approx((16 + 2) * P / 4, rel=1e-12)
    # loading from rank 0 (fp32 model.dtype, w = 4): with offload the shards are filled in host
    # memory, so the GPU holds nothing while loading, and rank 0's host holds its full fp32
    # policy (4·P) plus its shards of policy and bf16 reference ((4 + 2)·P / 4); without
    # offload each GPU holds its shards (4 + 2)·P / 4 and the embedding being broadcast, 4·V·h.
    assert offload["load_fits"] and offload["load_peak_gib"] == 0
    assert offload["load_host_gib"] * GIB == pytest.approx(4 * P + 6 * P / 4, rel=1e-12)
    assert offload["binding_constraint"] == "steady state (rollout)"
    Vh = 151936 * 4096
    assert resident["load_peak_gib"] * GIB == pytest.approx(6 * P / 4 + 4 * Vh, rel=1e-12)
    assert resident["load_fits"] and resident["binding_constraint"] == "steady state (rollout)"


def test_usable_memory_calibration():
    assert usable_gib(80, {"fixed_gib": 2.0, "fragmentation": 0.25}) == pytest.approx(62.4)


def test_cli_json_and_errors(capsys):
    assert main(["plan", "--model", "qwen3-0.6b", "--gpus", "2", "--gpu-memory", "24",
                 "--json", "trainer=sft", "parallel.strategy=fsdp2"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["per_gpu_gib"], float) and isinstance(out["fits"], bool)
    assert out["inputs"]["strategy"] == "fsdp2" and "parameters" in out["components"]
    assert main(["plan", "--model", "qwen9-1b", "--gpu-memory", "24"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model: 'qwen9-1b'") and "\n" not in err
    assert main(["plan", "--model", "qwen3-0.6b", "--gpu-memory", "24", "train.nope=1"]) == 2
    assert "unknown config key 'train.nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arch, autocast, lora, dtype",
    [
        ("qwen3", False, False, "float32"),
        ("llama", False, False, "float32"),
        ("qwen3", True, False, "float32"),
        ("qwen3", False, True, "float32"),
        ("qwen3", True, True, "bfloat16"),
    ],
)
def test_activation_formula_against_what_autograd_saves(arch, autocast, lora, dtype):
    """Bytes of the distinct non-parameter tensors autograd saves in a forward of the decoder
    layers (`saved_tensors_hooks`), against `layer_activation_bytes` (+ the final norm, + the
    autocast bf16 weight copies): within 10% (kernel choices differ a little by device)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from rlhflab.plan import layer_activation_bytes

    cls_cfg, cls = (
        (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    )
    shape = ModelShape("s", 64, 2, 128, 4, 2, 16, 100, True, qk_norm=arch == "qwen3")
    cfg = cls_cfg(
        hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100, tie_word_embeddings=True,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = cls(cfg).to(getattr(torch, dtype))
    if lora:
        pytest.importorskip("peft")
        from rlhflab.config import LoRAConfig
        from rlhflab.models.lora import apply_lora

        apply_lora(model, LoRAConfig(r=4))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            saved[s.data_ptr()] = s.nbytes()
        return t

    B, S = 2, 16
    ids = torch.randint(0, 100, (B, S), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(B, S, dtype=torch.long)
    attn[0, :3] = 0  # left padding: SDPA gets a mask, as in rollouts
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
        model.model(input_ids=ids, attention_mask=attn)
    rs = 4 if dtype == "float32" else 2
    c = 2 if (autocast or rs == 2) else 4
    per_layer = layer_activation_bytes(
        shape, c=c, rs=rs, autocast=autocast, lora_r=4 if lora else None
    )
    final_norm = 4 * 64 + (0 if lora else rs * 64)
    expected = (2 * per_layer + final_norm) * B * S
    if autocast and not lora:  # bf16 copies of the blocks' fp32 linear weights
        expected += 2 * (shape.linear_params() - 100 * 64)
    assert sum(saved.values()) == pytest.approx(expected, rel=0.10)


@pytest.mark.parametrize("shape", ["qwen3-8b", "llama-3.2-1b"])
def test_docs_tables_are_what_the_planner_says(shape, monkeypatch):
    """docs/plan.md's what-fits rows equal bench/plan_tables.py's output (regenerate the tables
    with `python bench/plan_tables.py` after changing a formula)."""
    from bench import plan_tables

    monkeypatch.chdir(ROOT)  # the presets are repository paths
    doc = (ROOT / "docs/plan.md").read_text()
    for gpus, mem in plan_tables.CLUSTERS.values():
        cells = [plan_tables.cell(shape, job, gpus, mem) for job in plan_tables.JOBS]
        params = BUILTIN_SHAPES[shape].params() / 1e9
        assert f"| {shape} ({params:.2f} B) | " + " | ".join(cells) + " |" in doc


# -- issue #36: a plan that does not fit says what makes it fit; hub ids; the micro-batch search


@pytest.mark.parametrize("name", list(BUILTIN_SHAPES))
def test_hub_ids_of_the_builtin_shapes_resolve_to_them(name):
    from rlhflab.plan import HUB_IDS

    hub = [h for h, n in HUB_IDS.items() if n == name]
    assert len(hub) == 1  # every built-in shape has its Hub id
    _, model = hub[0].split("/")
    assert model.lower() == name  # the Hub's name of the same model
    for spelled in (hub[0], hub[0].lower(), hub[0].upper()):
        assert resolve_shape(spelled) is BUILTIN_SHAPES[name]
    over = ["train.micro_batch_size=2"]
    by_hub = plan(hub[0], gpus=1, gpu_memory_gib=80, overrides=over, suggest=False)
    assert by_hub["per_gpu_gib"] == plan(name, gpus=1, gpu_memory_gib=80, overrides=over,
                                         suggest=False)["per_gpu_gib"]  # fmt: skip


def test_a_local_directory_named_like_a_hub_id_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = Path("Qwen/Qwen3-8B")
    d.mkdir(parents=True)
    cfg = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "vocab_size": 100, "model_type": "qwen3"}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    assert resolve_shape("Qwen/Qwen3-8B").hidden_size == 64


def test_without_a_micro_batch_the_run_is_judged_at_the_largest_that_fits():
    # GRPO preset (its micro-batch is a CPU value), Qwen3-0.6B on one 48 GB card
    kw = dict(gpus=1, gpu_memory_gib=48, config=GRPO, prompt_len=256, suggest=False)
    r = plan("qwen3-0.6b", overrides=["rollout.max_new_tokens=512"], **kw)
    m, limit = r["inputs"]["micro_batch"], r["micro_batch_limit"]
    assert r["micro_batch_searched"] and 1 < m < limit  # a real search, not a bound
    assert m != r["config_micro_batch"] and r["fits"]
    at = lambda mb: plan("qwen3-0.6b", overrides=["rollout.max_new_tokens=512",  # noqa: E731
                                                  f"train.micro_batch_size={mb}"], **kw)  # fmt: skip
    assert at(m)["fits"] and not at(m + 1)["fits"]
    assert at(m)["per_gpu_gib"] == r["per_gpu_gib"]
    assert not at(m)["micro_batch_searched"]  # a given micro-batch is judged as given


def _replan(e: dict, over: list[str], **kw) -> dict:
    """The plan with a suggestion's change applied, recomputed from scratch."""
    return plan("qwen3-8b", overrides=[*over, *e["overrides"]], suggest=False,
                **{**kw, "gpus": e["gpus"]})  # fmt: skip


def test_each_suggestion_is_the_plan_recomputed_with_its_change_cheapest_first():
    from rlhflab.plan.suggest import CHANGES

    over = ["rollout.max_new_tokens=768", "kl.coef=0.04"]
    kw = dict(gpu_memory_gib=48, config=GRPO, prompt_len=256, gpus=4)
    r = plan("qwen3-8b", overrides=over, **kw)
    assert not r["fits"]
    sug = r["suggestions"]
    each = sug["each"]
    names = [e["change"] for e in each]
    # every change that applies on 4 GPUs, alone, in the documented order, then more GPUs
    assert names[:5] == [c.name for c in CHANGES]
    # more GPUs: 8 and 16 (the preset's 16 prompts per step split over at most 16 ranks); 16
    # is the largest tried, and the fp32 policy gathered for rollout still does not fit
    more = each[5]
    assert names[5].startswith("more GPUs: 16 + ") and more["gpus"] == 16 and not more["fits"]
    exact = ["model.gradient_checkpointing=true", "parallel.strategy=fsdp2"]
    assert not plan("qwen3-8b", overrides=[*over, *exact], suggest=False, **{**kw, "gpus": 8})[
        "fits"
    ]
    for e in [*each, sug["cheapest"]]:
        again = _replan(e, over, **kw)
        assert again["per_gpu_gib"] == e["per_gpu_gib"]
        assert (again["fits"] and again["load_fits"]) == e["fits"]
        assert again["inputs"]["micro_batch"] == e["micro_batch"]
    # the cheapest combination fits, and no combination of lower cost (Σ 2^rank) does
    best = sug["cheapest"]
    assert best["fits"]
    rank = {c.name: c.rank for c in CHANGES}
    cost = sum(2 ** rank[n] for n in best["changes"])
    import itertools

    for k in range(1, 6):
        for cs in itertools.combinations(CHANGES, k):
            if sum(2**c.rank for c in cs) < cost:
                extra = list(dict.fromkeys(o for c in cs for o in c.overrides))
                p = plan("qwen3-8b", overrides=[*over, *extra], suggest=False, **kw)
                assert not (p["fits"] and p["load_fits"]), [c.name for c in cs]


def test_a_given_micro_batch_that_does_not_fit_is_the_first_suggestion():
    over = ["trainer=sft", "train.max_len=1024", "train.batch_size=64",
            "train.micro_batch_size=64"]  # fmt: skip
    r = plan("qwen3-0.6b", gpus=1, gpu_memory_gib=24, overrides=over)
    assert not r["fits"] and 0 < r["max_micro_batch"] < 64
    first = r["suggestions"]["each"][0]
    assert first["change"] == "micro-batch" and first["fits"]
    assert first["micro_batch"] == r["max_micro_batch"]
    assert first["per_gpu_gib"] == plan("qwen3-0.6b", gpus=1, gpu_memory_gib=24, overrides=[
        *over, f"train.micro_batch_size={r['max_micro_batch']}"])["per_gpu_gib"]  # fmt: skip
    assert r["suggestions"]["cheapest"]["changes"] == ["micro-batch"]


def test_cli_prints_what_makes_it_fit(capsys):
    argv = ["plan", "--model", "Qwen/Qwen3-8B", "--gpus", "1", "--gpu-memory", "80"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "What makes it fit, each change alone, cheapest first" in out
    assert "The cheapest combination that fits:" in out and "model.lora.r=16" in out
    assert main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["suggestions"]["cheapest"]["fits"] and res["model"]["name"] == "qwen3-8b"


# -- issue 37: bad numbers and files are one line naming the option / file / fields.


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-3"])
def test_gpu_memory_must_be_finite_and_positive(value, capsys):
    # Before: inf was accepted ("fits"), and --json printed `Infinity` (not JSON).
    assert main(["plan", "--model", "qwen3-0.6b", f"--gpu-memory={value}", "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("error: --gpu-memory: must be a finite number of GiB > 0, got "), err


def test_non_utf8_config_json_names_the_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"hidden_size": 8, "name": "caf\xe9"}')  # Latin-1, not UTF-8
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "24"]) == 2
    err = capsys.readouterr().err
    # Before: "error: 'utf-8' codec can't decode byte 0xe9 in position 31: ..." (no file).
    assert (
        err
        == f"error: --model: {path} is not UTF-8 text (byte 31); config.json must be UTF-8 JSON\n"
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--prompt-len", "40929"],  # 40929 + rollout.max_new_tokens 32 = 40961 > 40960
         "prompt 40929 + completion 32 = 40961 tokens > 40960 (max_position_embeddings of "
         "qwen3-0.6b); lower --prompt-len, rollout.max_new_tokens"),
        (["rollout.max_new_tokens=40705"],  # the default prompt 256 + 40705 = 40961
         "prompt 256 + completion 40705 = 40961 tokens > 40960"),
        (["--completion-len", "40705"], "lower --prompt-len, --completion-len"),
        (["trainer=sft", "train.max_len=40961"],
         "prompt 0 + completion 40961 = 40961 tokens > 40960 (max_position_embeddings of "
         "qwen3-0.6b); lower train.max_len"),
    ],
)  # fmt: skip
def test_a_sequence_longer_than_the_model_context_is_refused(argv, line, capsys):
    # Before: "fits" (positions past max_position_embeddings were planned as if they existed).
    assert main(["plan", "--model", "qwen3-0.6b", "--gpu-memory", "80", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: does not fit the model's context: ") and err.count("\n") == 1
    assert line in err, err


def test_a_sequence_at_the_model_context_is_planned(tmp_path, capsys):
    # 40704 + 256 = 40960 = max_position_embeddings of Qwen3 (its config.json): allowed.
    assert main(["plan", "--model", "qwen3-0.6b", "--gpu-memory", "80", "--json",
                 "rollout.max_new_tokens=40704", "train.micro_batch_size=1"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["inputs"]["completion_len"] == 40704
    # a local config.json's max_position_embeddings is the limit
    cfg = dict(model_type="llama", hidden_size=8, num_hidden_layers=2, intermediate_size=16,
               num_attention_heads=2, vocab_size=10, max_position_embeddings=64)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve_shape(str(tmp_path)).max_position_embeddings == 64
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "1", "trainer=sft",
                 "train.max_len=65"]) == 2  # fmt: skip
    assert "65 tokens > 64 (max_position_embeddings of " in capsys.readouterr().err


def _needs_torchao() -> None:
    """Skip without torchao (the lowmem extra); fail instead under RLHFLAB_REQUIRE_TORCHAO=1
    (CI's lowmem step)."""
    import importlib.util
    import os

    if importlib.util.find_spec("torchao") is None:
        if os.environ.get("RLHFLAB_REQUIRE_TORCHAO"):
            pytest.fail("RLHFLAB_REQUIRE_TORCHAO is set but torchao is not installed")
        pytest.skip("needs torchao (the lowmem extra)")


def test_qwen3_8b_full_grpo_with_reference_fits_4x48gb_without_offload_with_bf16_adamw():
    """Issue #41's plan line: bf16 weights and gradients, torchao's bf16 AdamW (m and v bf16,
    stochastic rounding), FSDP2 over 4 ranks, 1,024 new tokens, micro-batch 2, a KL reference:
    2 + 2 + 4 bytes per parameter and the bf16 reference (2), each over 4 ranks."""
    over = [
        "rollout.max_new_tokens=1024", "train.micro_batch_size=2", "kl.coef=0.04",
        "parallel.strategy=fsdp2", "model.gradient_checkpointing=true",
        "model.dtype=bfloat16", "optim.name=adamw_bf16",
    ]  # fmt: skip
    _needs_torchao()  # the config refuses optim.name adamw_bf16 without it
    r = plan("qwen3-8b", overrides=over, gpus=4, gpu_memory_gib=48, config=GRPO, prompt_len=256)
    P = BUILTIN_SHAPES["qwen3-8b"].params()
    c = r["components"]
    assert c["parameters"] * GIB == pytest.approx(2 * P / 4, rel=1e-12)
    assert c["gradients"] * GIB == pytest.approx(2 * P / 4, rel=1e-12)
    assert c["optimizer_state"] * GIB == pytest.approx(4 * P / 4, rel=1e-12)
    assert c["reference"] * GIB == pytest.approx(2 * P / 4, rel=1e-12)
    assert r["fits"] and r["load_fits"] and r["host_gib"] == 0


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "adamw_bf16"])
def test_optimizer_state_term_against_bytes_measured_on_cpu(name, tmp_path, tiny_tokenizer):
    """The planner's optimizer-state term for a built model's shape (base: 256 hidden, where
    nearly every value sits in a matrix of 4096 values or more) against the bytes the
    optimizer's state tensors hold after one step of that model (CPU): within 5%."""
    torch = pytest.importorskip("torch")
    if name != "adamw":
        _needs_torchao()
    from rlhflab import optimizers
    from rlhflab.models.build import build_model

    model = build_model(tiny_tokenizer, size="base", max_position_embeddings=64)
    dtype = "bfloat16" if name == "adamw_bf16" else "float32"
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(tmp_path)
    shape = resolve_shape(str(tmp_path))
    opt = optimizers.build(name, list(model.parameters()), lr=1e-3, betas=(0.9, 0.999),
                           eps=1e-8, weight_decay=0.0)  # fmt: skip
    ids = torch.randint(0, 300, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    measured = optimizers.measured_state_bytes(opt)
    planned = estimate(shape, PlanInputs(trainer="sft", model_dtype=dtype, optimizer=name,
                                         autocast=False))["components"]["optimizer_state"]  # fmt: skip
    assert planned * GIB == pytest.approx(measured, rel=0.05)


def test_a_token_budget_is_judged_at_the_full_length_rows_it_holds():
    # 256 + 512 = 768 tokens a row: a budget of 3,000 tokens holds 3 rows; 700 holds none, and a
    # row longer than the budget goes alone (1)
    kw = dict(gpus=1, gpu_memory_gib=48, config=GRPO, prompt_len=256, suggest=False)
    over = ["rollout.max_new_tokens=512"]
    for budget, rows in ((3000, 3), (700, 1)):
        r = plan("qwen3-0.6b", overrides=[*over, f"train.max_tokens_per_micro_batch={budget}"],
                 **kw)  # fmt: skip
        at = plan("qwen3-0.6b", overrides=[*over, f"train.micro_batch_size={rows}"], **kw)
        assert r["inputs"]["micro_batch"] == rows and r["token_budget"] == budget
        assert not r["micro_batch_searched"] and r["per_gpu_gib"] == at["per_gpu_gib"]
        from rlhflab.plan.report import micro_batch_line

        assert f"train.max_tokens_per_micro_batch={budget} holds" in micro_batch_line(r)


def test_a_budget_that_does_not_fit_is_replaced_by_a_micro_batch_that_does():
    over = ["rollout.max_new_tokens=1024", "train.max_tokens_per_micro_batch=2560"]
    r = plan("qwen3-8b", gpus=4, gpu_memory_gib=48, prompt_len=256, overrides=over)
    assert not r["fits"] and r["inputs"]["micro_batch"] == 2  # 2,560 // 1,280
    first = r["suggestions"]["each"][0]
    assert first["change"] == "micro-batch"
    assert first["overrides"][0] == "train.max_tokens_per_micro_batch=null"
    again = plan("qwen3-8b", gpus=4, gpu_memory_gib=48, prompt_len=256, suggest=False,
                 overrides=[*over, *first["overrides"]])  # fmt: skip
    assert again["token_budget"] is None and again["per_gpu_gib"] == first["per_gpu_gib"]


def test_half_weights_rollout_is_a_bf16_copy_not_the_gathered_policy():
    # Qwen3-8B GRPO + KL on 4× 48 GB, fsdp2, fp32 weights with bf16 autocast: the rollout phase
    # holds the gathered fp32 policy and autocast's bf16 weight copies; with rollout.half_weights
    # the engine's bf16 copy (2 bytes × P) and one full fp32 tensor while it is filled (the
    # largest: the embedding, V × H) instead.
    over = ["kl.coef=0.04", "parallel.strategy=fsdp2", "precision.autocast=bf16",
            "model.gradient_checkpointing=true", "rollout.max_new_tokens=1024",
            "train.micro_batch_size=2"]  # fmt: skip
    kw = dict(gpus=4, gpu_memory_gib=48, config=GRPO, suggest=False)
    gathered = plan("qwen3-8b", overrides=over, **kw)
    half = plan("qwen3-8b", overrides=[*over, "rollout.half_weights=true"], **kw)
    s = BUILTIN_SHAPES["qwen3-8b"]
    P, big = s.params(), s.vocab_size * s.hidden_size
    assert half["components"]["rollout_half_copy"] == pytest.approx((2 * P + 4 * big) / GIB)
    assert gathered["components"]["fsdp_gathered_model"] == pytest.approx(4 * P / GIB)
    assert half["components"]["fsdp_gathered_model"] == 0.0
    delta = (2 * P + 4 * big - 4 * P - 2 * s.linear_params()) / GIB
    assert half["phases"]["rollout"] - gathered["phases"]["rollout"] == pytest.approx(delta)
    # the scoring passes (old and reference log-probs) never gather a model whole
    assert gathered["phases"]["scoring"] < 4 * P / GIB
