"""`rlhflab pipeline`: the classic RLHF pipeline on one preference dataset, in one command.

    1. reward model   Bradley–Terry RM on the dataset's pairs, from the SFT model's backbone
    2. RL             each policy-gradient method (PPO, GRPO, ...) from the SFT model, rewarded by
                      that RM, on the same dataset's prompts (`data.source: dataset`)
    3. DPO            each direct-alignment method from the SFT model, on the same pairs
    4. comparison     every final model and the SFT model on the held-out prompts: the RM's score
                      of the greedy completion, KL(π ‖ π_SFT) per completion (k1, summed over the
                      tokens of completions sampled at temperature 1), greedy response length,
                      and each run's wall-clock; `comparison.md`, `comparison.png`,
                      `results.json`

The pipeline file is flat: `sft_model`, `data` (path, format, split, ...), `rm` (the RM config's
own sections), and `methods` (name → {preset, overrides}). The pipeline fills in each run's
model, data and reward; every config is validated before the first run starts.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError

from rlhflab.config import PromptDataConfig, Strict, apply_overrides, config_from_dict, read_yaml
from rlhflab.errors import ConfigError

RM_PLACEHOLDER = "<the pipeline's reward model>"


class PipelineDataConfig(Strict):
    """The preference dataset: pairs for the RM and DPO, prompts for RL and the comparison."""

    path: str
    format: Literal["hh_rlhf", "ultrafeedback", "pairs"] = "hh_rlhf"
    split: str = "train"
    max_rows: int | None = Field(None, ge=1)
    heldout_frac: float = Field(0.1, gt=0, lt=1)  # prompts held out for the comparison
    n_heldout: int | None = Field(None, ge=1)


class PipelineEvalConfig(Strict):
    """The comparison on held-out prompts."""

    max_new_tokens: int = Field(32, ge=1)
    batch_size: int = Field(64, ge=1)


class MethodConfig(Strict):
    """One method: a preset (configs/pg/*.yaml or configs/dpo/*.yaml) and dotted overrides."""

    preset: str
    overrides: list[str] = Field(default_factory=list)


class PipelineConfig(Strict):
    """`rlhflab pipeline FILE`: see the module doc."""

    name: str = "pipeline"
    seed: int = 0
    sft_model: str
    data: PipelineDataConfig
    rm: dict[str, Any] = Field(default_factory=dict)
    methods: dict[str, MethodConfig]
    eval: PipelineEvalConfig = Field(default_factory=PipelineEvalConfig)
    threads: int | None = None


def _prompt_data(d: PipelineDataConfig, seed: int) -> dict:
    """The `data` section that reads the preference file's prompts (PromptDataConfig)."""
    column, fmt = {"hh_rlhf": ("chosen", "hh_transcript")}.get(d.format, ("prompt", "auto"))
    return {
        "source": "dataset",
        "path": d.path,
        "split": d.split,
        "prompt_column": column,
        "prompt_format": fmt,
        "heldout_frac": d.heldout_frac,
        "n_heldout": d.n_heldout,
        "max_rows": d.max_rows,
        "seed": seed,
    }


def _raw(path: str, base: Path | None = None) -> dict:
    """A preset's YAML: `path` as given, else relative to the pipeline file's folder or one of
    its ancestors (so `configs/pg/grpo.yaml` works from anywhere inside a checkout)."""
    candidates = [Path(path)]
    if base is not None and not Path(path).is_absolute():
        candidates += [d / path for d in (base.resolve().parent, *base.resolve().parents)]
    for p in candidates:
        if p.is_file():
            return read_yaml(p) or {}
    raise ConfigError(f"pipeline: preset not found: {path}")


def build_configs(
    pc: PipelineConfig, root: Path, rm_path: str = RM_PLACEHOLDER, base: Path | None = None
) -> dict:
    """{"rm": RMConfig, <method>: PGConfig | DPOConfig} with model, data and reward filled in.

    Raises ConfigError (one line naming the method and key) for a bad preset or override."""
    d = pc.data
    common = {"seed": pc.seed, "model": {"name_or_path": pc.sft_model}}
    if pc.threads:
        common["precision"] = {"threads": pc.threads}
    out = {}
    rm_raw = {
        "trainer": "reward_model",
        "kind": "preference",
        **copy.deepcopy(pc.rm),
        **common,
        "run": {"name": f"{pc.name}-rm", "root": str(root)},
    }
    rm_raw["data"] = {
        **rm_raw.get("data", {}),
        "source": "preference",
        "path": d.path,
        "format": d.format,
        "split": d.split,
        "max_rows": d.max_rows,
    }
    out["rm"] = config_from_dict(rm_raw, source="pipeline rm")
    for name, m in pc.methods.items():
        raw = apply_overrides(_raw(m.preset, base), list(m.overrides))
        trainer = raw.get("trainer")
        raw.update(common)
        raw["precision"] = {**raw.get("precision", {}), **common.get("precision", {})}
        raw["run"] = {**raw.get("run", {}), "name": f"{pc.name}-{name}", "root": str(root)}
        raw["eval"] = {**raw.get("eval", {}), "n": 0}  # compared below, on the same prompts
        if trainer == "policy_gradient":
            raw["data"] = _prompt_data(d, pc.seed)
            raw["reward"] = {
                "components": [
                    {"name": "reward_model", "args": {"path": rm_path, "kind": "preference"}}
                ]
            }
        elif trainer == "direct_alignment":
            raw["data"] = {
                **raw.get("data", {}),
                "source": "file",
                "path": d.path,
                "format": d.format,
                "split": d.split,
                "max_rows": d.max_rows,
            }
            raw.setdefault("verifiable", {})["rounds"] = 1
        else:
            raise ConfigError(
                f"pipeline: methods.{name}: {m.preset} is a {trainer!r} preset; use a "
                "policy_gradient or direct_alignment preset"
            )
        out[name] = config_from_dict(raw, source=f"pipeline methods.{name} ({m.preset})")
    return out


def load_pipeline(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read and validate a pipeline file (dotted overrides applied)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"pipeline file not found: {p}")
    raw = apply_overrides(read_yaml(p) or {}, overrides or [])
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"{p}: {loc}: {first['msg']}") from None


def run_pipeline(path: str | Path, overrides: list[str] | None = None, root: str = "runs") -> dict:
    """Run the pipeline file at `path`; returns the comparison (also in results.json)."""
    from rlhflab.data.prompts import load_prompt_dataset
    from rlhflab.rundir import create_run_dir
    from rlhflab.serialize import write_json_atomic, write_text_atomic
    from rlhflab.trainers import run_config

    pc = load_pipeline(path, overrides)
    # Validate everything before the first run: configs, and the held-out prompts.
    build_configs(pc, Path(root), base=Path(path))
    heldout = load_prompt_dataset(
        PromptDataConfig(**_prompt_data(pc.data, pc.seed)), seed=pc.seed
    ).heldout
    out_dir = create_run_dir(root, pc.name)
    write_text_atomic(
        out_dir / "pipeline.yaml", yaml.safe_dump(pc.model_dump(mode="json"), sort_keys=False)
    )
    t0 = time.perf_counter()
    rm_res = run_config(build_configs(pc, out_dir, base=Path(path))["rm"])
    cfgs = build_configs(pc, out_dir, rm_path=rm_res["model_dir"], base=Path(path))
    runs = {"rm": rm_res}
    for name in pc.methods:
        runs[name] = run_config(cfgs[name])
    models = {"sft": pc.sft_model, **{n: runs[n]["model_dir"] for n in pc.methods}}
    rows = compare_models(models, rm_res["model_dir"], heldout, pc)
    for name, row in rows.items():
        row["wall_s"] = runs[name]["wall_s"] if name in runs else None
        row["run_dir"] = runs[name]["run_dir"] if name in runs else None
    results = {
        "pipeline": pc.name,
        "rm": {"run_dir": rm_res["run_dir"], "eval": rm_res["eval"], "wall_s": rm_res["wall_s"]},
        "heldout_prompts": len(heldout),
        "methods": rows,
        "wall_s": round(time.perf_counter() - t0, 2),
        "out_dir": str(out_dir),
    }
    write_json_atomic(out_dir / "results.json", results)
    write_text_atomic(out_dir / "comparison.md", comparison_table(results))
    plot_pipeline(results, out_dir / "comparison.png")
    return results


def compare_models(models: dict[str, str], rm_path: str, heldout: list, pc: PipelineConfig):
    """{name: {"rm_score", "kl_to_sft", "response_len"}} of each model on the held-out prompts.

    rm_score: mean RM score (raw Bradley–Terry logit) of the greedy completion; response_len: mean
    greedy completion length in tokens (eos included); kl_to_sft: mean over prompts of
    Σ_t (log π(o_t) − log π_SFT(o_t)) over a completion sampled from π at temperature 1 — the k1
    estimate of KL(π ‖ π_SFT) per completion (0 for the SFT model itself).
    """
    import torch

    from rlhflab.data.formatting import encode_prompt
    from rlhflab.data.prompts import render_row
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.reward_model import RewardModelScorer
    from rlhflab.rollout.engines import SamplingParams, make_engine, sample_chunks
    from rlhflab.rollout.sampler import completion_logps

    if pc.threads:
        torch.set_num_threads(pc.threads)
    tokenizer = load_tokenizer(pc.sft_model)
    ref = load_model(pc.sft_model).eval()
    scorer = RewardModelScorer.from_pretrained(rm_path, kind="preference")
    prompts = [encode_prompt(tokenizer, render_row(tokenizer, r)) for r in heldout]
    e = pc.eval
    out = {}
    for name, path in models.items():
        model = ref if name == "sft" else load_model(path).eval()
        engine = make_engine(None, model, tokenizer)  # the hf engine, as the trainers sample
        gen = torch.Generator().manual_seed(pc.seed)
        scores, lengths, kls = [], [], []
        greedy = SamplingParams(max_new_tokens=e.max_new_tokens, greedy=True)
        sampled = SamplingParams(max_new_tokens=e.max_new_tokens)  # the generator's draws only
        with torch.no_grad():
            for _, ro, _ in sample_chunks(model, engine, tokenizer, prompts, greedy,
                                          chunk=e.batch_size):  # fmt: skip
                scores += scorer.score_rollout(ro).tolist()
                lengths += ro.lengths.float().tolist()
            for _, ro, _ in sample_chunks(model, engine, tokenizer, prompts, sampled,
                                          chunk=e.batch_size, generator=gen):  # fmt: skip
                logp, _ = completion_logps(model, ro)
                logp_ref, _ = completion_logps(ref, ro)
                kls += ((logp - logp_ref) * ro.mask).sum(1).tolist()
        n = max(1, len(scores))
        out[name] = {
            "rm_score": sum(scores) / n,
            "kl_to_sft": sum(kls) / n,
            "response_len": sum(lengths) / n,
        }
    return out


def comparison_table(results: dict) -> str:
    """Markdown table of the comparison."""
    lines = [
        f"# Pipeline '{results['pipeline']}': {results['heldout_prompts']} held-out prompts",
        "",
        "| method | RM score (greedy) | KL to SFT (k1, sampled) | response length | wall-clock s |",
        "|---|---|---|---|---|",
    ]
    for name, r in results["methods"].items():
        wall = "-" if r.get("wall_s") is None else f"{r['wall_s']:.1f}"
        lines.append(
            f"| {name} | {r['rm_score']:.3f} | {r['kl_to_sft']:.3f} | "
            f"{r['response_len']:.1f} | {wall} |"
        )
    return "\n".join(lines) + "\n"


def plot_pipeline(results: dict, path: Path) -> None:
    """Bar charts of RM score, KL to SFT and response length per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["methods"])
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), dpi=100)
    for ax, key, title in zip(
        axes,
        ("rm_score", "kl_to_sft", "response_len"),
        ("RM score (greedy, held-out)", "KL to SFT per completion", "response length"),
        strict=True,
    ):
        ax.bar(names, [results["methods"][n][key] for n in names], color="tab:blue")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
