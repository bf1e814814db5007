"""Data parallelism on torch.distributed: the only module that imports it.

Launch with torchrun (`torchrun --nproc-per-node N -m rlhflab train CONFIG ...`); torchrun sets
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and `setup()` reads them. Without
them (a plain `rlhflab train`) the world has one process and every helper here is the identity:
a single-process run takes the same code path and gives the same numbers.

What the trainers call (nothing else in the package touches torch.distributed):

    setup(parallel) / teardown()       process group (NCCL for GPU tensors and gloo for host-side
                                       ones on CUDA, gloo on CPU), collective timeout
    world_size() rank() is_main()      who we are
    device()                           cuda:LOCAL_RANK on GPUs, else cpu
    shard(rows)                        this rank's contiguous share of a global batch
    all_reduce_sum / _max / _min(t)    in place on a tensor, returned
    gather_cat(t)                      every rank's rows, concatenated in rank order
    all_gather_object / broadcast_object
    any_rank(flag)                     True when any rank says True (stop signals, errors)
    main_then_share(fn)                rank 0 runs fn; its result, or its refusal, on every rank
    wrap(model, parallel)              none | ddp | fsdp2 (see below)
    sync_grads(model)                  after the last micro-batch of an optimizer step
    gathered(model)                    full parameters on every rank while sampling
    full_model_state / load_full_model_state
    full_optimizer_state / load_full_optimizer_state

Gradients are summed across ranks, never averaged. Every trainer divides its loss by the
denominator of the *global* batch (tokens or sequences counted on each rank, summed once per
optimizer step with `all_reduce_sum`), so the summed gradient of N ranks × k micro-batches is the
gradient of the whole batch in one process (the torchtitan `global_valid_tokens` design).

Strategies (`parallel.strategy`):
- "none": the model as it is (one process; with several processes an error, since nothing
  would synchronise the replicas).
- "ddp": parameters replicated on every rank; after the last micro-batch of an optimizer step the
  gradients are summed with one all-reduce per flat bucket (`sync_grads`). This is what
  DistributedDataParallel does with `no_sync()` accumulation, without overlapping the
  communication with the backward pass. We do not wrap the model in DistributedDataParallel
  because the sampler (KV-cache decoding) and the padding-free scorer call the model's
  submodules directly, and DDP only synchronises gradients of passes that go through its own
  forward; the explicit all-reduce is correct whatever the forward path, and a rank may run any
  number of micro-batches.
- "fsdp2": `torch.distributed.fsdp.fully_shard` on every decoder layer, then on the root
  (ZeRO-3, Rajbhandari et al. 2020, arXiv 1910.02054: parameters, gradients and optimizer state
  sharded), with a `MixedPrecisionPolicy`
  (parameters in bf16 or fp32 for compute, gradients reduced in fp32) and optional CPU offload.
  The reduce-scatter sums (gradient divide factor 1). Forward and backward passes are
  collectives: every rank must run the same number of them, which the trainers ensure by giving
  every rank the same number of micro-batches (`micro_batches`). Sampling unshards the model first
  (`gathered`), so ranks whose completions stop at different lengths never wait on each other.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
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


def launched() -> bool:
    """True when torchrun (or another launcher) started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup(strategy: str = "none", timeout_s: float = 600.0) -> None:
    """Join the process group torchrun describes (idempotent); with one process, nothing.

    Args:
        strategy: `parallel.strategy` ("none" | "ddp" | "fsdp2"), kept for `wrap`.
        timeout_s: collective timeout: a rank that died makes the others fail after at most this
            long instead of hanging (gloo and NCCL both honour it).
    Raises:
        ConfigError: several processes with strategy "none".
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


def teardown() -> None:
    """Leave the process group this module joined (no-op with one process)."""
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


def micro_batches(rows: Sequence, size: int, pad_row=None) -> list[tuple[list, float]]:
    """Micro-batches of this rank's `rows`, as (rows, weight) pairs, padded so that every rank
    runs the same number of forward/backward passes (FSDP2's passes are collectives).

    A padding entry is `[pad_row]` (default: the first of `rows`) with weight 0.0: the trainer
    multiplies that pass's loss by 0, so it adds nothing to the gradient, and skips its
    statistics. With one process there is no padding. `rows` may be empty on a rank (then give
    `pad_row`, any valid row).
    """
    mbs = [(list(rows[s : s + size]), 1.0) for s in range(0, len(rows), size)]
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


def all_gather_object(obj: Any) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank (picklable Python objects)."""
    if not _talk():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


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


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _fsdp():
    from torch.distributed import fsdp

    return fsdp


def is_sharded(model: torch.nn.Module | None) -> bool:
    """True for a model (or a part of it) wrapped by FSDP2: its parameters are DTensor shards."""
    if model is None or not _on():
        return False
    fsdp = _fsdp()
    return any(isinstance(m, fsdp.FSDPModule) for m in model.modules())


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of a causal LM (decoder layers), found as the longest
    nn.ModuleList in the model; [] when there is none."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def wrap(
    model: torch.nn.Module,
    parallel,
    *,
    roots: list[torch.nn.Module] | None = None,
    weights: dict[str, torch.Tensor] | None = None,
) -> torch.nn.Module:
    """Prepare a model for data parallelism; returns the same object.

    Args:
        model: policy, reference, critic or reward model; a frozen model (the reference) is
            sharded the same way and simply has no gradients or optimizer state. Under "ddp" it
            is on `device()` on every rank; under "fsdp2" rank 0's holds the weights (on the
            CPU or the device) and the other ranks' may be on the meta device (no memory; see
            `loads_from_rank0`).
        parallel: the `parallel` config section (strategy, mixed_precision, cpu_offload).
        roots: under fsdp2, the parts sharded as separate FSDP roots instead of `model` itself
            (the reward model: backbone and score head, which the scorer calls one by one).
        weights: under fsdp2, rank 0's weights to load instead of the model's own (`host_state`
            of another model with the same names: the reference's are the policy's); ignored on
            other ranks.
    With one process or strategy "none", the model is returned unchanged; under "ddp" rank 0's
    parameters and buffers are broadcast so every replica starts equal (`sync_grads` keeps them
    equal). Under "fsdp2" the model goes to the meta device, each decoder layer and then the
    root are `fully_shard`ed, every rank allocates its shards on `device()` and receives them
    from rank 0 one tensor at a time (`set_model_state_dict(..., broadcast_from_rank0=True)`,
    as torchtune does), non-persistent buffers (RoPE's `inv_freq`) too: no rank but 0 holds a
    full copy, and none on its GPU.
    """
    if not _talk():
        return model
    if _STATE["strategy"] != "fsdp2":  # ddp: every replica starts from rank 0's weights
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
        return model
    fsdp = _fsdp()
    full = (weights if weights is not None else host_state(model)) if is_main() else {}
    persistent = set(model.state_dict())
    _to_meta(model)
    mp = None
    if parallel.mixed_precision == "bf16":
        mp = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {}
    if mp is not None:
        kwargs["mp_policy"] = mp
    if parallel.cpu_offload:
        kwargs["offload_policy"] = offload_policy(device())
    for block in _blocks(model):
        fsdp.fully_shard(block, **kwargs)
    for root in roots or [model]:
        fsdp.fully_shard(root, **kwargs)
    # shards on the device (with cpu_offload FSDP2 moves them to host memory at its first use)
    model.to_empty(device=device())
    _load_from_rank0(model, full, persistent)
    for m in model.modules():  # sum over ranks (denominators are global); gloo has only SUM
        if isinstance(m, fsdp.FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def loads_from_rank0() -> bool:
    """True when `wrap` fills every rank's model from rank 0's weights (FSDP2 over several
    processes): ranks other than 0 may then build their models on the meta device (shapes, no
    memory), and rank 0 may keep its copy in host memory until `wrap` shards it."""
    return _on() and _STATE["strategy"] == "fsdp2"


def host_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of every parameter and buffer (non-persistent ones such as RoPE's
    `inv_freq` included), detached and sharing storage with the model: what `wrap` broadcasts
    from rank 0. The tensors stay valid after the model itself goes to the meta device."""
    out = {name: b.detach() for name, b in model.named_buffers()}
    out.update({name: t.detach() for name, t in model.state_dict(keep_vars=True).items()})
    return out


def _meta_tensors(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """{id(tensor): a meta copy} for every parameter and buffer; one copy per shared tensor,
    parameters stay Parameters with their `requires_grad`."""
    memo: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in memo:
            continue
        empty = torch.empty_like(t, device="meta")
        if isinstance(t, torch.nn.Parameter):
            empty = torch.nn.Parameter(empty, requires_grad=t.requires_grad)
        memo[id(t)] = empty
    return memo


def _to_meta(model: torch.nn.Module) -> None:
    """Replace the model's parameters and buffers by meta tensors in place (tied weights stay
    tied, frozen ones frozen); the old tensors live on where something else holds them."""
    memo = _meta_tensors(model)
    for m in model.modules():
        for store in (m._parameters, m._buffers):
            for key, t in store.items():
                if t is not None:
                    store[key] = memo[id(t)]


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` (modules, config, patched methods) whose parameters and buffers
    are on the meta device: no memory is copied. For a frozen reference loaded by `wrap(copy,
    parallel, weights=host_state(model))`."""
    import copy

    return copy.deepcopy(model, memo=_meta_tensors(model))


def _load_from_rank0(model: torch.nn.Module, full: dict, persistent: set[str]) -> None:
    """Fill a sharded model (shards allocated) from rank 0's `full` state: the state dict one
    tensor at a time, then the non-persistent buffers (not in a state dict) by broadcast.
    Raises RuntimeError naming a key when the state does not fit the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    sd = {k: v for k, v in full.items() if k in persistent}
    if is_main() and set(sd) != persistent:
        missing = sorted(persistent - set(sd))[:3]
        raise RuntimeError(f"rank 0's weights lack {missing} of the model being sharded")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, sd, options=options)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in persistent:
                continue
            if is_main():
                buf.copy_(full[name])
            dist.broadcast(buf, src=0)


def offload_policy(dev: torch.device):
    """FSDP2's `CPUOffloadPolicy` for ranks whose compute device is `dev` (`parallel.cpu_offload`).

    The sharded parameters, their gradients and so the optimizer state live in host memory;
    each layer's shards are copied to `dev` for its forward/backward and the optimizer steps on
    the CPU. On CUDA the host copies are pinned (page-locked), for asynchronous transfers; on a
    CPU device there is no accelerator to pin for (torch refuses: "Cannot access accelerator
    device when none is available") and placement is unchanged, so the policy only takes
    FSDP2's offload code path (which the tests on CPU run).
    """
    return _fsdp().CPUOffloadPolicy(pin_memory=dev.type == "cuda")


def sync_grads(model: torch.nn.Module) -> None:
    """Sum gradients over ranks after the last micro-batch of an optimizer step ("ddp").

    FSDP2 reduce-scatters (sums) during each backward, and one process has nothing to do; in
    both cases this is a no-op. Parameters without a gradient on any rank get a zero gradient
    first, so every rank all-reduces the same buckets.
    """
    if not _talk() or is_sharded(model):
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # flat buckets of ~25 MB, like DDP's default bucket size
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= 25 * 2**20:
            _all_reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _all_reduce_bucket(bucket)


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@contextlib.contextmanager
def gathered(model: torch.nn.Module | None) -> Iterator[None]:
    """Full parameters on every rank for the duration (sampling, no-grad scoring, evaluation):
    under FSDP2 the model is unsharded once and its forwards do no communication, so ranks may
    run different numbers of them. Otherwise nothing happens."""
    if model is None or not is_sharded(model):
        yield
        return
    fsdp = _fsdp()
    mods = [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]
    for m in mods:
        m.unshard()
        m.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for m in mods:
            m.reshard()
            m.set_reshard_after_forward(True)


def grad_norm(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of the gradients before clipping (over all shards), clipping to `max_norm`
    when it is set. After `sync_grads` every replica holds the summed gradient, so the local
    norm is the global one; FSDP2's DTensor gradients are reduced by `clip_grad_norm_`.
    Returns a 0-d float32 tensor (the same on every rank)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if is_sharded(model):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm or float("inf"))
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if max_norm is None:
        return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{parameter name: full gradient on CPU} (a collective under FSDP2); tied parameters once."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().cpu().clone().contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# Full state for checkpoints (gathered; see rlhflab.checkpoint for why not DCP)
# ---------------------------------------------------------------------------------------------


def _sd_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(
    model: torch.nn.Module, *, keep_tied: bool = False
) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict on CPU, on rank 0 (None on other ranks) for an FSDP2 model.

    A collective under FSDP2 (every rank must call it). Tied parameters appear under one name
    only: the first in sorted order, or with `keep_tied` the name `save_pretrained` keeps (the
    input embedding's, not the LM head's). For other models this returns None: they are saved
    from the module directly.
    """
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model, options=_sd_options())
    if not is_main():
        return None
    for group in _tied_groups(model):
        if keep_tied:  # what save_pretrained writes for a tied model: the input embedding's name
            drop = [n for n in group if n in _output_embedding_names(model)]
            drop = drop if len(drop) < len(group) else []
        else:
            drop = sorted(group)[1:]
        for name in drop:
            sd.pop(name, None)
    return {k: v.contiguous() for k, v in sd.items()}


def load_full_model_state(
    model: torch.nn.Module, sd: dict[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Load a full (unsharded) state dict, as written from `full_model_state`, into an FSDP2
    model on every rank; tied names are filled from the saved one. Raises RuntimeError / KeyError
    when names or shapes do not fit. `strict=False` loads a part (a LoRA model's adapters; the
    caller checks the names) and leaves the other parameters as they are."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    sd = dict(sd)
    for group in _tied_groups(model):
        kept = sorted(group)[0]
        for name in group:
            if strict or kept in sd:
                sd.setdefault(name, sd[kept])
    set_model_state_dict(model, sd, options=_sd_options_load(strict))


def _sd_options_load(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, strict=strict)


def _output_embedding_names(model: torch.nn.Module) -> set[str]:
    """Parameter names of a Hugging Face model's output embedding (LM head), if it has one."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return set()
    return {f"{n}.weight" for n, m in model.named_modules() if m is head}


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return [names for names in seen.values() if len(names) > 1]


def full_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict | None:
    """An FSDP2 model's optimizer state unsharded, in `Optimizer.state_dict()` form (state keyed
    by parameter index, as one process has it) on rank 0; None on other ranks and for
    unsharded models (whose `opt.state_dict()` is already complete). A collective."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=_sd_options())
    if not is_main():
        return None
    index: dict[str, int] = {}
    groups = []
    for g in osd["param_groups"]:
        ids = []
        for fqn in g["params"]:
            index[fqn] = len(index)
            ids.append(index[fqn])
        groups.append({**g, "params": ids})
    state = {index[fqn]: st for fqn, st in osd["state"].items()}
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, sd: dict) -> None:
    """Inverse of `full_optimizer_state` on every rank of an FSDP2 model (a collective).
    Raises: KeyError / RuntimeError when the state does not fit the optimizer's parameters
    (the checkpoint module turns these into one CheckpointError line)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    # The FQN of each parameter index, in the optimizer's own order.
    template = get_optimizer_state_dict(model, opt, options=StateDictOptions())
    fqns = [fqn for g in template["param_groups"] for fqn in g["params"]]
    state = {fqns[int(i)]: st for i, st in sd["state"].items()}
    groups, start = [], 0
    for g in sd["param_groups"]:
        n = len(g["params"])
        groups.append({**g, "params": fqns[start : start + n]})
        start += n
    set_optimizer_state_dict(
        model,
        opt,
        {"state": state, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )
