"""Sharded checkpoint files: per-rank safetensors and a JSON index of each shard's global place.

Under `parallel.strategy: fsdp2` each rank writes only its own shards of a module (or of its
optimizer's state), and reads back only the slices its shards need:

    <name>-rank00000-of-00002.safetensors   rank 0's pieces, under the state-dict names
    <name>-rank00001-of-00002.safetensors   rank 1's pieces
    <name>.shards.json                      the index (JSON, no pickle), written by rank 0:

    {"format": "rlhflab.sharded", "version": 1, "world_size": 2,
     "run_id": "<the run's id>", "step": 12,
     "files": ["<name>-rank00000-of-00002.safetensors", ...],
     "tensors": {"<tensor>": {"shape": [5, 3], "dtype": "float64",
                              "shards": [{"file": "<name>-rank00000-of-00002.safetensors",
                                          "offsets": [0, 0], "lengths": [3, 3]}, ...]}}}

`offsets` / `lengths` are the box a file's piece covers in the global tensor, per dimension (what
torch.distributed.checkpoint records as a chunk's `offsets` / `sizes`); the pieces of a tensor tile
it exactly. A replicated tensor (a buffer, AdamW's scalar `step`) is written once, by rank 0, as
one piece covering the whole tensor. Ranks with an empty shard write no piece. Each rank file
carries the run id and step in its safetensors metadata (`rlhflab.checkpoint.format.stamp`), as
the index does; `check_shard_files` compares every file's header (tensor names, shapes, dtypes)
with the index before anything is loaded (`load_checkpoint` calls it).

    shard_file_name / index_name     the file names
    write_rank_file(path, pieces)    one rank's safetensors file; its index entries
    merge_index(name, world, parts)  the index from every rank's entries (coverage checked)
    check_shard_files(dir, index)    every file's header against the index (names, shapes, dtypes)
    TensorReader(dir, name)          reads whole tensors or boxes of them from a sharded
                                     checkpoint or from an ordinary full `<name>.safetensors`
    read_tensors(dir, name)          every tensor whole (world size 1; consolidation)
    (tied parameters, `distributed.tied_groups`, are written once, under the group's first name)
    module_pieces / optimizer_pieces this rank's pieces of a module / an optimizer's state
    load_module / optimizer_tensors  this rank's slices back into a module / optimizer state

A full file is read through the same interface (one piece per tensor covering it), so a
checkpoint written by one process restores into a sharded run and the other way round.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlhflab import distributed
from rlhflab.checkpoint.state import encode_tensors
from rlhflab.errors import CheckpointError
from rlhflab.serialize import match_umask

INDEX_FORMAT = "rlhflab.sharded"
INDEX_VERSION = 1

#: safetensors' dtype codes → torch dtypes (what a full file's header says).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPES = {str(d).removeprefix("torch."): d for d in _SAFETENSORS_DTYPES.values()}

#: A piece one rank saves: (local tensor, global shape, global offset of its first element).
Piece = tuple[torch.Tensor, Sequence[int], Sequence[int]]


def shard_file_name(name: str, rank: int, world: int) -> str:
    """The file of rank `rank` of `world`: e.g. `model-rank00001-of-00002.safetensors`."""
    return f"{name}-rank{rank:05d}-of-{world:05d}.safetensors"


def index_name(name: str) -> str:
    """The index file of the sharded tensors `name`: `<name>.shards.json`."""
    return f"{name}.shards.json"


def write_rank_file(
    path: Path, pieces: dict[str, Piece | None], metadata: dict[str, str] | None = None
) -> dict[str, dict]:
    """Write one rank's pieces to the safetensors file `path` (None entries are skipped: another
    rank saves them), with `metadata` in its header (the run id and step); returns this file's
    index entries, {tensor: {"shape", "dtype", "offsets", "lengths"}} (lists of ints; dtype as
    torch names it, e.g. "float64").

    Raises:
        ValueError: a piece does not fit inside its global shape.
    """
    tensors, entries = {}, {}
    for key, piece in pieces.items():
        if piece is None:
            continue
        local, shape, offset = piece
        shape, offset, lengths = list(shape), list(offset), list(local.shape)
        if len(shape) != len(lengths) or len(offset) != len(lengths):
            raise ValueError(f"{key}: piece of shape {lengths} in a tensor of shape {shape}")
        if any(o < 0 or o + n > s for o, n, s in zip(offset, lengths, shape, strict=True)):
            raise ValueError(f"{key}: piece {lengths} at {offset} is outside shape {shape}")
        if local.numel() == 0 and math.prod(shape) > 0:
            continue  # an empty shard (more ranks than rows)
        tensors[key] = local.detach().to("cpu").contiguous()
        entries[key] = {
            "shape": shape,
            "dtype": str(local.dtype).removeprefix("torch."),
            "offsets": offset,
            "lengths": lengths,
        }
    save_file(tensors, str(path), metadata=metadata)
    match_umask(path)  # safetensors writes 0600 whatever the umask
    return entries


def merge_index(
    name: str,
    world: int,
    parts: Sequence[dict[str, dict]],
    *,
    run_id: str | None = None,
    step: int | None = None,
) -> dict:
    """The index of `name` (the JSON object described above) from the entries
    `write_rank_file` returned on each rank, in rank order, recording the run id and step
    of the checkpoint (left out when None).

    Raises:
        ValueError: the ranks disagree on a tensor's shape or dtype, or its pieces do not
            cover it exactly (element counts differ).
    """
    files = [shard_file_name(name, r, world) for r in range(world)]
    tensors: dict[str, dict] = {}
    for fname, entries in zip(files, parts, strict=True):
        for key, e in entries.items():
            t = tensors.setdefault(key, {"shape": e["shape"], "dtype": e["dtype"], "shards": []})
            if (t["shape"], t["dtype"]) != (e["shape"], e["dtype"]):
                raise ValueError(
                    f"{key}: {fname} says shape {e['shape']} {e['dtype']}, "
                    f"another rank {t['shape']} {t['dtype']}"
                )
            t["shards"].append({"file": fname, "offsets": e["offsets"], "lengths": e["lengths"]})
    for key, t in tensors.items():
        have = sum(math.prod(s["lengths"]) for s in t["shards"])
        if have != math.prod(t["shape"]):
            raise ValueError(f"{key}: pieces hold {have} of {math.prod(t['shape'])} elements")
    index = {"format": INDEX_FORMAT, "version": INDEX_VERSION, "world_size": world}
    if run_id is not None:
        index.update(run_id=run_id, step=step)
    return {**index, "files": files, "tensors": dict(sorted(tensors.items()))}


def check_shard_files(path: Path, index_file: str, listed: set[str]) -> None:
    """Compare the index `index_file` of the checkpoint directory `path` with its files'
    safetensors headers (no tensor is read): each file it names is in the checkpoint's manifest
    (`listed`) and holds exactly the tensors the index places in it, each piece with the
    shape (`lengths`) and dtype the index records. So a file swapped in from a model of another
    shape is refused before loading, whatever the manifest says.

    Raises:
        CheckpointError: one line naming the checkpoint, the file and the first difference.
    """
    path = Path(path)
    where = f"checkpoint {path}: {index_file}"
    tensors = _parse_index(path / index_file)
    expected: dict[str, dict[str, tuple[list[int], torch.dtype]]] = {}
    for key, t in tensors.items():
        for s in t["shards"]:
            expected.setdefault(s["file"], {})[key] = (s["lengths"], t["dtype"])
    files = read_index(path / index_file)["files"]
    for fname in files:
        if fname not in listed:
            raise CheckpointError(f"{where} names file {fname}, which the manifest does not list")
        want = expected.get(fname, {})
        try:
            with safe_open(str(path / fname), framework="pt") as f:
                have = {}
                for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                    sl = f.get_slice(key)
                    have[key] = (list(sl.get_shape()), sl.get_dtype())
        except Exception as exc:  # safetensors' own error type for a malformed header
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CheckpointError(f"checkpoint {path}: file {fname} unreadable: {msg}") from None
        extra, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        if extra or missing:
            what = f"holds {extra[:3]} that the index does not place there" if extra else (
                f"lacks {missing[:3]} that the index places there")  # fmt: skip
            raise CheckpointError(f"checkpoint {path}: file {fname} {what} ({index_file})")
        for key in sorted(want):
            shape, code = have[key]
            dtype = _SAFETENSORS_DTYPES.get(code)
            if (shape, dtype) != want[key]:
                w_shape, w_dtype = want[key]
                raise CheckpointError(
                    f"checkpoint {path}: file {fname} holds {key} as {shape} {code}, "
                    f"{index_file} says {w_shape} {str(w_dtype).removeprefix('torch.')}: "
                    "a file of another model"
                )


def read_index(path: Path) -> dict:
    """The JSON object of an index file; CheckpointError naming it when it is not one."""
    try:
        index = json.loads(Path(path).read_text())
        if not isinstance(index, dict) or not isinstance(index.get("files"), list):
            raise ValueError("not an index object")
        return index
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} unreadable: {msg}") from None


class TensorReader:
    """Read tensors, or boxes of them, from a checkpoint's sharded files or its full file.

    `TensorReader(path, name)` uses `<path>/<name>.shards.json` when it exists, else
    `<path>/<name>.safetensors` (a checkpoint written by one process, by DDP ranks, or by an
    older version). Only the files holding a requested box are opened, and only the slices
    that overlap it are read (`safe_open(...).get_slice(key)[a:b, ...]`), so a rank reads about
    its own shard's bytes. Use as a context manager or call `close()`.

    Raises (on construction): CheckpointError naming the file when neither file exists or the
    index is malformed.
    """

    def __init__(self, path: Path, name: str) -> None:
        self.path = Path(path)
        self._handles: dict[str, object] = {}
        index = self.path / index_name(name)
        full = self.path / f"{name}.safetensors"
        if index.is_file():
            self.sharded = True
            self.tensors = _parse_index(index)
        elif full.is_file():
            self.sharded = False
            self.tensors = {}
            f = self._open(full.name)
            for key in list(f.keys()):  # a safetensors handle, not a dict
                sl = f.get_slice(key)
                shape = list(sl.get_shape())
                dtype = _SAFETENSORS_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise CheckpointError(f"checkpoint {full}: {key} has dtype {sl.get_dtype()}")
                self.tensors[key] = {
                    "shape": shape,
                    "dtype": dtype,
                    "shards": [{"file": full.name, "offsets": [0] * len(shape), "lengths": shape}],
                }
        else:
            raise CheckpointError(
                f"checkpoint {self.path}: missing file {full.name} (or {index.name})"
            )

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the open files."""
        self._handles.clear()

    def names(self) -> list[str]:
        """The tensor names, sorted."""
        return sorted(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        """The global shape of tensor `key`."""
        return tuple(self.tensors[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        """The saved dtype of tensor `key`."""
        return self.tensors[key]["dtype"]

    def _open(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.path / fname), framework="pt")
        return self._handles[fname]

    def read(
        self,
        key: str,
        offsets: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """The box `[offsets, offsets + lengths)` of tensor `key` (the whole tensor when both are
        None), as a new CPU tensor of the saved dtype with shape `lengths`, assembled from the
        slices of the pieces that overlap it.

        Raises:
            KeyError: no tensor `key`.
            ValueError: the box is outside the tensor.
            CheckpointError: the pieces do not cover the box (naming the file and tensor).
        """
        t = self.tensors[key]
        shape = t["shape"]
        offsets = [0] * len(shape) if offsets is None else list(offsets)
        lengths = list(shape) if lengths is None else list(lengths)
        if len(offsets) != len(shape) or len(lengths) != len(shape):
            raise ValueError(f"{key}: a box of rank {len(lengths)} in a tensor of shape {shape}")
        if any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, shape, strict=True)
        ):
            raise ValueError(f"{key}: box {lengths} at {offsets} is outside shape {shape}")
        out = torch.empty(lengths, dtype=t["dtype"])
        want = math.prod(lengths)
        if want == 0:
            return out
        if not shape:  # a scalar: one piece holds it
            return self._open(t["shards"][0]["file"]).get_tensor(key).reshape(())
        covered = 0
        for s in t["shards"]:
            lo = [max(o, so) for o, so in zip(offsets, s["offsets"], strict=True)]
            hi = [
                min(o + n, so + sn)
                for o, n, so, sn in zip(offsets, lengths, s["offsets"], s["lengths"], strict=True)
            ]
            if any(h <= low for low, h in zip(lo, hi, strict=True)):
                continue
            src = tuple(
                slice(a - so, b - so) for a, b, so in zip(lo, hi, s["offsets"], strict=True)
            )
            dst = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))
            piece = self._open(s["file"]).get_slice(key)[src]
            out[dst] = piece.reshape([b - a for a, b in zip(lo, hi, strict=True)])
            covered += math.prod(b - a for a, b in zip(lo, hi, strict=True))
        if covered != want:
            raise CheckpointError(
                f"checkpoint {self.path}: tensor {key}: its pieces cover {covered} of the "
                f"{want} elements asked for"
            )
        return out

    def read_all(self) -> dict[str, torch.Tensor]:
        """Every tensor, whole (world size 1, or a module that is not sharded)."""
        return {k: self.read(k) for k in self.names()}


def read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    """{tensor name: whole tensor} of `name` ("model", "optimizer", ...) in the checkpoint
    directory `path`, from its sharded files or its full file: e.g. to consolidate a sharded
    checkpoint into one `model.safetensors` (`safetensors.torch.save_file`). Reads every piece;
    verify the checkpoint first (`load_checkpoint`)."""
    with TensorReader(path, name) as reader:
        return reader.read_all()


def _parse_index(path: Path) -> dict[str, dict]:
    """The `tensors` of an index file, dtypes as torch dtypes; CheckpointError when malformed."""
    try:
        index = json.loads(path.read_text())
        if index.get("format") != INDEX_FORMAT or index.get("version") != INDEX_VERSION:
            raise ValueError(f"format {index.get('format')} version {index.get('version')}")
        files = set(index["files"])
        out = {}
        for key, t in index["tensors"].items():
            shape = [int(x) for x in t["shape"]]
            shards = [
                {
                    "file": s["file"],
                    "offsets": [int(x) for x in s["offsets"]],
                    "lengths": [int(x) for x in s["lengths"]],
                }
                for s in t["shards"]
            ]
            bad = [s["file"] for s in shards if s["file"] not in files or "/" in s["file"]]
            if bad or any(len(s["offsets"]) != len(shape) for s in shards):
                raise ValueError(f"tensor {key}: bad shard entry")
            out[key] = {"shape": shape, "dtype": _DTYPES[t["dtype"]], "shards": shards}
        return out
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"checkpoint {path.parent}: {path.name} unreadable: {msg}") from None


# ---------------------------------------------------------------------------------------------
# Modules and optimizers ↔ pieces (this rank's shards; `rlhflab.distributed` knows the layout)
# ---------------------------------------------------------------------------------------------


def module_pieces(module: torch.nn.Module) -> dict[str, Piece | None]:
    """This rank's pieces of `module`'s state dict (tied names once, under the first), for
    `write_rank_file`: a sharded parameter's local shard, a replicated tensor on rank 0 only."""
    drop = {n for group in distributed.tied_groups(module) for n in group[1:]}
    return {k: distributed.local_piece(t) for k, t in module.state_dict().items() if k not in drop}


def optimizer_pieces(opt: torch.optim.Optimizer) -> tuple[dict[str, Piece | None], dict]:
    """This rank's pieces of an optimizer's state, keyed `<param index>.<name>` as in the full
    file (`rlhflab.checkpoint.state`), and its JSON part (param groups, non-tensor values):
    AdamW's exp_avg / exp_avg_sq are sharded like their parameter, its scalar `step` is
    rank 0's.

    An optimizer with rank-local state (`optimizers.rank_local_state`: adamw_8bit, whose m and v
    are quantized in blocks of each rank's shard) saves each rank's m and v as they are, whole,
    under `<param index>.<name>@rank<r>` (a quantized state as its inner tensors,
    `optimizers.flatten_state`, described in the JSON's "quantized"; "rank_local" holds the
    world size): it is restored exactly by the same world size only."""
    from rlhflab.optimizers import RANK_LOCAL, flatten_state, rank_local_state

    per_rank = rank_local_state(opt)
    suffix = f"{RANK_LOCAL}{distributed.rank():05d}"
    sd = opt.state_dict()
    pieces, scalars, quantized = {}, {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if not torch.is_tensor(v):
                scalars[f"{idx}.{k}"] = v
            elif per_rank and distributed.is_shard(v):
                flat, qmeta = flatten_state(f"{idx}.{k}{suffix}", v.to_local())
                pieces.update({n: (t, tuple(t.shape), (0,) * t.dim()) for n, t in flat.items()})
                if qmeta is not None:
                    quantized[f"{idx}.{k}{suffix}"] = qmeta
            else:
                pieces[f"{idx}.{k}"] = distributed.local_piece(v)
    meta = {"param_groups": encode_tensors(sd["param_groups"]), "scalars": scalars}
    if per_rank:
        meta["rank_local"] = {"world_size": distributed.world_size()}
        meta["quantized"] = quantized  # this rank's; the checkpointer merges every rank's
    return pieces, meta


def load_module(module: torch.nn.Module, reader: TensorReader) -> None:
    """Copy into `module` (sharded or not) the slices of the saved tensors that its own shards
    cover, read through `reader`; a tied group is filled from whichever of its names was saved.

    Raises:
        KeyError: a tensor of the module is not in the checkpoint, or the checkpoint holds one
            the module does not have.
        ValueError: a saved shape differs from the module's.
    """
    aliases = {n: group for group in distributed.tied_groups(module) for n in group}
    used = set()
    for name, t in module.state_dict(keep_vars=True).items():
        src = next((n for n in aliases.get(name, [name]) if n in reader.tensors), None)
        if src is None:
            raise KeyError(f"missing tensor {name}")
        if reader.shape(src) != tuple(t.shape):
            raise ValueError(
                f"{name}: saved shape {list(reader.shape(src))}, this model's {list(t.shape)}"
            )
        used.add(src)
        _, offset, local = distributed.shard_region(t)
        piece = reader.read(src, offset, local)
        with torch.no_grad():
            distributed.local_view(t).copy_(piece)
    extra = sorted(set(reader.names()) - used)
    if extra:
        raise KeyError(f"unexpected tensor(s) {extra[:3]}")


def optimizer_tensors(opt: torch.optim.Optimizer, reader: TensorReader) -> dict[str, torch.Tensor]:
    """The saved optimizer tensors (`<param index>.<name>`) laid out like `opt`'s parameters:
    a tensor shaped like its parameter is read as the slice of this rank's shard (a DTensor
    like the parameter under FSDP2), anything else (AdamW's `step`) whole; this rank's
    rank-local tensors (`optimizer_pieces`: `...@rank<r>`, whole) as saved, other ranks' not at
    all. Feed the result to `rlhflab.checkpoint.state._load_optimizer_state` without a module.

    Raises:
        KeyError / IndexError / ValueError: a key that names no parameter of `opt`.
    """
    from rlhflab.optimizers import RANK_LOCAL

    own = f"{RANK_LOCAL}{distributed.rank():05d}"
    params = [p for g in opt.param_groups for p in g["params"]]
    out = {}
    for key in reader.names():
        _, local, rest = key.partition(RANK_LOCAL)
        if local:
            if f"{local}{rest}".startswith(own):
                out[key] = reader.read(key)
            continue
        idx, _, _ = key.partition(".")
        p = params[int(idx)]
        if reader.shape(key) == tuple(p.shape):
            _, offset, local_shape = distributed.shard_region(p)
            out[key] = distributed.from_local_like(reader.read(key, offset, local_shape), p)
        else:
            out[key] = reader.read(key)
    return out
