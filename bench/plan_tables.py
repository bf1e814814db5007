"""docs/plan.md's "what fits" tables: `rlhflab plan` (rlhflab.plan.plan, the function the CLI
calls) for every built-in shape × job on 4× A6000 48 GB and 8× H100 80 GB.

Each job is a preset with the overrides below (sequence ~1k tokens, micro-batch 4 or 2 pairs,
activation checkpointing). Full fine-tuning tries fsdp2 (fp32 compute), then fsdp2 with
parallel.mixed_precision=bf16, then that plus parallel.cpu_offload=true, and reports the first
that fits; LoRA (r 16, bf16 base) runs as ddp replicas.

    python bench/plan_tables.py      # prints the markdown tables
"""

from __future__ import annotations

from rlhflab.plan import BUILTIN_SHAPES, plan

CKPT = ["model.gradient_checkpointing=true"]
LORA = ["model.lora.r=16", "model.dtype=bfloat16", "parallel.strategy=ddp"]
PG = ["rollout.max_new_tokens=768", "train.micro_batch_size=4", *CKPT]
JOBS = {  # name: (preset, overrides, prompt_len, lora?)
    "SFT": ("configs/sft/jsonl.yaml", ["train.max_len=1024", "train.micro_batch_size=4",
                                       "train.batch_size=64", *CKPT], None, False),
    "SFT LoRA": ("configs/sft/jsonl.yaml", ["train.max_len=1024", "train.micro_batch_size=4",
                                            "train.batch_size=64", *CKPT, *LORA], None, True),
    "GRPO": ("configs/pg/grpo.yaml", PG, 256, False),
    "GRPO + KL": ("configs/pg/grpo.yaml", [*PG, "kl.coef=0.04"], 256, False),
    "GRPO LoRA + KL": ("configs/pg/grpo.yaml", [*PG, "kl.coef=0.04", *LORA], 256, True),
    "DPO": ("configs/dpo/dpo.yaml", ["data.source=file", "data.path=prefs.jsonl",
                                     "data.max_prompt_len=512", "data.max_completion_len=512",
                                     "train.micro_batch_size=2", *CKPT], None, False),
    "DPO LoRA": ("configs/dpo/dpo.yaml", ["data.source=file", "data.path=prefs.jsonl",
                                          "data.max_prompt_len=512", "data.max_completion_len=512",
                                          "train.micro_batch_size=2", *CKPT, *LORA], None, True),
    "RM": ("configs/rm/preference.yaml", ["data.source=preference", "data.path=prefs.jsonl",
                                          "data.max_len=1024", "train.micro_batch_size=4", *CKPT],
           None, False),
}  # fmt: skip
LADDER = [  # full fine-tuning: the first of these that fits
    ("fp32", ["parallel.strategy=fsdp2"]),
    ("bf16", ["parallel.strategy=fsdp2", "parallel.mixed_precision=bf16"]),
    ("bf16+off", ["parallel.strategy=fsdp2", "parallel.mixed_precision=bf16",
                  "parallel.cpu_offload=true"]),
]  # fmt: skip
CLUSTERS = {"4× RTX A6000 48 GB": (4, 48.0), "8× H100 80 GB": (8, 80.0)}


def cell(shape: str, job: str, gpus: int, mem: float) -> str:
    """'31.2 bf16' (GiB per GPU, the settings that fit), with '⚠' when the loading peak
    (`load_peak_gib`: shards filled from rank 0) does not fit; '✗ 61.0' with the smallest
    estimate when nothing fits."""
    preset, over, prompt_len, lora = JOBS[job]
    ladder = [("", [])] if lora else LADDER
    best = None
    for tag, extra in ladder:
        r = plan(shape, gpus=gpus, gpu_memory_gib=mem, config=preset, overrides=[*over, *extra],
                 prompt_len=prompt_len)  # fmt: skip
        if r["fits"]:
            warn = "" if r["load_fits"] else " ⚠"
            return f"{r['per_gpu_gib']:.1f} {tag}".strip() + warn
        best = r["per_gpu_gib"] if best is None else min(best, r["per_gpu_gib"])
    return f"✗ {best:.0f}"


def table(gpus: int, mem: float) -> str:
    """One markdown table: a row per built-in shape, a column per job."""
    lines = ["| model | " + " | ".join(JOBS) + " |", "|---" * (len(JOBS) + 1) + "|"]
    for name, shape in BUILTIN_SHAPES.items():
        cells = [cell(name, job, gpus, mem) for job in JOBS]
        lines.append(f"| {name} ({shape.params() / 1e9:.2f} B) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    for title, (gpus, mem) in CLUSTERS.items():
        print(f"\n**{title}** (GiB per GPU)\n")
        print(table(gpus, mem))
