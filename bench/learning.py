"""Benchmark 6: held-out accuracy per wall-clock, GRPO from the same SFT checkpoint.

Start: the quickstart's SFT stage (spell_backward, 3-5 letter words, Qwen3-shape "small" model,
vocab 300, 130 steps), built once with `rlhflab train configs/sft/tiny_scratch.yaml ...`.
Each run: GRPO with the quickstart's settings (16 prompts x group 8, 10 new tokens, temperature 1,
binary verifier reward, group z-score advantages, PPO-clip, per-sequence token mean, no KL, LR
warmup 30 steps then constant, grad clip 1.0, 1 thread) for a fixed wall-clock budget, counted the
same way on both sides: from the start of the first training step to the end of the step after
which it has run out (set-up, model loading and data preparation are not counted on either side):
    ours   rlhflab's trainer (the quickstart's GRPO config, checkpoints off) built with the run
           harness (`rlhflab.trainers.loop.Run`) and stepped until the budget has passed since
           the first `step()` began
    TRL    GRPOTrainer (loss_type "grpo", scale_rewards "group", beta 0, same prompts and the same
           verifier as the reward function), stopped by a callback once the budget has passed
           since the first `on_step_begin`
(Earlier versions gave rlhflab `train.max_seconds` = budget, which counts from the trainer's
set-up start, model loading and the task's 20,000-problem split included, and TRL its budget from
`on_train_begin`: under load rlhflab's set-up alone used the 60 s, and its run made one step.)
Learning rates from the same sweep for both; each framework's best LR is picked on validation
problems (held-out[200:400]) and reported on others (held-out[:200]), greedy, rlhflab's
evaluator for both models. Every run is its own subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench import common

SFT_ARGS = [
    "configs/sft/tiny_scratch.yaml",
    "precision.threads=1",
    "task.config={min_word_len: 3, max_word_len: 5}",
    "model.build={size: small, arch: qwen3, vocab_size: 300, max_position_embeddings: 128}",
    f"train.steps={3 if common.SMOKE else 130}",
    *(["task.n_train=200", "task.n_heldout=50"] if common.SMOKE else []),
    "eval.n=0",
    "tracking.console=false",
    f"run.name=bench_sft{'_smoke' if common.SMOKE else ''}",
]
RUNS = common.CACHE_DIR / "runs"
N_REPORT, N_VALID = (8, 8) if common.SMOKE else (200, 200)


def sft_model() -> Path:
    marker = common.CACHE_DIR / f"sft_model{'_smoke' if common.SMOKE else ''}.txt"
    if marker.exists() and Path(marker.read_text().strip()).exists():
        return Path(marker.read_text().strip())
    if common.SMOKE:  # in this process (the same run, without a process start)
        from rlhflab.config import load_config
        from rlhflab.trainers import run_config

        root = common.BENCH_DIR.parent
        run_config(load_config(root / SFT_ARGS[0], [*SFT_ARGS[1:], f"run.root={RUNS}"]))
    else:
        cmd = [sys.executable, "-m", "rlhflab", "train", *SFT_ARGS, f"run.root={RUNS}"]
        out = subprocess.run(cmd, cwd=str(common.BENCH_DIR.parent), capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"the SFT start failed: {out.stderr[-3000:]}")
    name = SFT_ARGS[-1].split("=", 1)[1]
    runs = sorted(RUNS.glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
    model = runs[-1] / "model"
    marker.write_text(str(model))
    return model


def _task():
    """The quickstart's task section (smoke: 200 training and 50 held-out problems)."""
    from rlhflab.quickstart import load_preset

    task = load_preset()["task"]
    return {**task, "n_train": 200, "n_heldout": 50} if common.SMOKE else task


def _splits():
    from rlhflab.data.tasks import make_splits

    t = _task()
    return make_splits(
        t["name"],
        config=t["config"],
        n_train=t["n_train"],
        n_heldout=t["n_heldout"],
        seed=t["seed"],
    )


def run_ours(sft: Path, lr: float, budget: float, out: Path) -> dict:
    """rlhflab's run: the quickstart's GRPO config from `sft` at `lr`, stepped through the run
    harness until `budget` seconds have passed since the first step began (then the run's end:
    the model saved). Returns the model directory, the steps and the training wall time."""
    from rlhflab.quickstart import build_configs
    from rlhflab.trainers.loop import Run
    from rlhflab.trainers.policy_gradient import PolicyGradient

    _, cfg = build_configs(
        fast=False,
        root=RUNS,
        overrides=[
            "grpo.train.steps=100000",
            "grpo.eval.n=0",
            f"grpo.optim.lr={lr}",
            "grpo.tracking.console=false",
            "grpo.run.name=bench_grpo_ours",
            "grpo.checkpoint.every=0",  # as TRL's side (save_strategy "no")
            "grpo.model.gradient_checkpointing=false",  # as TRL's side (common_args)
            *[f"grpo.task.{k}={v}" for k, v in _task().items() if k in ("n_train", "n_heldout")],
        ],
    )
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": str(sft)})})
    session = Run(cfg, PolicyGradient)  # set-up: not counted (nor is TRL's)
    t0 = time.perf_counter()
    with session:
        while session.step() is not None and time.perf_counter() - t0 <= budget:
            pass
    wall = time.perf_counter() - t0
    res = session.finish()
    return {"model": res["model_dir"], "steps": res["steps"], "wall_s": wall}


def run_trl(sft: Path, lr: float, budget: float, out: Path) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from bench.trl_driver import checkpointing_of, common_args, grpo_args
    from rlhflab.data.formatting import render_prompt
    from rlhflab.models.loading import load_tokenizer
    from rlhflab.quickstart import load_preset
    from rlhflab.rewards.verifier import Verifier

    common.setup()
    g = load_preset()["grpo"]
    t = _task()
    splits = _splits()
    tok = load_tokenizer(str(sft))
    verifier = Verifier(answer_format=t["answer_format"], reward=t["reward"])
    problems = splits.train

    def reward(completions, idx, **kwargs):
        return [verifier.score(c, problems[i]) for c, i in zip(completions, idx, strict=True)]

    class Budget(TrainerCallback):
        """Stops training after the step at whose end `budget` seconds have passed since the
        first step began (rlhflab's side counts the same way)."""

        t0: float | None = None

        def on_train_begin(self, args, state, control, model=None, **kw):
            if args.gradient_checkpointing or checkpointing_of(model):
                raise RuntimeError(
                    "unfair benchmark: TRL would run with gradient checkpointing, rlhflab without"
                )

        def on_step_begin(self, args, state, control, **kw):
            if self.t0 is None:
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if time.perf_counter() - self.t0 > budget:
                control.should_training_stop = True

    timer = Budget()

    ds = Dataset.from_dict(
        {
            "prompt": [render_prompt(tok, p.question) for p in problems],
            "idx": list(range(len(problems))),
        }
    )
    r = g["rollout"]
    settings = common_args(str(out / "trl_out"), steps=100000, lr=lr)
    settings.update(  # the quickstart preset's schedule
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=g["optim"]["warmup_steps"],
        max_grad_norm=g["optim"]["max_grad_norm"],
    )
    args = GRPOConfig(
        **settings,
        **grpo_args(
            n_prompts=r["prompts_per_step"],
            group=r["group_size"],
            max_new=r["max_new_tokens"],
            beta=0.0,
            fixed_length=False,
            temperature=r["temperature"],
        ),
    )
    trainer = GRPOTrainer(
        model=str(sft),
        reward_funcs=reward,
        args=args,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[timer],
    )
    trainer.train()
    wall = time.perf_counter() - timer.t0
    model_dir = out / "trl_model"
    trainer.model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return {"model": str(model_dir), "steps": trainer.state.global_step, "wall_s": wall}


def evaluate(model_dir: str) -> dict:
    from rlhflab.eval.accuracy import evaluate as rl_eval
    from rlhflab.models.loading import load_model, load_tokenizer
    from rlhflab.rewards.verifier import Verifier

    common.setup()
    t = _task()
    held = _splits().heldout
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    v = Verifier(answer_format=t["answer_format"], reward=t["reward"])
    rep = rl_eval(model, tok, held[:N_REPORT], v, batch_size=200, max_new_tokens=10)
    val = rl_eval(
        model, tok, held[N_REPORT : N_REPORT + N_VALID], v, batch_size=200, max_new_tokens=10
    )
    return {
        "report": rep["accuracy"],
        "report_stderr": rep["accuracy_stderr"],
        "valid": val["accuracy"],
    }


def _sub(*args) -> dict:
    """`python -m bench.learning ARGS` in a fresh process (its JSON answer); in smoke mode in
    this process (the same functions, without the processes' start-up)."""
    if common.SMOKE:
        return _main([str(a) for a in args])
    out = subprocess.run(
        [sys.executable, "-m", "bench.learning", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=str(common.BENCH_DIR.parent),
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(*, lrs: list[float], budget: float) -> dict:
    """The sweep, alternating frameworks per LR; returns every run and the SFT start."""
    import tempfile

    sft = sft_model()
    result = {"sft": _sub("eval", sft), "budget_s": budget, "lrs": lrs, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        frameworks = ("ours", "trl") if common.have_trl() else ("ours",)  # smoke without TRL
        for lr in lrs:
            for fw in frameworks:
                out = Path(tmp) / f"{fw}_{lr}"
                out.mkdir()
                r = _sub("train", fw, sft, lr, budget, out)
                r.update(_sub("eval", r["model"]))
                r.update({"framework": fw, "lr": lr})
                r.pop("model")
                result["runs"].append(r)
    for fw in frameworks:
        runs = [r for r in result["runs"] if r["framework"] == fw]
        result[f"best_{fw}"] = max(runs, key=lambda r: r["valid"])
    return result


def _main(argv: list[str]) -> dict:
    if argv[0] == "eval":
        return evaluate(argv[1])
    fw, sft, lr, budget, out = argv[1], Path(argv[2]), float(argv[3]), float(argv[4]), Path(argv[5])
    fn = run_ours if fw == "ours" else run_trl
    return fn(sft, lr, budget, out)


if __name__ == "__main__":
    common.setup()
    print(json.dumps(_main(sys.argv[1:])))
