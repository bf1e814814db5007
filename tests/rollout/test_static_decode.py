"""The "static" decode loop (`sample(decode="static")`: static KV cache, stop checks on the
device, host checks every `sync_every` tokens, compaction of finished rows) gives the eager loop's
completions: the same tokens, masks and truncation flags, and log-probs equal to float64 rounding
(the attention sums run over a wider, masked key range). Compared in float64 (`tiny_model64`),
where an argmax flip between the two loops would need logits equal to ~1e-13. The CUDA-graph
capture of the step runs only on CUDA and is not exercised here."""

import pytest
import torch

from rlhflab.rollout.engines.hf import HFEngine
from rlhflab.rollout.sampler import _StaticDecoder, sample

PROMPTS = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33, 34]]
GROUPS = [p for p in PROMPTS for _ in range(3)]  # repeated prompts: prefix sharing on


def _pair(model, tok, prompts, sync_every, **kw):
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("eos_token_id", tok.eos_token_id)
    kw["pad_token_id"] = tok.pad_token_id
    eager = sample(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
    static = sample(model, prompts, generator=torch.Generator().manual_seed(3), decode="static",
                    sync_every=sync_every, **kw)  # fmt: skip
    return eager, static


def _same(eager, static):
    assert torch.equal(static.completion_ids, eager.completion_ids)
    assert torch.equal(static.mask, eager.mask)
    assert torch.equal(static.truncated, eager.truncated)
    assert static.logp.dtype == eager.logp.dtype == torch.float64
    scale = max(eager.logp.abs().max().item(), 1.0)
    torch.testing.assert_close(static.logp, eager.logp, rtol=0, atol=1e4 * 2.0**-52 * scale)


@pytest.mark.parametrize("sync_every", [1, 3, 8])
def test_static_loop_gives_the_eager_loop_s_completions(
    tiny_model64, tiny_tokenizer, sync_every, monkeypatch
):
    tiny_model64.eval()
    compactions = []
    compact = _StaticDecoder.compact
    monkeypatch.setattr(
        _StaticDecoder, "compact",
        lambda self, keep, full: (compactions.append(keep.numel()), compact(self, keep, full)),
    )  # fmt: skip
    # the first stop id is an early, common token so that rows stop at different steps
    stops = [tiny_tokenizer.eos_token_id, *range(5, 40)]
    for kw in ({"temperature": 0.9}, {"greedy": True}, {"top_k": 20, "top_p": 0.9, "min_p": 0.01}):
        eager, static = _pair(tiny_model64, tiny_tokenizer, GROUPS, sync_every,
                              stop_token_ids=stops, **kw)  # fmt: skip
        _same(eager, static)
    lengths = eager.mask.sum(1)
    assert len(set(lengths.tolist())) > 2  # stops at different steps
    assert compactions  # finished rows were dropped at a host check
    # a data-parallel share (rows 2..3 of 4, at the global width) and no prefix sharing
    width = max(len(p) for p in PROMPTS)
    kw = dict(rows=[2, 3], n_rows=4, width=width, stop_token_ids=stops)
    _same(*_pair(tiny_model64, tiny_tokenizer, PROMPTS[2:], sync_every, **kw))
    _same(*_pair(tiny_model64, tiny_tokenizer, GROUPS, sync_every, share_prefix=False))


def test_static_loop_without_stops_and_one_token(tiny_model64, tiny_tokenizer):
    tiny_model64.eval()
    _same(*_pair(tiny_model64, tiny_tokenizer, PROMPTS, 4, eos_token_id=-1))  # never stops
    _same(*_pair(tiny_model64, tiny_tokenizer, PROMPTS, 4, max_new_tokens=1))


def test_engine_passes_the_decode_path_and_refuses_bad_values(tiny_model64, tiny_tokenizer):
    from rlhflab.rollout.engines import SamplingParams

    tiny_model64.eval()
    kw = dict(
        pad_token_id=tiny_tokenizer.pad_token_id, stop_token_ids=(tiny_tokenizer.eos_token_id,)
    )
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.8)
    out = {
        d: HFEngine(tiny_model64, decode=d, sync_every=2, **kw).generate(
            PROMPTS, params, generator=torch.Generator().manual_seed(1)
        )
        for d in ("eager", "static")
    }
    _same(out["eager"], out["static"])
    with pytest.raises(ValueError, match="decode must be one of"):
        HFEngine(tiny_model64, decode="graph", **kw)
    with pytest.raises(ValueError, match="sync_every"):
        HFEngine(tiny_model64, sync_every=0, **kw)
    with pytest.raises(ValueError, match="decode must be one of"):
        sample(tiny_model64, PROMPTS, max_new_tokens=2, eos_token_id=0, pad_token_id=0,
               decode="fast")  # fmt: skip


@pytest.mark.slow
def test_grpo_with_the_static_loop_trains_as_with_the_eager_loop(tmp_path, caplog):
    """`rollout.decode: static` through the trainer (config → make_engine → sample), in float64:
    3 GRPO steps give the eager loop's per-step metrics (rewards, lengths, losses, gradient
    norms) to float64 rounding."""
    import json
    from pathlib import Path

    from factories import tiny_pg, tiny_sft

    from rlhflab.config import config_from_dict
    from rlhflab.trainers import run_config

    sft = tiny_sft(tmp_path / "sft", train={"steps": 4, "batch_size": 8, "micro_batch_size": 8,
                                            "max_len": 48})  # fmt: skip
    model_dir = run_config(config_from_dict(sft))["model_dir"]
    rows = {}
    caplog.set_level("INFO", logger="rlhflab.rollout.sampler")
    for decode in ("eager", "static"):
        raw = tiny_pg(tmp_path / decode, model_dir, train={"steps": 3, "micro_batch_size": 16})
        raw["model"]["dtype"] = "float64"
        raw["rollout"].update(decode=decode, max_new_tokens=8)
        if decode == "static":  # sync_every is read by the static loop only (refused with eager)
            raw["rollout"]["sync_every"] = 2
        res = run_config(config_from_dict(raw))
        lines = Path(res["run_dir"], "metrics.jsonl").read_text().splitlines()
        rows[decode] = [json.loads(r) for r in lines]
    assert "static decode, eager step" in caplog.text  # the static loop ran (no CUDA here)
    assert len(rows["eager"]) == len(rows["static"]) >= 3
    for e, s in zip(rows["eager"], rows["static"], strict=True):
        keys = [k for k, v in e.items() if isinstance(v, float) and not k.startswith("perf/")
                and "time" not in k]  # fmt: skip
        assert any(k.startswith("rollout/") for k in keys)
        for k in keys:
            assert s[k] == pytest.approx(e[k], rel=1e-9, abs=1e-12), k


def test_a_model_without_a_static_cache_is_refused_in_one_line(tiny_tokenizer):
    """rlhflab's own `gpt` architecture computes its mask from the cached length and cannot take
    transformers' StaticCache: refused before any forward, naming the fix."""
    from types import SimpleNamespace

    from rlhflab.errors import ConfigError
    from rlhflab.models.build import build_model
    from rlhflab.rollout.engines import make_engine

    gpt = build_model(tiny_tokenizer, size="tiny", arch="gpt", max_position_embeddings=64).eval()
    with pytest.raises(ValueError, match="decode='static' needs a model that takes"):
        sample(gpt, PROMPTS, max_new_tokens=2, eos_token_id=0, pad_token_id=0, decode="static")
    cfg = SimpleNamespace(engine="hf", stop_token_ids=(), decode="static")
    with pytest.raises(ConfigError, match=r"use rollout\.decode=eager"):
        make_engine(cfg, gpt, tiny_tokenizer)
