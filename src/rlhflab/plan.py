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
    optimizer    torch AdamW: exp_avg and exp_avg_sq like the parameter: 2·w per trainable
                 parameter (8 bytes in fp32; 4 for a bf16 model.dtype).
    reference    (policy gradient with kl.coef > 0, full fine-tuning) a frozen deep copy of the
                 policy: w_ref·P (w_ref = model.dtype today; `reference_dtype` plans the bf16 copy
                 issue #25 asks for). LoRA: 0 (the base with adapters disabled is π_ref).
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
              autocast weight copies (below).
    scoring   no-grad log-probs of the old / reference policy and the critic's values, one
              micro-batch at a time: (B, T+1, V) logits in c bytes plus their float() copy in fp32
              (+ fp32 again when temperature != 1); one layer's activations; the gathered model.
    train     forward + backward of one micro-batch: activations (below), logits (below), autocast
              weight copies, and under fsdp2 the unsharded working set: the root's embedding /
              norm / LM head for the whole forward and backward, plus two decoder layers
              (current + prefetch) in compute dtype and one layer of unsharded fp32 gradients.
              PPO's critic runs its own forward/backward after the policy's: the phase is the
              larger of the two.
    optimizer torch AdamW (foreach, the CUDA default) allocates one temporary like exp_avg_sq
              (sqrt) for all parameters of a dtype at once: w per trainable parameter (on the host
              under cpu_offload).

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
    Outside the layers: the final norm (4h + rs·h) + c·h per token.
Tokens per micro-batch: rows × (prompt + completion) (DPO: 2 rows per pair; SFT / RM: max_len).

Logits (`completion_logps`): the model forward returns (B, T+1, V) logits for the completion
positions (`logits_to_keep`), in c bytes; the trainer takes `.float()` and
`ops.selective_log_softmax` saves that fp32 tensor for its chunked backward, which allocates one
fp32 gradient of the same shape, cast back to c bytes for the LM head. Peak per element:
4 (saved) + 4 (gradient) + 2 if 16-bit logits (the cast) + 4 if temperature != 1 (the division's
copy). The row-chunked log-softmax removes only the *extra* fp32 copies inside the softmax; the
(B, T+1, V) tensors remain. SFT counts every position of max_len (an upper bound: prompt positions
carry no loss but are in the logits when the prompt length is not given); RM has a scalar head
(no logits).

Loading (`load_peak_gib`): today every rank builds the full model on its GPU in model.dtype before
sharding (P·w), and the reference (a deep copy) and the critic (a copy of the backbone) are made
from that full model before it is sharded: one more full copy at that moment. This peak precedes
training; it is reported apart and flagged when it, not the steady state, is what does not fit.

What is not counted (so the estimate is a lower bound there): the CUDA context, cuBLAS / NCCL
workspaces and the caching allocator's fragmentation (`CALIBRATION`, subtracted from the card
before comparing); torch.compile / CUDA graphs; vLLM (its own memory fraction); evaluation
batches (eval.batch_size rows with their own KV cache); a reward model's scoring activations;
Python objects. Measured peaks to compare with: `torch.cuda.max_memory_allocated`, which also
excludes the context and fragmentation.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

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


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The shape of a dense Llama / Qwen3 decoder (the config.json fields that set its memory)."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on q and k

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """{module name: (d_in, d_out)} of the nn.Linear layers of one decoder block."""
        h, q, k, f = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, k),
            "v_proj": (h, k),
            "o_proj": (q, h),
            "gate_proj": (h, f),
            "up_proj": (h, f),
            "down_proj": (f, h),
        }

    def layer_params(self) -> int:
        """Parameters of one decoder block: its linears, two RMSNorms, Qwen3's q/k norms."""
        lin = sum(i * o for i, o in self.linear_dims().values())
        return lin + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def embedding_params(self) -> int:
        """V·h, and 2·V·h when the LM head is not tied to the embedding."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def params(self) -> int:
        """Distinct parameters (tied weights once): layers, embeddings, final norm."""
        return (
            self.num_hidden_layers * self.layer_params()
            + self.embedding_params()
            + self.hidden_size
        )

    def backbone_params(self) -> int:
        """Parameters without an untied LM head (the critic's / a reward model's backbone)."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.params() - head

    def linear_params(self) -> int:
        """Parameters that go through nn.Linear (the blocks' linears and the LM head)."""
        lin = sum(i * o for i, o in self.linear_dims().values())
        return self.num_hidden_layers * lin + self.vocab_size * self.hidden_size

    def lora_params(self, r: int, targets: list[str] | str = "all-linear") -> int:
        """Trainable LoRA parameters: r·(d_in + d_out) per adapted linear of every block."""
        return self.num_hidden_layers * r * sum(i + o for i, o in self._adapted(targets))

    def _names(self, targets: list[str] | str) -> list[str]:
        """The block linears that `targets` (module-name suffixes or "all-linear") adapt."""
        dims = self.linear_dims()
        if targets == "all-linear":
            return list(dims)
        return [n for n in dims if any(n == t or n.endswith(t) for t in targets)]

    def _adapted(self, targets: list[str] | str) -> list[tuple[int, int]]:
        dims = self.linear_dims()
        return [dims[n] for n in self._names(targets)]


def _qwen3(name, h, layers, f, heads, kv, vocab, tied) -> ModelShape:
    return ModelShape(name, h, layers, f, heads, kv, 128, vocab, tied, qk_norm=True)


#: Published config.json values (Hugging Face model cards).
BUILTIN_SHAPES: dict[str, ModelShape] = {
    "qwen3-0.6b": _qwen3("qwen3-0.6b", 1024, 28, 3072, 16, 8, 151936, True),
    "qwen3-1.7b": _qwen3("qwen3-1.7b", 2048, 28, 6144, 16, 8, 151936, True),
    "qwen3-4b": _qwen3("qwen3-4b", 2560, 36, 9728, 32, 8, 151936, True),
    "qwen3-8b": _qwen3("qwen3-8b", 4096, 36, 12288, 32, 8, 151936, False),
    "llama-3.2-1b": ModelShape("llama-3.2-1b", 2048, 16, 8192, 32, 8, 64, 128256, True),
    "llama-3.2-3b": ModelShape("llama-3.2-3b", 3072, 28, 8192, 24, 8, 128, 128256, True),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 4096, 32, 14336, 32, 8, 128, 128256, False),
}


def resolve_shape(name_or_path: str) -> ModelShape:
    """A built-in shape by name, or the shape in `<dir>/config.json` of a local model directory.

    Raises:
        ValueError: neither a built-in name nor a directory with a readable config.json, a
            field missing or not a positive integer, or a mixture-of-experts model.
    """
    key = name_or_path.lower()
    if key in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[key]
    path = Path(name_or_path) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model: {name_or_path!r} is neither a built-in shape "
            f"({', '.join(BUILTIN_SHAPES)}) nor a directory with a config.json"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model: cannot read {path}: {exc}") from None
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg
    if not isinstance(cfg, dict):
        raise ValueError(f"--model: {path} is not a JSON object")
    if any(k in cfg for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(f"--model: {path}: mixture-of-experts models are not planned")

    def field(key: str, default=None) -> int:
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--model: {path}: '{key}' must be a positive integer, got {value!r}")
        return value

    heads = field("num_attention_heads")
    hidden = field("hidden_size")
    return ModelShape(
        name=str(name_or_path),
        hidden_size=hidden,
        num_hidden_layers=field("num_hidden_layers"),
        intermediate_size=field("intermediate_size"),
        num_attention_heads=heads,
        num_key_value_heads=field("num_key_value_heads", heads),
        head_dim=field("head_dim", cfg.get("head_dim") or hidden // heads),
        vocab_size=field("vocab_size"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=str(cfg.get("model_type", "")).startswith("qwen3"),
    )


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
    reference_dtype: str | None = None  # None: model.dtype (a deep copy, as the code does today)
    critic: bool = False
    reward_model: ModelShape | None = None
    activation_checkpointing: bool = False
    scoring_passes: bool = False  # no-grad log-prob passes over the rollout (PG)


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


def estimate(shape: ModelShape, p: PlanInputs) -> dict:
    """Per-GPU memory of one rank of the run `p` on model `shape`.

    Returns a dict: `components` {name: GiB} (each term at its own peak), `phases`
    {phase: GiB of its transient terms}, `resident_gib`, `binding_phase`, `per_gpu_gib`
    (resident + the largest phase), `usable_gib`, `fits`, `load_peak_gib`, `load_fits`,
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
    w_ref = _bytes_of(p.reference_dtype) if p.reference_dtype else w
    compute_w = 2 if (fsdp and p.mixed_precision == "bf16") else w  # unsharded param dtype
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
        put("optimizer_state", 8 * trainable)
    else:
        put("parameters", w * P_model)
        put("gradients", w * trainable)
        put("optimizer_state", 2 * w * trainable)
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
    outside = (4 * shape.hidden_size + rs * shape.hidden_size + c * shape.hidden_size) * tokens
    if p.activation_checkpointing:
        act = L * rs * shape.hidden_size * tokens + a_layer * tokens + outside
    else:
        act = L * a_layer * tokens + outside
    if p.trainer == "reward_model":
        logits_train = logits_score = 0.0
    else:
        elems = rows * (p.completion_len + 1) * shape.vocab_size
        half = c == 2
        tau = 4 if p.temperature != 1.0 else 0
        logits_train = elems * (8 + (2 if half else 0) + tau)
        logits_score = elems * ((c + 4) if half else 4) + elems * tau
    cast_copies = 2 * shape.linear_params() if casts_weights else 0.0
    if lora and p.autocast:  # the fp32 adapters' bf16 casts (cached: trainable leaves)
        cast_copies += 2 * T
    layer_unsharded = 0.0
    gathered = 0.0
    if fsdp:
        root = (P - L * shape.layer_params()) * compute_w
        layer_unsharded = root + 2 * shape.layer_params() * compute_w + 4 * shape.layer_params()
        gathered = P * compute_w  # distributed.gathered: the whole model at once
    critic_act = 0.0
    if p.critic:
        critic_act = L * a_layer * tokens if not p.activation_checkpointing else act
    train = max(act + logits_train, critic_act) + cast_copies + layer_unsharded

    score = 0.0
    if p.scoring_passes or p.reference or p.critic:
        one_layer = a_layer * tokens
        score = logits_score + one_layer + cast_copies + gathered
    kv = 0.0
    rollout = 0.0
    if p.rollout_rows > 0:
        kv_per_token = 2 * L * shape.kv_dim * c
        kv = kv_per_token * p.rollout_rows * seq
        sampling = 4 * 4 * max(p.rollout_rows_global, p.rollout_rows) * shape.vocab_size
        rollout = kv + sampling + cast_copies + gathered
    opt_temp = 0.0 if offload else (4 if lora else w) * trainable / n
    phases = {"train": train, "scoring": score, "rollout": rollout, "optimizer_step": opt_temp}
    binding = max(phases, key=phases.get)
    total = resident + phases[binding]

    # loading: the full model on every rank's GPU, plus a full copy for the reference / critic
    extra_copy = (p.reference and not lora) or (p.critic and not lora)
    load = w * P_model * (2 if extra_copy else 1)
    if fsdp and not offload:
        load += gpu.get("reward_model", 0.0)

    usable = usable_gib(p.gpu_memory_gib)
    comps = {
        **{k: v / GIB for k, v in gpu.items()},
        "activations": act / GIB,
        "logits": max(logits_train, logits_score if score else 0.0) / GIB,
        "autocast_weight_copies": cast_copies / GIB,
        "fsdp_unsharded_working_set": layer_unsharded / GIB,
        "fsdp_gathered_model": gathered / GIB if (score or rollout) else 0.0,
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
        # what does not fit first: "load" when only today's loading peak is over the card
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


def _local_shape(path: str | None, fallback: ModelShape) -> ModelShape:
    """The shape at a local model directory `path`, else `fallback` (a hub id cannot be read
    offline; a reward model is assumed to be the policy's shape then)."""
    if path and (Path(path) / "config.json").is_file():
        return resolve_shape(path)
    return fallback


def inputs_from_config(
    cfg,
    shape: ModelShape,
    *,
    gpus: int,
    gpu_memory_gib: float,
    prompt_len: int | None = None,
    completion_len: int | None = None,
    activation_checkpointing: bool = False,
    reference_dtype: str | None = None,
) -> tuple[PlanInputs, int]:
    """PlanInputs of an rlhflab config (`rlhflab.config.load_config`) on `gpus` GPUs, and the
    largest micro-batch worth trying (the rows one rank trains per optimizer step).

    prompt_len: prompt tokens where the config does not bound them (policy-gradient prompts, DPO
    pairs without data.max_prompt_len); None: 256 (0 for SFT / RM, whose max_len bounds the whole
    sequence). completion_len: overrides the config's max_new_tokens / max_len / completion bound.
    """
    trainer = cfg.trainer
    par = cfg.parallel
    strategy = par.strategy
    if strategy == "auto":
        strategy = "ddp" if gpus > 1 else "none"
    ranks = gpus if strategy != "none" else 1
    lora = cfg.model.lora
    p = PlanInputs(
        trainer=trainer,
        gpus=gpus,
        gpu_memory_gib=gpu_memory_gib,
        strategy=strategy,
        mixed_precision=par.mixed_precision,
        cpu_offload=par.cpu_offload,
        model_dtype=cfg.model.dtype,
        autocast=cfg.precision.autocast != "none",
        lora_r=lora.r if lora is not None else None,
        lora_targets=lora.target_modules if lora is not None else "all-linear",
        activation_checkpointing=activation_checkpointing or cfg.model.gradient_checkpointing,
        reference_dtype=reference_dtype,
    )
    default_prompt = 256 if prompt_len is None else prompt_len
    if trainer == "policy_gradient":
        ro = cfg.rollout
        batch = ro.prompts_per_step * ro.group_size
        per_rank = max(1, batch // ranks)
        limit = max(1, batch // cfg.train.minibatches // ranks)
        p.micro_batch = min(cfg.train.micro_batch_size, limit)
        p.prompt_len = default_prompt
        p.completion_len = completion_len or ro.max_new_tokens
        p.rollout_rows, p.rollout_rows_global = per_rank, batch
        p.temperature = ro.temperature
        p.reference = cfg.kl.coef > 0
        p.critic = cfg.value is not None
        steps_per_batch = cfg.train.update_epochs * cfg.train.minibatches
        p.scoring_passes = steps_per_batch > 1 or (p.reference and cfg.kl.placement != "loss")
        rm = [c for c in cfg.reward.components if c.name == "reward_model"]
        if rm:
            p.reward_model = _local_shape(rm[0].args.get("path"), shape)
    elif trainer == "direct_alignment":
        d, v = cfg.data, cfg.verifiable
        p.rows_per_example = 2
        limit = max(1, cfg.train.batch_size // ranks)
        p.micro_batch = min(cfg.train.micro_batch_size, limit)
        p.prompt_len = d.max_prompt_len or default_prompt
        if d.source == "verifiable":
            p.completion_len = completion_len or v.max_new_tokens
            p.rollout_rows = p.rollout_rows_global = min(
                cfg.eval.batch_size, v.n_prompts * v.samples_per_prompt
            )
        else:
            p.completion_len = completion_len or d.max_completion_len or 256
        p.scoring_passes = True  # reference log-probs, once per round, without gradients
    elif trainer in ("sft", "reward_model"):
        max_len = cfg.train.max_len if trainer == "sft" else cfg.data.max_len
        if trainer == "reward_model" and cfg.kind == "preference":
            p.rows_per_example = 2
        limit = max(1, cfg.train.batch_size // ranks)
        p.micro_batch = min(cfg.train.micro_batch_size, limit)
        p.prompt_len = 0 if prompt_len is None else prompt_len
        p.completion_len = completion_len or max(1, max_len - p.prompt_len)
    else:
        raise ValueError(f"trainer: {trainer!r} is not planned")
    return p, limit


def plan(
    model: str,
    *,
    gpus: int,
    gpu_memory_gib: float,
    config: str | None = None,
    overrides: list[str] | None = None,
    prompt_len: int | None = None,
    completion_len: int | None = None,
    activation_checkpointing: bool = False,
    reference_dtype: str | None = None,
) -> dict:
    """The `rlhflab plan` result: `estimate` of the run, its inputs, the largest micro-batch.

    config: an rlhflab preset (loaded with `rlhflab.config.load_config`, overrides applied); None:
    a policy-gradient run with every default (overrides such as `trainer=sft` pick another).
    Raises ConfigError (one line) on a bad model, config, override or number.
    """
    from rlhflab.config import apply_overrides, config_from_dict, load_config
    from rlhflab.errors import ConfigError

    if gpus < 1:
        raise ConfigError(f"--gpus: must be >= 1, got {gpus}")
    if not gpu_memory_gib > 0:
        raise ConfigError(f"--gpu-memory: must be > 0 GiB, got {gpu_memory_gib}")
    for name, v in (("--prompt-len", prompt_len), ("--completion-len", completion_len)):
        if v is not None and v < (0 if name == "--prompt-len" else 1):
            raise ConfigError(f"{name}: must be >= {0 if name == '--prompt-len' else 1}, got {v}")
    if reference_dtype not in (None, *_DTYPE_BYTES):
        raise ConfigError(f"--reference-dtype: choose one of {', '.join(_DTYPE_BYTES)}")
    try:
        shape = resolve_shape(model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if config is not None:
        cfg = load_config(config, overrides or [])
    else:
        raw = apply_overrides({"trainer": "policy_gradient"}, overrides or [])
        raw.setdefault("model", {})
        if isinstance(raw["model"], dict) and "build" not in raw["model"]:
            raw["model"].setdefault("name_or_path", model)
        cfg = config_from_dict(raw, source="plan")
    try:
        p, limit = inputs_from_config(
            cfg,
            shape,
            gpus=gpus,
            gpu_memory_gib=gpu_memory_gib,
            prompt_len=prompt_len,
            completion_len=completion_len,
            activation_checkpointing=activation_checkpointing,
            reference_dtype=reference_dtype,
        )
        out = estimate(shape, p)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    out["max_micro_batch"] = max_micro_batch(shape, p, limit)
    out["micro_batch_limit"] = limit
    inputs = dataclasses.asdict(p)
    inputs["reward_model"] = p.reward_model.name if p.reward_model else None
    return {
        "model": dataclasses.asdict(shape),
        "config": config,
        "overrides": list(overrides or []),
        "inputs": inputs,
        **out,
    }


_ROWS = [
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state (AdamW)"),
    ("reference", "reference (frozen)"),
    ("critic", "critic (params+grads+optim)"),
    ("reward_model", "reward model"),
    ("activations", "activations"),
    ("logits", "logits"),
    ("autocast_weight_copies", "autocast bf16 weight copies"),
    ("fsdp_unsharded_working_set", "FSDP2 unsharded layers + root"),
    ("fsdp_gathered_model", "FSDP2 whole model gathered"),
    ("rollout_kv_cache", "rollout KV cache"),
    ("optimizer_step_temporaries", "optimizer-step temporaries"),
]
_PHASE_OF = {
    "activations": "train",
    "logits": "train / scoring",
    "autocast_weight_copies": "train, scoring, rollout",
    "fsdp_unsharded_working_set": "train",
    "fsdp_gathered_model": "scoring, rollout",
    "rollout_kv_cache": "rollout",
    "optimizer_step_temporaries": "optimizer step",
}


def summary_rows(result: dict) -> list[tuple[str, str, str]]:
    """(term, GiB per GPU, when) rows of a `plan` result, for the table."""
    rows = []
    comps, host = result["components"], result["host_components"]
    for key, label in _ROWS:
        v = comps.get(key, 0.0)
        when = _PHASE_OF.get(key, "resident")
        if key in host and host[key] > 0:
            when = f"host: {host[key]:.2f} GiB"
        rows.append((label, f"{v:.2f}", when))
    rows.append(("resident total", f"{result['resident_gib']:.2f}", "whole step"))
    for phase, v in result["phases"].items():
        mark = " (largest)" if phase == result["binding_phase"] else ""
        rows.append((f"phase: {phase}", f"{v:.2f}", f"transient{mark}"))
    return rows


def render(result: dict, console=None) -> None:
    """Print a `plan` result as a table (rich) with the verdict lines under it."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    i = result["inputs"]
    title = (
        f"{result['model']['name']} ({result['params_b']:.2f} B params, "
        f"{result['trainable_b']:.3g} B trainable) · {i['trainer']} · {i['gpus']} GPU × "
        f"{i['gpu_memory_gib']:g} GiB · {i['strategy']}"
    )
    table = Table(title=title)
    table.add_column("term")
    table.add_column("GiB / GPU", justify="right")
    table.add_column("when")
    for row in summary_rows(result):
        table.add_row(*row)
    verdict = "fits" if result["fits"] else "does NOT fit"
    table.add_row(
        "total per GPU",
        f"{result['per_gpu_gib']:.2f}",
        f"resident + {result['binding_phase']}: {verdict} in {result['usable_gib']:.1f} usable",
    )
    load = "fits" if result["load_fits"] else "does NOT fit (binding)"
    table.add_row("load peak (today's loader)", f"{result['load_peak_gib']:.2f}", load)
    console.print(table)
    cal = result["calibration"]
    console.print(
        f"usable = ({i['gpu_memory_gib']:g} GiB − {cal['fixed_gib']} GiB CUDA context/workspaces)"
        f" / (1 + {cal['fragmentation']:.0%} fragmentation) = {result['usable_gib']:.1f} GiB; "
        f"micro-batch {i['micro_batch']} (largest that fits: {result['max_micro_batch']} "
        f"of {result['micro_batch_limit']}); host (offloaded) {result['host_gib']:.1f} GiB per rank"
    )
