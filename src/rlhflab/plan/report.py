"""The `rlhflab plan` table: `summary_rows` of a `plan` result and `render` (rich)."""

from __future__ import annotations

_ROWS = [
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer state (AdamW)"),
    ("reference", "reference (frozen)"),
    ("critic", "critic (params+grads+optim)"),
    ("reward_model", "reward model"),
    ("activations", "activations"),
    ("logits", "logits"),
    ("autocast_weight_copies", "autocast bf16 weight copies"),
    ("fsdp_unsharded_working_set", "FSDP2 unsharded layers + root"),
    ("fsdp_gathered_model", "FSDP2 whole model gathered"),
    ("rollout_kv_cache", "rollout KV cache"),
    ("optimizer_step_temporaries", "optimizer-step temporaries"),
]
_PHASE_OF = {
    "activations": "train",
    "logits": "train / scoring",
    "autocast_weight_copies": "train, scoring, rollout",
    "fsdp_unsharded_working_set": "train",
    "fsdp_gathered_model": "scoring, rollout",
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
        f"micro-batch {i['micro_batch']} (largest that fits: {result['max_micro_batch']} "
        f"of {result['micro_batch_limit']}); host (offloaded) {result['host_gib']:.1f} GiB per rank"
        f"; rank 0's host while loading {result['load_host_gib']:.1f} GiB"
    )
