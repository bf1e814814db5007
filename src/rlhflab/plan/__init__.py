"""`rlhflab plan`: per-GPU memory of a training run, estimated before any GPU is rented.

Pure arithmetic (stdlib only; no torch, no model is built or loaded). The package, by concern:

    shapes.py   ModelShape, the built-in shapes and their Hub ids, resolve_shape (a name, a Hub
                id of a built-in shape, or a local config.json)
    memory.py   every memory term derived from first principles (its docstring), PlanInputs,
                estimate, max_micro_batch, the calibration
    inputs.py   an rlhflab config as PlanInputs (inputs_from_config), PlanSetting (a run
                re-planned with more overrides), plan (the command's result)
    suggest.py  fit_suggestions: the changes that make a run fit, cheapest first
    report.py   the table (summary_rows, render)

This module re-exports their public names (`from rlhflab.plan import plan, estimate, ...`).
"""

from rlhflab.plan.inputs import PlanSetting, inputs_from_config, plan
from rlhflab.plan.memory import (
    CALIBRATION,
    FUSED_BLOCK,
    GIB,
    PlanInputs,
    estimate,
    fused_head_bytes,
    layer_activation_bytes,
    max_micro_batch,
    usable_gib,
)
from rlhflab.plan.report import render, summary_rows
from rlhflab.plan.shapes import BUILTIN_SHAPES, HUB_IDS, ModelShape, resolve_shape
from rlhflab.plan.suggest import COST_ORDER, fit_suggestions

__all__ = [
    "BUILTIN_SHAPES",
    "CALIBRATION",
    "COST_ORDER",
    "FUSED_BLOCK",
    "GIB",
    "HUB_IDS",
    "ModelShape",
    "PlanInputs",
    "PlanSetting",
    "estimate",
    "fit_suggestions",
    "fused_head_bytes",
    "inputs_from_config",
    "layer_activation_bytes",
    "max_micro_batch",
    "plan",
    "render",
    "resolve_shape",
    "summary_rows",
    "usable_gib",
]
