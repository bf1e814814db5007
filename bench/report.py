"""Write bench/results.json and the markdown table of bench/RESULTS.md from benchmark results."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(x: float) -> str:
    if x != x:  # NaN
        return "–"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    if abs(x) >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def results_json(results: dict[str, dict]) -> dict:
    """{name: {"ours": median, "theirs": median, "unit", "ratio"}} (the issue's format)."""
    return {
        name: {
            "ours": r["ours"]["median"],
            "theirs": r["theirs"]["median"],
            "unit": r["unit"],
            "ratio": r["ratio"],
        }
        for name, r in results.items()
    }


def markdown_table(results: dict[str, dict]) -> str:
    """One row per benchmark: ours and theirs as median (min–max), ratio, target, met."""
    lines = [
        "| benchmark | ours: median (min–max) | theirs: median (min–max) | unit | ratio ours/theirs | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        o, t = r["ours"], r["theirs"]
        if r.get("target") is None:
            target = "–"
        else:
            target = ("≥ " if r.get("higher_is_better") else "≤ ") + f"{r['target']:g}"
        met = {True: "yes", False: "**no**", None: "–"}[r.get("met")]
        lines.append(
            f"| {name} | {_fmt(o['median'])} ({_fmt(o['min'])}–{_fmt(o['max'])}) "
            f"| {_fmt(t['median'])} ({_fmt(t['min'])}–{_fmt(t['max'])}) | {r['unit']} "
            f"| {_fmt(r['ratio'])} | {target} | {met} |"
        )
    return "\n".join(lines) + "\n"


def notes(results: dict[str, dict]) -> str:
    return (
        "\n".join(f"- **{name}**: {r['note']}" for name, r in results.items() if r.get("note"))
        + "\n"
    )


def write(
    results: dict[str, dict], machine: dict, out_dir: Path, *, raw: dict | None = None
) -> None:
    """results.json (issue format), results_full.json (every measurement) and a table file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results_json(results), indent=2) + "\n")
    full = {"machine": machine, "results": results, **(raw or {})}
    (out_dir / "results_full.json").write_text(json.dumps(full, indent=2) + "\n")
