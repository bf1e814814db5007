"""Data parallelism on torch.distributed: the only package that imports it.

Launch with torchrun (`torchrun --nproc-per-node N -m rlhflab train CONFIG ...`); torchrun sets
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and `setup()` reads them. Without
them (a plain `rlhflab train`) the world has one process and every helper here is the identity:
a single-process run takes the same code path and gives the same numbers.

What the trainers call (nothing else in the package touches torch.distributed):

    setup(parallel) / teardown()       process group (NCCL for GPU tensors and gloo for host-side
                                       ones on CUDA, gloo on CPU), collective timeout
    on_teardown(fn)                    fn() before the group is left (vLLM's own groups)
    world_size() rank() is_main()      who we are
    device()                           cuda:LOCAL_RANK on GPUs, else cpu
    shard(rows)                        this rank's contiguous share of a global batch
    micro_batches(rows, size)          this rank's micro-batches, as many as every other rank's
                                       (fixed size, or a token budget: token_budget_split)
    all_reduce_sum / _max / _min(t)    in place on a tensor, returned
    gather_cat(t)                      every rank's rows, concatenated in rank order
    all_gather_tensor(t)               every rank's same-shape tensor, stacked (device backend)
    all_gather_object / broadcast_object, side_group (a second group for a background thread)
    any_rank(flag)                     True when any rank says True (stop signals, errors)
    main_then_share(fn)                rank 0 runs fn; its result, or its refusal, on every rank
  in models.py (re-exported here):
    wrap(model, parallel)              none | ddp | fsdp2 (see below)
    loads_from_rank0() meta_copy(m)    FSDP2: ranks > 0 build models on the meta device
    host_state(m)                      rank 0's weights for `wrap(..., weights=)`
    sync_grads(model)                  after the last micro-batch of an optimizer step
    gathered(model)                    full parameters on every rank while sampling
  in state.py (re-exported here):
    full_model_state / load_full_model_state
    full_tensor(t, dtype)              one parameter whole on every rank (rollout engine pushes)
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
  Models are loaded without full copies: ranks > 0 build them on the meta device, and `wrap`
  fills every rank's shards from rank 0's weights, one tensor at a time.
  The reduce-scatter sums (gradient divide factor 1). Forward and backward passes are
  collectives: every rank must run the same number of them, which the trainers ensure by giving
  every rank the same number of micro-batches (`micro_batches`). Sampling unshards the model first
  (`gathered`), so ranks whose completions stop at different lengths never wait on each other.
"""

from rlhflab.distributed.group import (  # noqa: F401
    _BEFORE_TEARDOWN,
    _PR_SET_PDEATHSIG,
    _STATE,
    ONE_RANK_ENV,
    PARENT_GRACE_S,
    _on,
    _reduce,
    _talk,
    all_gather_object,
    all_gather_tensor,
    all_reduce_max,
    all_reduce_min,
    all_reduce_sum,
    any_rank,
    arm_parent_death_signal,
    backend_for,
    barrier,
    broadcast_object,
    check_split,
    collectives_started,
    device,
    exit_with_parent,
    gather_cat,
    is_main,
    launched,
    main_then_share,
    micro_batches,
    on_teardown,
    padded_cells,
    rank,
    setup,
    shard,
    shard_bounds,
    side_group,
    sum_dict,
    teardown,
    token_budget_split,
    world_size,
)

# The package's face: the process group and collectives (group.py), models (models.py) and their
# full state (state.py), re-exported: `distributed.wrap(...)`. (Private helpers too, so that code
# written against the single module still finds them.)
from rlhflab.distributed.models import (  # noqa: F401
    _all_reduce_bucket,
    _blocks,
    _fsdp,
    full_grads,
    gathered,
    grad_norm,
    host_state,
    is_sharded,
    loads_from_rank0,
    meta_copy,
    offload_policy,
    sync_grads,
    wrap,
)
from rlhflab.distributed.state import (  # noqa: F401
    _output_embedding_names,
    _sd_options,
    _sd_options_load,
    from_local_like,
    full_model_state,
    full_optimizer_state,
    full_tensor,
    is_shard,
    load_full_model_state,
    load_full_optimizer_state,
    local_piece,
    local_view,
    model_state_specs,
    shard_region,
    stream_model_state,
    tied_groups,
)
