"""The process group and the collectives of `rlhflab.distributed` (re-exported there; see its
docstring): setup / teardown, who we are, sharding of global batches, and the collectives the
trainers call. The only module besides models.py and state.py that touches torch.distributed.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlhflab.errors import ConfigError, PeerRefused, RlhfLabError

# "owned": this module started the default process group (under torchrun). A group that another
# library starts in a single process (vLLM's world-1 group) is neither used nor destroyed here.
_STATE: dict[str, Any] = {"strategy": "none", "device": None, "talked": False, "owned": False}


# ---------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------


#: Set by `rlhflab train --nproc 1` with `parallel.strategy` ddp or fsdp2: the one rank torchrun
#: starts joins a process group of one (NCCL on a GPU), so that a one-GPU machine runs the code
#: path of a launched job (`launched()`), as `--nproc N` does with N ranks.
ONE_RANK_ENV = "RLHFLAB_ONE_RANK_GROUP"


def launched() -> bool:
    """True when torchrun (or another launcher) started this process as one of several, or as
    the one rank of `rlhflab train --nproc 1` with a ddp / fsdp2 strategy (`ONE_RANK_ENV` set and
    torchrun's WORLD_SIZE=1 present)."""
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.strip() == "1" and os.environ.get(ONE_RANK_ENV) == "1":
        return True
    return int(world or "1") > 1


def setup(strategy: str = "none", timeout_s: float = 600.0) -> None:
    """Join the process group torchrun describes (idempotent); with one process, nothing.

    Args:
        strategy: `parallel.strategy` ("none" | "ddp" | "fsdp2"), kept for `wrap`.
        timeout_s: collective timeout: a rank that died makes the others fail after at most this
            long instead of hanging (gloo and NCCL both honour it).
    Raises:
        ConfigError: several processes with strategy "none"; on a CUDA machine, a LOCAL_RANK
            with no GPU of its own (more processes per node than visible GPUs).
    """
    _STATE["strategy"] = strategy
    if not launched():
        _STATE["device"] = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return
    if strategy == "none":
        raise ConfigError(
            f"parallel.strategy: 'none' with WORLD_SIZE={os.environ['WORLD_SIZE']} "
            "(set parallel.strategy=ddp or fsdp2 under torchrun)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if local_rank >= visible:  # else torch.cuda.set_device fails with a CUDA traceback
            raise ConfigError(
                f"rank {os.environ.get('RANK', local_rank)}: LOCAL_RANK {local_rank} but this "
                f"node shows {visible} CUDA device(s): launch at most {visible} process(es) per "
                "node (--nproc / --nproc-per-node), one per GPU (CUDA_VISIBLE_DEVICES)"
            )
        torch.cuda.set_device(local_rank)
        _STATE["device"] = torch.device("cuda", local_rank)
    else:
        _STATE["device"] = torch.device("cpu")
    exit_with_parent()
    if not dist.is_initialized():
        dist.init_process_group(
            backend_for(_STATE["device"]), timeout=datetime.timedelta(seconds=timeout_s)
        )
        _STATE["owned"] = True


def backend_for(dev: torch.device) -> str:
    """The process-group backend string for ranks whose compute device is `dev`.

    On CUDA: "cpu:gloo,cuda:nccl" — tensors on the GPU (gradients, FSDP2 shards, the DDP
    broadcast) go through NCCL, and the small host-side collectives (denominators, metric sums,
    stop flags, object gathers) through gloo. NCCL alone refuses CPU tensors ("No backend type
    associated with device type cpu"), and moving every counter to the GPU would add a host
    synchronisation per collective. On CPU: "gloo". Returns e.g. "cpu:gloo,cuda:nccl".
    """
    return "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"


#: Seconds a worker whose launcher died may spend on its graceful stop (finish the step, write a
#: checkpoint) before it exits at once: a peer may be gone too, and a collective with it would
#: otherwise wait for `parallel.timeout_s`.
PARENT_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def arm_parent_death_signal() -> bool:
    """Ask the kernel to send this process SIGTERM when its parent dies (Linux
    `prctl(PR_SET_PDEATHSIG, SIGTERM)`); returns False where that is not available. Also the
    `preexec_fn` of the torchrun child that `rlhflab train --nproc` starts, so that killing
    `rlhflab` (even by SIGKILL) stops torchrun, which stops its workers."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_parent(grace_s: float = PARENT_GRACE_S, poll_s: float = 0.5) -> bool:
    """Make this worker follow its launcher (torchrun's agent, its parent process) when the
    launcher dies, even by SIGKILL, which it cannot forward: no orphan keeps training.

    On Linux the kernel sends this process SIGTERM when its parent dies
    (`prctl(PR_SET_PDEATHSIG, SIGTERM)`), which takes the graceful path of a stop signal
    (`rlhflab.checkpoint.StopSignals`: finish the step, checkpoint, exit 143) or, outside the
    training loop, ends the process. A daemon thread also polls `os.getppid()` every `poll_s`
    seconds (elsewhere than Linux it sends the SIGTERM itself); once the parent is gone it
    gives the graceful stop `grace_s` seconds, then ends the process with `os._exit(143)`
    (a rank stuck in a collective with a dead peer cannot stop by itself). Checkpoints are
    committed atomically, so the last committed one stays intact whenever the exit comes.
    Idempotent; returns whether the kernel signal is armed."""
    if _STATE.get("watchdog"):
        return _STATE["watchdog"] == "pdeathsig"
    parent = os.getppid()
    armed = arm_parent_death_signal()  # False where not Linux: the watchdog alone

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        if not armed:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + int(signal.SIGTERM))

    threading.Thread(target=watch, name="rlhflab-parent-watchdog", daemon=True).start()
    _STATE["watchdog"] = "pdeathsig" if armed else "poll"
    if armed and os.getppid() != parent:  # died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
    return armed


_BEFORE_TEARDOWN: list = []  # callables run by `teardown` first, last registered first


def on_teardown(fn) -> None:
    """Have `teardown` call `fn()` before it leaves the process group: for a library that made
    groups of its own inside ours (the colocated vLLM engine under torchrun), whose shutdown
    must run while they are still valid (after, it fails: "Invalid process group")."""
    _BEFORE_TEARDOWN.append(fn)


def teardown() -> None:
    """Leave the process group this module joined (no-op with one process), after running the
    `on_teardown` callables."""
    while _BEFORE_TEARDOWN:
        _BEFORE_TEARDOWN.pop()()
    if _STATE["owned"] and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _STATE["owned"] = False


def _on() -> bool:
    # Several processes only: in one process a default group may exist that is not ours (the
    # colocated vLLM engine starts a world-1 group), and there is nobody to talk to.
    return launched() and dist.is_available() and dist.is_initialized()


def _talk() -> bool:
    """True when there are several processes; records that a collective is about to happen."""
    if _on():
        _STATE["talked"] = True
        return True
    return False


def collectives_started() -> bool:
    """True once this process took part in a collective. Before that, every rank has run the same
    validation on the same config, so a failure there is the same on every rank (printed once)."""
    return _STATE["talked"]


def world_size() -> int:
    """Number of processes (1 without torchrun)."""
    return dist.get_world_size() if _on() else 1


def rank() -> int:
    """This process's rank, 0..world_size-1."""
    return dist.get_rank() if _on() else 0


def is_main() -> bool:
    """Rank 0: the only rank that writes the run directory and prints."""
    return rank() == 0


def device() -> torch.device:
    """cuda:LOCAL_RANK under torchrun on GPUs, cuda with one process on a GPU machine, else cpu."""
    if _STATE["device"] is None:
        _STATE["device"] = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return _STATE["device"]


def barrier() -> None:
    """Wait for every rank."""
    if _talk():
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def check_split(n: int, field: str, what: str, why: str = "") -> None:
    """A ConfigError naming `field` when a global batch of n `what` does not split evenly over
    the ranks (every rank must run the same number of micro-batches). Called in set-up, before
    any collective, so every rank fails the same way. `why` is appended in parentheses.
    Raises: ConfigError, e.g. "train.batch_size: 6 rows do not split over 4 ranks"."""
    if n % world_size():
        note = f" ({why})" if why else ""
        raise ConfigError(f"{field}: {n} {what} do not split over {world_size()} ranks{note}")


def shard_bounds(n: int, *, even: bool = True) -> tuple[int, int]:
    """[start, end) of this rank's contiguous share of n global rows.

    even=True: n must split evenly (training batches; see `check_split`). even=False: shares of
    ceil(n / world_size) rows, the last ones shorter or empty — for work done under `gathered`
    (sampling, evaluation, reference scoring), where ranks may run different numbers of passes.
    Raises: ValueError when `even` and n does not split over the ranks.
    """
    w, r = world_size(), rank()
    if even and n % w:
        raise ValueError(f"a global batch of {n} rows does not split over {w} ranks")
    per = n // w if even else -(-n // w)
    return min(r * per, n), min((r + 1) * per, n)


def shard(rows: Sequence, *, even: bool = True) -> list:
    """This rank's contiguous share of a global batch (a list of rows in global order); `even`
    as in `shard_bounds`."""
    start, end = shard_bounds(len(rows), even=even)
    return list(rows[start:end])


def padded_cells(widths: Sequence[Sequence[int]], rows: Sequence[int],
                 seqs_per_row: int = 1) -> int:  # fmt: skip
    """Tokens (cells) of the padded grid of the micro-batch `rows`: `seqs_per_row · |rows|`
    sequences by `Σ_k max_{i∈rows} widths[i][k]` columns (row i laid out as padded segments of
    lengths `widths[i]`, e.g. (prompt, completion), left- and right-padded). 0 for no rows."""
    if not rows:
        return 0
    columns = sum(max(widths[i][k] for i in rows) for k in range(len(widths[rows[0]])))
    return seqs_per_row * len(rows) * columns


def token_budget_split(widths: Sequence[Sequence[int]], max_tokens: int,
                       seqs_per_row: int = 1) -> list[list[int]]:  # fmt: skip
    """Indices of `widths` grouped into micro-batches whose padded grid (`padded_cells`) holds
    at most `max_tokens` tokens.

    Row i lays out as padded segments of lengths `widths[i]` (a Rollout row: (prompt tokens,
    completion tokens up to the last scored one)); a micro-batch of rows S costs
    `padded_cells(widths, S, seqs_per_row)` (2 sequences per row for a preference pair: chosen
    and rejected in one forward). Rows are taken longest first (ties by index, so the split is
    deterministic) and a micro-batch is closed when the next row would push its grid past the
    budget; a row whose own grid exceeds the budget is a micro-batch alone (the caller reports
    it). Every index appears exactly once.

    The knob is verl's `ppo_max_token_len_per_gpu` under `use_dynamic_bsz`; the split is not
    verl's: its `rearrange_micro_batches` (verl/utils/seqlen_balancing.py) takes
    ⌈Σ real tokens / budget⌉ micro-batches (the maximum over ranks) and balances their real-token
    sums with Karmarkar–Karp, its forwards removing the padding, and requires the budget to hold
    the longest sequence. Here the cost is the padded grid (the GPU forward is padded), the
    filling greedy, ranks may differ in their number of micro-batches (`micro_batches` pads the
    passes) and a longer row is allowed.

    Raises:
        ValueError: `max_tokens` < 1 or rows of different segment counts.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
    if len({len(w) for w in widths}) > 1:
        raise ValueError("token_budget_split: every row needs the same number of segments")
    order = sorted(range(len(widths)), key=lambda i: (-sum(widths[i]), i))
    out: list[list[int]] = []
    cur: list[int] = []
    top: list[int] = []  # per-segment maxima of `cur`
    for i in order:  # `top` keeps padded_cells' column maxima incrementally
        grown = [max(a, b) for a, b in zip(top, widths[i], strict=True)] if cur else list(widths[i])
        if cur and seqs_per_row * (len(cur) + 1) * sum(grown) > max_tokens:
            out.append(cur)
            cur, grown = [], list(widths[i])
        cur.append(i)
        top = grown
    if cur:
        out.append(cur)
    return out


def micro_batches(rows: Sequence, size: int, pad_row=None, *, widths=None,
                  max_tokens: int | None = None, seqs_per_row: int = 1) -> list[tuple[list, float]]:  # fmt: skip
    """Micro-batches of this rank's `rows`, as (rows, weight) pairs, padded so that every rank
    runs the same number of forward/backward passes (FSDP2's passes are collectives).

    `size` rows each, in order; or, with `max_tokens` (`train.max_tokens_per_micro_batch`) and
    `widths` (one entry per row, see `token_budget_split`), rows grouped by length into
    micro-batches of at most `max_tokens` padded tokens, longest first.

    A padding entry is `[pad_row]` (default: the first of `rows`) with weight 0.0: the trainer
    multiplies that pass's loss by 0, so it adds nothing to the gradient, and skips its
    statistics. With one process there is no padding. `rows` may be empty on a rank (then give
    `pad_row`, any valid row).
    """
    if max_tokens is None:
        mbs = [(list(rows[s : s + size]), 1.0) for s in range(0, len(rows), size)]
    else:
        if widths is None or len(widths) != len(rows):
            raise ValueError("micro_batches: max_tokens needs one `widths` entry per row")
        split = token_budget_split(widths, max_tokens, seqs_per_row)
        mbs = [([rows[i] for i in part], 1.0) for part in split]
    n = len(mbs)
    if _talk():
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        n = int(t.item())
    pad = [pad_row] if pad_row is not None else list(rows[:1])
    while len(mbs) < n:
        mbs.append((pad, 0.0))
    return mbs


# ---------------------------------------------------------------------------------------------
# Collectives (identity with one process)
# ---------------------------------------------------------------------------------------------


def _reduce(t: torch.Tensor, op) -> torch.Tensor:
    if _talk():
        dist.all_reduce(t, op=op)
    return t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of `t` over ranks, in place; returned. `t`: any shape and dtype (kept), on the CPU
    (through gloo) or on this rank's device (through NCCL on CUDA; see `backend_for`). A Python number is turned into a 0-d float64 tensor first (so
    denominators stay exact). With one process, `t` itself."""
    if not torch.is_tensor(t):
        t = torch.tensor(t, dtype=torch.float64)
    return _reduce(t, dist.ReduceOp.SUM if _on() else None)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Element-wise max of `t` (any shape and dtype, kept) over ranks, in place; returned."""
    return _reduce(t, dist.ReduceOp.MAX if _on() else None)


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    """Element-wise min of `t` (any shape and dtype, kept) over ranks, in place; returned."""
    return _reduce(t, dist.ReduceOp.MIN if _on() else None)


def sum_dict(values: dict[str, float]) -> dict[str, float]:
    """{key: Σ over ranks} of a dict of Python numbers with the same keys on every rank (one
    all-reduce in float64); the dict itself with one process."""
    if not _talk():
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {**values, **dict(zip(keys, t.tolist(), strict=True))}


def any_rank(flag: bool | int | None) -> int:
    """The largest value of `flag` (False/None = 0) over ranks: e.g. a stop signal number seen
    by any rank, so that every rank stops after the same step."""
    t = torch.tensor([int(flag or 0)], dtype=torch.long)
    return int(all_reduce_max(t).item())


def gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 in rank order (shapes may differ in dim 0).

    Shards are contiguous in global order, so this rebuilds the global batch's per-row values
    (rewards, lengths, ...) exactly as one process would hold them."""
    if not _talk():
        return t
    parts = all_gather_object(t.detach().cpu())
    return torch.cat(parts).to(t.device)


def all_gather_tensor(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t` (the same shape on every rank) stacked along a new dim 0 in rank order:
    shape (world_size, *t.shape), on `t`'s device, through the backend of that device (NCCL for
    CUDA tensors, gloo for CPU ones; `torch.distributed.all_gather`). With one process,
    `t.unsqueeze(0)`. Used by `rlhflab doctor` to measure the all-gather FSDP2 runs."""
    if not _talk():
        return t.unsqueeze(0)
    out = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def all_gather_object(obj: Any, group: Any = None) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (picklable Python objects); `group`: a
    group of `side_group()` (default: the run's group)."""
    if not _talk():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj, group=group)
    return out


def side_group() -> Any:
    """A second group of all ranks on gloo (host memory), for collectives a background thread
    runs while the main thread runs its own (the async rollouts' gather): the ranks order the
    collectives of one group alike, and two threads on one group would not. Every rank must call
    it at the same point; None with one process."""
    if not _talk():
        return None
    return dist.new_group(backend="gloo")


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not _talk():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main_then_share(fn) -> Any:
    """`fn()` run on rank 0 alone (with one process: simply `fn()`), its result on every rank.

    When rank 0's `fn` refuses (an `RlhfLabError` such as a locked run directory, or an OSError),
    the other ranks learn it instead of waiting in their next collective for a rank that is
    gone ("[gloo] Connection closed by peer"): rank 0 re-raises its error, marked `shared`
    (the CLI prints it once, without a rank prefix), and every other rank raises `PeerRefused`
    (the CLI exits quietly with the same code). Anything else (a bug) propagates on rank 0."""
    if not _on():
        return fn()
    outcome, error = None, None
    if is_main():
        try:
            outcome = ("ok", fn())
        except (RlhfLabError, OSError) as exc:
            error = exc
            outcome = ("refused", f"{type(exc).__name__}: {exc}")
    outcome = broadcast_object(outcome)
    if outcome[0] == "ok":
        return outcome[1]
    if error is not None:
        error.shared = True
        raise error
    raise PeerRefused(f"rank 0 refused to start ({outcome[1]})")
