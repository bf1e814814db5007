"""Counter-based sampling noise: uniforms and Gumbel noise that are a pure function of (the
call's seed, global row, decoding step, vocabulary index), so each process computes the noise
of its own rows only (see `CounterNoise`; docs/engine_hf.md). Imports torch only.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Counter-based noise. All arithmetic is on non-negative int64 values below 2**63: 32-bit words,
# multiplied only by constants below 2**31 (so no product overflows) and masked back to 32 bits.
# Integer operations are exact, so every CPU kernel set (scalar, AVX2, AVX-512) and CUDA give the
# same bits: there is no rounding to differ, unlike float reductions.
_MASK32 = 0xFFFFFFFF
# The 32-bit finaliser "lowbias32" with the constants of its improved variant (both < 2**31;
# C. Wellons, hash-prospector, https://github.com/skeeto/hash-prospector, issue #19): a bijection
# of 32-bit words with full avalanche (bias ~0.107).
_M1, _M2 = 0x21F0AAAD, 0x735A2D97
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: decorrelates the key words from small counters


def _mix32(x):
    """The lowbias32 bijection of 32-bit words, on int64 tensors (or Python ints) in [0, 2**32).
    A tensor argument is overwritten (in-place operations: one (b, V) buffer, not ten)."""
    if not isinstance(x, Tensor):
        x = x ^ (x >> 16)
        x = (x * _M1) & _MASK32  # x < 2**32, _M1 < 2**31: the product is < 2**63
        x = x ^ (x >> 15)
        x = (x * _M2) & _MASK32
        return x ^ (x >> 15)
    x ^= x >> 16
    x.mul_(_M1).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_M2).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


class CounterNoise:
    """Counter-based noise of one sampling call: a pure function of (seed, global row, decoding
    step, vocabulary index), as Philox is of its key and counter, so any subset of rows can be
    computed alone and equals those rows of the whole block.

    Construction: counter c = row + n_rows · step (distinct for every (row, step) of the call);
    row key K = mix(c ^ S) with S a mix of the seed's high word xor its low word; vocabulary word
    H_v = mix(mix(v ^ s_lo) ^ (s_hi + φ)); element (row, v) = mix(K ^ H_v); `mix` is lowbias32, a
    bijection. So within a row the V words are distinct (H is a bijection of v), two (row, step)
    counters never share a row key, and words of different rows coincide only at the birthday
    rate of any 32-bit generator (~V²/2**32 per pair of rows, at unrelated vocabulary indices).

    Args:
        seed: the call's seed, 0 <= seed < 2**62 (`draw_seed`).
        n_rows: global batch size (the same on every rank).
        vocab: V, the width of the logits.
        steps: the most decoding steps the call takes (max_new_tokens).
        device: where the noise is computed.

    Raises:
        ValueError: a seed outside [0, 2**62), or n_rows × steps > 2**32 (counters would repeat).
    """

    def __init__(self, seed: int, n_rows: int, vocab: int, steps: int, device) -> None:
        if not 0 <= seed < 2**62:
            raise ValueError(f"CounterNoise: seed must be in [0, 2**62), got {seed}")
        if n_rows * steps > 2**32:
            raise ValueError(
                f"CounterNoise: {n_rows} rows x {steps} steps exceed the 2**32 counters of a call"
            )
        s_lo, s_hi = seed & _MASK32, seed >> 32
        self.n_rows, self.vocab = n_rows, vocab
        self.seed_word = _mix32(s_hi ^ _GOLDEN) ^ s_lo  # a Python int in [0, 2**32)
        v = torch.arange(vocab, dtype=torch.long, device=device)
        self.word = _mix32(_mix32(v ^ s_lo) ^ ((s_hi + _GOLDEN) & _MASK32))  # (V,) int64

    def bits(self, rows: Tensor, step: int | Tensor) -> Tensor:
        """(b, V) int64 in [0, 2**32): the words of global rows `rows` ((b,) long, each <
        n_rows) at decoding step `step` (an int, or a 0-d long tensor on the same device)."""
        counter = rows.long() + self.n_rows * step
        key = _mix32((counter ^ self.seed_word) & _MASK32)  # (b,)
        return _mix32(key[:, None] ^ self.word[None, :])

    def gumbel(
        self, rows: Tensor, step: int | Tensor, dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """(b, V) standard Gumbel noise g = −log(−log u), u = `counter_uniform(bits, dtype)`,
        in `dtype` (the sampler passes its logits' dtype: float32, or float64 in float64 runs).
        The sampler calls this once per decoding step with the rows it is decoding, so its size
        is the process's own running rows × V."""
        if rows.device.type != "cpu":
            return _gumbel_of(counter_uniform(self.bits(rows, step), dtype))
        # On CPU in blocks of rows that stay in cache (~512 KiB of int64 words): the dozen
        # passes over the words then cost cache bandwidth, not memory bandwidth. Same values.
        out = torch.empty((rows.numel(), self.vocab), dtype=dtype)
        per = max(1, _CPU_BLOCK // max(self.vocab, 1))
        for i in range(0, rows.numel(), per):
            out[i : i + per] = _gumbel_of(
                counter_uniform(self.bits(rows[i : i + per], step), dtype)
            )
        return out


_CPU_BLOCK = 1 << 16  # words per block of `CounterNoise.gumbel` on CPU


def _gumbel_of(u: Tensor) -> Tensor:
    """−log(−log u), in place on u."""
    return u.log_().neg_().log_().neg_()


def counter_uniform(bits: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """Uniforms in the open interval (0, 1) from 32-bit words, exact in `dtype`.

    float64: (bits + 0.5) / 2**32, 32 bits of resolution. Any other dtype (float32): the top 23
    bits, (bits >> 9) + 0.5) / 2**23 — an odd multiple of 2**-24, exact in float32 (torch.rand
    gives 24 bits but may return 0). Never 0 nor 1, so −log(−log u) is finite (|g| < 23)."""
    if dtype == torch.float64:
        return (bits.double() + 0.5) * 2.0**-32
    return ((bits >> 9).float() + 0.5) * 2.0**-23
