"""The sharded checkpoint files (`rlhflab.checkpoint.sharded`) in one process: the index records
each piece's global box, and a read of any box takes from each file exactly the overlapping
slice — checked against values written down by hand. The 2-rank saves and resumes at another
world size are in tests/distributed/test_sharded_checkpoint.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rlhflab.checkpoint.sharded import (
    TensorReader,
    check_shard_files,
    index_name,
    load_module,
    merge_index,
    module_pieces,
    optimizer_pieces,
    optimizer_tensors,
    read_tensors,
    shard_file_name,
    write_rank_file,
)
from rlhflab.errors import CheckpointError

# A 5 x 3 tensor w[i, j] = 3 i + j split as FSDP2 splits dim 0 over 2 ranks (c = ceil(5/2) = 3):
# rank 0 rows 0..2, rank 1 rows 3..4; a 1 x 2 tensor b, all on rank 0 (rank 1's shard is empty);
# a scalar s, rank 0's.
W = torch.arange(15, dtype=torch.float64).reshape(5, 3)
B = torch.tensor([[7.0, 9.0]], dtype=torch.float64)
S = torch.tensor(4.0)


def _write_two_ranks(path):
    """The files two ranks write for W, B, S; returns the index."""
    rank0 = {"w": (W[0:3], (5, 3), (0, 0)), "b": (B, (1, 2), (0, 0)), "s": (S, (), ())}
    rank1 = {"w": (W[3:5], (5, 3), (3, 0)), "b": (B[1:1], (1, 2), (1, 0)), "s": None}
    parts = [
        write_rank_file(path / shard_file_name("opt", r, 2), pieces)
        for r, pieces in enumerate([rank0, rank1])
    ]
    index = merge_index("opt", 2, parts)
    (path / index_name("opt")).write_text(json.dumps(index))
    return index


def test_index_records_each_piece_box(tmp_path):
    index = _write_two_ranks(tmp_path)
    assert shard_file_name("opt", 1, 2) == "opt-rank00001-of-00002.safetensors"
    assert index["files"] == [
        "opt-rank00000-of-00002.safetensors",
        "opt-rank00001-of-00002.safetensors",
    ]
    w = index["tensors"]["w"]
    assert (w["shape"], w["dtype"]) == ([5, 3], "float64")
    assert w["shards"] == [
        {"file": "opt-rank00000-of-00002.safetensors", "offsets": [0, 0], "lengths": [3, 3]},
        {"file": "opt-rank00001-of-00002.safetensors", "offsets": [3, 0], "lengths": [2, 3]},
    ]
    # the empty shard and the replicated scalar are written once, by rank 0
    assert [s["file"] for s in index["tensors"]["b"]["shards"]] == [index["files"][0]]
    assert index["tensors"]["s"] == {
        "shape": [],
        "dtype": "float32",
        "shards": [{"file": index["files"][0], "offsets": [], "lengths": []}],
    }


def test_read_takes_the_overlapping_slices(tmp_path):
    _write_two_ranks(tmp_path)
    with TensorReader(tmp_path, "opt") as r:
        assert r.sharded and r.names() == ["b", "s", "w"]
        # rows 2..3, columns 1..2: row 2 from rank 0's file, row 3 from rank 1's
        # w[2, 1:3] = (7, 8), w[3, 1:3] = (10, 11)
        box = r.read("w", [2, 1], [2, 2])
        assert box.dtype == torch.float64
        assert box.tolist() == [[7.0, 8.0], [10.0, 11.0]]
        assert r.read("w").tolist() == W.tolist()
        assert r.read("s").item() == 4.0 and r.read("s").shape == ()
        assert r.read("b", [0, 1], [1, 1]).tolist() == [[9.0]]
        assert r.read("w", [5, 0], [0, 3]).shape == (0, 3)  # an empty shard reads nothing
    with TensorReader(tmp_path, "opt") as r:  # rank 1's rows of a 2-rank layout: one file opened
        assert r.read("w", [3, 0], [2, 3]).tolist() == [[9.0, 10.0, 11.0], [12.0, 13.0, 14.0]]
        assert list(r._handles) == ["opt-rank00001-of-00002.safetensors"]
    with pytest.raises(ValueError, match="outside"):
        TensorReader(tmp_path, "opt").read("w", [4, 0], [2, 3])


def test_a_full_file_reads_the_same_way(tmp_path):
    """A checkpoint written by one process (`<name>.safetensors`) through the same reader."""
    save_file({"w": W, "s": S}, str(tmp_path / "opt.safetensors"))
    with TensorReader(tmp_path, "opt") as r:
        assert not r.sharded and r.shape("w") == (5, 3) and r.dtype("w") == torch.float64
        assert r.read("w", [3, 0], [2, 3]).tolist() == [[9.0, 10.0, 11.0], [12.0, 13.0, 14.0]]
    assert read_tensors(tmp_path, "opt")["s"].item() == 4.0
    with pytest.raises(CheckpointError, match=r"missing file model\.safetensors"):
        TensorReader(tmp_path, "model")


def test_pieces_that_do_not_tile_the_tensor_are_refused(tmp_path):
    part = write_rank_file(tmp_path / "x.safetensors", {"w": (W[0:3], (5, 3), (0, 0))})
    with pytest.raises(ValueError, match="w: pieces hold 9 of 15 elements"):
        merge_index("opt", 1, [part])
    with pytest.raises(ValueError, match="outside shape"):
        write_rank_file(tmp_path / "y.safetensors", {"w": (W[0:3], (5, 3), (3, 0))})


def test_a_hole_in_the_index_is_a_checkpoint_error(tmp_path):
    index = _write_two_ranks(tmp_path)
    index["tensors"]["w"]["shards"].pop()  # rank 1's rows listed nowhere
    (tmp_path / index_name("opt")).write_text(json.dumps(index))
    with TensorReader(tmp_path, "opt") as r:
        assert r.read("w", [0, 0], [3, 3]).tolist() == W[0:3].tolist()
        # rows 2..4 x 3 columns = 9 elements, of which rank 0's file holds row 2: 3
        with pytest.raises(CheckpointError, match="tensor w: its pieces cover 3 of the 9"):
            r.read("w", [2, 0], [3, 3])


@pytest.mark.parametrize(
    "text", ["{not json", '{"format": "rlhflab.sharded", "version": 1}', '{"format": "x"}']
)
def test_a_malformed_index_is_one_line_naming_the_file(tmp_path, text):
    (tmp_path / index_name("model")).write_text(text)
    with pytest.raises(CheckpointError, match=r"model\.shards\.json unreadable") as err:
        TensorReader(tmp_path, "model")
    assert "\n" not in str(err.value)


class _Tied(torch.nn.Module):
    """Embedding tied to the output layer, a buffer, an untied linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3, dtype=torch.float64)
        self.proj = torch.nn.Linear(3, 3, dtype=torch.float64)
        self.head = torch.nn.Linear(3, 5, bias=False, dtype=torch.float64)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([2.0, 3.0], dtype=torch.float64))


def test_module_and_optimizer_round_trip_in_one_process(tmp_path):
    """One process (world size 1): the pieces are whole tensors; a tied pair is saved once and
    fills both names on load; AdamW's state comes back equal."""
    torch.manual_seed(0)
    src = _Tied()
    opt = torch.optim.AdamW(src.parameters(), lr=0.1)
    src.proj(src.embed(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    for name, pieces in [("model", module_pieces(src)), ("optimizer", optimizer_pieces(opt)[0])]:
        part = write_rank_file(tmp_path / shard_file_name(name, 0, 1), pieces)
        (tmp_path / index_name(name)).write_text(json.dumps(merge_index(name, 1, [part])))
    saved = read_tensors(tmp_path, "model")
    assert sorted(saved) == ["embed.weight", "proj.bias", "proj.weight", "scale"]

    torch.manual_seed(1)
    dst = _Tied()
    with TensorReader(tmp_path, "model") as r:
        load_module(dst, r)
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k
    assert dst.head.weight is dst.embed.weight

    opt2 = torch.optim.AdamW(dst.parameters(), lr=0.1)
    with TensorReader(tmp_path, "optimizer") as r:
        tensors = optimizer_tensors(opt2, r)
    assert sorted(tensors) == sorted(
        f"{i}.{k}" for i in range(3) for k in ("exp_avg", "exp_avg_sq", "step")
    )
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(tensors[f"{i}.{k}"], v), (i, k)

    dst.extra = torch.nn.Linear(1, 1)
    with (
        TensorReader(tmp_path, "model") as r,
        pytest.raises(KeyError, match=r"missing tensor extra\.weight"),
    ):
        load_module(dst, r)
    fewer = _Tied()
    del fewer._buffers["scale"]
    with TensorReader(tmp_path, "model") as r, pytest.raises(KeyError, match=r"unexpected.*scale"):
        load_module(fewer, r)
    other = torch.nn.Module()
    other.proj = torch.nn.Linear(4, 3, dtype=torch.float64)
    with TensorReader(tmp_path, "model") as r, pytest.raises(ValueError, match="saved shape"):
        load_module(other, r)


def _listed(path):
    return {p.name for p in path.iterdir()}


def test_shard_headers_match_the_index(tmp_path):
    _write_two_ranks(tmp_path)
    check_shard_files(tmp_path, index_name("opt"), _listed(tmp_path))  # as written: no error


@pytest.mark.parametrize(
    "rank1, message",
    [
        # rank 1's rows of a 7 x 3 w (another model's shape): 3 rows where the index says 2
        (
            {"w": (torch.zeros(3, 3, dtype=torch.float64), (7, 3), (4, 0))},
            r"holds w as \[3, 3\] F64, opt\.shards\.json says \[2, 3\] float64: a file of another",
        ),
        ({"w": (W[3:5].float(), (5, 3), (3, 0))}, r"holds w as \[2, 3\] F32, .* \[2, 3\] float64"),
        ({"w": (W[3:5], (5, 3), (3, 0)), "v": (B, (1, 2), (0, 0))}, r"holds \['v'\] that the"),
        ({}, r"lacks \['w'\] that the index places there"),
    ],
)
def test_a_shard_file_unlike_its_index_is_refused_naming_it(tmp_path, rank1, message):
    """A rank file rewritten after the index (another model's shard, another dtype, a tensor
    more or less): its header is compared with the index before anything is read."""
    _write_two_ranks(tmp_path)
    fname = shard_file_name("opt", 1, 2)
    write_rank_file(tmp_path / fname, rank1)
    with pytest.raises(CheckpointError, match=rf"checkpoint {tmp_path}: file {fname} {message}"):
        check_shard_files(tmp_path, index_name("opt"), _listed(tmp_path))


def test_an_index_naming_an_unlisted_file_is_refused(tmp_path):
    _write_two_ranks(tmp_path)
    listed = _listed(tmp_path) - {shard_file_name("opt", 1, 2)}
    with pytest.raises(CheckpointError, match="which the manifest does not list"):
        check_shard_files(tmp_path, index_name("opt"), listed)
