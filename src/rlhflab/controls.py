"""`rlhflab controls RUN_DIR`: did RL beat the cheapest alternatives at the same budget?

From the RL run's own start policy (`model.name_or_path`), task and held-out set, and with the
wall-clock the RL run spent training, run the controls and compare every one with the RL run's
final model on the same held-out problems:

    sft   SFT on the task's gold answers (its training split), `train.max_seconds` = the budget
    rft   rejection-sampling fine-tuning, online: the RL run's own config — sampler, prompts,
          group size, optimizer — with the advantage replaced by the raw binary reward
          (`loss.advantage=none`) and no KL. With rewards in {0, 1} the loss is −log π_θ(o) on
          the samples whose reward is 1 and nothing on the others: NLL on the accepted samples.
          RFT (Yuan et al. 2023, arXiv 2308.01825, abstract) "uses supervised models to generate
          and collect correct reasoning paths as augmented fine-tuning datasets". Departures:
          online (one update per sampled batch, from the current policy) instead of one
          collected dataset; no de-duplication of paths; the token means are averaged over all B
          sampled sequences (the run's aggregation), not over the accepted ones, so a step's
          loss is the SFT loss × (accepted / sampled).
    bon   best-of-N at the start policy, N = the run's `rollout.group_size` (samples per prompt in
          RL), temperature as the run samples: no training. Selected by the run's reward, which
          for a verifier reads the reference answer, so it is pass@N — an oracle no deployed
          selector matches — reported beside maj@N (majority vote over the N answers, which needs
          no answer key).

**The budget** is the RL run's training wall-clock: the sum over its logged steps of
`perf/step_s − perf/eval_s` (rollout, reference and update, and the harness's per-step work;
held-out evaluations excluded), read from its metrics.jsonl. Each trained control gets it as
`train.max_seconds`, which also counts the control's own set-up (model loading, tokenising the
data; about a second on the quickstart): a small handicap for the controls, stated in the report.
The RL run's time was measured when it ran; the controls run now, with the run's thread count —
compare only on the same machine, idle both times. Only a wall-clock budget is implemented (a
generated-token budget needs a trainer stop on tokens).

**The comparison** is greedy held-out accuracy (the task's verifier) of every model, evaluated
here by the same code (`eval.common.load_and_evaluate`, the run's `eval.max_new_tokens`); for
best-of-N the per-problem pass@N and maj@N. RL − control is paired by held-out problem: the mean
of the per-problem differences with its 95% t interval (`stats.paired_difference`). That interval
is over problems for these trained models; the variation between training seeds is not in it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rlhflab.errors import ConfigError
from rlhflab.serialize import write_json_atomic, write_text_atomic

ARMS = ("sft", "rft", "bon")


def training_seconds(run_dir: Path) -> dict:
    """The RL run's training wall-clock from its metrics.jsonl: {"seconds": Σ (perf/step_s −
    perf/eval_s), "steps": steps counted, "eval_seconds": Σ perf/eval_s}.

    Raises:
        ConfigError: no step logged `perf/step_s` (stage timers off: `perf.stage_timers`).
    """
    step_s = eval_s = 0.0
    steps = 0
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if "perf/step_s" in row:
                step_s += float(row["perf/step_s"])
                eval_s += float(row.get("perf/eval_s", 0.0))
                steps += 1
    if steps == 0:
        raise ConfigError(f"controls {run_dir}: metrics.jsonl has no perf/step_s (the run's "
                          "perf.stage_timers was off), so its training time is unknown")  # fmt: skip
    return {"seconds": step_s - eval_s, "steps": steps, "eval_seconds": eval_s}


def _final_results(run_dir: Path) -> dict:
    path = run_dir / "final_results.json"
    if not path.is_file():
        raise ConfigError(f"controls {run_dir}: no final_results.json (the run has not finished)")
    res = json.loads(path.read_text())
    if not res.get("model_dir") or not Path(res["model_dir"]).is_dir():
        raise ConfigError(f"controls {run_dir}: the run saved no final model (run.save_model)")
    return res


def sft_config(cfg, start: str, budget_s: float | None, root: Path, steps: int) -> dict:
    """The SFT-on-gold control's config (a dict for `config_from_dict`): the run's task, seed,
    threads and optimizer (its LR and warmup, constant schedule), its rollout batch as SFT rows
    per step (prompts_per_step × group_size, the sequences one RL step trains on), from `start`,
    `train.max_seconds` = `budget_s` (None: `steps` steps), no evaluation during training."""
    o = cfg.optim
    rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    micro = math.gcd(rows, cfg.train.micro_batch_size)
    return {
        "trainer": "sft",
        "seed": cfg.seed,
        "model": {"name_or_path": start, "dtype": cfg.model.dtype},
        "task": cfg.task.model_dump(mode="json"),
        "train": {
            "steps": steps,
            "batch_size": rows,
            "micro_batch_size": micro,
            "max_seconds": budget_s,
        },
        "optim": {
            "lr": o.lr,
            "warmup_steps": o.warmup_steps,
            "max_grad_norm": o.max_grad_norm,
            "schedule": "constant",
        },
        "eval": {"n": 0},
        "precision": cfg.precision.model_dump(mode="json"),
        "checkpoint": {"every": 0},
        "tracking": {"console": False},
        "run": {"name": "control-sft", "root": str(root)},
    }


def rft_config(cfg, start: str, budget_s: float | None, root: Path, steps: int) -> dict:
    """The RFT control's config: the RL run's own config with `loss.advantage=none`,
    `kl.coef=0`, from `start`, `train.steps` = `steps` and `train.max_seconds` = `budget_s`
    (None: no time limit), no evaluation, no checkpoints."""
    raw = cfg.model_dump(mode="json")
    raw["model"]["name_or_path"] = start
    raw["loss"]["advantage"] = "none"
    raw["loss"]["advantage_args"] = {}
    raw["kl"]["coef"] = 0.0
    raw["train"].update(steps=steps, max_seconds=budget_s)
    raw["eval"].update(n=0, every=0)
    raw["checkpoint"] = {"every": 0}
    raw["tracking"]["console"] = False
    raw["run"].update(name="control-rft", root=str(root), resume=None)
    return raw


def _greedy(path: str, held: dict, max_new_tokens: int) -> dict:
    from rlhflab.eval.common import load_and_evaluate

    return load_and_evaluate(path, held["rows"], held["scorer"], max_new_tokens=max_new_tokens,
                             system=held["system"], instruction=held["instruction"],
                             return_scores=True)  # fmt: skip


def _paired(rl: list[float], other: list[float]) -> dict:
    from rlhflab.stats import paired_difference

    d = paired_difference(rl, other)
    return {"mean": d["mean"], "lo": d["lo"], "hi": d["hi"], "n": d["n"]}


def verdict(diff: dict, name: str) -> str:
    """ "RL beat {name}" / "{name} beat RL" when the 95% interval of RL − control excludes 0,
    else "not resolved"."""
    if diff["lo"] is not None and diff["lo"] > 0:
        return f"RL beat {name}"
    if diff["hi"] is not None and diff["hi"] < 0:
        return f"{name} beat RL"
    return "not resolved at 95%"


BUDGETS = ("wall", "samples")


def run_controls(run_dir: str | Path, *, arms=ARMS, budget: str = "wall",
                 out: str | Path | None = None, print_fn=print) -> dict:  # fmt: skip
    """Run the controls `arms` (a subset of ARMS) for the RL run at `run_dir` and compare each
    with its final model (module doc). Writes OUT/controls.json and OUT/README.md (OUT defaults to
    RUN_DIR/controls; the control runs go under OUT/runs). `budget`: "wall" (the run's training
    wall-clock, module doc) or "samples" (as many optimizer steps as the run: RFT samples the
    same number of completions, SFT trains on as many gold sequences as RL sampled; independent
    of machine load). Returns the controls.json dict:
    {"run_dir", "budget": {...}, "arms": {name: {"accuracy", "stderr", ...}}, "paired": {name:
    {"mean", "lo", "hi", "n", "verdict"}}, "skipped": {name: why}, "per_problem": {name: [0/1
    score per held-out problem, in the run's held-out order]}, "wall_s"}.

    Raises:
        ConfigError: not a finished policy-gradient run with a held-out set, a start policy
            built from scratch, an unknown arm, or OUT already holding controls.json.
    """
    from rlhflab.eval.run_dir import initial_model, run_heldout

    t0 = time.perf_counter()
    run_dir = Path(run_dir)
    if budget not in BUDGETS:
        raise ConfigError(f"controls: --budget {budget!r}; choose from {', '.join(BUDGETS)}")
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ConfigError(f"controls: unknown arm(s) {bad or arms}; choose from {', '.join(ARMS)}")
    held = run_heldout(run_dir)
    cfg = held["cfg"]
    if held["env"] is not None:
        raise ConfigError(f"controls {run_dir}: multi-turn (env) runs are not supported")
    start = initial_model(cfg, run_dir)
    final = _final_results(run_dir)
    timing = training_seconds(run_dir)
    out = Path(out) if out is not None else run_dir / "controls"
    if (out / "controls.json").exists():
        raise ConfigError(f"controls: {out / 'controls.json'} exists; pass another --out")
    root = out / "runs"
    gold = cfg.data.source == "task"
    binary = gold and cfg.task.reward == "binary"
    max_new = cfg.eval.max_new_tokens
    if budget == "wall":  # unbounded steps: the time budget ends the control runs
        steps, seconds = max(10 * cfg.train.steps, 100_000), timing["seconds"]
        what = f"{seconds:.1f} s of RL training ({timing['steps']} steps, evaluations excluded)"
    else:
        steps, seconds = int(final.get("steps") or cfg.train.steps), None
        rows = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        what = f"{steps} optimizer steps of {rows} sequences (the RL run's)"
    skipped: dict[str, str] = {}
    # Every control's config is built and validated before anything trains.
    from rlhflab.config import config_from_dict
    from rlhflab.trainers import run_config

    configs = {}
    for name, make in (("sft", sft_config), ("rft", rft_config)):
        if name not in arms:
            continue
        if name == "sft" and not gold:
            skipped[name] = "the run's prompts have no gold answers (data.source is not a task)"
        elif name == "rft" and not binary:
            skipped[name] = "RFT here needs a binary reward (task.reward: binary)"
        else:
            raw = make(cfg, start, seconds, root, steps)
            configs[name] = config_from_dict(raw, source=f"controls ({name})")
    root.mkdir(parents=True, exist_ok=True)
    print_fn(f"controls: budget {what}; arms {', '.join(arms)}")

    results: dict = {"start": {}, "rl": {}}
    per: dict[str, list[float]] = {}
    for name, path in (("start", start), ("rl", final["model_dir"])):
        ev = _greedy(path, held, max_new)
        per[name] = ev["per_problem"]["accuracy"]
        results[name] = {"accuracy": ev["accuracy"], "stderr": ev["accuracy_stderr"],
                         "model": path}  # fmt: skip
    results["rl"].update(steps=final.get("steps"), train_s=timing["seconds"])
    for name, ctl_cfg in configs.items():
        print_fn(f"controls: {name} ...")
        res = run_config(ctl_cfg)
        ev = _greedy(res["model_dir"], held, max_new)
        per[name] = ev["per_problem"]["accuracy"]
        results[name] = {"accuracy": ev["accuracy"], "stderr": ev["accuracy_stderr"],
                         "steps": res["steps"], "status": res["status"],
                         "wall_s": res["wall_s"], "run_dir": res["run_dir"],
                         "model": res["model_dir"]}  # fmt: skip
    if "bon" in arms:
        from rlhflab.eval.common import load_and_evaluate

        n = cfg.rollout.group_size
        print_fn(f"controls: best-of-{n} at the start policy ...")
        ev = load_and_evaluate(start, held["rows"], held["scorer"], max_new_tokens=max_new,
                               k=[n], n_samples=n, temperature=cfg.rollout.temperature,
                               seed=cfg.seed, system=held["system"],
                               instruction=held["instruction"], return_scores=True)  # fmt: skip
        for key, label in ((f"pass@{n}", "bon"), (f"maj@{n}", "maj")):
            if key in ev["per_problem"]:
                per[label] = ev["per_problem"][key]
                results[label] = {"accuracy": ev[key], "stderr": ev[f"{key}_stderr"], "n": n}
    paired = {}
    for name in ("start", "sft", "rft", "bon", "maj"):
        if name in per:
            paired[name] = _paired(per["rl"], per[name])
            paired[name]["verdict"] = verdict(paired[name], LABELS[name])
    report = {"run_dir": str(run_dir), "start_model": start, "task": cfg.task.name,
              "heldout_n": len(held["rows"]), "threads": cfg.precision.threads,
              "budget": {"kind": budget, "description": what, **timing}, "arms": results, "paired": paired, "skipped": skipped, "per_problem": per,
              "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    write_json_atomic(out / "controls.json", report)
    write_text_atomic(out / "README.md", render(report))
    return report


def run_controls_over_runs(run_dirs: list, *, out: str | Path, arms=ARMS, budget: str = "wall",
                           print_fn=print) -> dict:  # fmt: skip
    """`run_controls` for each RL run in `run_dirs` (the same config at different seeds), each
    into OUT/run<i>-seed<seed>/, then RL − control paired over the runs: the per-run accuracy
    differences with their 95% t interval (`stats.paired_difference`) — the comparison of the
    methods, with the variation between training seeds in it. Writes OUT/controls.json and
    OUT/README.md. A run whose OUT/run<i>-seed<seed>/controls.json exists (an interrupted
    campaign) is kept, not run again. Returns {"runs": [each run's report], "arms": {name: {"accuracy" (mean over
    runs), "stderr" (s.e. over runs), "per_run"}}, "paired": {name: {"mean", "lo", "hi", "n",
    "verdict"}}, "budget": {"kind"}, "wall_s"}.

    Raises:
        ConfigError: fewer than 2 runs, OUT already holding controls.json, or a run's own
            refusal (`run_controls`).
    """
    from rlhflab.config import load_config
    from rlhflab.eval.accuracy import mean_and_stderr
    from rlhflab.stats import paired_difference

    t0 = time.perf_counter()
    out = Path(out)
    if len(run_dirs) < 2:
        raise ConfigError("controls: pairing over runs needs at least 2 run directories")
    if (out / "controls.json").exists():
        raise ConfigError(f"controls: {out / 'controls.json'} exists; pass another --out")
    seeds = [load_config(Path(rd) / "config.yaml").seed for rd in run_dirs]
    reports = []
    for i, (rd, seed) in enumerate(zip(run_dirs, seeds, strict=True)):
        target = out / f"run{i}-seed{seed}"
        done = target / "controls.json"
        if done.is_file():  # an interrupted campaign: a run whose controls finished is kept
            prev = json.loads(done.read_text())
            if prev["run_dir"] != str(rd) or prev["budget"]["kind"] != budget:
                raise ConfigError(f"controls: {done} is for {prev['run_dir']} with --budget "
                                  f"{prev['budget']['kind']}; pass another --out")  # fmt: skip
            print_fn(f"controls: run {i + 1}/{len(run_dirs)} {rd}: kept ({done})")
            reports.append(prev)
            continue
        print_fn(f"controls: run {i + 1}/{len(run_dirs)} {rd} (seed {seed})")
        reports.append(run_controls(rd, arms=arms, budget=budget, out=target,
                                    print_fn=print_fn))  # fmt: skip
    names = [k for k in ("rl", "sft", "rft", "bon", "maj", "start")
             if all(k in r["arms"] for r in reports)]  # fmt: skip
    arms_out, paired = {}, {}
    for name in names:
        per_run = [r["arms"][name]["accuracy"] for r in reports]
        mean, se = mean_and_stderr(per_run)
        arms_out[name] = {"accuracy": mean, "stderr": se, "per_run": per_run}
        if name in ("bon", "maj"):
            arms_out[name]["n"] = reports[0]["arms"][name]["n"]
        if name != "rl":
            d = paired_difference(arms_out["rl"]["per_run"], per_run)
            paired[name] = {k: d[k] for k in ("mean", "lo", "hi", "n")}
            paired[name]["verdict"] = verdict(paired[name], LABELS[name])
    report = {"runs": reports, "run_dirs": [str(r) for r in run_dirs], "seeds": seeds,
              "arms": arms_out, "paired": paired, "budget": {"kind": budget},
              "task": reports[0]["task"], "heldout_n": reports[0]["heldout_n"],
              "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    write_json_atomic(out / "controls.json", report)
    write_text_atomic(out / "README.md", render_over_runs(report))
    return report


def render_over_runs(report: dict) -> str:
    """The README of `run_controls_over_runs`: the table paired over runs, then each run's
    table paired over problems."""
    lines = [
        f"# Controls over {len(report['runs'])} runs (seeds {', '.join(map(str, report['seeds']))})",
        "",
        f"Task `{report['task']}`, {report['heldout_n']} held-out problems. Each run's controls "
        "start from that run's start policy with that run's "
        + ("training wall-clock" if report["budget"]["kind"] == "wall" else "number of steps")
        + "; accuracies are means over runs ± s.e. over runs, and RL − arm is paired by run "
        "(t interval over the runs: the variation between training seeds is in it).",
        "",
        *table_lines(report, over_runs=True),
        "",
        conclusion(report),
        "",
    ]
    for rd, r in zip(report["run_dirs"], report["runs"], strict=True):
        lines += [f"## `{rd}`", "", *table_lines(r), "", conclusion(r), ""]
    return "\n".join(lines)


LABELS = {
    "start": "the start policy",
    "rl": "RL (the run)",
    "sft": "SFT on gold",
    "rft": "RFT",
    "bon": "best-of-N (pass@N)",
    "maj": "majority of N",
}


def table_lines(report: dict, *, over_runs: bool = False) -> list[str]:
    """The markdown table: arm, held-out greedy accuracy ± s.e., budget used, RL − arm [95% CI]
    paired over problems (over runs with `over_runs`), and the verdict."""
    arms, paired = report["arms"], report["paired"]
    unit = "runs" if over_runs else "problems"
    lines = [f"| arm | held-out accuracy | budget used | RL − arm, paired over {unit} [95% CI] "
             "| verdict |", "|---|---|---|---|---|"]  # fmt: skip
    for name in ("rl", "sft", "rft", "bon", "maj", "start"):
        if name not in arms:
            continue
        a = arms[name]
        label = LABELS[name].replace("N", str(a["n"])) if name in ("bon", "maj") else LABELS[name]
        if over_runs:
            used = "per run: see below" if name != "start" else "–"
        elif name == "rl":
            used = f"{a['train_s']:.0f} s training, {a['steps']} steps"
        elif name in ("sft", "rft"):
            used = f"{a['wall_s']:.0f} s with set-up, {a['steps']} steps"
        elif name == "start":
            used = "–"
        else:
            used = f"{a['n']} samples per problem"
        acc = f"{100 * a['accuracy']:.1f}% (± {100 * a['stderr']:.1f})"
        if name in paired:
            d = paired[name]
            lo, hi = (f"{100 * x:+.1f}" if x is not None else "–" for x in (d["lo"], d["hi"]))
            diff = f"{100 * d['mean']:+.1f} [{lo}, {hi}] points"
            lines.append(f"| {label} | {acc} | {used} | {diff} | {d['verdict']} |")
        else:
            lines.append(f"| {label} | {acc} | {used} | – | – |")
    return lines


def conclusion(report: dict) -> str:
    """One line from the paired intervals: which trained controls RL beat, which beat RL."""
    trained = [k for k in ("sft", "rft") if k in report["paired"]]
    beat = [LABELS[k] for k in trained if "RL beat" in report["paired"][k]["verdict"]]
    lost = [LABELS[k] for k in trained if "beat RL" in report["paired"][k]["verdict"]]
    open_ = [LABELS[k] for k in trained if LABELS[k] not in beat + lost]
    parts = []
    if beat:
        parts.append(f"RL beat {', '.join(beat)}")
    if lost:
        parts.append(f"{', '.join(lost)} beat RL")
    if open_:
        parts.append(f"RL vs {', '.join(open_)}: not resolved")
    same = "training wall-clock" if report["budget"]["kind"] == "wall" else "steps"
    where = "over these runs" if "runs" in report else "on these held-out problems"
    return (f"At equal {same}, {where} (95% paired intervals): "
            + ("; ".join(parts) if parts else "no trained control ran") + ".")  # fmt: skip


def render(report: dict) -> str:
    """The README of `run_controls`: the setting and budget, the table paired by problem, the
    conclusion line, what best-of-N and RFT are, and the arms skipped with why."""
    b = report["budget"]
    skipped = [f"- {LABELS[k]}: skipped — {why}" for k, why in report["skipped"].items()]
    return "\n".join([
        f"# Controls for `{report['run_dir']}`",
        "",
        f"Task `{report['task']}`, {report['heldout_n']} held-out problems, greedy accuracy by the "
        f"task's verifier. Start policy: `{report['start_model']}`. Budget: "
        + (f"the RL run's training wall-clock, {b['seconds']:.1f} s over {b['steps']} steps "
           f"(held-out evaluations, {b['eval_seconds']:.1f} s, excluded), given to each trained "
           "control as `train.max_seconds` (which counts its own set-up too)"
           if b["kind"] == "wall" else
           f"{b['description']}: each trained control makes as many steps")
        + f"; {report['threads']} torch thread(s). Intervals are paired by held-out problem "
        "(variation between training seeds "
        "is not in them).",
        "",
        *table_lines(report),
        "",
        conclusion(report),
        "",
        "Best-of-N is selected by the run's reward, which for a verifier reads the reference "
        "answer: it is pass@N, an oracle; majority of N needs no answer key. RFT is the run's "
        "config with the raw binary reward as advantage and no KL (NLL on accepted samples, "
        "averaged over all sampled sequences); SFT on gold uses the run's LR, constant, with "
        "one RL step's sequences per step (`rlhflab.controls`).",
        *(["", *skipped] if skipped else []),
        "",
    ])  # fmt: skip
