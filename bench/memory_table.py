"""The README's "Many GPUs" memory table: model-state bytes per GPU for Qwen3-shape models under
each `parallel.strategy`, computed (not measured) from exact parameter counts.

Parameter counts come from the architectures built on the meta device (no weights, no download).
What the table counts, per trained parameter (AdamW, fp32 master weights, as rlhflab trains):
    weights 4 B + gradients 4 B + AdamW exp_avg 4 B + exp_avg_sq 4 B = 16 B
a frozen reference model: 4 B (fp32 weights, no gradients or optimizer state);
a PPO critic: a second backbone with its own optimizer, 16 B per parameter of it.
ddp replicates all of it on every GPU; fsdp2 divides it by the number of GPUs N; fsdp2 with CPU
offload keeps it in host memory (GPU: about one layer's parameters at a time). Not counted:
activations (activation checkpointing cuts those, not these), the all-gathered layer in flight,
CUDA context, and sampling: a rollout unshards the whole policy on every GPU
(`distributed.gathered`), +4 B/param (2 with parallel.mixed_precision=bf16) while it runs.

    python bench/memory_table.py
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

SHAPES = {  # the published configs' shapes
    "Qwen3-0.6B": Qwen3Config(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "Qwen3-1.7B": Qwen3Config(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "Qwen3-4B": Qwen3Config(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    ),
    "7B (Qwen2.5-7B shape)": Qwen2Config(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
    ),
}  # fmt: skip
TRAINED, FROZEN = 16, 4  # bytes per parameter


def n_params(config) -> int:
    """Distinct parameters of the causal LM built on the meta device (tied weights once)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def per_gpu_bytes(strategy: str, n_gpus: int, *, ref: bool, critic: bool) -> float:
    """Model-state bytes per parameter of the policy, per GPU."""
    total = TRAINED + (FROZEN if ref else 0) + (TRAINED if critic else 0)
    if strategy == "ddp":
        return total
    if strategy == "fsdp2":
        return total / n_gpus
    return 0.0  # fsdp2 + CPU offload: host memory


def main() -> None:
    rows = [("ddp (any N)", "ddp", 1), ("fsdp2, N=4", "fsdp2", 4), ("fsdp2, N=8", "fsdp2", 8)]
    combos = [
        ("policy", False, False),
        ("+ reference", True, False),
        ("+ ref + critic", True, True),
    ]
    print("Bytes per parameter per GPU (model states):\n")
    print("| strategy | " + " | ".join(c[0] for c in combos) + " |")
    print("|---|" + "---|" * len(combos))
    for label, strategy, n in rows:
        cells = [f"{per_gpu_bytes(strategy, n, ref=r, critic=c):g}" for _, r, c in combos]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("| fsdp2 + cpu_offload | 0 | 0 | 0 |\n")
    print("(with CPU offload the states live in host memory: the fsdp2 numbers per rank)\n")
    print("GB per GPU (policy + reference, the GRPO-with-KL setting; + critic for PPO):\n")
    print(
        "| model | parameters | ddp | ddp + critic | fsdp2 N=4 | fsdp2 N=8 | fsdp2 N=8 + critic |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, config in SHAPES.items():
        n = n_params(config)

        def gb(strategy, gpus, critic, n=n):
            return f"{n * per_gpu_bytes(strategy, gpus, ref=True, critic=critic) / 1e9:.1f}"

        cells = [gb("ddp", 1, False), gb("ddp", 1, True), gb("fsdp2", 4, False)]
        cells += [gb("fsdp2", 8, False), gb("fsdp2", 8, True)]
        print(f"| {name} | {n / 1e9:.2f} B | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
