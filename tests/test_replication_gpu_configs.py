"""Every replication's GPU config: each training stage fits one 48 GB GPU (an RTX A6000, the
smaller of the cards the GPU configs are written for) per `rlhflab plan`'s estimate at the
stage's own micro-batch, its cells can be spread over GPUs (`--only i/N`), and its header says
how, and that its wall-clock is not measured."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIGS = sorted((ROOT / "configs/replications").glob("*_gpu.yaml"))
GPU_GIB = 48.0
# prompt tokens where a policy-gradient config does not bound them: R1-Zero's template (~170
# tokens) plus a GSM8K question (< 200)
PROMPT_LEN = 512
# the stages that train the start policy, skipped when `experiment.policy` names one (docs)
START_STAGES = ("sft", "base")


def _built_shape(build: dict, name: str):
    """The plan shape of a model the config builds from scratch (`model.build`)."""
    from rlhflab.models.build import SIZE_PRESETS
    from rlhflab.plan.shapes import shape_from_config

    preset = SIZE_PRESETS[build.get("size", "base")]
    cfg = {**preset, "vocab_size": build["vocab_size"], "tie_word_embeddings": True,
           "head_dim": preset["hidden_size"] // preset["num_attention_heads"],
           "model_type": build.get("arch", "qwen3"),
           "max_position_embeddings": build.get("max_position_embeddings", 512)}  # fmt: skip
    return shape_from_config(cfg, name=name, where=name)


def _model_of(spec: dict, section: str):
    """(name, plan shape) of the model a stage trains: its own (a Hub id of a built-in shape, or
    built from scratch), or, for a placeholder, the replication's start policy or the model its
    first stage trains."""
    from rlhflab.plan import resolve_shape

    model = spec[section].get("model") or {}
    if "build" in model:
        return f"{section} (built)", _built_shape(model["build"], section)
    name = model.get("name_or_path")
    if name is None or name.startswith("<"):
        name = (spec.get("experiment") or {}).get("policy")
    if name is None or name.startswith("<"):  # the model the replication's first stage trains
        first = next(k for k in spec if k != "experiment")
        return _model_of(spec, first)
    return name, resolve_shape(name)  # a built-in shape: the Hub is not read


def _stages(path: Path) -> list[tuple[str, str, object, object]]:
    from rlhflab.config import read_yaml
    from rlhflab.replications import stage

    spec = read_yaml(path)
    out = []
    for section in [k for k in spec if k != "experiment"]:
        if section in START_STAGES and (spec.get("experiment") or {}).get("policy"):
            continue  # not trained: the replication starts from experiment.policy
        model, shape = _model_of(spec, section)
        built = "build" in (spec[section].get("model") or {})
        over = {} if built else {"model": {"name_or_path": "x"}}
        if isinstance(spec[section].get("data"), dict) and "path" in spec[section]["data"]:
            over["data"] = {"path": "x"}
        out.append((section, model, shape, stage(spec, section, str(path), **over)))
    return out


def test_there_is_a_gpu_config_per_replication():
    from rlhflab.replications import REPLICATIONS

    names = {Path(default).stem for _, default in REPLICATIONS.values()}
    assert {p.stem.removesuffix("_gpu") for p in GPU_CONFIGS} == names


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_every_stage_of_a_gpu_config_fits_one_48gb_gpu_per_plan(path):
    from rlhflab.plan import estimate, inputs_from_config

    for section, model, shape, cfg in _stages(path):
        inputs, _ = inputs_from_config(cfg, shape, gpus=1, gpu_memory_gib=GPU_GIB,
                                       prompt_len=PROMPT_LEN)  # fmt: skip
        est = estimate(shape, inputs)
        assert est["fits"] and est["load_fits"], (
            f"{path.name} [{section}] {model}: {est['per_gpu_gib']:.1f} GiB per GPU at micro-batch "
            f"{inputs.micro_batch} (load {est['load_peak_gib']:.1f}), usable {est['usable_gib']:.1f}"
        )


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_a_gpu_config_spreads_its_cells_and_says_its_time_is_unmeasured(path):
    from rlhflab.config import read_yaml
    from rlhflab.replications import REPLICATIONS
    from rlhflab.replications.cells import is_cellular

    name = next(n for n, (_, d) in REPLICATIONS.items() if Path(d).stem == path.stem[:-4])
    module = importlib.import_module(REPLICATIONS[name][0])
    header = "".join(line for line in path.read_text().splitlines(True) if line.startswith("#"))
    assert "unmeasured" in header.lower() or "not run" in header.lower()
    if not is_cellular(module):
        pytest.skip(f"{name} is not split into cells yet")
    cells = module.cells(read_yaml(path), str(path))
    assert len(cells) >= 4, f"{path.name}: {len(cells)} cells cannot spread over 4 GPUs"
    assert "--only" in header, f"{path.name}: the header must say how to split it (--only i/N)"
