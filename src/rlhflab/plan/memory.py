"""`rlhflab plan`: per-GPU memory of a training run, estimated before any GPU is rented.

Pure arithmetic (stdlib only; no torch, no model is built or loaded). Every term below is what
rlhflab's code keeps in GPU memory today (trainers/, distributed.py, rollout/sampler.py), in bytes;
the report converts to GiB (2**30 bytes). Symbols:

    h hidden size, L layers, f MLP (intermediate) size, q = heads·head_dim, k = kv_heads·head_dim,
    V vocabulary, P parameters, N GPUs (ranks), w bytes of a stored parameter (model.dtype:
    float32 4, bfloat16/float16 2), c bytes of a compute (activation) element (2 under bf16
    autocast or a 16-bit model, else 4), rs bytes of the residual stream (the dtype of the
    embedding output: 4 for an fp32 model even under autocast, since fp32 + bf16 adds give fp32;
    2 for a 16-bit model or FSDP2 with mixed_precision bf16).

Parameters (`ModelShape.params`), a Llama / Qwen3 dense decoder:
    embedding V·h; per layer: q_proj h·q, k_proj and v_proj h·k each, o_proj q·h, gate/up/down
    3·h·f, two RMSNorms 2h, Qwen3's q/k norms 2·head_dim; final norm h; LM head V·h unless tied.
    (Qwen3-8B: 8.19 B, 6.95 B without embeddings; Llama-3.1-8B 8.03 B; Qwen3-0.6B 0.60 B.)

Resident state (alive the whole step; per GPU):
    parameters   w·P (full fine-tuning). LoRA: w·P frozen base + 4·T adapters (peft keeps lora_A/B
                 in fp32), T = r·Σ(d_in + d_out) over the adapted linears (default "all-linear":
                 q, k, v, o, gate, up, down of every block; not the LM head).
    gradients    w per trainable parameter (full: w·P; LoRA: 4·T). Grads stay allocated from one
                 backward to the next `zero_grad(set_to_none=True)`, so through the next rollout.
    optimizer    `rlhflab.optimizers.bytes_per_param` per trainable parameter: torch AdamW
                 ("adamw"): exp_avg and exp_avg_sq like the parameter, 2·w (8 bytes in fp32; 4
                 for a bf16 model.dtype); "adamw_8bit": 2·(1 + 4/256) = 2.03 (block-wise 8-bit
                 m and v; the few tensors it leaves unquantized, norms and biases, are ignored);
                 "adamw_bf16": 4 (bf16 m and v, with bf16 weights and gradients: 8 in all).
    reference    (policy gradient with kl.coef > 0, full fine-tuning) a frozen copy of the
                 policy: w_ref·P (w_ref: 2 under fsdp2 over N > 1 ranks with mixed_precision
                 bf16, which stores the reference in bf16 (`trainers.common.Reference`), else
                 model.dtype; `reference_dtype` overrides it). LoRA: 0 (the base with adapters
                 disabled is π_ref).
                 DPO: 0 (reference log-probs are computed once per round and cached).
    critic       (PPO, advantage gae) a copy of the backbone (no LM head) with a scalar head, its
                 own gradients and AdamW: 4·w·P_backbone; LoRA: its own adapters only, 16·T.
    reward model (a `reward_model` reward component) loaded per process in fp32, not sharded:
                 4·P_rm.
    Under strategy fsdp2 every one of these is divided by N (each rank holds 1/N of every tensor);
    under ddp / none nothing is divided. fsdp2 with cpu_offload (FSDP2 CPUOffloadPolicy) keeps
    parameters, gradients and optimizer state of every sharded model on the host (`host_gib`)
    and runs the AdamW step there; they come to the GPU only while a layer is unsharded.

Transient terms, by phase (one phase at a time; the total is resident + the largest phase):
    rollout   KV cache of the hf sampler, preallocated for prompt + max_new_tokens:
              2·L·kv_heads·head_dim·c bytes per token × rows × (prompt + new), rows = this rank's
              rollouts (prompts_per_step·group_size / N); sampling logits and Gumbel noise
              ~4 fp32 (rows_global, V) tensors per step; under fsdp2 the whole policy gathered
              (`distributed.gathered`: P × its compute dtype, 2 with mixed_precision bf16, else w);
              autocast weight copies (below). With `rollout.half_weights` instead of the last two:
              the engine's bf16 copy, 2·P, filled under fsdp2 one parameter at a time (the
              largest one, full, in w) while the policy stays sharded.
    scoring   no-grad log-probs of the old / reference policy and the critic's values, one
              micro-batch at a time: (B, T+1, V) logits in c bytes plus their float() copy in fp32
              (+ fp32 again when temperature != 1); one layer's activations; under fsdp2 the
              root and two decoder layers unsharded in compute dtype (the policy gradient's
              passes: the models' own forwards), or the whole model gathered (with a critic:
              its values; DPO's reference pass).
    train     forward + backward of one micro-batch: activations (below), logits (below), autocast
              weight copies, and under fsdp2 the unsharded working set: the root's embedding /
              norm / LM head for the whole forward and backward, plus two decoder layers
              (current + prefetch) in compute dtype and one layer of unsharded fp32 gradients.
              PPO's critic runs its own forward/backward after the policy's: the phase is the
              larger of the two.
    optimizer torch AdamW (foreach, the CUDA default) allocates one temporary like exp_avg_sq
              (sqrt) for all parameters of a dtype at once: w per trainable parameter (on the host
              under cpu_offload). torchao's optimizers (adamw_8bit, adamw_bf16) step one tensor
              at a time in one compiled kernel: counted as one fp32 copy of the largest
              trainable tensor (the embedding, vocab × hidden; its 1/N shard), an estimate not
              yet measured on a GPU.

Autocast weight copies: under bf16 autocast every nn.Linear casts its fp32 weight to bf16 (cached
for trainable leaves during the forward; saved by autograd for the backward of the input either
way): 2 bytes × the linear parameters (blocks + the LM head, tied or not), alive from the forward
to the backward. Zero when the weights are already 16-bit (model.dtype bfloat16, or FSDP2 with
mixed_precision bf16, whose unsharded layers are bf16 and freed per layer); LoRA adds 2·T (its
fp32 adapters' casts).

Activations, bytes per token per decoder layer (`layer_activation_bytes`). Korthikanti et al. 2022
(arXiv 2205.05198, §4.1) count what autograd saves for the backward of a GPT layer,
34·h bytes per token in 16-bit with dropout; the same count for rlhflab's layers (SwiGLU MLP,
GQA attention through SDPA with a padding mask, so K and V are repeated to all heads; no
dropout; no s² term: flash / memory-efficient SDPA kernels keep no attention matrix):
    trainable layer (full fine-tuning)
        2 RMSNorms      2·(4h + rs·h)   the fp32 upcast of the input (pow / rsqrt) and the
                                        normalised output (for the weight's gradient)
        linear inputs   5·c·h if autocast casts an fp32 residual (q, k, v, gate, up each save
                        their own bf16 cast), else 0 (the norm output itself is saved)
                        + c·q (o_proj input, a contiguous copy) + c·f (down_proj input)
        q/k norms       (4 + c)·(q + k)   Qwen3 only
        attention       4·c·q           q, repeated k and v, and the output (SDPA backward)
        SwiGLU          3·c·f           gate (SiLU), SiLU(gate) and up (product)
    frozen layer with LoRA adapters (the base needs no input for its weight gradient)
        2 RMSNorms 2·4h; q/k norms 4·(q + k); attention 4·c·q; SwiGLU 3·c·f; every adapted linear
        saves its input cast for lora_A: c_lora·d_in + c_lora·r (c_lora = c under autocast, else
        4: peft casts the input to the adapters' fp32); in an fp32 model without autocast there
        is no cast, and adapters reading the same tensor (q/k/v, gate/up) share it.
    With activation checkpointing (model.gradient_checkpointing; HF non-reentrant, per layer):
        rs·h per token per layer (the layer's input) + one layer's full activations, recomputed
        during its backward.
    Outside the layers: the final norm (4h + rs·h) per token, and the LM head's saved input:
    c·h per token (its autocast cast) for the full-logits head, rs·h per scored row (N, below)
    for the fused head.
Tokens per micro-batch: rows × (prompt + completion) (DPO: 2 rows per pair; SFT / RM: max_len).

Logits (`completion_logps`), the LM head and the log-softmax of the scored rows. Two paths,
chosen as `completion_logps` chooses (`ModelShape.fused_head`, i.e. `models.packing.can_pack`):

Fused head (Llama / Qwen3 / Qwen2 / Mistral: a plain nn.Linear head; any device, autocast, FSDP2):
`ops.linear_selective_log_softmax` takes the (N, h) hidden states of the scored positions and
the head's weight and never holds the (N, V) logits; it works on row-chunks of
C = min(N, max(1, 2**23 // V)) rows (one fp32 (C, V) block ≈ 32 MiB; C = 55 at V = 151,936).
N = rows·T (rows·(T+1) under fsdp2: the sharded model's forward scores the kept T+1 positions).
mm = the head's matmul bytes (autocast's bf16, else the weight's dtype) = c. Bytes at its peaks:
    forward, per chunk   z_prev·4 (the previous chunk's logits are alive until `z` is rebound)
                         + z·4 + z/τ·4 (or logsumexp's (z − max) and exp): 12·C·V; with entropy
                         (`_entropy_rows`: z, log_softmax, exp, p > 0 (1 byte), p·logp, where):
                         21·C·V. The policy-gradient trainer asks for the entropy on the first
                         optimizer step of each batch; SFT / DPO and no-grad scoring do not.
    backward, per chunk  z·4 + the previous chunk's grad_z·mm + (z − lse)·4 + exp(·)·4
                         (then grad_z /= τ and its cast to mm, no larger): (12 + mm)·C·V.
    weight gradient      (full fine-tuning: the head is trainable) a float32 accumulator
                         `zeros_like(weight, dtype=float32)`: 4·V·h for the whole backward,
                         and at each chunk's `grad_w += gz.T @ h` the (V, h) matmul output in
                         mm bytes while z (4) and grad_z (mm) are alive: mm·V·h + (4 + mm)·C·V.
                         So 4·V·h + max((12 + mm)·C·V, mm·V·h + (4 + mm)·C·V); the whole
                         head (unsharded under fsdp2), whatever N. Frozen head (LoRA): the
                         chunk's (12 + mm)·C·V only.
    grad of hidden       `empty_like(hidden)`: rs·N·h (backward only).
    per token            lse and logp 4 + 4 (saved / returned), entropy 4 when asked, and
                         grad_out 4 in the backward: N·4·(2 + [entropy] + [backward]).
    train = max(forward, backward) with every term above of its pass; scoring (no grad) =
    12·C·V + 8·N + rs·N·h (the reshaped (N, h) copy of the kept positions, freed after).
The head's bf16 weight copy under autocast (2·V·h) is made in the op's forward, freed, and made
again in its backward, so it is alive at the train peak: it stays in `autocast_weight_copies`.
The op saves its input, the (N, h) hidden states reshaped from a strided slice (a copy):
rs·N·h, counted with the activations (in place of the unfused head's saved c·h input cast).
An upper bound on the first micro-batch of a step (the accumulator then becomes `.grad`,
already counted in `gradients`).

Full logits (any other architecture): the model forward returns (B, T+1, V) logits for the
completion positions (`logits_to_keep`), in c bytes; the trainer takes `.float()` and
`ops.selective_log_softmax` saves that fp32 tensor for its chunked backward, which allocates one
fp32 gradient of the same shape, cast back to c bytes for the LM head. Peak per element:
4 (saved) + 4 (gradient) + 2 if 16-bit logits (the cast) + 4 if temperature != 1 (the division's
copy). Scoring: (c + 4) bytes per element (+ 4 if temperature != 1).
SFT counts every position of max_len (an upper bound: prompt positions carry no loss but are
scored when the prompt length is not given); RM has a scalar head (no logits).

Loading (`load_peak_gib`, `load_host_gib`), what `trainers.common.prepare_model(...,
sharded_later=True)`, `Reference` and `distributed.wrap(..., weights=)` hold before training.
    fsdp2 over N > 1 ranks (`distributed.loads_from_rank0`): rank 0 loads or builds the model in
    host memory (model.dtype; GGUF files: every rank, in host memory), the other ranks build it
    on the meta device; the reference is a meta copy of the policy, the critic
    (`ValueModel.from_policy`) a copy of its backbone (on rank 0's host, meta elsewhere), and
    `wrap` shards each one and fills every rank's shards from rank 0's full tensors
    (`set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`: one full tensor
    at a time, broadcast in rank 0's dtype w, then copied into the shard). Per GPU, once the
    last model (the critic, wrapped after the policy) is filled:
        load = (w_ref·P + w·P + w·P_critic) / N + w·max_tensor + reward model
    (P_critic = P_backbone + h + 1; LoRA: the policy's w·P_base + 4·T, no reference, a critic
    of 4·(T + h + 1)); max_tensor is the largest parameter (the embedding V·h in real models;
    rank 0 copies it from its host to the GPU to send it). Under cpu_offload the shards are
    allocated in host memory and the broadcast goes through gloo on the host (the
    "cpu:gloo,cuda:nccl" group): the GPU holds none of it, load = the reward model only.
    Rank 0's host (`load_host_gib`): its full policy w·P (a reward model: the causal LM it is
    made from, LM head included), plus the critic's copy of the backbone
    w·P_critic (4·(T + h + 1) under LoRA: the frozen base is shared), plus its offloaded shards
    under cpu_offload (the three terms / N); the reference shares the policy's tensors
    (`host_state`).
    Still full on every rank's GPU before sharding: verifiable-pairs DPO (it samples before
    `wrap`; rank 0 keeps its full copy, whose tensors are the ones broadcast, until its shards
    are filled: load = w·P/N + w·P) and a critic from `value.init_from` (loaded on the device
    before the policy is wrapped, and held by rank 0 through its own `wrap`: load =
    (w_ref·P + w·P)/N + w·P_critic + max(w·max_tensor, w·P_critic/N)); under cpu_offload the
    terms / N and w·max_tensor are 0 there too.
    One process, or ddp: the model is loaded on the GPU (w·P), the reference is a deep copy
    (+ w·P) and the critic a copy of the backbone (+ w·P_critic): load = w·(P + P + P_critic)
    with both, plus the reward model; nothing on the host.
This peak precedes training; it is reported apart and flagged when it, not the steady state, is
what does not fit.

What is not counted (so the estimate is a lower bound there): the CUDA context, cuBLAS / NCCL
workspaces and the caching allocator's fragmentation (`CALIBRATION`, subtracted from the card
before comparing); torch.compile / CUDA graphs; vLLM (its own memory fraction); evaluation
batches (eval.batch_size rows with their own KV cache); a reward model's scoring activations;
Python objects. Measured peaks to compare with: `torch.cuda.max_memory_allocated`, which also
excludes the context and fragmentation.
"""

from __future__ import annotations

import dataclasses

from rlhflab.optimizers import bytes_per_param
from rlhflab.plan.shapes import ModelShape

GIB = 2**30

#: Card memory not available to tensors: the CUDA context, cuBLAS and NCCL workspaces (a fixed
#: amount per process) and the caching allocator's fragmentation (a share of the tensors'
#: peak). A starting point to be calibrated against measured peaks (torch.cuda.max_memory_reserved
#: over max_memory_allocated, and nvidia-smi's total over max_memory_reserved) on the cards used.
CALIBRATION = {"fixed_gib": 1.5, "fragmentation": 0.10}


def usable_gib(gpu_memory_gib: float, calibration: dict | None = None) -> float:
    """GiB of a `gpu_memory_gib` card that tensors may use: the card minus the fixed per-process
    overhead, divided by 1 + fragmentation (`CALIBRATION` unless given)."""
    cal = CALIBRATION if calibration is None else calibration
    return max(0.0, gpu_memory_gib - cal["fixed_gib"]) / (1.0 + cal["fragmentation"])


@dataclasses.dataclass
class PlanInputs:
    """What sets the memory of a run (`inputs_from_config` fills it from an rlhflab config).

    trainer: "sft" | "policy_gradient" | "direct_alignment" | "reward_model".
    micro_batch: sequences per forward/backward (DPO: pairs, 2 rows each).
    prompt_len, completion_len: tokens (SFT / RM: prompt_len 0, completion_len = max_len).
    rollout_rows: sequences one rank generates at once (0: no rollout).
    """

    trainer: str = "policy_gradient"
    gpus: int = 1
    gpu_memory_gib: float = 80.0
    strategy: str = "none"  # none | ddp | fsdp2
    mixed_precision: str = "fp32"  # fsdp2 parameter dtype for compute: fp32 | bf16
    cpu_offload: bool = False  # fsdp2 CPUOffloadPolicy
    model_dtype: str = "float32"
    autocast: bool = True  # bf16 autocast (precision.autocast auto on a bf16 GPU, or bf16)
    lora_r: int | None = None
    lora_targets: list[str] | str = "all-linear"
    micro_batch: int = 8
    rows_per_example: int = 1  # 2 for DPO pairs and preference-RM pairs (chosen + rejected)
    prompt_len: int = 256
    completion_len: int = 512
    rollout_rows: int = 0
    rollout_rows_global: int = 0
    temperature: float = 1.0
    reference: bool = False
    reference_dtype: str | None = None  # None: what the code stores (bf16 under fsdp2 mp bf16)
    critic: bool = False
    critic_init_from: bool = False  # value.init_from: the critic loads on every rank's device
    loads_full: bool = False  # the model loads on every rank's device before wrap (verifiable DPO)
    reward_model: ModelShape | None = None
    activation_checkpointing: bool = False
    scoring_passes: bool = False  # no-grad log-prob passes over the rollout (PG)
    optimizer: str = "adamw"  # optim.name (rlhflab.optimizers): adamw | adamw_8bit | adamw_bf16
    half_weights: bool = False  # rollout.half_weights: the hf engine samples from a bf16 copy


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _bytes_of(dtype: str) -> int:
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[dtype]


def layer_activation_bytes(
    shape: ModelShape,
    *,
    c: int,
    rs: int,
    autocast: bool,
    lora_r: int | None = None,
    lora_targets: list[str] | str = "all-linear",
) -> int:
    """Bytes autograd saves per token for one decoder layer (formula in the module docstring).

    c: compute bytes (2 or 4); rs: residual-stream bytes; autocast: bf16 autocast on; lora_r:
    None for a trainable layer, else the rank of the adapters on a frozen layer."""
    h, q, k, f = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    qk = 1 if shape.qk_norm else 0
    if lora_r is None:
        norms = 2 * (4 * h + rs * h)
        casts = 5 * c * h if (autocast and rs == 4) else 0
        linear_inputs = casts + c * q + c * f
        return norms + linear_inputs + qk * (4 + c) * (q + k) + 4 * c * q + 4 * c * f
    adapted = shape._adapted(lora_targets)
    c_lora = c if autocast else 4
    if not autocast and rs == 4:  # no cast: adapters reading the same input share one tensor
        source = {"q_proj": "attn_norm", "k_proj": "attn_norm", "v_proj": "attn_norm",
                  "gate_proj": "mlp_norm", "up_proj": "mlp_norm"}  # fmt: skip
        dims = shape.linear_dims()
        inputs = {source.get(n, n): dims[n][0] for n in shape._names(lora_targets)}
        return (
            2 * 4 * h + qk * 4 * (q + k) + 4 * c * q + 3 * c * f
            + sum(4 * d for d in inputs.values()) + 4 * lora_r * len(adapted)
        )  # fmt: skip
    adapters = sum(c_lora * (d_in + lora_r) for d_in, _ in adapted)
    return 2 * 4 * h + qk * 4 * (q + k) + 4 * c * q + 3 * c * f + adapters


#: Elements of one float32 (rows, V) block of the fused head (`ops._FUSED_BLOCK`, 8 Mi).
FUSED_BLOCK = 1 << 23


def fused_head_bytes(
    shape: ModelShape, scored: int, *, c: int, rs: int, head_trainable: bool, entropy: bool
) -> tuple[int, int]:
    """(train, scoring) bytes of `ops.linear_selective_log_softmax` over `scored` rows (N) at its
    peaks, the module docstring's "Fused head" terms; c: the matmul bytes (2 or 4), rs: the
    hidden states' bytes. Excludes the head's autocast copy and its saved input (counted
    elsewhere)."""
    h, V = shape.hidden_size, shape.vocab_size
    chunk = min(scored, max(1, FUSED_BLOCK // V)) * V  # C·V elements
    e = 1 if entropy else 0
    forward = (21 if entropy else 12) * chunk + 4 * (2 + e) * scored
    loop = (12 + c) * chunk  # the chunk's own peak: z, grad_z, (z − lse), exp
    if head_trainable:  # the accumulator, and at the weight's matmul its output + z + grad_z
        loop = 4 * V * h + max(loop, c * V * h + (4 + c) * chunk)
    backward = loop + rs * h * scored + 4 * (3 + e) * scored
    scoring = 12 * chunk + 8 * scored + rs * h * scored
    return max(forward, backward), scoring


def estimate(shape: ModelShape, p: PlanInputs) -> dict:
    """Per-GPU memory of one rank of the run `p` on model `shape`.

    Returns a dict: `components` {name: GiB} (each term at its own peak), `phases`
    {phase: GiB of its transient terms}, `resident_gib`, `binding_phase`, `per_gpu_gib`
    (resident + the largest phase), `usable_gib`, `fits`, `load_peak_gib` (per GPU),
    `load_fits`, `load_host_gib` (rank 0's host memory while loading),
    `binding_constraint` ("load", or "steady state (<phase>)"),
    `host_gib` (per rank, offloaded state), `params_b`, `trainable_b`.
    Raises ValueError on an unknown strategy or dtype, or gpus / micro_batch < 1.
    """
    if p.strategy not in ("none", "ddp", "fsdp2"):
        raise ValueError(f"parallel.strategy: {p.strategy!r} is not none, ddp or fsdp2")
    if p.gpus < 1 or p.micro_batch < 1:
        raise ValueError("gpus and micro-batch must be >= 1")
    fsdp = p.strategy == "fsdp2" and p.gpus > 1
    n = p.gpus if fsdp else 1
    offload = fsdp and p.cpu_offload
    w = _bytes_of(p.model_dtype)
    compute_w = 2 if (fsdp and p.mixed_precision == "bf16") else w  # unsharded param dtype
    w_ref = _bytes_of(p.reference_dtype) if p.reference_dtype else (2 if compute_w == 2 else w)
    c = 2 if (p.autocast or compute_w == 2) else 4
    rs = compute_w
    casts_weights = p.autocast and compute_w == 4  # autocast makes bf16 copies of fp32 weights
    lora = p.lora_r is not None
    P = shape.params()
    P_bb = shape.backbone_params()
    T = shape.lora_params(p.lora_r, p.lora_targets) if lora else 0
    head = shape.hidden_size + 1 if p.trainer == "reward_model" else 0  # score head
    trainable = (T if lora else P) + head

    # -- resident state (per GPU)
    gpu, host = {}, {}

    def put(name: str, nbytes: float, shardable: bool = True) -> None:
        per = nbytes / n if shardable else nbytes
        if offload and shardable:
            host[name] = host.get(name, 0.0) + per
            gpu[name] = gpu.get(name, 0.0)
        else:
            gpu[name] = gpu.get(name, 0.0) + per

    P_model = P_bb + head if p.trainer == "reward_model" else P
    if lora:
        put("parameters", w * (P_model - head) + 4 * (T + head))
        put("gradients", 4 * trainable)
        put("optimizer_state", bytes_per_param(p.optimizer, 4) * trainable)
    else:
        put("parameters", w * P_model)
        put("gradients", w * trainable)
        put("optimizer_state", bytes_per_param(p.optimizer, w) * trainable)
    put("reference", w_ref * P if (p.reference and not lora) else 0.0)
    if p.critic:
        critic_trainable = T + shape.hidden_size + 1 if lora else P_bb + shape.hidden_size + 1
        put("critic", (16 if lora else 4 * w) * critic_trainable)
    else:
        put("critic", 0.0)
    rm = p.reward_model
    put("reward_model", 4 * rm.backbone_params() if rm else 0.0, shardable=False)
    resident = sum(gpu.values())

    # -- transient terms
    L = shape.num_hidden_layers
    seq = p.prompt_len + p.completion_len
    rows = p.micro_batch * p.rows_per_example
    tokens = rows * seq
    a_layer = layer_activation_bytes(
        shape, c=c, rs=rs, autocast=p.autocast, lora_r=p.lora_r, lora_targets=p.lora_targets
    )
    h, V = shape.hidden_size, shape.vocab_size
    scored = rows * (p.completion_len + (1 if fsdp else 0))  # N: rows the fused head scores
    fused = shape.fused_head and p.trainer != "reward_model"  # RM: a scalar score head
    head_in = rs * h * scored if fused else c * h * tokens
    outside = (4 * h + rs * h) * tokens + head_in
    if p.activation_checkpointing:
        act = L * rs * h * tokens + a_layer * tokens + outside
    else:
        act = L * a_layer * tokens + outside
    if p.trainer == "reward_model":
        logits_train = logits_score = 0.0
    elif fused:
        logits_train, logits_score = fused_head_bytes(
            shape, scored, c=c, rs=rs, head_trainable=not lora,
            entropy=p.trainer == "policy_gradient",
        )  # fmt: skip
    else:
        elems = rows * (p.completion_len + 1) * V
        half = c == 2
        tau = 4 if p.temperature != 1.0 else 0
        logits_train = elems * (8 + (2 if half else 0) + tau)
        logits_score = elems * ((c + 4) if half else 4) + elems * tau
    cast_copies = 2 * shape.linear_params() if casts_weights else 0.0
    if lora and p.autocast:  # the fp32 adapters' bf16 casts (cached: trainable leaves)
        cast_copies += 2 * T
    layer_unsharded = 0.0
    gathered = 0.0
    score_weights = 0.0
    score_gathers = False
    biggest = max([V * h, *(a * b for a, b in shape.linear_dims().values())])  # largest tensor
    if fsdp:
        root = (P - L * shape.layer_params()) * compute_w
        layer_unsharded = root + 2 * shape.layer_params() * compute_w + 4 * shape.layer_params()
        gathered = P * compute_w  # distributed.gathered: the whole model at once
        # the policy gradient's scoring passes run through the models' own forwards: the root
        # and two layers at a time, as in training without the gradients; the critic's values
        # and DPO's reference pass gather the model whole
        score_gathers = p.trainer != "policy_gradient" or p.critic
        score_weights = gathered if score_gathers else root + 2 * shape.layer_params() * compute_w
    critic_act = 0.0
    if p.critic:
        critic_act = L * a_layer * tokens if not p.activation_checkpointing else act
    train = max(act + logits_train, critic_act) + cast_copies + layer_unsharded

    score = 0.0
    if p.scoring_passes or p.reference or p.critic:
        one_layer = a_layer * tokens
        score = logits_score + one_layer + cast_copies + score_weights
    kv = 0.0
    rollout = 0.0
    half_copy = 0.0
    if p.rollout_rows > 0:
        kv_per_token = 2 * L * shape.kv_dim * c
        kv = kv_per_token * p.rollout_rows * seq
        sampling = 4 * 4 * max(p.rollout_rows_global, p.rollout_rows) * shape.vocab_size
        rollout = kv + sampling + cast_copies + gathered
        if p.half_weights:  # the bf16 copy instead: no weight casts, no whole model gathered
            # (under fsdp2 the copy is filled one parameter at a time: the largest, full, in w)
            half_copy = 2 * P + (w * biggest if fsdp else 0.0)
            rollout = kv + sampling + half_copy
    if offload:
        opt_temp = 0.0
    elif p.optimizer == "adamw":
        opt_temp = (4 if lora else w) * trainable / n
    else:  # torchao steps one tensor at a time: one fp32 copy of the largest (its shard);
        # LoRA: of all the adapters together (an upper bound, small)
        opt_temp = 4 * (T if lora else shape.vocab_size * shape.hidden_size) / n
    phases = {"train": train, "scoring": score, "rollout": rollout, "optimizer_step": opt_temp}
    binding = max(phases, key=phases.get)
    total = resident + phases[binding]

    # loading (module docstring "Loading"): parameter bytes of each model, unsharded
    policy_b = w * (P_model - head) + 4 * (T + head) if lora else w * P_model
    ref_b = w_ref * P if (p.reference and not lora) else 0.0
    crit_b = 0.0
    if p.critic:
        crit_b = 4 * (T + h + 1) if lora else w * (P_bb + h + 1)
    rm_b = gpu.get("reward_model", 0.0)
    if fsdp:
        flight = 0.0 if offload else w * biggest  # the full tensor being broadcast
        sh = 0.0 if offload else 1 / n  # the share of each model's shards on the GPU
        load = (ref_b + policy_b + crit_b) * sh + flight
        if p.loads_full:  # rank 0 keeps its full copy on the GPU until its shards are filled
            load = (ref_b + policy_b + crit_b) * sh + policy_b
        if p.critic and p.critic_init_from:  # full on the GPU, held by rank 0 through its wrap
            load = (ref_b + policy_b) * sh + crit_b + max(flight, crit_b * sh)
        load += rm_b
        host_crit = 0.0 if p.critic_init_from else crit_b
        lm_b = w * P if (p.trainer == "reward_model" and not lora) else policy_b  # the full LM
        load_host = 0.0 if p.loads_full else lm_b + host_crit
        if offload:
            load_host += (ref_b + policy_b + crit_b) / n
    else:  # the model on the GPU, a deep copy for the reference, a copy of the backbone
        load = policy_b + (w * P if ref_b else 0.0) + crit_b + rm_b
        load_host = 0.0

    usable = usable_gib(p.gpu_memory_gib)
    comps = {
        **{k: v / GIB for k, v in gpu.items()},
        "activations": act / GIB,
        "logits": max(logits_train, logits_score if score else 0.0) / GIB,
        "autocast_weight_copies": cast_copies / GIB,
        "fsdp_unsharded_working_set": layer_unsharded / GIB,
        "fsdp_gathered_model": gathered / GIB
        if ((score and score_gathers) or (rollout and not p.half_weights))
        else 0.0,
        "rollout_half_copy": half_copy / GIB,
        "rollout_kv_cache": kv / GIB,
        "optimizer_step_temporaries": opt_temp / GIB,
    }
    return {
        "params_b": P / 1e9,
        "trainable_b": trainable / 1e9,
        "components": comps,
        "host_components": {k: v / GIB for k, v in host.items()},
        "resident_gib": resident / GIB,
        "phases": {k: v / GIB for k, v in phases.items()},
        "binding_phase": binding,
        "per_gpu_gib": total / GIB,
        "usable_gib": usable,
        "fits": total / GIB <= usable,
        "load_peak_gib": load / GIB,
        "load_fits": load / GIB <= usable,
        "load_host_gib": load_host / GIB,
        # what does not fit first: "load" when only the loading peak is over the card
        "binding_constraint": (
            "load" if total / GIB <= usable < load / GIB else f"steady state ({binding})"
        ),
        "host_gib": sum(host.values()) / GIB,
        "calibration": dict(CALIBRATION),
    }


def max_micro_batch(shape: ModelShape, p: PlanInputs, limit: int) -> int:
    """The largest micro-batch in 1..limit whose estimate fits (0: not even 1 fits). Memory grows
    with the micro-batch, so a binary search."""
    lo, hi = 0, max(1, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(shape, dataclasses.replace(p, micro_batch=mid))["fits"]:
            lo = mid
        else:
            hi = mid - 1
    return lo
