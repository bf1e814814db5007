"""Shared plumbing of the benchmarks: environment, models, prompts, timing and statistics.

Every benchmark loads the SAME saved weights into rlhflab and into TRL, runs on one torch thread,
in fp32, and alternates the two frameworks step by step (A, B, A, B, ...) in one process.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import string
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch

THREADS = 1
BENCH_DIR = Path(__file__).resolve().parent
# Models and the SFT checkpoint (git-ignored); RLHFLAB_BENCH_CACHE puts them elsewhere.
CACHE_DIR = Path(os.environ.get("RLHFLAB_BENCH_CACHE") or BENCH_DIR / ".cache")
# Smoke mode (`bench/run.py --smoke`, the test suite's tests/bench/test_bench_smoke.py): every row
# once at its smallest size, to show that it runs; nothing it measures is a result. Set in the
# environment so that the rows' subprocesses (memory, learning) see it too.
SMOKE = os.environ.get("RLHFLAB_BENCH_SMOKE") == "1"

# The two model scales of the issue.
TINY = "tiny"  # rlhflab "base" Qwen3 shape: vocab 1024, hidden 256, 4 layers, ~4.2 M parameters
SMOL = "smol135m"  # SmolLM2-135M's configuration, random init: vocab 49152, hidden 576, 30 layers

SMOL_CONFIG = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
)


def setup(threads: int = THREADS) -> None:
    """One torch thread, quiet libraries, deterministic seeds."""
    import logging
    import warnings

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore")
    for name in ("transformers", "trl", "accelerate", "datasets", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:
        pass
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        pass


def have_trl() -> bool:
    """Whether TRL is importable (the `bench` extra). Without it the step rows run rlhflab's
    side alone (smoke test; their TRL values are NaN)."""
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def machine() -> dict:
    """CPU model, cores, torch / transformers / trl versions, GPU (if any)."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": THREADS,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    for mod in ("transformers", "trl"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    return info


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


def summary(values: list[float]) -> dict:
    """median / min / max / n of a list of measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": [round(v, 6) for v in values],
    }


@dataclass
class Pair:
    """One benchmark's result: our and their measurements in `unit`."""

    name: str
    ours: list[float]
    theirs: list[float]
    unit: str
    higher_is_better: bool = False
    target: float | None = None  # the target ratio ours/theirs (<= unless higher_is_better)
    note: str = ""
    extra: dict | None = None

    def to_dict(self) -> dict:
        o, t = summary(self.ours), summary(self.theirs)
        ratio = o["median"] / t["median"] if t["median"] else float("nan")
        met = None
        if self.target is not None:
            met = ratio >= self.target if self.higher_is_better else ratio <= self.target
        return {
            "ours": o,
            "theirs": t,
            "unit": self.unit,
            "ratio": ratio,
            "target": self.target,
            "higher_is_better": self.higher_is_better,
            "met": met,
            # A/B rounds alternate, so the i-th values of both sides were measured back to back.
            "pair_ratios": [
                round(a / b, 4) for a, b in zip(self.ours, self.theirs, strict=False) if b
            ],
            "note": self.note,
            **({"extra": self.extra} if self.extra else {}),
        }


def alternate(fn_a, fn_b, *, warmup: int, reps: int) -> tuple[list[float], list[float]]:
    """Time fn_a and fn_b alternately (A B A B ...): `warmup` unmeasured rounds, then `reps`.

    Each fn returns None (its wall time is measured here) or a float (its own measured quantity,
    e.g. tokens/s)."""
    a_vals, b_vals = [], []
    for i in range(warmup + reps):
        for fn, vals in ((fn_a, a_vals), (fn_b, b_vals)):
            t0 = time.perf_counter()
            out = fn()
            dt = time.perf_counter() - t0
            if i >= warmup:
                vals.append(dt if out is None else out)
    return a_vals, b_vals


# ---------------------------------------------------------------------------------------------
# Models and data
# ---------------------------------------------------------------------------------------------


def words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(n)]


def vowel_reward(completions, **kwargs) -> list[float]:
    """The benchmarks' reward (both frameworks, the same function, in TRL's reward-function
    convention, which rlhflab's `reward.components[].function` also calls): the fraction of
    vowels among a completion's letters. Cheap, deterministic and varied, so group advantages
    are not all zero."""
    out = []
    for t in completions:
        letters = [c for c in t.lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / max(1, len(letters)))
    return out


def tokenizer_texts() -> list[str]:
    """Text for the benchmark tokenizer: spell_backward-like questions and answers."""
    out = []
    for w in words(1000 if SMOKE else 20000, seed=0):  # smoke: a faster, cruder tokenizer
        out.append(f"Spell this word backward (example: sun -> nus): {w}")
        out.append(w[::-1])
    return out


def model_dir(kind: str) -> Path:
    """A saved model (safetensors + tokenizer) of the given scale, built once and cached."""
    if SMOKE:
        kind = TINY  # smoke: every row on the tiny model (the code path is the same)
    path = CACHE_DIR / kind
    if (path / "config.json").exists():
        return path
    from rlhflab.models.build import build_model, save_pretrained
    from rlhflab.models.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(tokenizer_texts(), vocab_size=1024)
    if kind == TINY:
        model = build_model(tokenizer, size="base", arch="qwen3", max_position_embeddings=512)
    elif kind == SMOL:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            **SMOL_CONFIG,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch.float32)
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    else:
        raise ValueError(kind)
    save_pretrained(model, tokenizer, path)
    return path


def load(path: Path):
    """(tokenizer, model) from a saved directory, fp32, train mode, SDPA attention."""
    from rlhflab.models.loading import load_model, load_tokenizer

    tokenizer = load_tokenizer(str(path))
    model = load_model(str(path), dtype="float32", attn_implementation="sdpa")
    model.train()
    return tokenizer, model


def prompt_texts(tokenizer, n: int, *, seed: int, length: int | None = None) -> list[str]:
    """Rendered chat prompts (strings) of spell_backward-like questions; with `length`, only
    prompts of exactly that many tokens (so both frameworks see identical shapes)."""
    from rlhflab.data.formatting import encode_prompt, render_prompt

    out = []
    for w in words(50 * n, seed=seed):
        text = render_prompt(tokenizer, question(w))
        if length is None or len(encode_prompt(tokenizer, text)) == length:
            out.append(text)
        if len(out) == n:
            break
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} prompts of {length} tokens")
    return out


def question(word: str) -> str:
    """A spell_backward-like question (the user text of a prompt)."""
    return f"Spell this word backward (example: sun -> nus): {word}"


def modal_prompt_length(tokenizer, seed: int = 0) -> int:
    from collections import Counter

    from rlhflab.data.formatting import encode_prompt

    lens = [len(encode_prompt(tokenizer, p)) for p in prompt_texts(tokenizer, 400, seed=seed)]
    return Counter(lens).most_common(1)[0][0]


def random_completion(rng: random.Random, n_words: int) -> str:
    return " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(n_words)
    )


def generate_sampled(
    model, ids, mask, *, pad_token_id: int, max_new: int, n: int = 1, eos_token_id=None
):
    """The `model.generate` side of the generation rows: sampling at temperature 1 with no
    truncation, `n` samples per prompt. With `eos_token_id` None (the fixed-length rows) EOS is
    off and every row gets exactly `max_new` new tokens; with an id, rows stop at it (at most
    `max_new` new tokens, the `*_eos_*` rows).

    ids, mask: (B, P) left-padded prompts. Returns generate's (B·n, P + new) token ids."""
    fixed = eos_token_id is None
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            num_return_sequences=n,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new,
            min_new_tokens=max_new if fixed else None,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        )


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss
