"""Every shipped config that fine-tunes all weights keeps float32 (or float64) master weights.

With `model.dtype: bfloat16` (or float16) and no LoRA, the parameters AdamW updates are bf16: an
update below half a unit in the last place of a weight (bf16 keeps 8 significant bits, so |Δw| <
~2⁻⁹·|w|) rounds away, and at the learning rates of full fine-tuning (≤ 1e-5) most of them do.
The project's form for mixed precision is fp32 `model.dtype` with `precision.autocast: bf16`
(bf16 compute). Frozen models (a distillation teacher, an RM used as reward) may be bf16; LoRA
adapters are float32 whatever the base's dtype. Every config is read with the project's loaders:
trainer presets, each stage of a replication config, the stages a pipeline file builds, and the
quickstart's embedded preset.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
LOW_PRECISION = ("bfloat16", "float16")


def _trained_configs(path: Path, tmp: Path) -> dict:
    """{stage name: validated training config} of one shipped YAML file."""
    from rlhflab.config import load_config, read_yaml

    if "replications" in path.parts:
        from rlhflab.replications import stage

        spec = read_yaml(path)
        out = {}
        for section in [k for k in spec if k != "experiment"]:
            built = "build" in (spec[section].get("model") or {})
            over = {} if built else {"model": {"name_or_path": "x"}}  # keeps the section's dtype
            if isinstance(spec[section].get("data"), dict) and "path" in spec[section]["data"]:
                over["data"] = {"path": "x"}
            out[section] = stage(spec, section, str(path), **over)
        return out
    if "pipeline" in path.parts:
        from rlhflab.pipeline import build_configs, load_pipeline

        return build_configs(load_pipeline(path), tmp, base=path)
    return {"": load_config(path)}


def _low_precision_full_finetunes(configs: dict) -> list[str]:
    return [
        f"{name or 'config'}: model.dtype {cfg.model.dtype}"
        for name, cfg in configs.items()
        if cfg.model.lora is None and cfg.model.dtype in LOW_PRECISION
    ]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_full_finetuning_configs_keep_fp32_master_weights(path, tmp_path):
    bad = _low_precision_full_finetunes(_trained_configs(path, tmp_path))
    assert not bad, (
        f"{path.relative_to(ROOT)}: full fine-tuning with {bad}; use model.dtype: "
        "float32 and precision.autocast: bf16"
    )


def test_quickstart_keeps_fp32_master_weights(tmp_path):
    from rlhflab.quickstart import build_configs

    for fast in (False, True):
        sft, grpo = build_configs(fast=fast, root=tmp_path)
        assert not _low_precision_full_finetunes({"sft": sft, "grpo": grpo})


def test_the_gpu_replications_compute_in_bf16(tmp_path):
    # The three GPU configs that held bf16 weights keep bf16 compute (autocast), fp32 weights.
    for name in ("rm_overopt_gpu", "dpo_overopt_gpu", "prm_orm_gpu"):
        path = ROOT / "configs/replications" / f"{name}.yaml"
        for section, cfg in _trained_configs(path, tmp_path).items():
            if section == "sft" and name != "prm_orm_gpu":
                continue  # unused while experiment.policy is set
            assert cfg.model.dtype == "float32" and cfg.precision.autocast == "bf16", (
                name,
                section,
            )
