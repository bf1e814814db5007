"""Batched sampling with a KV cache, and the log-probs the trainer recomputes from the same tokens.

All prompts of a step are sampled together: prompts are left-padded to a common width P, position
ids count only real tokens (so padding never shifts a sequence), every sequence stops at its own
EOS, and sequences that have stopped are dropped from the batch so later decoding steps only pay
for the ones still running. What comes back is a `Rollout` of token ids — nothing is decoded and
re-tokenised for training.

The sampling distribution is π_θ(· | context) at temperature τ: softmax(logits / τ). Sampler
log-probs `logp` are taken under that tempered distribution *before* top-k / top-p truncation,
which is the convention of TRL and verl; with top_k = 0 and top_p = 1 they are the exact
log-probs of the tokens drawn.

Draws use the Gumbel-max trick, argmax_v(logits_v / τ + g_v) with g = −log(−log u), u ~ U(0, 1),
which samples exactly softmax(logits / τ) (restricted to the top-k / top-p set). The uniforms come
from a counter-based generator (`counter_uniform`): u is a hash of (the call's seed, global row,
decoding step, vocabulary index), so each process computes the noise of its own rows only
(memory per token: own rows × V) and a completion's tokens depend only on its prompt, its global
row and the seed — not on its batch neighbours, on which rows already stopped, or on how the
global batch is split over data-parallel ranks (each rank samples its own rows and gets what one
process would).

Prefix sharing: a prompt that occurs several times in the batch (a group of `group_size` samples
of one prompt) is prefilled once; its KV cache and first-token logits are then copied to each of
its rows (`KV-cache expansion`), so a group costs one prefill instead of `group_size`. The draws
are those of the unshared batch (same rows, same noise), so the tokens are the same.

A sequence stops at the first of its stop tokens (EOS and any `stop_token_ids`); the stop token is
kept in the completion and counted in the mask, as EOS always was.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from rlhflab import distributed
from rlhflab.models.packing import PackedLayout, can_pack, layout_for, packed_hidden
from rlhflab.ops import (
    entropy_from_logits,
    linear_selective_log_softmax,
    position_ids_from_mask,
    selective_log_softmax,
    upcast,
)
from rlhflab.rollout.kv_cache import (
    PreallocatedLayer,
    PrefixStore,
    preallocated_cache,
    select_static_rows,
    static_cache,
)
from rlhflab.rollout.noise import CounterNoise, counter_uniform  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)
DECODE_PATHS = ("eager", "static")


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword under which `model`'s forward takes its KV cache (a transformers `Cache`):
    "cache" where the forward has that parameter (transformers >= 5.24, whose forwards mark
    `past_key_values` as deprecated, and rlhflab's own `gpt`), else "past_key_values" (older
    transformers). A wrapper is looked through: DDP's `.module`, torch.compile's `_orig_mod`
    (their forwards take **kwargs and hand them on)."""
    inner = model
    while hasattr(inner, "module") or hasattr(inner, "_orig_mod"):
        inner = getattr(inner, "module", None) or inner._orig_mod
    params = inspect.signature(inner.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@dataclass
class Rollout:
    """A batch of sampled completions.

    Attributes:
        prompt_ids: (B, P) long, left-padded with the pad id.
        prompt_mask: (B, P) long, 1 on real prompt tokens.
        completion_ids: (B, T) long, right-padded with the pad id after EOS.
        mask: (B, T) float32, 1 on generated tokens (EOS included), 0 on padding.
        logp: (B, T) float32, sampler log-probs of the completion tokens (0 on padding).
        truncated: (B,) bool, True where no EOS was produced within max_new_tokens.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    mask: Tensor
    logp: Tensor
    truncated: Tensor

    @property
    def input_ids(self) -> Tensor:  # (B, P+T)
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:  # (B, P+T)
        return torch.cat([self.prompt_mask, self.mask.long()], dim=1)

    @property
    def lengths(self) -> Tensor:  # (B,) completion lengths in tokens
        return self.mask.sum(1)

    def to(self, device: torch.device | str) -> Rollout:
        """The same rollout with every tensor on `device`."""
        return Rollout(*(getattr(self, f.name).to(device) for f in fields(self)))

    def widths(self) -> list[tuple[int, int]]:
        """Per row, (prompt tokens, completion columns up to its last scored token): the
        lengths its padded layout needs (`distributed.token_budget_split`'s widths)."""
        cols = torch.arange(1, self.mask.size(1) + 1, device=self.mask.device)
        comp = torch.where(self.mask > 0, cols, 0).amax(1) if self.mask.size(0) else cols[:0]
        return list(zip(self.prompt_mask.sum(1).tolist(), comp.tolist(), strict=True))

    def trimmed(self) -> Rollout:
        """The same rows without the columns that are padding in every row: leading prompt
        columns with no real token and completion columns past every row's last scored token
        (at least one kept). Positions come from the mask and nothing attends to those columns,
        so every kept token is scored as before; a micro-batch of short rows then pays for its
        own widths, not the whole batch's."""
        if self.mask.size(0) == 0:
            return self
        widths = self.widths()
        p = max(w[0] for w in widths)
        t = max(1, max(w[1] for w in widths))
        P, T = self.prompt_ids.size(1), self.completion_ids.size(1)
        if p == P and t == T:
            return self
        return Rollout(
            self.prompt_ids[:, P - p :],
            self.prompt_mask[:, P - p :],
            self.completion_ids[:, :t],
            self.mask[:, :t],
            self.logp[:, :t],
            self.truncated,
        )

    def select(self, index: Tensor | slice) -> Rollout:
        """Rows `index` of every field (a micro-batch view)."""
        return Rollout(
            self.prompt_ids[index],
            self.prompt_mask[index],
            self.completion_ids[index],
            self.mask[index],
            self.logp[index],
            self.truncated[index],
        )


def left_pad(
    sequences: list[list[int]], pad_id: int, width: int | None = None
) -> tuple[Tensor, Tensor]:
    """Left-pad token lists to a (B, P) long tensor and its 0/1 attention mask.

    P is the longest sequence, or `width` when given (it must be at least the longest)."""
    longest = max(len(s) for s in sequences)
    if width is not None and width < longest:
        raise ValueError(f"left_pad: width {width} is shorter than the longest sequence {longest}")
    width = longest if width is None else width
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[i, width - len(seq) :] = 1
    return ids, mask


def _filter_logits(logits: Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> Tensor:
    """Mask logits outside the top-k / nucleus (top-p) / min-p set with −inf. logits (B, V) float32.

    min-p (Nguyen et al. 2024, arXiv:2407.01082) keeps tokens whose probability is at least
    min_p × the most likely token's: logit_v >= max logit + log(min_p)."""
    if min_p > 0.0:
        floor = logits.max(-1, keepdim=True).values + math.log(min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the token that crosses top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def draw_tokens(
    logits: Tensor,
    noise: CounterNoise | None,
    rows: Tensor,
    step: int | Tensor,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> Tensor:
    """One token per row from tempered logits (b, V) float: argmax when `noise` is None
    (greedy), else the Gumbel-max draw argmax(filtered logits + g) with g the noise of global
    rows `rows` ((b,) long) at decoding step `step` — an exact sample of softmax(logits)
    restricted to the top-k / top-p / min-p set. Returns (b,) long."""
    if noise is None:
        return logits.argmax(-1)
    g = noise.gumbel(rows, step, logits.dtype)
    return (_filter_logits(logits, top_k, top_p, min_p) + g).argmax(-1)


def draw_seed(generator: torch.Generator | None, device: torch.device) -> int:
    """The one draw `sample` takes from its generator per call (the seed of that call's noise).
    A data-parallel rank with nothing to sample in a call takes it too, to stay in step."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    autocast_dtype: torch.dtype | None = None,
    rows: list[int] | None = None,
    n_rows: int | None = None,
    width: int | None = None,
    stop_token_ids: Sequence[int] = (),
    share_prefix: bool = True,
    decode: str = "eager",
    sync_every: int = 8,
    cuda_graph: bool = True,
    prefix_store: PrefixStore | None = None,
    stats: dict[str, int] | None = None,
) -> Rollout:
    """Sample one completion per prompt, all prompts in one batch.

    Args:
        model: a Hugging Face causal LM (called with input_ids, attention_mask, position_ids,
            its KV cache under `cache_kwarg(model)`, logits_to_keep=1).
        prompts: B token-id lists (already rendered with the chat template), any lengths >= 1.
        max_new_tokens: generation budget T per sequence.
        eos_token_id / pad_token_id: stop token and the id written after a sequence stops.
        temperature, top_p, top_k, min_p: the sampling distribution (ignored when greedy).
        greedy: argmax decoding (evaluation); `logp` then holds log-probs at temperature 1.
        generator: torch.Generator for reproducible draws (on the model's device). One seed is
            drawn from it per call, whatever the batch, so callers on every data-parallel rank
            keep their generators in step.
        autocast_dtype: run forwards under torch.autocast with this dtype (e.g. bfloat16).
        rows: the global row index of each prompt (default 0..B-1); n_rows: the global batch
            size (default B). Row i is sampled with the noise of global row rows[i].
        width: left-pad the prompts to this width P (default: the longest prompt). A rank that
            samples a share of a global batch passes the global batch's longest prompt, so its
            tensors have the shapes one process would use and the float arithmetic (attention
            sums over the padded keys) runs in the same order.
        stop_token_ids: further stop tokens besides `eos_token_id` (Llama-3 instruct models end
            a turn with <|eot_id|> as well as <|end_of_text|>); a sequence stops at the first
            stop token it emits, which is kept in the completion.
        share_prefix: prefill each distinct prompt once and copy its KV cache to its rows
            (False: prefill every row, as before prefix sharing; kept for benchmarks).
        decode: "eager" (the loop below: stopped rows dropped at every token, one host
            synchronisation per token) or "static" (`_decode_static`: a static KV cache, stop
            conditions on the device, rows compacted every `sync_every` tokens, the decode step
            captured as a CUDA graph on CUDA when `cuda_graph`). Both give the same tokens (up
            to float rounding of the attention sums) and log-probs.
        sync_every: "static" only: tokens between the host's checks for finished rows (>= 1).
        cuda_graph: "static" only: capture the decode step as a CUDA graph on CUDA devices.
        prefix_store: KV reuse (`rlhflab.rollout.kv_cache.PrefixStore`, "eager" decode only):
            a prompt that extends a stored sequence starts from that sequence's keys and values
            and only the rest of it is forwarded; a row that stops is stored (its prompt and
            completion up to, not including, the stop token, whose key is not computed yet).
            In the batch the rows keep the columns of the plain path (left-padded to `width`),
            and the prefill forwards the last U columns, U the most tokens any row has beyond
            its stored prefix; columns before are the stored keys. The sampled tokens and
            log-probs are those of prefilling everything, up to float rounding of the split
            forward. Prefix sharing is off in a batch where any row reuses a stored prefix.
        stats: counters to add to: "prefilled" (prompt tokens forwarded, padding not counted)
            and "reused" (prompt tokens taken from `prefix_store`).

    Returns:
        Rollout with completion tensors of width T' <= max_new_tokens (the longest completion).

    Raises:
        ValueError: an empty prompt, `rows` that do not give each prompt a row < n_rows, an
            unknown `decode` or `sync_every` < 1, a `prefix_store` with "static" decode or with
            a model whose cache has layers that are not full attention.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("sample: every prompt needs at least one token")
    if decode not in DECODE_PATHS:
        raise ValueError(f"sample: decode must be one of {list(DECODE_PATHS)}, got {decode!r}")
    if sync_every < 1:
        raise ValueError(f"sample: sync_every must be >= 1, got {sync_every}")
    if prefix_store is not None and decode != "eager":
        raise ValueError("sample: prefix_store (KV reuse) needs decode='eager'")
    if decode == "static" and not supports_static_decode(model):
        raise ValueError(
            f"sample: decode='static' needs a model that takes transformers' StaticCache; "
            f"{type(getattr(model, 'module', model)).__name__} does not (use decode='eager')"
        )
    device = next(model.parameters()).device
    rows_t = torch.tensor(rows if rows is not None else range(len(prompts)), device=device)
    n_rows = n_rows if n_rows is not None else len(prompts)
    if rows_t.numel() != len(prompts) or (rows_t.numel() and int(rows_t.max()) >= n_rows):
        raise ValueError(
            f"sample: rows must give each of the {len(prompts)} prompts a row < {n_rows}"
        )
    seed = None if greedy else draw_seed(generator, device)
    noise: CounterNoise | None = None  # built at the first step, when V is known
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id, width)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    batch = prompt_ids.size(0)
    temp = 1.0 if greedy else temperature
    stops = torch.tensor(sorted({eos_token_id, *stop_token_ids}), device=device)
    # KV reuse: each row's stored prefix (its length, its keys/values per layer), if any.
    stored = [prefix_store.take(p) for p in prompts] if prefix_store is not None else []
    reuse = any(layers is not None for _, layers in stored)
    # Prefix sharing: `first` holds one row per distinct prompt; `expand` maps every row to it.
    first: dict[tuple[int, ...], int] = {}
    owner = [first.setdefault(tuple(p), i) for i, p in enumerate(prompts)]
    distinct = sorted(set(owner))
    expand = None
    if share_prefix and len(distinct) < batch and not reuse:
        slot = {row: j for j, row in enumerate(distinct)}
        expand = torch.tensor([slot[o] for o in owner], device=device)  # (B,) into distinct
        distinct_t = torch.tensor(distinct, device=device)

    out_ids = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logp_dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    out_logp = torch.zeros((batch, max_new_tokens), dtype=logp_dtype, device=device)
    out_mask = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)

    active = torch.arange(batch, device=device)  # rows of the full batch still decoding
    attn = prompt_mask.clone()
    positions = position_ids_from_mask(attn)
    step_input, step_positions, step_attn = prompt_ids, positions, attn
    if expand is not None:  # prefill only the distinct prompts
        step_input = prompt_ids[distinct_t]
        step_positions, step_attn = positions[distinct_t], attn[distinct_t]
    # The static loop's step may be captured as a CUDA graph: autocast's weight-cast cache must
    # be off there (a cast cached during capture would be a graph-owned buffer; torch's advice).
    autocast = torch.autocast(
        device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None,
        cache_enabled=False if decode == "static" else None,
    )  # fmt: skip
    if decode == "static":
        if stats is not None:
            stats["prefilled"] = stats.get("prefilled", 0) + int(step_attn.sum())
        return _decode_static(
            model, prompt_ids, prompt_mask, positions, expand, distinct if expand is not None
            else None, rows_t, n_rows, seed, max_new_tokens, temp, (top_k, top_p, min_p), stops,
            pad_token_id, sync_every, cuda_graph and device.type == "cuda", autocast, logp_dtype,
        )  # fmt: skip
    # Keys/values written in place into buffers sized for the whole rollout (no per-step torch.cat).
    capacity = prompt_ids.size(1) + max_new_tokens
    cache = preallocated_cache(model.config, capacity)  # filled in place by every forward
    kw = cache_kwarg(model)
    reused = 0
    if prefix_store is not None:
        if not all(isinstance(layer, PreallocatedLayer) for layer in cache.layers):
            raise ValueError(
                "sample: prefix_store (KV reuse) needs a model whose cache layers are all full "
                f"attention; {type(getattr(model, 'module', model)).__name__} has others"
            )
        if reuse:
            fresh, reused = _fill_stored_prefixes(cache, prompts, stored, prompt_ids.size(1))
            step_input, step_positions = prompt_ids[:, -fresh:], positions[:, -fresh:]
    if stats is not None:
        stats["prefilled"] = stats.get("prefilled", 0) + int(
            step_attn[:, -step_input.size(1) :].sum()
        )
        stats["reused"] = stats.get("reused", 0) + reused
    for t in range(max_new_tokens):
        with autocast:
            out = model(
                input_ids=step_input,
                attention_mask=step_attn,
                position_ids=step_positions,
                **{kw: cache},
                use_cache=True,
                logits_to_keep=1,
            )
        logits = upcast(out.logits[:, -1])  # (b, V)
        if t == 0 and expand is not None:  # copy each distinct prompt's cache to its rows
            cache.batch_select_indices(expand)
            logits, step_positions = logits[expand], positions
        if temp != 1.0:
            logits = logits / temp
        if not greedy and noise is None:
            noise = CounterNoise(seed, n_rows, logits.size(-1), max_new_tokens, device)
        token = draw_tokens(logits, noise, rows_t[active], t, top_k, top_p, min_p)
        logp = selective_log_softmax(logits, token)

        out_ids[active, t] = token
        out_logp[active, t] = logp
        out_mask[active, t] = 1.0
        done = torch.isin(token, stops)
        finished[active[done]] = True
        if prefix_store is not None and bool(done.any()):
            _store_stopped(prefix_store, cache, prompts, out_ids, active, done, t,
                           prompt_ids.size(1))  # fmt: skip
        if bool(done.all()):
            break
        if bool(done.any()):  # drop stopped rows from the cache and every per-row tensor
            keep = (~done).nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            active, token, attn = active[keep], token[keep], attn[keep]
            step_positions = step_positions[keep]
        attn = torch.cat([attn, attn.new_ones(attn.size(0), 1)], dim=1)
        step_input, step_attn = token[:, None], attn
        step_positions = step_positions[:, -1:] + 1

    width = int(out_mask.sum(1).max().item()) if batch else 0
    width = max(width, 1)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=out_ids[:, :width].contiguous(),
        mask=out_mask[:, :width].contiguous(),
        logp=out_logp[:, :width].contiguous(),
        truncated=~finished,
    )


def _fill_stored_prefixes(cache, prompts, stored, width: int) -> tuple[int, int]:
    """Write the stored keys/values of each row into the first columns of `cache` (a fresh
    `preallocated_cache`), in the left-padded layout of `width` columns (row i's prompt in its
    last len(prompt) columns): every column before the last U is either padding (zeros, masked)
    or a stored key. Returns U, the columns left to forward (the most tokens any row has beyond
    its stored prefix; a row with no stored prefix counts its whole prompt), and the number of
    stored keys written (a row's stored tokens in the last U columns are forwarded again)."""
    fresh = max(len(p) - n for p, (n, _) in zip(prompts, stored, strict=True))
    cached = width - fresh
    layers = next(layers for _, layers in stored if layers is not None)
    reused = sum(max(0, cached - (width - len(p))) for p, (_, row) in zip(prompts, stored, strict=True)
                 if row is not None)  # fmt: skip
    for li, layer in enumerate(cache.layers):
        k0, v0 = layers[li]
        keys = k0.new_zeros((len(prompts), k0.shape[0], cached, k0.shape[-1]))
        values = v0.new_zeros((len(prompts), v0.shape[0], cached, v0.shape[-1]))
        for i, (p, (_, row)) in enumerate(zip(prompts, stored, strict=True)):
            start = width - len(p)  # the row's first real column
            if row is not None and start < cached:
                keys[i, :, start:cached] = row[li][0][:, : cached - start]
                values[i, :, start:cached] = row[li][1][:, : cached - start]
        layer.update(keys, values)
    return fresh, reused


def _store_stopped(store, cache, prompts, out_ids, active, done, t: int, width: int) -> None:
    """Keep in `store` the cache of every row that stopped at decoding step `t`: its prompt and
    its first t completion tokens (the stop token's key is not computed), the cache's columns
    from the row's first real one up to width + t."""
    for d in done.nonzero().squeeze(-1).tolist():
        r = int(active[d])
        start = width - len(prompts[r])
        tokens = list(prompts[r]) + out_ids[r, :t].tolist()
        store.put(tokens, [(layer.keys[d, :, start : width + t].clone(),
                            layer.values[d, :, start : width + t].clone())
                           for layer in cache.layers])  # fmt: skip


def supports_static_decode(model: torch.nn.Module) -> bool:
    """True when `model` (DDP's `.module` unwrapped) takes transformers' `StaticCache`, as the
    "static" decode loop needs: transformers marks such models `_can_compile_fullgraph`
    (Qwen3, Llama, GPT-2, ...); rlhflab's own `gpt` architecture is not."""
    return bool(getattr(getattr(model, "module", model), "_can_compile_fullgraph", False))


class _StaticDecoder:
    """The state of a "static" decode: every per-row tensor has the current batch's fixed shape,
    and one decoding step (`step`) changes it only in place, with device-side counters (token
    position, cache position, output column), so it can be captured once as a CUDA graph and
    replayed. Rows that have stopped keep being decoded (their outputs masked) until the host
    compacts the batch (`compact`)."""

    def __init__(self, model, cache, rows, noise, filt, stops, pad, temp, autocast, logp_dtype,
                 width: int, steps: int) -> None:  # fmt: skip
        self.model, self.cache, self.rows, self.noise = model, cache, rows, noise
        self.cache_kw = cache_kwarg(model)
        self.filt, self.stops, self.pad, self.temp, self.autocast = filt, stops, pad, temp, autocast
        b, device = rows.numel(), rows.device
        self.active = torch.arange(b, device=device)  # rows of the full batch in this batch
        self.tok = torch.full((b, 1), pad, dtype=torch.long, device=device)
        self.pos = torch.zeros((b, 1), dtype=torch.long, device=device)
        self.attn = torch.zeros((b, width + steps), dtype=torch.long, device=device)
        self.t = torch.zeros((), dtype=torch.long, device=device)  # decoding step of the next draw
        self.col = torch.full((b, 1), width - 1, dtype=torch.long, device=device)  # input column
        self.finished = torch.zeros(b, dtype=torch.bool, device=device)
        self.out_ids = torch.full((b, steps), pad, dtype=torch.long, device=device)
        self.out_logp = torch.zeros((b, steps), dtype=logp_dtype, device=device)
        self.out_mask = torch.zeros((b, steps), dtype=torch.float32, device=device)

    def draw(self, logits: Tensor) -> None:
        """Draw step t's tokens from (b, V) logits and write them; t += 1 (all on the device)."""
        logits = upcast(logits)
        if self.temp != 1.0:
            logits = logits / self.temp
        token = draw_tokens(logits, self.noise, self.rows, self.t, *self.filt)
        logp = selective_log_softmax(logits, token)
        live = ~self.finished
        token = torch.where(live, token, self.pad)
        at = self.t.expand(token.size(0), 1)
        self.out_ids.scatter_(1, at, token[:, None])
        self.out_logp.scatter_(1, at, torch.where(live, logp, 0).to(self.out_logp.dtype)[:, None])
        self.out_mask.scatter_(1, at, live.float()[:, None])
        self.finished |= live & torch.isin(token, self.stops)
        self.tok.copy_(token[:, None])
        self.t += 1

    def step(self) -> None:
        """One decoding step: feed the last tokens at their positions, draw the next ones."""
        self.col += 1
        self.attn.scatter_(1, self.col, 1)
        with self.autocast:
            out = self.model(
                input_ids=self.tok, attention_mask=self.attn, position_ids=self.pos,
                **{self.cache_kw: self.cache}, use_cache=True, logits_to_keep=1,
            )  # fmt: skip
        self.pos += 1
        self.draw(out.logits[:, -1])

    def compact(self, keep: Tensor, full: dict[str, Tensor]) -> None:
        """Write the rows not in `keep` to the full-batch outputs `full`, then keep only `keep`."""
        gone = torch.ones_like(self.finished)
        gone[keep] = False
        for name, buf in full.items():
            buf[self.active[gone]] = getattr(self, name)[gone]
        for name in ("rows", "active", "tok", "pos", "attn", "col", "finished", "out_ids",
                     "out_logp", "out_mask"):  # fmt: skip
            setattr(self, name, getattr(self, name)[keep])
        select_static_rows(self.cache, keep)


def _decode_static(model, prompt_ids, prompt_mask, positions, expand, distinct, rows, n_rows,
                   seed, steps, temp, filt, stops, pad, sync_every, use_graph, autocast,
                   logp_dtype) -> Rollout:  # fmt: skip
    """`sample(decode="static")`: prompts prefilled in one pass into a static KV cache of width
    P + steps; then every decoding step runs on fixed shapes with no host synchronisation, stop
    tokens are checked on the device, and the host looks at the finished flags only every
    `sync_every` steps: it stops when every row has finished and drops the finished rows from
    the batch when at least a quarter of it has. On CUDA with `use_graph`, the decode step is
    captured as a CUDA graph (again after each compaction) and replayed. The tokens drawn are
    those of the eager loop: the same noise (global row, step), the same logits up to the float
    rounding of attention sums over a wider, masked key range."""
    device = prompt_ids.device
    batch, width = prompt_ids.shape
    cache = static_cache(model.config, width + steps)
    ids, pos, attn = prompt_ids, positions, prompt_mask
    if expand is not None:  # prefill only the distinct prompts
        d = torch.tensor(distinct, device=device)
        ids, pos, attn = ids[d], pos[d], attn[d]
    with autocast:
        out = model(
            input_ids=ids, attention_mask=attn, position_ids=pos, **{cache_kwarg(model): cache},
            use_cache=True, logits_to_keep=1,
        )  # fmt: skip
    logits = out.logits[:, -1]
    if expand is not None:  # copy each distinct prompt's cache to its rows
        select_static_rows(cache, expand)
        logits = logits[expand]
    noise = None if seed is None else CounterNoise(seed, n_rows, logits.size(-1), steps, device)
    dec = _StaticDecoder(model, cache, rows, noise, filt, stops, pad, temp, autocast, logp_dtype,
                         width, steps)  # fmt: skip
    dec.attn[:, :width] = prompt_mask
    dec.pos.copy_(positions[:, -1:])  # the step's input sits one past the prompt's last position
    dec.pos += 1
    dec.draw(logits)
    full = {
        "out_ids": dec.out_ids.clone(), "out_logp": dec.out_logp.clone(),
        "out_mask": dec.out_mask.clone(), "finished": dec.finished.clone(),
    }  # fmt: skip
    logger.info(
        "sampler: static decode, %s step, %d rows, host sync every %d tokens",
        "CUDA-graph" if use_graph else "eager", batch, sync_every,
    )  # fmt: skip
    graph, warm = None, False
    for t in range(1, steps):  # draws tokens 1 .. steps-1 (token 0 came from the prefill)
        if t % sync_every == 0:  # the host looks at the finished flags only here
            n_done = int(dec.finished.sum())
            if n_done == dec.finished.numel():
                break
            if 4 * n_done >= dec.finished.numel():  # drop finished rows: a smaller batch
                dec.compact((~dec.finished).nonzero().squeeze(-1), full)
                graph, warm = None, False
        if use_graph and graph is None and warm:
            graph = _capture(dec)
            use_graph = graph is not None
        if graph is not None:
            graph.replay()
        elif use_graph:  # the first step on new shapes runs eagerly on a side stream (warm-up)
            _side_stream_step(dec)
            warm = True
        else:
            dec.step()
    # every row still in the batch goes back to its place in the full batch
    for name, buf in full.items():
        buf[dec.active] = getattr(dec, name)
    lengths = full["out_mask"].sum(1)
    used = max(int(lengths.max().item()) if batch else 0, 1)
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=full["out_ids"][:, :used].contiguous(),
        mask=full["out_mask"][:, :used].contiguous(),
        logp=full["out_logp"][:, :used].contiguous(),
        truncated=~full["finished"],
    )


def _side_stream_step(dec: _StaticDecoder) -> None:
    """One real decoding step on a side CUDA stream: the warm-up torch asks for before a capture
    (lazy cuBLAS / allocator initialisation happens outside the graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dec.step()
    torch.cuda.current_stream().wait_stream(stream)


def _capture(dec: _StaticDecoder):
    """`dec.step` recorded as a CUDA graph: capture runs no kernel and changes no state; each
    `replay()` is one decoding step on the same buffers. Returns None, with a logged warning
    naming the error, when the capture fails; the static step then runs eagerly (logged, never
    silent)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            dec.step()
    except Exception as e:
        logger.warning("sampler: CUDA graph capture failed (%s); static decode runs eagerly", e)
        return None
    return graph


def completion_logps(
    model: torch.nn.Module,
    rollout: Rollout,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log π_θ(o_t | q, o_<t) of the rollout's completion tokens, with gradients.

    One forward over [prompt; completion] with the same attention mask and position ids as the
    sampler, keeping logits only for the T completion positions (`logits_to_keep`). Log-probs use
    the tempered distribution softmax(logits / τ), as the sampler does. On CPU, rows of uneven
    length are scored padding-free (`rlhflab.models.packing`): the same values up to float
    rounding, without paying for the padding. Models with a plain linear LM head (`can_pack`),
    sharded or not, on any device and under autocast, never hold the (B, T, V) logits: the head
    and the log-softmax run fused in row-chunks (`ops.linear_selective_log_softmax`), so peak
    memory does not grow with B × T × V; values and gradients equal the unfused ones up to float
    rounding (tests/test_fused_head.py).

    The rollout is scored at its own widths (`Rollout.trimmed`: columns that are padding in
    every row are dropped first, then the outputs are padded back to T), so a micro-batch of
    short rows does not pay for the longest row of its step.

    Returns:
        logp: (B, T) float32, 0 on padding; entropy: (B, T) float32 detached, or None.
    """
    width = rollout.completion_ids.size(1)
    logp, entropy = _completion_logps(
        model, rollout.trimmed(), temperature=temperature, with_entropy=with_entropy,
        autocast_dtype=autocast_dtype,
    )  # fmt: skip
    if logp.size(1) < width:  # back to the caller's (B, T) grid
        logp = torch.nn.functional.pad(logp, (0, width - logp.size(1)))
        if entropy is not None:
            entropy = torch.nn.functional.pad(entropy, (0, width - entropy.size(1)))
    return logp, entropy


def _completion_logps(model, rollout: Rollout, *, temperature, with_entropy, autocast_dtype):
    """`completion_logps` on the rollout as given (no trimming)."""
    input_ids = rollout.input_ids
    attn = rollout.attention_mask
    width = rollout.completion_ids.size(1)
    autocast = torch.autocast(
        input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
    )
    # A model with a plain linear LM head (rlhflab.models.packing.can_pack): the head and the
    # log-softmax are fused in row-chunks (ops.linear_selective_log_softmax; the head's matmul in
    # the autocast dtype, the log-softmax in float32), so no (B, T, V) logits exist, on any
    # device. Rows of uneven length are also packed padding-free when that removes enough
    # padding (`layout_for`: prompts shared on CPU, varlen rows when sharded or elsewhere). An
    # FSDP2-sharded model is only called through its own forward (its hooks gather the
    # parameters): the fused head then runs inside that forward, in place of the LM head
    # (`_fused_in_forward`). Anything else: the padded layout with `logits_to_keep`.
    head = model.get_output_embeddings() if can_pack(model) else None
    fused = isinstance(head, torch.nn.Linear)
    sharded = distributed.is_sharded(model)
    layout = layout_for(model, rollout, sharded=sharded) if head is not None else None
    if fused and sharded:
        return _fused_in_forward(model, head, rollout, layout, temperature, with_entropy, autocast)
    if head is not None and not sharded:
        if layout is not None:
            hidden = packed_hidden(model, layout, autocast)[layout.pred_rows, layout.pred_cols]
            tokens = rollout.completion_ids[layout.out_rows, layout.out_cols]  # (N,)
        elif fused:
            with autocast:
                out = model.base_model(
                    input_ids=input_ids,
                    attention_mask=attn,
                    position_ids=position_ids_from_mask(attn),
                    use_cache=False,
                )
            p = rollout.prompt_ids.size(1)  # position P-1+t predicts o_t
            hidden = out.last_hidden_state[:, p - 1 : p - 1 + width]  # (B, T, H)
            tokens = rollout.completion_ids
        if layout is not None or fused:
            if fused:
                with autocast:
                    lp, ent = linear_selective_log_softmax(
                        hidden, head.weight, tokens, bias=head.bias, temperature=temperature,
                        with_entropy=with_entropy,
                    )  # fmt: skip
            else:
                with autocast:
                    logits = upcast(head(hidden))  # (N, V)
                if temperature != 1.0:
                    logits = logits / temperature
                lp = selective_log_softmax(logits, tokens)
                ent = entropy_from_logits(logits.detach()) if with_entropy else None
            if layout is not None:  # back to the (B, T) grid
                at = (layout.out_rows, layout.out_cols)
                grid = torch.zeros(rollout.mask.shape, dtype=lp.dtype, device=input_ids.device)
                lp = grid.index_put(at, lp)
                ent = grid.index_put(at, ent) if ent is not None else None
            entropy = ent.detach() * rollout.mask if ent is not None else None
            return lp * rollout.mask, entropy
    with autocast:
        out = model(
            input_ids=input_ids,
            attention_mask=attn,
            position_ids=position_ids_from_mask(attn),
            use_cache=False,
            logits_to_keep=width + 1,
        )
    # (B, T+1, V): position P-1+t predicts o_t; the last position predicts nothing. It is scored
    # against a dummy token and dropped afterwards instead of slicing the logits to (B, T, V),
    # because that slice is not contiguous and the row-chunked ops would copy it whole.
    logits = upcast(out.logits)
    if temperature != 1.0:
        logits = logits / temperature
    index = torch.nn.functional.pad(rollout.completion_ids, (0, 1))  # (B, T+1)
    logp = selective_log_softmax(logits, index)[:, :-1] * rollout.mask
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())[:, :-1] * rollout.mask
    return logp, entropy


def forward_through_head(
    model, head: torch.nn.Module, head_fn, rollout: Rollout, autocast,
    layout: PackedLayout | None = None,
):  # fmt: skip
    """`model`'s own forward with `head.forward` replaced for the call by `head_fn`, so FSDP2's
    hooks gather the head and see the result as the forward's output, as in an ordinary
    forward. Returns what `head_fn` returned (the model output's `logits`). `autocast` is a
    context manager (a no-op one for none).

    Without `layout`: the rollout's padded [prompt; completion], T+1 kept positions (the last
    prompt token and every completion token), `head_fn` gets hidden (B, T+1, H). With a
    `layout` (`models.packing.layout_for`: its 4-D mask, or None for varlen rows): its packed
    rows, every position kept, `head_fn` gets hidden (R, W, H) and picks the positions it needs
    from the layout (`pred_rows`/`pred_cols`, `prediction_index`)."""
    if layout is not None:
        inputs = {"input_ids": layout.input_ids, "attention_mask": layout.attention_mask,
                  "position_ids": layout.position_ids, "logits_to_keep": 0}  # fmt: skip
    else:
        attn, width = rollout.attention_mask, rollout.completion_ids.size(1)
        inputs = {"input_ids": rollout.input_ids, "attention_mask": attn,
                  "position_ids": position_ids_from_mask(attn), "logits_to_keep": width + 1}  # fmt: skip
    head.forward = head_fn
    try:
        with autocast:
            out = model(**inputs, use_cache=False)
    finally:
        del head.forward
    return out.logits


def completion_head(model, rollout: Rollout, head_fn, sel: Tensor, autocast):
    """`head_fn` applied to the hidden states that predict the completion tokens where the
    (B, T) bool `sel` is True: (N, H), N = sel.sum(), in `sel.nonzero()` (row-major) order.

    `model`'s own forward on [prompt; completion] with its LM head's forward replaced for the
    call by the selection and `head_fn` (`forward_through_head`), so FSDP2's hooks gather the
    head and see the result as the forward's output; `head_fn` must therefore not call the head
    module itself (use `torch.nn.functional.linear(h, head.weight, head.bias)`). Rows of uneven
    length are packed as `completion_logps` packs them (`models.packing.layout_for`: prompts
    shared on CPU, varlen rows when sharded or elsewhere), so the padding is never computed.
    `autocast` is a context manager (a no-op one for none). Returns what `head_fn` returned.
    Raises ValueError for a model without a linear LM head (`get_output_embeddings`)."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"completion_head: {type(model).__name__} has no linear LM head")
    layout = layout_for(model, rollout, sharded=distributed.is_sharded(model))
    if layout is None:
        select = lambda hidden: head_fn(hidden[:, :-1][sel])  # noqa: E731  (B, T+1, H)
    else:
        at = layout.prediction_index(sel)
        select = lambda hidden: head_fn(hidden[at])  # noqa: E731  (R, W, H)
    return forward_through_head(model, head, select, rollout, autocast, layout)


def _fused_in_forward(model, head, rollout: Rollout, layout, temperature, with_entropy, autocast):
    """`completion_logps` of an FSDP2-sharded model: its own forward, with the LM head's forward
    replaced for the call by the fused, row-chunked log-softmax of the chosen tokens.

    The model's forward computes `logits = lm_head(hidden)` for the kept positions and returns
    them untouched (the architectures of `can_pack`); here lm_head returns the log-probs
    instead: (B, T+1) in the padded layout, (N,) at the layout's predictions in a varlen packed
    one. FSDP2's hooks are those of an ordinary forward: the root's pre-forward hook has
    unsharded `head.weight` (read inside the call, as nn.Linear.forward reads it), the backward
    of the fused op accumulates the head's gradient into that unsharded parameter, which FSDP2
    reduce-scatters after the backward as it does for the plain head, and the pre-backward hook
    sits on the returned log-probs. Returns what `completion_logps` returns."""
    if layout is not None:  # the predictions' positions in the packed rows, their tokens
        index = rollout.completion_ids[layout.out_rows, layout.out_cols]  # (N,)
    else:
        index = torch.nn.functional.pad(rollout.completion_ids, (0, 1))  # (B, T+1); last dummy
    entropy: list[Tensor | None] = []

    def fused_head(hidden: Tensor) -> Tensor:  # (B, T+1, H) -> (B, T+1); (R, W, H) -> (N,)
        if layout is not None:
            hidden = hidden[layout.pred_rows, layout.pred_cols]  # (N, H)
        lp, ent = linear_selective_log_softmax(
            hidden, head.weight, index, bias=head.bias, temperature=temperature,
            with_entropy=with_entropy,
        )  # fmt: skip
        entropy.append(ent)
        return lp

    out = forward_through_head(model, head, fused_head, rollout, autocast, layout)
    if len(entropy) != 1 or out.shape != index.shape:
        raise RuntimeError(
            f"completion_logps: {type(model).__name__}'s forward did not call its LM head once "
            "on the kept positions; it cannot be scored with the fused head"
        )
    ent = entropy[0]
    if layout is not None:  # back to the (B, T) grid
        at = (layout.out_rows, layout.out_cols)
        grid = torch.zeros(rollout.mask.shape, dtype=out.dtype, device=out.device)
        logp = grid.index_put(at, out) * rollout.mask
        return logp, (grid.index_put(at, ent.detach()) * rollout.mask if ent is not None else None)
    logp = out[:, :-1] * rollout.mask
    return logp, (ent[:, :-1].detach() * rollout.mask if ent is not None else None)


def decode_completions(
    tokenizer, rollout: Rollout, stop_token_ids: Sequence[int] = ()
) -> list[str]:
    """Completion texts: the generated tokens up to (not including) EOS, special tokens kept.

    Special tokens are kept so answer tags that are single tokens (`<answer>`) survive decoding;
    pad and EOS never appear because only unmasked tokens before EOS are decoded. A completion
    that ends in one of `stop_token_ids` loses that token too, as it loses EOS.
    """
    stops = {tokenizer.eos_token_id, *stop_token_ids}
    rows = []
    for ids, mask in zip(rollout.completion_ids.tolist(), rollout.mask.tolist(), strict=True):
        toks = [t for t, m in zip(ids, mask, strict=True) if m]
        if toks and toks[-1] in stops:
            toks = toks[:-1]
        rows.append(toks)
    return tokenizer.batch_decode(rows, skip_special_tokens=False)


def pack(prompts: list[list[int]], completions: list[list[int]], pad_token_id: int) -> Rollout:
    """A `Rollout` from given prompt and completion token lists (SFT and preference data).

    Prompts are left-padded and completions right-padded exactly as the sampler lays them out, so
    `completion_logps` scores SFT targets, preference pairs and sampled completions the same way.
    `logp` is zeros and `truncated` False.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"pack: {len(prompts)} prompts but {len(completions)} completions")
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    width = max(1, max(len(c) for c in completions))
    ids = torch.full((len(completions), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(completions), width), dtype=torch.float32)
    for i, comp in enumerate(completions):
        ids[i, : len(comp)] = torch.tensor(comp, dtype=torch.long)
        mask[i, : len(comp)] = 1.0
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=ids,
        mask=mask,
        logp=torch.zeros_like(mask),
        truncated=torch.zeros(len(completions), dtype=torch.bool),
    )
