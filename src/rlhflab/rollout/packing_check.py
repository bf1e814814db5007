"""Packed = padded on this machine, for every attention implementation it has.

The test suite checks the packed layouts on CPU with `sdpa` and `eager`; the flash kernels run
only on CUDA, so they are checked where they run: by `rlhflab doctor`'s `packing` row and by
`python -m bench.gpu_probe_packing`, both through `check_packing` here.

A random-init Qwen3 model (its linear weights scaled 8× so that log-probs depend on the context)
scores sequences of very different lengths (prompts of 8–64 tokens, completions of 1–256) with
`rollout.sampler.completion_logps` — the trainers' own scoring path — once in the padded layout
with `sdpa` (the reference) and, for each attention implementation, in the layout
`models.packing.layout_for` picks, both as an unsharded model and as if FSDP2-sharded (the varlen
layout through the model's own forward). Per arm: the largest |Δ log-prob| over real tokens and
the largest |Δ gradient| relative to the largest gradient of Σ logp. Then the boundary check:
changing one sequence's tokens must leave every other sequence's log-probs bit for bit unchanged
(attention that crossed a boundary would move them).

Tolerances: float64 on CPU 1e-9 (eager 1e-5: transformers' eager softmax is float32); float32 on
CUDA 1e-3 nats and 1e-3 relative; bf16 autocast 0.25 nats and 5e-2 relative.
"""

from __future__ import annotations

import contextlib
import random

import torch

#: (log-prob tolerance in nats, gradient tolerance relative to the largest gradient)
TOLERANCES = {
    "float64": (1e-9, 1e-9),
    "float64_eager": (1e-5, 1e-5),
    "float32": (1e-3, 1e-3),
    "bf16_autocast": (0.25, 5e-2),
}

#: A small Qwen3 shape (the doctor's); `bench.engines.QWEN3_SHAPES` has the larger ones.
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=128)  # fmt: skip


def attention_implementations(device: str) -> list[str]:
    """The attention implementations packing allows that this machine can run: `sdpa`, `eager`,
    and `flash_attention_2` on CUDA when `flash_attn` imports."""
    impls = ["sdpa", "eager"]
    if device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401

            impls.append("flash_attention_2")
        except ImportError:
            pass
    return impls


def random_rollout(rows: int, vocab: int, device: str, seed: int = 0):
    """A `Rollout` of `rows` sequences: prompts of 8–64 tokens, completions of 1, 8, 64 or 256."""
    from rlhflab.rollout.sampler import pack

    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab - 1) for _ in range(rng.randint(8, 64))] for _ in range(rows)
    ]
    comps = [[rng.randrange(3, vocab - 1) for _ in range(rng.choice([1, 8, 64, 256]))]
             for _ in range(rows)]  # fmt: skip
    return pack(prompts, comps, 0).to(device)


@contextlib.contextmanager
def _layout(padded: bool, sharded: bool):
    """Within: `completion_logps` scores in the padded layout (`padded`), and treats the model as
    FSDP2-sharded (`sharded`); the layouts it chose are collected in the yielded list."""
    import rlhflab.rollout.sampler as sampler
    from rlhflab import distributed

    real_layout, real_sharded = sampler.layout_for, distributed.is_sharded
    chosen: list[str] = []

    def layout_for(m, r, *, sharded):
        lay = None if padded else real_layout(m, r, sharded=sharded)
        chosen.append("padded" if lay is None else "tree" if lay.attention_mask is not None
                      else f"varlen x{lay.input_ids.size(0)}")  # fmt: skip
        return lay

    sampler.layout_for = layout_for
    if sharded:
        distributed.is_sharded = lambda m: True
    try:
        yield chosen
    finally:
        sampler.layout_for, distributed.is_sharded = real_layout, real_sharded


def _score(model, ro, *, padded: bool, sharded: bool, autocast_dtype):
    """(log-probs (B, T) float64, flat float64 gradient of Σ logp over real tokens, layouts)."""
    from rlhflab.rollout import sampler

    with _layout(padded, sharded) as chosen:
        model.zero_grad()
        lp, _ = sampler.completion_logps(model, ro, autocast_dtype=autocast_dtype)
        (lp.float() * ro.mask).sum().backward()
    grad = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return lp.detach().double(), grad, chosen


def check_packing(model, ro, *, impls: list[str], precisions: list[tuple[str, object]]) -> dict:
    """Every arm of the check on `model` (a Qwen3ForCausalLM, weights in float64 on CPU or
    float32 on CUDA) and rollout `ro`. `precisions`: [(name in TOLERANCES, autocast dtype or
    None)]. Returns {"arms": [{precision, attn, sharded, layout, max_dlogp, max_dgrad_rel, ok},
    {"check": "boundaries", attn, layout, ok}], "logp_spread", "real_tokens", "grid", "ok"}.
    The model's `config._attn_implementation` is restored afterwards."""
    cfg = model.config
    saved = cfg._attn_implementation
    real = ro.mask > 0
    out = {"arms": [], "logp_spread": None, "grid": ro.input_ids.numel(),
           "real_tokens": int(ro.prompt_mask.sum() + ro.mask.sum())}  # fmt: skip
    try:
        for pname, ac in precisions:
            cfg._attn_implementation = "sdpa"
            ref_lp, ref_g, _ = _score(model, ro, padded=True, sharded=False, autocast_dtype=ac)
            g_max = ref_g.abs().max().item()
            out["logp_spread"] = out["logp_spread"] or ref_lp[real].std().item()
            for impl in impls:
                cfg._attn_implementation = impl
                key = (
                    f"{pname}_eager"
                    if impl == "eager" and f"{pname}_eager" in TOLERANCES
                    else pname
                )
                tol_lp, tol_g = TOLERANCES[key]
                for sharded in (False, True):
                    lp, g, chosen = _score(
                        model, ro, padded=False, sharded=sharded, autocast_dtype=ac
                    )
                    d_lp = (lp - ref_lp)[real].abs().max().item()
                    d_g = (g - ref_g).abs().max().item() / g_max
                    out["arms"].append({"precision": pname, "attn": impl, "sharded": sharded,
                                        "layout": chosen, "max_dlogp": d_lp,
                                        "max_dgrad_rel": d_g,
                                        "ok": d_lp <= tol_lp and d_g <= tol_g})  # fmt: skip
        # boundaries: another first sequence leaves every other sequence's log-probs as they were
        vocab = cfg.vocab_size
        other = ro.completion_ids.clone()
        other[0] = (other[0] + 1) % (vocab - 4) + 3
        ro2 = type(ro)(ro.prompt_ids, ro.prompt_mask, other, ro.mask, ro.logp, ro.truncated)
        for impl in impls:
            cfg._attn_implementation = impl
            a, _, chosen = _score(model, ro, padded=False, sharded=True, autocast_dtype=None)
            b, _, _ = _score(model, ro2, padded=False, sharded=True, autocast_dtype=None)
            out["arms"].append({"check": "boundaries", "attn": impl, "layout": chosen,
                                "ok": torch.equal(a[1:], b[1:])})  # fmt: skip
    finally:
        cfg._attn_implementation = saved
    out["ok"] = all(a["ok"] for a in out["arms"])
    return out


def tiny_model(device: str, vocab: int = 512):
    """The check's random-init Qwen3 of `TINY_SHAPE` (float64 on CPU, float32 on CUDA), its
    linear weights scaled 8× (at the init's scale log-probs sit within rounding of −log V)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dtype = torch.float64 if device == "cpu" else torch.float32
    cfg = Qwen3Config(**TINY_SHAPE, vocab_size=vocab, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=vocab - 1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device=device, dtype=dtype).train()
    scale_weights(model)
    return model


def scale_weights(model, factor: float = 8.0) -> None:
    """Multiply every matrix weight by `factor` in place (log-probs that depend on the context)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(factor)


def precisions_for(device: str) -> list[tuple[str, object]]:
    """float64 on CPU; float32 and bf16 autocast on CUDA."""
    if device == "cpu":
        return [("float64", None)]
    return [("float32", None), ("bf16_autocast", torch.bfloat16)]
