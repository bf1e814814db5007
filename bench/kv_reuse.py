"""KV reuse across turns (`env.kv_reuse`) on the calculator task: prompt tokens prefilled per
episode, and the sampling time, with each turn continuing from the episode's KV cache against
re-prefilling the whole history every turn.

The policy: the calculator SFT model (configs/multiturn/calculator_sft.yaml, `--sft-steps`) after
`--grpo-steps` of GRPO with the calculator environment (configs/multiturn/calculator_grpo.yaml),
so that its episodes call the tool (two or three model turns). Then `--batches` batches of
`--episodes` episodes each (the GRPO config's sampling: T = 1, its limits), every batch sampled
twice from the same seed, KV reuse on and off, in alternating order. Reported: prompt tokens
forwarded per episode (the hf engine's counters: "prefilled" real tokens, padding not counted;
"reused" taken from kept caches), turns per episode, the sampling wall-clock per batch with the
paired difference (on − off) and its 95% t interval over batches, and whether both arms drew the
same tokens (float32: a kept cache can round differently from a fresh prefill; the float64
equality is a test, tests/rollout/test_kv_reuse.py).

    python -m bench.kv_reuse --out bench/kv_reuse_results.json
    python -m bench.kv_reuse --smoke --out /tmp/kv.json      # tiny sizes, not results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "multiturn"


def train_policy(root: Path, sft_steps: int, grpo_steps: int, seed: int) -> str:
    """The calculator SFT model, then `grpo_steps` of GRPO with the environment; its directory."""
    from rlhflab.config import load_config
    from rlhflab.data.tasks import make_splits
    from rlhflab.envs.calculator_demos import demonstrations
    from rlhflab.trainers import policy_gradient, sft

    base = [f"seed={seed}", f"run.root={root}", f"train.steps={sft_steps}"]
    cfg = load_config(CONFIGS / "calculator_sft.yaml", base)
    t = cfg.task
    splits = make_splits(t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout,
                         seed=t.seed)  # fmt: skip
    demos = root / "demos.jsonl"
    demos.write_text("".join(json.dumps(r) + "\n" for r in demonstrations(splits.train, 0.4, seed)))
    model_dir = sft.train(
        load_config(CONFIGS / "calculator_sft.yaml", [*base, f"data.path={demos}"])
    )["model_dir"]
    if grpo_steps == 0:
        return model_dir
    cfg = load_config(CONFIGS / "calculator_grpo.yaml", [
        f"seed={seed}", f"run.root={root}", f"model.name_or_path={model_dir}",
        f"train.steps={grpo_steps}", f"eval.every={grpo_steps}", "eval.n=20",
    ])  # fmt: skip
    return policy_gradient.train(cfg)["model_dir"]


def measure(model_dir: str, episodes: int, batches: int, seed: int) -> dict:
    import torch

    from rlhflab.config import load_config
    from rlhflab.data.tasks import make_splits
    from rlhflab.envs import load_env
    from rlhflab.envs.episodes import run_episodes
    from rlhflab.eval.episodes import episode_limits
    from rlhflab.models.loading import context_length, load_model, load_tokenizer
    from rlhflab.rollout.engines import SamplingParams, make_engine

    torch.set_num_threads(1)
    cfg = load_config(CONFIGS / "calculator_grpo.yaml", [f"model.name_or_path={model_dir}"])
    t = cfg.task
    rows = make_splits(t.name, config=t.config, n_train=t.n_train, n_heldout=t.n_heldout,
                       seed=t.seed).train  # fmt: skip
    tokenizer = load_tokenizer(model_dir)
    model = load_model(model_dir, device="cpu").eval()
    env = load_env(cfg.env.class_, cfg.env.args, tool_timeout_s=cfg.env.tool_timeout_s)
    sampling = SamplingParams(n=1, temperature=cfg.rollout.temperature)
    arms = {"on": [], "off": []}
    for b in range(batches):
        problems = rows[b * episodes : (b + 1) * episodes]
        order = ("on", "off") if b % 2 == 0 else ("off", "on")
        for arm in order:
            engine = make_engine(cfg.rollout, model, tokenizer)
            limits = episode_limits(cfg.env, rollout_max_new_tokens=cfg.rollout.max_new_tokens,
                                    context=context_length(model))  # fmt: skip
            limits = dataclasses.replace(limits, kv_reuse=arm == "on")
            t0 = time.perf_counter()
            with torch.no_grad():
                out = run_episodes(engine, tokenizer, env, problems, sampling, limits,
                                   generator=torch.Generator().manual_seed(seed * 1000 + b))  # fmt: skip
            wall = time.perf_counter() - t0
            tr = out.trajectory
            arms[arm].append({
                "wall_s": wall, "episodes": len(problems), "turns": sum(out.turns),
                "prefilled": engine.stats["prefilled"], "reused": engine.stats["reused"],
                "model_tokens": int(tr.mask.sum()), "tokens": tr.completion_ids.tolist(),
            })  # fmt: skip
    return arms


def summarize(arms: dict, args) -> dict:
    res = {"args": vars(args) | {"out": str(args.out)}, "machine": platform.processor()
           or platform.machine(), "torch_threads": 1}  # fmt: skip
    for arm, runs in arms.items():
        eps = sum(r["episodes"] for r in runs)
        res[arm] = {
            "prefilled_per_episode": sum(r["prefilled"] for r in runs) / eps,
            "reused_per_episode": sum(r["reused"] for r in runs) / eps,
            "turns_per_episode": sum(r["turns"] for r in runs) / eps,
            "model_tokens_per_episode": sum(r["model_tokens"] for r in runs) / eps,
            "wall_s_per_batch": [round(r["wall_s"], 4) for r in runs],
        }
    from rlhflab.replications.verdict import t_interval

    diff = [a["wall_s"] - b["wall_s"] for a, b in zip(arms["on"], arms["off"], strict=True)]
    m, lo, hi = t_interval(diff)
    res["wall_s_on_minus_off"] = {"mean": m, "ci95": [lo, hi], "batches": len(diff)}
    res["same_tokens_batches"] = sum(
        a["tokens"] == b["tokens"] for a, b in zip(arms["on"], arms["off"], strict=True)
    )
    res["prefilled_ratio_on_off"] = (
        res["on"]["prefilled_per_episode"] / res["off"]["prefilled_per_episode"]
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft-steps", type=int, default=1500)
    ap.add_argument("--grpo-steps", type=int, default=20)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="a policy directory (skips the training)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: shows that it runs")
    ap.add_argument("--out", type=Path, default=Path("bench/kv_reuse_results.json"))
    args = ap.parse_args()
    if args.smoke:
        args.sft_steps, args.grpo_steps, args.episodes, args.batches = 2, 0, 4, 2
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model = args.model or train_policy(Path(tmp), args.sft_steps, args.grpo_steps, args.seed)
        train_s = time.perf_counter() - t0
        res = summarize(measure(model, args.episodes, args.batches, args.seed), args)
    res["train_s"] = round(train_s, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    on, off = res["on"], res["off"]
    print(f"[kv_reuse] prompt tokens prefilled per episode: {off['prefilled_per_episode']:.1f} "
          f"(re-prefill) -> {on['prefilled_per_episode']:.1f} (kv reuse), "
          f"{on['reused_per_episode']:.1f} reused; turns/episode {on['turns_per_episode']:.2f}; "
          f"wall on-off {res['wall_s_on_minus_off']['mean']:+.3f} s/batch "
          f"{res['wall_s_on_minus_off']['ci95']}; same tokens {res['same_tokens_batches']}"
          f"/{args.batches} batches")  # fmt: skip


if __name__ == "__main__":
    main()
