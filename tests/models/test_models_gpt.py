"""The from-scratch GPT (rlhflab.models.gpt): logits against a naive explicit-loop reference,
save/load round trip, KV-cache decoding against full recomputation, and the sampler / trainer
log-probs (padded and packed) agreeing on it."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from rlhflab.models.build import build_model
from rlhflab.models.gpt import GPTConfig, GPTForCausalLM
from rlhflab.rollout.packing import can_pack
from rlhflab.rollout.sampler import completion_logps, sample

CFG = dict(vocab_size=61, max_position_embeddings=32, hidden_size=48, num_hidden_layers=3,
           num_attention_heads=4)  # fmt: skip


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPTForCausalLM(GPTConfig(**{**CFG, **kw})).eval()


def _close(a, b):
    """Equal to float64 rounding (1e4·eps relative to b's magnitude). Two computations of the
    same values (cache vs recomputation, sampler vs trainer, naive vs torch) are compared in
    float64: in float32 they differ by ~1e-7 relative, differently with each CPU's kernels."""
    assert a.dtype == b.dtype == torch.float64
    atol = 1e4 * torch.finfo(torch.float64).eps * max(b.abs().max().item(), 1e-30)
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def _layer_norm(x, ln):  # (C,) -> (C,): (x - mean) / sqrt(var + eps) · w + b
    mu = sum(x) / len(x)
    var = sum((v - mu) ** 2 for v in x) / len(x)
    return [(v - mu) / math.sqrt(var + ln.eps) * w + b for v, w, b in zip(x, ln.weight.tolist(), ln.bias.tolist(), strict=True)]  # fmt: skip


def _linear(x, lin):  # y_j = Σ_i x_i W_ji + b_j
    w = lin.weight.tolist()
    b = lin.bias.tolist() if lin.bias is not None else [0.0] * len(w)
    return [sum(xi * wij for xi, wij in zip(x, row, strict=True)) + bj for row, bj in zip(w, b, strict=True)]  # fmt: skip


def _gelu(v):  # exact GELU: v · Φ(v)
    return 0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0)))


@torch.no_grad()
def naive_logits(model, ids: list[int]) -> list[list[float]]:
    """GPT-2 forward in plain python floats (float64), one position and one head at a time."""
    cfg, t = model.config, model.transformer
    c, nh = cfg.hidden_size, cfg.num_attention_heads
    hd = c // nh
    x = [[a + b for a, b in zip(t.wte.weight[tok].tolist(), t.wpe.weight[i].tolist(), strict=True)]
         for i, tok in enumerate(ids)]  # fmt: skip
    for block in t.h:
        h = [_layer_norm(v, block.ln_1) for v in x]
        qkv = [_linear(v, block.attn.c_attn) for v in h]
        out = []
        for i in range(len(ids)):
            y = []
            for head in range(nh):
                sl = slice(head * hd, (head + 1) * hd)
                q = qkv[i][0:c][sl]
                scores = [
                    sum(a * b for a, b in zip(q, qkv[j][c : 2 * c][sl], strict=True))
                    / math.sqrt(hd)
                    for j in range(i + 1)
                ]  # fmt: skip  (causal: keys 0..i)
                m = max(scores)
                w = [math.exp(s - m) for s in scores]
                z = sum(w)
                y += [
                    sum(w[j] / z * qkv[j][2 * c :][sl][d] for j in range(i + 1)) for d in range(hd)
                ]
            out.append(y)
        x = [[a + b for a, b in zip(xv, _linear(yv, block.attn.c_proj), strict=True)] for xv, yv in zip(x, out, strict=True)]  # fmt: skip
        h = [_layer_norm(v, block.ln_2) for v in x]
        mlp = [_linear([_gelu(u) for u in _linear(v, block.mlp.c_fc)], block.mlp.c_proj) for v in h]
        x = [[a + b for a, b in zip(xv, mv, strict=True)] for xv, mv in zip(x, mlp, strict=True)]
    x = [_layer_norm(v, t.ln_f) for v in x]
    return [_linear(v, model.lm_head) for v in x]


def test_logits_equal_naive_reference():
    model = _model().double()
    ids = [3, 17, 5, 60, 0, 9, 9]
    got = model(torch.tensor([ids])).logits[0]
    want = torch.tensor(naive_logits(model, ids), dtype=torch.float64)
    _close(got, want)


def test_gpt2_initialisation_and_tied_head():
    model = _model(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, vocab_size=2000)
    assert model.lm_head.weight is model.transformer.wte.weight
    block = model.transformer.h[0]
    std = 0.02 / math.sqrt(2 * 8)
    assert block.attn.c_proj.weight.std().item() == pytest.approx(std, rel=0.03)
    assert block.mlp.c_proj.weight.std().item() == pytest.approx(std, rel=0.03)
    assert block.attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert block.mlp.c_fc.weight.shape == (4 * 256, 256)


def test_save_load_round_trip(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).model_type == "rlhflab_gpt"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, GPTForCausalLM)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    x = torch.randint(0, CFG["vocab_size"], (2, 9))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)


@torch.no_grad()
def test_kv_cache_decoding_equals_full_recomputation():
    """Left-padded prompts, then one token at a time through the cache: the logits of every step
    equal those of a full forward over the whole (padded) sequence."""
    model = _model().double()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8]])
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    full = model(ids, attention_mask=attn, position_ids=pos).logits  # (2, 8, V)
    p = 5  # prompt: the first 5 columns
    cache = DynamicCache(config=model.config)  # filled in place by every forward
    out = model(ids[:, :p], attention_mask=attn[:, :p], position_ids=pos[:, :p], cache=cache,
                use_cache=True)  # fmt: skip
    step_logits = [out.logits[:, -1]]
    for t in range(p, ids.size(1)):
        out = model(ids[:, t : t + 1], attention_mask=attn[:, : t + 1],
                    position_ids=pos[:, t : t + 1], cache=cache, use_cache=True)  # fmt: skip
        step_logits.append(out.logits[:, -1])
    assert cache.get_seq_length() == ids.size(1)
    _close(torch.stack(step_logits, 1), full[:, p - 1 :])


def test_sampler_and_trainer_logps_agree(tiny_tokenizer):
    """The sampler (preallocated KV cache, rows dropped as they stop) and the trainer's recomputed
    log-probs (packed, padding-free, and padded) agree on the GPT."""
    model = build_model(tiny_tokenizer, size="tiny", arch="gpt", max_position_embeddings=64)
    model = model.double()  # (its LayerNorms compute in the input's dtype)
    assert can_pack(model)
    prompts = [tiny_tokenizer.encode(q) for q in ("What is 2 + 3?", "1 + 1 =", "Add 40 and 2.")]
    g = torch.Generator().manual_seed(0)
    model.eval()
    r = sample(model, prompts * 2, max_new_tokens=8, eos_token_id=tiny_tokenizer.eos_token_id,
               pad_token_id=tiny_tokenizer.pad_token_id, generator=g)  # fmt: skip
    logp, _ = completion_logps(model, r)
    assert r.mask.sum() > 6
    _close(logp * r.mask, r.logp * r.mask)
    logits = model(r.input_ids, attention_mask=r.attention_mask).logits  # padded path by hand
    assert torch.isfinite(logits).all()


def test_sequence_classification_head_for_reward_models(tiny_tokenizer):
    from rlhflab.models.reward import reward_model_from_causal_lm

    lm = build_model(tiny_tokenizer, size="tiny", arch="gpt", max_position_embeddings=64)
    rm = reward_model_from_causal_lm(lm.double(), pad_token_id=tiny_tokenizer.pad_token_id)
    x = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    out = rm(x, attention_mask=mask).logits  # (2, 1): read at the last real token
    h = rm.transformer(x[:1, :3]).last_hidden_state[:, -1]
    _close(out[0], rm.score(h)[0])  # padded batch vs the real tokens alone


def test_gradient_checkpointing_gives_the_same_gradients():
    """`model.gradient_checkpointing: true` recomputes each Block in the backward pass."""
    a, b = _model(), _model()
    b.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert all(block.gradient_checkpointing for block in b.transformer.h)
    x = torch.randint(0, CFG["vocab_size"], (2, 10))
    for m in (a, b):
        m.train()
        m(x).logits.logsumexp(-1).sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=0)


_LOAD_IN_FRESH_PROCESS = """
import sys
{first}
from transformers import AutoModelForCausalLM
import torch
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
x = torch.load(sys.argv[2])
torch.save(model(x).logits, sys.argv[3])
print(type(model).__name__)
"""


@pytest.mark.parametrize("first", ["import rlhflab", "import transformers; import rlhflab"])
def test_saved_gpt_loads_with_plain_auto_class_after_import_rlhflab(
    tmp_path, tiny_tokenizer, first
):
    # A fresh interpreter that imports rlhflab (before or after transformers), never
    # rlhflab.models.gpt, loads a saved GPT with plain AutoModelForCausalLM.from_pretrained.
    import subprocess
    import sys

    from rlhflab.models.build import save_pretrained

    model = build_model(tiny_tokenizer, size="tiny", arch="gpt", max_position_embeddings=64).eval()
    save_pretrained(model, tiny_tokenizer, tmp_path / "model")
    x = torch.randint(0, model.config.vocab_size, (2, 7))
    torch.save(x, tmp_path / "x.pt")
    code = _LOAD_IN_FRESH_PROCESS.format(first=first)
    args = [str(tmp_path / "model"), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")]
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "GPTForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "y.pt"), model(x).logits, atol=0, rtol=0)
    # The model card says what to import.
    card = (tmp_path / "model" / "README.md").read_text()
    assert "import rlhflab" in card and "rlhflab_gpt" in card


def test_import_rlhflab_stays_light():
    # `import rlhflab` registers the GPT lazily: it imports neither torch nor transformers.
    import subprocess
    import sys

    code = "import sys, rlhflab; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
