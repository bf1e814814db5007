"""Tiny tasks, model builds and run configs shared by the tests: one definition instead of a copy
per file. Every factory returns a fresh dict (safe to mutate); keyword arguments replace keys
(for the config factories: whole sections, as `dict.update` does).

- `tiny_task()`: reasoning_gym chain_sum, two one-digit terms, 300 train / 16 held-out problems.
- `tiny_build()`: the `model.build` section of a tiny from-scratch model (vocab 300, 64 positions).
- `tiny_sft(root)`, `tiny_pg(root, model_dir)`, `tiny_dpo(root, model_dir)`: raw configs (dicts
  for `config_from_dict`) of each trainer family, small enough to run in seconds on a CPU.
- `write_separators(model, tokenizer, sep)`: make a tiny model write a step separator often (dense
  PRM rewards need steps in the sampled completions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def tiny_task(**over: Any) -> dict:
    """The `task` section: chain_sum with 2 terms of 1 digit, plain answers, binary reward."""
    return {
        "name": "chain_sum",
        "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
        "n_train": 300,
        "n_heldout": 16,
        "seed": 0,
        "answer_format": "plain",
        "reward": "binary",
        **over,
    }


def tiny_build(**over: Any) -> dict:
    """The `model.build` section: a tiny model and a 300-token tokenizer trained on the task."""
    return {
        "size": "tiny",
        "vocab_size": 300,
        "max_position_embeddings": 64,
        "tokenizer_texts": 300,
        **over,
    }


def tiny_sft(root: str | Path, **sections: Any) -> dict:
    """SFT from scratch on `tiny_task()`: 6 steps of 8 examples, no evaluation, console off."""
    raw = {
        "trainer": "sft",
        "model": {"build": tiny_build()},
        "task": tiny_task(),
        "train": {"steps": 6, "batch_size": 8, "micro_batch_size": 8, "max_len": 48},
        "optim": {"lr": 1e-3},
        "eval": {"n": 0},
        "tracking": {"console": False},
        "run": {"name": "sft", "root": str(root)},
    }
    raw.update(sections)
    return raw


def tiny_pg(root: str | Path, model_dir: str | Path, **sections: Any) -> dict:
    """GRPO (the policy-gradient defaults) from `model_dir`: 5 steps of 4 prompts × 4 samples."""
    raw = {
        "trainer": "policy_gradient",
        "model": {"name_or_path": str(model_dir)},
        "task": tiny_task(),
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6},
        "train": {"steps": 5, "micro_batch_size": 16},
        "optim": {"lr": 1e-3},
        "eval": {"n": 0},
        "tracking": {"console": False},
        "run": {"name": "grpo", "root": str(root)},
    }
    raw.update(sections)
    return raw


def tiny_dpo(root: str | Path, model_dir: str | Path, **sections: Any) -> dict:
    """DPO from `model_dir` on verifiable pairs (12 prompts × 4 samples, gold chosen): 8 steps."""
    raw = {
        "trainer": "direct_alignment",
        "model": {"name_or_path": str(model_dir)},
        "task": tiny_task(),
        "data": {"heldout_pairs": 4},
        "verifiable": {
            "n_prompts": 12,
            "samples_per_prompt": 4,
            "max_new_tokens": 6,
            "chosen": "gold",
        },
        "train": {"steps": 8, "batch_size": 4, "micro_batch_size": 4},
        "optim": {"lr": 1e-3},
        "eval": {"n": 0, "pref_every": 0},
        "tracking": {"console": False},
        "run": {"name": "dpo", "root": str(root)},
    }
    raw.update(sections)
    return raw


def worker_env() -> dict:
    """The environment of a torchrun test job: this one without rlhflab's fault switches, one
    thread per process, offline."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("RLHFLAB_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def saved_qwen3_105m(path: Path, *, tokenizer: bool = False) -> int:
    """A random Qwen3-shape model of 105 M parameters (420 MB in float32) saved as safetensors
    at `path` (and a 300-token tokenizer trained on sums when `tokenizer`); returns the weights'
    size in bytes. Many layers and a small vocabulary: its largest tensor (the 8 MB embedding,
    what a rank holds while one tensor is broadcast or exported) is small beside the model, so
    memory tests can tell one tensor from a full copy."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=32,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    if tokenizer:
        from rlhflab.models.tokenizer import train_tokenizer

        texts = [f"{i} + {i % 7} = {i + i % 7}" for i in range(300)]
        train_tokenizer(texts, vocab_size=300).save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def reseal(ck: Path) -> None:
    """Recompute a checkpoint's manifest (sizes and sha256s) and COMMITTED marker as the
    checkpointer computes them (`Checkpointer._save_main`): what someone who swaps a file and
    "fixes" the manifest does, so that only the checks beyond the manifest can refuse it."""
    import json

    from rlhflab.checkpoint import COMMITTED, MANIFEST, sha256_file

    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["files"] = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(ck.iterdir())
        if p.name not in (MANIFEST, COMMITTED)
    }
    (ck / MANIFEST).write_text(json.dumps(manifest, indent=1))
    (ck / COMMITTED).write_text(sha256_file(ck / MANIFEST) + "\n")


def spy_micro_batches(monkeypatch) -> list[list[list]]:
    """Record every split `distributed.micro_batches` returns in this process (one list of
    micro-batches' rows per call), so a test can check that a token budget really grouped rows
    into several micro-batches of uneven sizes."""
    from rlhflab import distributed

    calls: list[list[list]] = []
    real = distributed.micro_batches

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append([rows for rows, _weight in out])
        return out

    monkeypatch.setattr(distributed, "micro_batches", spy)
    return calls


def uneven_step_rows(n: int = 24) -> list[dict]:
    """Step-labelled solutions (`data.source: step_labelled`) of 1 to 4 steps of uneven length,
    ratings +1/−1 by a fixed rule: a PRM's or a token-level ORM's data with much padding."""
    rows = []
    for i in range(n):
        k = 1 + i % 4
        lines = [f"{i}+{j} = {i + j}" + "z" * ((3 * i + j) % 7) for j in range(k)]
        ratings = [1 if (i + j) % 3 else -1 for j in range(k)]
        rows.append({"prompt": f"Add up {i}.", "steps": lines, "ratings": ratings,
                     "final": f"<answer>{i}</answer>", "outcome": int(all(r > 0 for r in ratings))})  # fmt: skip
    return rows


def force_layout(monkeypatch, layout: str) -> list:
    """Make `rollout.sampler.completion_head` score in `layout` ("padded", "tree" or "varlen")
    whatever `layout_for` would choose; returns the list of layouts it built."""
    import rlhflab.models.packing as packing
    import rlhflab.rollout.sampler as sampler

    chosen: list = []

    def layout_for(model, ro, *, sharded):
        if layout == "padded":
            return None
        lay = packing.packed_layout(ro, share_prompts=layout == "tree")
        chosen.append(lay)
        return lay

    monkeypatch.setattr(sampler, "layout_for", layout_for)
    return chosen


def write_separators(model, tokenizer, sep: str = "\n", *, target: float = 0.2) -> int:
    """Make `model` write `sep` (one token) often: Adam steps (lr 1e-2, at most 100) on
    −log π(sep) in random contexts of 24 tokens until its mean probability there exceeds `target`
    (about 1 token in 5 then; an untrained model spreads its mass over the whole vocabulary).
    In place, in the model's dtype; deterministic (seed 0). Returns the separator's token id."""
    import torch

    ids = tokenizer(sep, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, f"{sep!r} is {len(ids)} tokens"
    sep_id = ids[0]
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        ctx = torch.randint(0, len(tokenizer), (8, 24), generator=gen)
        p_sep = torch.softmax(model(ctx).logits.float(), -1)[..., sep_id]
        if p_sep.mean() > target:
            break
        opt.zero_grad()
        (-torch.log(p_sep).mean()).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return sep_id


def opinionated_judge(tokenizer, path: Path, contexts: list[tuple[str, str]], *,
                      template: str, max_position_embeddings: int = 256) -> list[int]:  # fmt: skip
    """Save a tiny Qwen3 judge whose greedy answer to `template` filled with a (prompt,
    completion) is "Score: d", d a digit 1–9 that depends on the completion: a judge whose
    scores vary by row, for tests where a constant judge would hide a mis-assigned row.

    Each training context's d is the digit a fresh random model prefers after "Score: " (its
    own opinion); Adam steps (lr 3e-3, at most 300, seed 0) on the cross-entropy of
    "Score: d<eos>" after the judge prompt (rendered as `JudgeScorer.generate` renders it)
    until every training context's greedy answer is its target. Returns the targets d."""
    import torch

    from rlhflab.data.formatting import encode_completion, encode_prompt, render_prompt
    from rlhflab.models.build import build_model

    torch.manual_seed(0)
    model = build_model(tokenizer, size="tiny", max_position_embeddings=max_position_embeddings)
    prompts = [encode_prompt(tokenizer, render_prompt(tokenizer, template.format(
        prompt=p, completion=c, low=1, high=9))) for p, c in contexts]  # fmt: skip
    marker = tokenizer("Score:", add_special_tokens=False)["input_ids"]
    digits = [tokenizer(f"Score: {d}", add_special_tokens=False)["input_ids"] for d in range(1, 10)]
    head = len(digits[0]) - 1
    assert all(len(d) == head + 1 and d[:head] == digits[0][:head] for d in digits), marker
    digit_ids = torch.tensor([d[-1] for d in digits])
    with torch.no_grad():  # the fresh model's preferred digit in each context
        targets = [int(model(torch.tensor([p + digits[0][:head]])).logits[0, -1, digit_ids]
                       .argmax()) + 1 for p in prompts]  # fmt: skip
    rows = [
        (p, encode_completion(tokenizer, f"Score: {d}"))
        for p, d in zip(prompts, targets, strict=True)
    ]
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        done, loss = True, 0.0
        for p, c in rows:
            logits = model(torch.tensor([p + c[:-1]])).logits[0, len(p) - 1 :]
            done &= bool((logits.argmax(-1) == torch.tensor(c)).all())
            loss = loss + torch.nn.functional.cross_entropy(logits, torch.tensor(c))
        if done:
            break
        opt.zero_grad()
        (loss / len(rows)).backward()
        opt.step()
    assert done, "the judge did not learn its training answers in 300 steps"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return targets


def hand_wired_judge(
    tokenizer, path: Path, answer: str = "Score: 7", *, size: str = "tiny"
) -> None:
    """Save a Qwen3 (`size`, tiny by default) whose greedy continuation of any chat prompt is
    `answer` then EOS.

    With every attention output and MLP output projection zero, the residual stream at a
    position is the embedding of its token: the model is a bigram table. Each source token of
    the chain (the chat prompt's last token, then `answer`'s tokens) gets a distinct basis
    vector as embedding; the LM head row of its successor is that vector (×10), every other
    row is zero, so the successor's logit is the only positive one. vLLM needs a head dimension of
    at least 32: size "small"."""
    import itertools

    import torch

    from rlhflab.data.formatting import encode_prompt, render_prompt
    from rlhflab.models.build import build_model

    model = build_model(tokenizer, size=size, max_position_embeddings=2048,
                        tie_word_embeddings=False)  # fmt: skip
    chain = [encode_prompt(tokenizer, render_prompt(tokenizer, "anything"))[-1],
             *tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]  # fmt: skip
    assert len(set(chain[:-1])) == len(chain) - 1  # distinct sources
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        head.zero_()
        for j, (src, dst) in enumerate(itertools.pairwise(chain)):
            emb[src] = 0.0
            emb[src, j] = 1.0
            head[dst, j] = 10.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
