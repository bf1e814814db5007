"""The sampler's counter-based noise (`rlhflab.rollout.sampler.CounterNoise`).

- A rank computes noise for its own running rows only (size per token = own rows × V), and its
  completions equal those rows of one process's (in-process here; under torchrun with 2 gloo
  ranks in `test_two_ranks_sample_what_one_process_samples`).
- The words are uniform and independent across rows, steps and vocabulary indices (fixed-seed
  chi-square tests with loose bounds: the seeds are fixed, so each test is deterministic), and
  Gumbel-max with them samples softmax(logits / τ) (frequencies within 5 binomial s.e.).
- The words are the same bits under every ATEN_CPU_CAPABILITY: they are integer arithmetic
  (shifts, xors, products below 2**63, masks), which has no rounding for kernels to differ in.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhflab.rollout import noise as noise_module
from rlhflab.rollout.sampler import CounterNoise, counter_uniform, draw_tokens, sample

PROMPTS = [[7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20], [30, 31, 32, 33, 34]]


def _chi2(counts: torch.Tensor) -> float:
    """Pearson's chi-square of counts against equal expected counts (float64)."""
    counts = counts.double()
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def _bound(dof: int) -> float:
    """A loose bound for a chi-square with `dof` degrees of freedom: mean + 6 s.d."""
    return dof + 6 * math.sqrt(2 * dof)


def test_words_are_uniform_and_independent_across_rows_steps_and_vocab():
    noise = CounterNoise(seed=2**61 + 12345, n_rows=64, vocab=1024, steps=16, device="cpu")
    rows = torch.arange(64)
    bits = torch.stack([noise.bits(rows, t) for t in range(16)])  # (T, B, V) = 1 M words
    assert bits.min() >= 0 and bits.max() < 2**32
    hi, lo = bits >> 24, bits & 255  # 256 buckets from the top and from the bottom byte
    for byte in (hi, lo):
        assert _chi2(torch.bincount(byte.flatten(), minlength=256)) < _bound(255)
    # pairs: neighbouring rows, steps and vocabulary indices, 16 x 16 joint buckets each
    q = bits >> 28
    for a, b in ((q[:, :-1], q[:, 1:]), (q[:-1], q[1:]), (q[..., :-1], q[..., 1:])):
        joint = torch.bincount((a * 16 + b).flatten(), minlength=256)
        assert _chi2(joint) < _bound(255)
    # the uniforms lie strictly inside (0, 1)
    u = counter_uniform(bits)
    assert u.dtype == torch.float64 and u.min() > 0 and u.max() < 1
    assert abs(float(u.mean()) - 0.5) < 6 * math.sqrt(1 / 12 / u.numel())
    u32 = counter_uniform(bits, torch.float32)  # the top 23 bits, exact in float32
    assert u32.dtype == torch.float32 and u32.min() > 0 and u32.max() < 1
    assert torch.equal(u32.double(), ((bits >> 9).double() + 0.5) / 2**23)


def test_a_subset_of_rows_is_those_rows_of_the_whole_block(monkeypatch):
    noise = CounterNoise(seed=7, n_rows=8, vocab=50, steps=4, device="cpu")
    whole = noise.bits(torch.arange(8), 3)
    assert torch.equal(noise.bits(torch.tensor([5, 2]), 3), whole[[5, 2]])
    assert torch.equal(noise.bits(torch.tensor([5]), torch.tensor(3)), whole[[5]])
    # the CPU path computes Gumbel noise in blocks of rows: the same values as in one block
    g = noise.gumbel(torch.arange(8), 3)
    monkeypatch.setattr(noise_module, "_CPU_BLOCK", 100)  # 2 rows per block
    assert torch.equal(noise.gumbel(torch.arange(8), 3), g)
    assert torch.equal(noise.gumbel(torch.tensor([5, 2]), 3), g[[5, 2]])
    # another seed or step gives other words
    assert not torch.equal(CounterNoise(8, 8, 50, 4, "cpu").bits(torch.arange(8), 3), whole)
    assert not torch.equal(noise.bits(torch.arange(8), 2), whole)


def test_bad_seed_or_too_many_counters_refused():
    with pytest.raises(ValueError, match="seed"):
        CounterNoise(seed=2**62, n_rows=1, vocab=2, steps=1, device="cpu")
    with pytest.raises(ValueError, match="2\\*\\*32 counters"):
        CounterNoise(seed=0, n_rows=2**16, vocab=2, steps=2**16 + 1, device="cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gumbel_max_with_counter_noise_samples_the_tempered_softmax(dtype):
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5], dtype=dtype)
    tau = 0.7
    rows, steps = 200, 150  # 30,000 draws: every (row, step) of one call
    noise = CounterNoise(seed=99, n_rows=rows, vocab=5, steps=steps, device="cpu")
    counts = torch.zeros(5, dtype=torch.float64)
    for t in range(steps):
        tok = draw_tokens((logits / tau).expand(rows, 5), noise, torch.arange(rows), t)
        counts += torch.bincount(tok, minlength=5)
    n = rows * steps
    p = torch.softmax(logits.double() / tau, -1)
    se = torch.sqrt(p * (1 - p) / n)
    assert ((counts / n - p).abs() < 5 * se).all(), (counts / n, p)


def test_noise_per_token_is_the_rank_s_own_running_rows(tiny_model64, tiny_tokenizer, monkeypatch):
    # What a data-parallel rank does: rows 2..3 of a 4-row global batch. Every decoding step
    # computes noise for those rows only (fewer once one stops), never for the global batch.
    sizes = []
    gumbel = CounterNoise.gumbel

    def counted(self, rows, step, *args):
        g = gumbel(self, rows, step, *args)
        sizes.append((rows.numel(), g.numel()))
        return g

    monkeypatch.setattr(CounterNoise, "gumbel", counted)
    tiny_model64.eval()
    vocab = tiny_model64.get_output_embeddings().weight.size(0)
    kw = dict(max_new_tokens=12, eos_token_id=tiny_tokenizer.eos_token_id, temperature=1.0)
    kw["pad_token_id"] = tiny_tokenizer.pad_token_id
    width = max(len(p) for p in PROMPTS)
    share = sample(tiny_model64, PROMPTS[2:], rows=[2, 3], n_rows=4, width=width,
                   generator=torch.Generator().manual_seed(0), **kw)  # fmt: skip
    running = share.mask.sum(0).long().tolist()  # rows still decoding at each step
    assert [r for r, _ in sizes] == running and max(running) == 2
    assert all(n == r * vocab for r, n in sizes)
    whole = sample(tiny_model64, PROMPTS, generator=torch.Generator().manual_seed(0), **kw)
    w = share.completion_ids.size(1)
    assert torch.equal(share.completion_ids, whole.completion_ids[2:, :w])


CAPABILITY_SCRIPT = """
import hashlib, json, torch
from rlhflab.rollout.noise import CounterNoise
n = CounterNoise(seed=2**40 + 3, n_rows=16, vocab=4099, steps=8, device="cpu")
b = torch.cat([n.bits(torch.arange(16), t) for t in range(8)])
g = {str(d): torch.cat([n.gumbel(torch.arange(16), t, d) for t in range(8)])
     for d in (torch.float32, torch.float64)}
print(json.dumps({"cap": torch.backends.cpu.get_cpu_capability(),
                  "bits": hashlib.sha256(b.numpy().tobytes()).hexdigest(),
                  "gumbel": {d: v[0, :64].tolist() + [float(v.double().sum())]
                             for d, v in g.items()}}))
"""


@pytest.mark.slow
def test_words_are_the_same_bits_under_every_cpu_kernel_set():
    caps = ["default", "avx2"]
    if "avx512f" in Path("/proc/cpuinfo").read_text():
        caps.append("avx512")
    out = {}
    for cap in caps:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": "1"}
        res = subprocess.run([sys.executable, "-c", CAPABILITY_SCRIPT], env=env, text=True,
                             capture_output=True, timeout=120, check=True)  # fmt: skip
        out[cap] = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["default"]["cap"].lower() == "default"  # the switch took effect
    bits = {o["bits"] for o in out.values()}
    assert len(bits) == 1, out
    # Gumbel = −log(−log u): the vectorised and scalar log may differ in the last bits, never
    # more (relative 4 eps of the dtype; the sum over 65k values: 1e3 eps); only a tie of two
    # noisy logits within that much could notice.
    for dtype, eps in (("torch.float32", 2.0**-23), ("torch.float64", 2.0**-52)):
        ref = torch.tensor(out["default"]["gumbel"][dtype], dtype=torch.float64)
        for o in out.values():
            got = torch.tensor(o["gumbel"][dtype], dtype=torch.float64)
            torch.testing.assert_close(got[:-1], ref[:-1], rtol=4 * eps, atol=0)
            torch.testing.assert_close(got[-1], ref[-1], rtol=1e3 * eps, atol=0)


def _qwen3_tiny():
    """A 2-layer Qwen3 of random weights (seeded: the same in every process), float64."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen3ForCausalLM(cfg).double().eval()


RANKS_WORKER = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from rlhflab import distributed
from rlhflab.rollout.sampler import CounterNoise, sample
from test_counter_noise import RANK_PROMPTS, _qwen3_tiny
distributed.setup("ddp")
sizes = []
gumbel = CounterNoise.gumbel
def counted(self, rows, step, *args):
    sizes.append(rows.numel())
    return gumbel(self, rows, step, *args)
CounterNoise.gumbel = counted
lo, hi = distributed.shard_bounds(len(RANK_PROMPTS))
ro = sample(_qwen3_tiny(), RANK_PROMPTS[lo:hi], max_new_tokens=10, eos_token_id=3,
            stop_token_ids=[4], pad_token_id=0, temperature=1.0, generator=torch.Generator().manual_seed(5),
            rows=list(range(lo, hi)), n_rows=len(RANK_PROMPTS),
            width=max(len(p) for p in RANK_PROMPTS))
with open(f"{sys.argv[2]}/rank{distributed.rank()}.json", "w") as f:
    json.dump({"ids": ro.completion_ids.tolist(), "mask": ro.mask.tolist(),
               "logp": ro.logp.tolist(), "sizes": sizes}, f)
distributed.teardown()
"""
RANK_PROMPTS = [[5 + (3 * i + j) % 11 for j in range(2 + i % 4)] for i in range(6)] * 2


@pytest.mark.slow
def test_two_ranks_sample_what_one_process_samples(tmp_path):
    """torchrun, 2 gloo ranks, each sampling its own 6 of 12 rows (groups of repeated prompts,
    so prefix sharing is on; stops at different steps): the union equals one process's
    completions and log-probs, and no rank computes noise for more than its own rows."""
    from factories import worker_env

    script = tmp_path / "worker.py"
    script.write_text(RANKS_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    res = subprocess.run([*cmd, str(script), str(Path(__file__).parent), str(tmp_path)],
                         env=worker_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    one = sample(_qwen3_tiny(), RANK_PROMPTS, max_new_tokens=10, eos_token_id=3, stop_token_ids=[4],
                 pad_token_id=0, temperature=1.0, generator=torch.Generator().manual_seed(5))  # fmt: skip
    for r, got in enumerate(ranks):
        assert max(got["sizes"]) <= 6  # own rows only (the global batch has 12)
        want = slice(6 * r, 6 * r + 6)
        w = len(got["ids"][0])
        assert got["ids"] == one.completion_ids[want, :w].tolist()
        assert got["mask"] == one.mask[want, :w].tolist() and not one.mask[want, w:].any()
        torch.testing.assert_close(
            torch.tensor(got["logp"], dtype=torch.float64), one.logp[want, :w],
            rtol=0, atol=1e-12,
        )  # fmt: skip
    lengths = one.mask.sum(1)
    assert len(set(lengths.tolist())) > 1 and (lengths < 10).any()  # stops at different steps
