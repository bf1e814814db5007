"""The streamed Hugging Face export (rlhflab.models.export, issue #25): its files load with
safetensors / from_pretrained and hold exactly the model's tensors, in one file or in several
shards with an index, for tied and untied models; the same layout as `save_pretrained`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlhflab.errors import ModelError
from rlhflab.models.build import build_model, save_pretrained
from rlhflab.models.export import (
    INDEX_NAME,
    export_names,
    save_pretrained_streamed,
    shard_files,
    write_safetensors_streamed,
)


def _model(tok, tied: bool):
    model = build_model(
        tok, size="tiny", max_position_embeddings=64, seed=3, tie_word_embeddings=tied
    )
    return model.to(torch.float64)


def _read_dir(d) -> dict[str, torch.Tensor]:
    index = d / INDEX_NAME
    if not index.exists():
        return load_file(d / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    out = {}
    for f in sorted(set(weight_map.values())):
        part = load_file(d / f)
        assert {k for k, v in weight_map.items() if v == f} == set(part), f
        out.update(part)
    return out


@pytest.mark.parametrize("loaded", [False, True])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("max_shard_size", [None, 20_000])
def test_streamed_export_equals_save_pretrained(
    tmp_path, tiny_tokenizer, tied, max_shard_size, loaded
):
    """Also for a model loaded with from_pretrained, whose saved order (and so the shards) is
    the sorted names, not its state_dict order."""
    from transformers import AutoModelForCausalLM

    model = _model(tiny_tokenizer, tied)
    if loaded:
        model.save_pretrained(tmp_path / "base")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float64)
    assert export_names(model) is not None
    ref, out = tmp_path / "ref", tmp_path / "out"
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    save_pretrained(model, tiny_tokenizer, ref)  # today's export
    if max_shard_size is not None:  # transformers' own layout at the same shard size
        (ref / "model.safetensors").unlink()
        model.save_pretrained(ref, max_shard_size=max_shard_size)
    out.mkdir()
    save_pretrained_streamed(model, tiny_tokenizer, out, **kw)

    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    if max_shard_size is None:
        assert shards == ["model.safetensors"]
    else:
        assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        index, ref_index = (json.loads((d / INDEX_NAME).read_text()) for d in (out, ref))
        assert index == ref_index  # weight_map, total_size, total_parameters
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text()) == json.loads((ref / name).read_text())

    sd = {k: v for k, v in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight")  # save_pretrained keeps the input embedding's name
    got = _read_dir(out)
    assert list(got) and set(got) == set(sd) == set(_read_dir(ref))
    for k, v in sd.items():
        assert got[k].dtype == v.dtype == torch.float64 and torch.equal(got[k], v), k

    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tied


def test_header_and_bytes_of_every_dtype_read_back(tmp_path):
    """Offsets computed from the shapes before any byte is written: safe_open reads each
    tensor back bit for bit, empty and 0-d tensors and a tensor larger than the shard limit
    (alone in its shard) included."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "b": torch.randn(7, generator=g).to(torch.bfloat16),
        "c": torch.randint(-9, 9, (2, 2, 3), generator=g),
        "d": torch.tensor(True),
        "e": torch.empty(0, 4),
        "f": torch.randn(40, generator=g),  # 160 bytes > the limit
        "g": torch.arange(6, dtype=torch.int8).reshape(2, 3).t().contiguous(),
        "h": torch.randn(3, generator=g).to(torch.float16),
    }
    specs = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    files = write_safetensors_streamed(tmp_path, specs, iter(tensors.items()), max_shard_size=100)
    assert files == shard_files(specs, 100) and len(files) > 1
    assert any(names == ["f"] for names in files.values())
    for f, names in files.items():
        with safe_open(str(tmp_path / f), framework="pt") as fh:
            assert sorted(fh.keys()) == sorted(names)
            assert fh.metadata() == {"format": "pt"}
            for k in names:
                t = fh.get_tensor(k)
                assert t.dtype == tensors[k].dtype and torch.equal(t, tensors[k]), k


def test_out_of_order_or_wrong_shape_is_one_error_and_the_stream_is_drained(tmp_path):
    specs = {"a": ((2,), torch.float32), "b": ((3,), torch.float32)}
    seen = []

    def stream(items):
        for k, v in items:
            seen.append(k)
            yield k, v

    with pytest.raises(ModelError, match=r"tensor a is .* expected"):
        write_safetensors_streamed(
            tmp_path, specs, stream([("a", torch.zeros(5)), ("b", torch.zeros(3))])
        )
    assert seen == ["a", "b"]  # other ranks' gathers still complete
    with pytest.raises(ModelError, match="got tensor b, expected a"):
        write_safetensors_streamed(tmp_path, specs, stream([("b", torch.zeros(3))]))
    with pytest.raises(ModelError, match="tensor b never came"):
        write_safetensors_streamed(tmp_path, specs, stream([("a", torch.zeros(2))]))


def test_final_model_is_renamed_into_place_only_when_complete(tmp_path, tiny_tokenizer):
    """`save_final_model` writes `.model.partial` and renames it: a save that fails halfway
    leaves no `model/` (or the previous one, untouched), never a half-written directory."""
    from rlhflab.trainers.common import save_final_model

    class Broken:
        def save_pretrained(self, path):
            raise OSError("disk full")

    model = _model(tiny_tokenizer, tied=True)
    path = tmp_path / "model"
    with pytest.raises(OSError, match="disk full"):
        save_final_model(model, Broken(), path)
    assert not path.exists()
    save_final_model(model, tiny_tokenizer, path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    assert "model.safetensors" in before and not (tmp_path / ".model.partial").exists()
    with pytest.raises(OSError, match="disk full"):
        save_final_model(model, Broken(), path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    save_final_model(model, tiny_tokenizer, path)  # a later save replaces the partial one
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
