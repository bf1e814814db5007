"""The `rlhflab plan` table: `summary_rows` of a `plan` result and `render` (rich)."""

from __future__ import annotations

_ROWS = [
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state"),
    ("reference", "reference (frozen)"),
    ("critic", "critic (params+grads+optim)"),
    ("reward_model", "reward model"),
    ("activations", "activations"),
    ("logits", "logits"),
    ("autocast_weight_copies", "autocast bf16 weight copies"),
    ("fsdp_unsharded_working_set", "FSDP2 unsharded layers + root"),
    ("fsdp_gathered_model", "FSDP2 whole model gathered"),
    ("rollout_half_copy", "bf16 rollout copy (half_weights)"),
    ("rollout_kv_cache", "rollout KV cache"),
    ("optimizer_step_temporaries", "optimizer-step temporaries"),
]
_PHASE_OF = {
    "activations": "train",
    "logits": "train / scoring",
    "autocast_weight_copies": "train, scoring, rollout",
    "fsdp_unsharded_working_set": "train",
    "fsdp_gathered_model": "rollout; scoring with a critic",
    "rollout_half_copy": "rollout",
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
    table.add_row("load peak (before training)", f"{result['load_peak_gib']:.2f}", load)
    console.print(table)
    cal = result["calibration"]
    console.print(
        f"usable = ({i['gpu_memory_gib']:g} GiB − {cal['fixed_gib']} GiB CUDA context/workspaces)"
        f" / (1 + {cal['fragmentation']:.0%} fragmentation) = {result['usable_gib']:.1f} GiB; "
        f"{micro_batch_line(result)}; host (offloaded) {result['host_gib']:.1f} GiB per rank"
        f"; rank 0's host while loading {result['load_host_gib']:.1f} GiB"
    )
    for line in suggestion_lines(result):
        console.print(line, highlight=False, soft_wrap=True)


def micro_batch_line(result: dict) -> str:
    """Which micro-batch the plan is judged at, and why."""
    mb, best, limit = (
        result["inputs"]["micro_batch"],
        result["max_micro_batch"],
        (result["micro_batch_limit"]),
    )
    if result.get("token_budget") is not None:
        return (
            f"micro-batch {mb}: the full-length rows train.max_tokens_per_micro_batch="
            f"{result['token_budget']} holds (largest that fits: {best} of {limit})"
        )
    if not result.get("micro_batch_searched"):
        return f"micro-batch {mb} as given (largest that fits: {best} of {limit})"
    if best == 0:
        return f"micro-batch 1: not even 1 fits (searched 1..{limit})"
    return (
        f"micro-batch {mb}: the largest that fits (searched 1..{limit}; not the config's "
        f"{result['config_micro_batch']}: give train.micro_batch_size=N to judge at N)"
    )


def suggestion_lines(result: dict) -> list[str]:
    """The `suggestions` of a plan that does not fit, one line each: the change, its per-GPU
    total and whether it fits, the overrides that make it; then the cheapest that fits."""
    sug = result.get("suggestions")
    if not sug:
        return []

    def one(e: dict) -> list[str]:
        verdict = "fits" if e["fits"] else "does NOT fit"
        gpus = f"--gpus {e['gpus']} " if e["gpus"] != result["inputs"]["gpus"] else ""
        return [
            f"  {e['per_gpu_gib']:8.2f} GiB/GPU  {verdict:12}  {e['change']} "
            f"(micro-batch {e['micro_batch']}; {e['cost']})",
            f"{'':27}{gpus}{' '.join(e['overrides'])}",
        ]

    lines = [
        "What makes it fit, each change alone, cheapest first (exact changes, then bf16 weights, "
        "then CPU offload, then LoRA, then more GPUs; docs/plan.md):"
    ]
    for e in sug["each"]:
        lines += one(e)
    if not sug["each"]:
        lines.append("  (no change applies)")
    best = sug["cheapest"]
    if best is None:
        lines.append("No combination of these changes fits on these GPUs.")
    else:
        lines.append("The cheapest combination that fits:")
        lines += one(best)
    return lines
