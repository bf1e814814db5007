"""`rlhflab <command>`: argument parsing only; the work is done by the modules it calls.

Commands:
    train CONFIG [key.path=value ...]   run the trainer named by the config's `trainer` key
    eval MODEL --task NAME | --data P   held-out greedy accuracy and pass@k / mean reward
    eval MODEL --benchmark NAME         a named benchmark protocol (gsm8k, math500, aime24/25,
                                        ifeval) on a local file (docs/benchmarks.md)
    quickstart [--fast] [--resume]      the main job: tiny model → SFT → GRPO → held-out eval
    compare PRESET... [k=v ...]         several presets (policy-gradient, direct alignment), same
                                        task and seeds: plot + table
    controls RUN_DIR...                 RL against SFT on gold, RFT and best-of-N from the same start
                                        at the same wall-clock, paired by held-out problem
    sweep CONFIG --grid k=v1,v2 ...     a grid of overrides × seeds: campaign folder with a
                                        mean ± s.e. table and plots; resumable
    replicate NAME [CONFIG] --out DIR   a small-scale replication (docs/replications.md);
                                        `replicate --list` lists them
    pipeline FILE [k=v ...]             RM → PPO/GRPO against it + DPO on its pairs: comparison
    best-of-n POLICY --rm PATH:KIND     best-of-N accuracy vs N with reward models (or --judge PATH,
                                        an LLM judge); rejection sampling
    prm-vs-orm                          PRM vs ORM best-of-N from the same data budget, with a plot
    plan --model M --gpu-memory GIB     per-GPU memory estimate of a run (docs/plan.md)
    doctor [--quick] [--out PATH]       check this machine end to end: one table, one JSON, exit 1
                                        on any failed row (docs/doctor.md)

A command prints a few summary lines on stdout; `--json` prints its whole results object there
instead (the summary lines then go to stderr). Every line printed is redacted like the files.

Every user-facing error is printed as one line `error: ...` with exit code 2. A run stopped by
SIGTERM / SIGINT writes a committed checkpoint and exits with 128 + the signal number (143 / 130);
the line after it is the command that continues (`train ... --resume=RUN_DIR`, `quickstart
--resume=DIR`, `sweep ... --resume`). A run whose health check fails under
`health.on_fail: stop` writes a committed checkpoint and exits with 3 (docs/health.md).

The package: this module (the parser, `main` and its error handling), `commands.py` (one handler
per command), `__main__.py` (`python -m rlhflab.cli`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import sys
from pathlib import Path

from rlhflab.cli.commands import (
    _cmd_best_of_n,
    _cmd_compare,
    _cmd_controls,
    _cmd_doctor,
    _cmd_eval,
    _cmd_pipeline,
    _cmd_plan,
    _cmd_prm_vs_orm,
    _cmd_quickstart,
    _cmd_replicate,
    _cmd_sweep,
    _cmd_train,
    _print_summary,
)
from rlhflab.cli.commands import (
    _dumps as _dumps,  # re-exported: tests and callers import it from rlhflab.cli
)
from rlhflab.errors import HealthStop, Interrupted, PeerRefused, RlhfLabError
from rlhflab.rollout.engines import ENGINE_NAMES

EXIT_USER_ERROR = 2
#: `replicate NAME`: the keys of `rlhflab.replications.REPLICATIONS` (a test keeps them equal; the
#: parser does not import the package, which loads pydantic and the configs).
#: `eval --benchmark NAME`: the keys of `rlhflab.eval.benchmarks.BENCHMARKS` (a test keeps them
#: equal; the parser does not import the package).
BENCHMARK_NAMES = ["gsm8k", "math500", "aime24", "aime25", "ifeval"]
REPLICATION_NAMES = "r1-zero | rm-overopt | dpo-overopt | prm-orm (--list describes each)"
#: Every command with results prints summary lines; `--json` prints the results object instead.
JSON_HELP = "print the whole results object as JSON on stdout (the summary lines go to stderr)"
#: Every command's `--threads`: default None, the default of `precision.threads` (torch's own
#: thread count), which `train`, `quickstart`, `pipeline` and `replicate` configs fall back to.
THREADS_HELP = "torch threads (default: torch's own, as precision.threads)"


class _Parser(argparse.ArgumentParser):
    """argparse with the house's error format: one line `error: ...`, exit code 2."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc.msg} at char {exc.pos})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object of the dataset's kwargs")
    return value


def _nonneg_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def _k_arg(text: str) -> int | list[int]:
    """`--k`: one int (>= 0) or a comma-separated list of ints >= 1."""
    return _int_list(text) if "," in text else _nonneg_int(text)


def _int_list(text: str) -> list[int]:
    return [_positive_int(x.strip()) for x in text.split(",") if x.strip()]


def package_version() -> str:
    """The installed distribution's version (`importlib.metadata`); the source tree's
    `rlhflab.__version__` when the package is not installed (run from a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rlhflab")
    except PackageNotFoundError:
        from rlhflab import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of every `rlhflab` subcommand (tests introspect it for `--help`)."""
    parser = _Parser(
        prog="rlhflab",
        description="LLM post-training for people who study RLHF.",
    )
    parser.add_argument("--version", action="version", version=f"rlhflab {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a YAML preset with dotted overrides")
    p.add_argument("config", help="YAML preset, e.g. configs/pg/grpo.yaml")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. optim.lr=1e-5")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="PATH",
        help="continue a run: a run directory or checkpoint directory; without PATH the newest "
        "committed checkpoint of a run of this name (an error if there is none). A key=value "
        "word after --resume is an override, never the PATH (write --resume=PATH for a path "
        "that looks like key=value)",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume although config keys that matter (model, data, seed, batch sizes) changed",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel processes on this machine: re-runs this command under "
        "`torchrun --standalone --nproc-per-node N` (multi-node: call torchrun yourself)",
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "eval",
        help="held-out accuracy (greedy) and pass@k of a model on a task, or its mean reward on a "
        "prompt dataset",
        description="With --task (or neither --task nor --data), a model saved by an rlhflab run "
        "(RUN/model, RUN/checkpoints/STEP) is evaluated as the run evaluated it: every task "
        "setting not given (task, --task-config, --seed, --exclude-train, --n, --answer-format, "
        "--instruction, --system, --reward, --max-new-tokens) is read from RUN/config.yaml, a "
        "given one that differs is named in a warning, and a run with an environment (env:) is "
        "evaluated by greedy episodes with it. The defaults shown below apply to other models.",
    )
    p.add_argument(
        "model",
        help="hub id or local directory of a causal LM (a run directory with --passk "
        "or --checkpoints)",
    )
    p.add_argument(
        "--task",
        default=None,
        help="reasoning_gym dataset name (default: the task of the run that trained MODEL)",
    )
    p.add_argument(
        "--data",
        default=None,
        help="prompt dataset instead of a task: hub id or .json/.jsonl/.parquet file",
    )
    p.add_argument("--data-name", default=None, help="hub dataset config (GSM8K: main)")
    p.add_argument("--split", default="test", help="--data split to evaluate (default test)")
    p.add_argument("--prompt-column", default="prompt", help="GSM8K: question, MATH: problem")
    p.add_argument("--prompt-format", choices=["auto", "hh_transcript"], default="auto")
    p.add_argument("--template", default=None, help="plain-text prompt template with {prompt}")
    p.add_argument(
        "--system", default=None, help="system turn (task prompts, and dataset prompts without one)"
    )
    p.add_argument(
        "--reward-fn",
        action="append",
        default=[],
        help="with --data: math_verify | exact_match | think_format | pkg.mod:fn | file.py:fn, "
        "optionally =WEIGHT; repeat to sum several",
    )
    p.add_argument(
        "--task-config", default=None, type=_json_object, help="the dataset's kwargs as JSON"
    )
    p.add_argument("--n", type=_positive_int, default=None, help="held-out problems (default 500)")
    p.add_argument(
        "--exclude-train",
        type=int,
        default=None,
        help="drop held-out questions that appear among the first N training items (default 20000)",
    )
    p.add_argument("--seed", type=int, default=None, help="task seed used for training (default 0)")
    p.add_argument(
        "--k",
        type=_k_arg,
        default=0,
        help="pass@k: N samples per problem for pass@1 and pass@N (0: off), or a list 1,4,16 "
        "for pass@k and maj@k at each k from --n-samples samples",
    )
    p.add_argument(
        "--n-samples",
        type=_nonneg_int,
        default=0,
        help="samples per problem for a --k list (default: the largest k)",
    )
    p.add_argument(
        "--passk",
        action="store_true",
        help="MODEL is a run directory: pass@k and maj@k (--k, default 1,2,4,8) of its initial "
        "and final model on its held-out set; writes RUN_DIR/eval/passk.json and passk.png",
    )
    p.add_argument(
        "--checkpoints",
        action="store_true",
        help="MODEL is a run directory: the held-out headline of every saved checkpoint (and "
        "the initial and final model); writes RUN_DIR/eval/checkpoints.json and .png",
    )
    p.add_argument(
        "--benchmark",
        choices=BENCHMARK_NAMES,
        default=None,
        help="a named benchmark protocol (docs/benchmarks.md): its prompt, decoding, samples, "
        "max new tokens and metric; --n, --n-samples, --k and --max-new-tokens are departures "
        "named in the results. With --checkpoints, MODEL is a run directory",
    )
    p.add_argument(
        "--benchmark-file",
        default=None,
        help="the benchmark's file in its published format (default: "
        "$RLHFLAB_BENCHMARKS_DIR/<name's file>, folder ~/.cache/rlhflab/benchmarks)",
    )
    p.add_argument("--temperature", type=float, default=None, help="pass@k sampling (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="(default 32)")
    p.add_argument(
        "--answer-format",
        choices=["plain", "tags", "last_number", "last_line", "boxed"],
        default=None,
        help="how the answer is read from a completion (default plain: the whole text)",
    )
    p.add_argument("--extractor", default=None, help="user extractor 'module:function'")
    p.add_argument(
        "--instruction",
        default=None,
        help="answer-format instruction after each task question, as task.instruction: auto "
        "(the default: the --answer-format's sentence; none for plain or --extractor), none, "
        "or a text",
    )
    p.add_argument("--reward", choices=["binary", "partial"], default=None, help="(default binary)")
    p.add_argument("--batch-size", type=_positive_int, default=256)
    p.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    p.add_argument("--show", type=int, default=0, help="print N completions with their scores")
    p.add_argument(
        "--judge",
        default=None,
        metavar="PATH",
        help="score the greedy completions with this LLM judge too (a model or run directory) "
        "and report its agreement with the verifier: accuracy, Cohen's kappa, AUC",
    )
    p.add_argument("--judge-template", default=None, help="the judge's pointwise template")
    p.add_argument("--judge-low", type=int, default=1, help="lowest judge score (default 1)")
    p.add_argument("--judge-high", type=int, default=10, help="highest judge score (default 10)")
    p.add_argument(
        "--judge-threshold",
        type=float,
        default=None,
        help="lowest judge score read as correct (default (low + high) / 2)",
    )
    p.add_argument("--gguf-file", default=None, help="a GGUF file inside MODEL (dequantised)")
    p.add_argument(
        "--engine",
        choices=list(ENGINE_NAMES),
        default="hf",
        help="rollout engine that samples, as rollout.engine (vllm: the rlhflab[vllm] extra)",
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("quickstart", help="tiny model → SFT → GRPO → held-out eval, with a report")
    p.add_argument("--fast", action="store_true", help="same code path, smaller budget (~2 min)")
    p.add_argument("--root", default="runs", help="where run directories go (default runs/)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        metavar="DIR",
        help="continue an interrupted quickstart (with the arguments it was started with): DIR, "
        "or without DIR the newest under --root; finished stages are skipped, the interrupted "
        "one continues from its checkpoint, and the report is written at the end",
    )
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.add_argument(
        "overrides",
        nargs="*",
        help="overrides of the embedded preset: task.<key>=value (both stages), sft.<key>=value, "
        "grpo.<key>=value",
    )
    p.set_defaults(func=_cmd_quickstart)

    p = sub.add_parser(
        "compare",
        help="run presets (policy-gradient and/or direct-alignment) on the same task and seeds; "
        "plot + table",
        description="Run every preset on seeds 0..N-1 with the same overrides, then write "
        "comparison.png (training signal: rollout reward or DPO margin, and held-out accuracy, "
        "against step and wall-clock; mean over seeds with a min-max band), comparison.md (one "
        "row per preset: family, composition, budget, accuracy, signal, time) and results.json "
        "to <root>/compare-<ts>/. Policy-gradient and direct-alignment presets may be mixed.",
    )
    p.add_argument(
        "args",
        nargs="+",
        metavar="PRESET.yaml | key.path=value",
        help="presets (e.g. configs/pg/grpo.yaml configs/dpo/dpo.yaml) then overrides, each "
        "applied to every preset that has its key (put --seeds/--root before them)",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per preset (default 3)")
    p.add_argument("--root", default="runs", help="where compare-<ts>/ goes (default runs/)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser(
        "controls",
        help="did RL beat the cheapest alternatives? SFT on gold, RFT and best-of-N from the run's "
        "start policy at its training wall-clock",
        description="From a finished policy-gradient run's start policy, task and held-out set, "
        "and with the wall-clock it spent training: SFT on the task's gold answers, online "
        "rejection-sampling fine-tuning with its reward (RFT), and best-of-N at the start policy; "
        "each compared with the run's final model on the same held-out problems, paired by "
        "problem with a 95%% t interval (with several runs: also paired over runs). Writes "
        "RUN_DIR/controls/README.md and controls.json (docs/controls.md).",
    )
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+",
                   help="a finished policy_gradient run directory; several (the same config at "
                   "other seeds, with --out): also paired over the runs")  # fmt: skip
    p.add_argument("--arms", nargs="+", default=["sft", "rft", "bon"],
                   help="which controls (default: sft rft bon)")  # fmt: skip
    p.add_argument("--budget", choices=["wall", "samples"], default="wall",
                   help="wall: the run's training wall-clock (default; compare on an idle machine); "
                   "samples: as many optimizer steps as the run (independent of load)")  # fmt: skip
    p.add_argument("--out", default=None, help="report folder (default RUN_DIR/controls)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_controls)

    p = sub.add_parser(
        "sweep",
        help="one config over a grid of overrides × seeds: campaign folder with a mean ± s.e. "
        "table and plots (resumable)",
        description="Train CONFIG at every point of the grid (the product of the --grid values) "
        "with seeds 0..N-1, one run after another, and write <root>/YYYY-MM-DD-<slug>/ with "
        "README.md (configs, a mean ± s.e. table of the headline held-out metric, KL, wall-clock, "
        "plots), results.json and runs/. Run the same command again to continue: finished runs "
        "are skipped, an interrupted one resumes from its checkpoint (docs/sweeps.md).",
    )
    p.add_argument("config", help="a training config, e.g. configs/pg/quickstart_grpo.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="fixed overrides")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="a swept key and its values (repeat for a product grid)")  # fmt: skip
    p.add_argument("--seeds", type=_positive_int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--root", default="experiments", help="where the campaign goes (experiments/)")
    p.add_argument("--slug", default=None, help="campaign name (default: config stem + grid keys)")
    p.add_argument("--metric", default="headline",
                   help="the tabulated metric: a key of final_results.json (default headline: "
                        "the run's named held-out headline; heldout_accuracy for older runs)")  # fmt: skip
    p.add_argument("--only", default=None, metavar="I/N",
                   help="run only the cells j with j mod N = I (one job of many); no report")  # fmt: skip
    p.add_argument("--report", action="store_true", help="train nothing; gather finished runs")
    p.add_argument("--resume", action="store_true",
                   help="continue the campaign (as the same command without it does), refusing "
                        "when there is none of this slug")  # fmt: skip
    p.add_argument("--baseline", default=None, metavar="LABEL",
                   help="the grid point every other is compared with, paired by seed, e.g. "
                        "kl.coef=0 (default: the first)")  # fmt: skip
    p.add_argument("--ci", choices=("t", "bootstrap"), default="t",
                   help="the paired difference's 95%% interval: Student t over the seeds "
                        "(default) or a percentile bootstrap over them")  # fmt: skip
    p.add_argument("--question", default=None, help="the question the README states")
    p.add_argument("--until-ci-width", type=float, default=None, metavar="W",
                   help="add seeds one at a time until every paired difference's 95%% interval "
                        "is narrower than W (with --max-seeds)")  # fmt: skip
    p.add_argument("--max-seeds", type=_positive_int, default=None, metavar="K",
                   help="the most seeds --until-ci-width may run")  # fmt: skip
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_sweep)

    p = sub.add_parser(
        "replicate",
        help="a small-scale replication of a published result (docs/replications.md)",
        description="Run a small-scale replication into --out DIR, e.g. `rlhflab replicate "
        "r1-zero --out runs/r1-zero`; `rlhflab replicate --list` describes each. Each training "
        "stage reports its progress on stderr; the summary and the files written end it.",
    )
    p.add_argument("name", nargs="?", default=None, metavar="NAME", help=REPLICATION_NAMES)
    p.add_argument("config", nargs="?", default=None,
                   help="its config (default configs/replications/<name>.yaml)")  # fmt: skip
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="optional overrides of the config")  # fmt: skip
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (JSON, plot, runs/); required to run")  # fmt: skip
    p.add_argument("--list", action="store_true", help="list the replications, one line each")
    p.add_argument("--only", default=None, metavar="i/N",
                   help="run only cells j with j mod N = i (one GPU or machine each); no report")  # fmt: skip
    p.add_argument("--report", action="store_true",
                   help="train nothing; judge and report the finished cells in --out")  # fmt: skip
    p.add_argument("--jobs", default="auto", metavar="N|auto",
                   help="cells run at a time, each in its own process (default auto: CPU cores "
                        "/ experiment.threads without a GPU, else 1)")  # fmt: skip
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(func=_cmd_replicate)

    p = sub.add_parser(
        "pipeline",
        help="the classic pipeline on one preference dataset: RM, then RL against it and DPO on "
        "its pairs from one SFT model; comparison table + plot",
    )
    p.add_argument("pipeline", help="a pipeline file, e.g. configs/pipeline/hh.yaml")
    p.add_argument("overrides", nargs="*", metavar="key.path=value")
    p.add_argument("--root", default="runs", help="where <name>-<ts>/ goes (default runs/)")
    p.set_defaults(func=_cmd_pipeline)

    p = sub.add_parser("best-of-n", help="best-of-N accuracy vs N with reward models")
    p.add_argument("policy", help="hub id or local directory of the sampling policy")
    p.add_argument("--rm", action="append", default=[], help="PATH:KIND (preference|orm|prm)")
    p.add_argument(
        "--judge",
        action="append",
        default=[],
        help="an LLM judge's model directory (or run directory): picks by a 1-10 score",
    )
    p.add_argument("--task", default=None, help="reasoning_gym dataset name")
    p.add_argument("--data", default=None, help="prompt dataset: hub id or .json/.jsonl/.parquet")
    p.add_argument("--data-name", default=None, help="hub dataset config")
    p.add_argument("--split", default="train", help="--data training split (default train)")
    p.add_argument("--heldout-split", default=None, help="--data held-out split (else 10%%)")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--prompt-format", choices=["auto", "hh_transcript"], default="auto")
    p.add_argument(
        "--reward-fn",
        action="append",
        default=[],
        help="with --data: what counts as correct (summed reward 1.0); as in `rlhflab eval`",
    )
    p.add_argument(
        "--task-config", default=None, type=_json_object, help="the dataset's kwargs as JSON"
    )
    p.add_argument(
        "--problems", type=_positive_int, default=64, help="held-out problems (default 64)"
    )
    p.add_argument("--exclude-train", type=int, default=20000, help="training items excluded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--n",
        type=_int_list,
        default=[1, 2, 4, 8],
        help="comma-separated N values (default 1,2,4,8)",
    )
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--answer-format",
        choices=["plain", "tags"],
        default="plain",
        help="how the answer is read from a completion, as in `rlhflab eval` and task."
        "answer_format (default plain: the whole text; tags: the last <answer>..</answer>)",
    )
    p.add_argument(
        "--instruction",
        default="auto",
        help="answer-format instruction after each task question, as task.instruction: auto "
        "(tags: 'Put your final answer between <answer> and </answer>.'), none, or a text",
    )
    p.add_argument("--prm-reduce", choices=["min", "prod"], default="min")
    p.add_argument("--out", default=None, help="directory for best_of_n.json and the plot")
    p.add_argument("--write-sft", default=None, help="write the selected samples as SFT JSONL")
    p.add_argument("--min-score", type=float, default=None, help="rejection threshold (RM score)")
    p.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    p.set_defaults(func=_cmd_best_of_n)

    p = sub.add_parser("prm-vs-orm", help="PRM vs ORM best-of-N, same data budget, with a plot")
    p.add_argument("--root", default="runs", help="where run directories go (default runs/)")
    p.add_argument("--policy", default=None, help="a policy that writes steps (default: train one)")
    p.add_argument("--task", default="chain_sum")
    p.add_argument(
        "--task-config", default=None, type=_json_object, help="the dataset's kwargs as JSON"
    )
    p.add_argument("--size", default="small", help="size of the policy trained from scratch")
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--prompts", type=int, default=256, help="training prompts sampled")
    p.add_argument("--samples-per-prompt", type=int, default=8)
    p.add_argument("--rm-steps", type=int, default=200)
    p.add_argument("--problems", type=int, default=200, help="held-out problems")
    p.add_argument("--n", type=_int_list, default=[1, 2, 4, 8, 16], help="comma-separated N values")
    p.add_argument("--prm-reduce", choices=["min", "prod"], default="min")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    p.set_defaults(func=_cmd_prm_vs_orm)

    p = sub.add_parser("plan", help="per-GPU memory estimate of a run (docs/plan.md)")
    p.add_argument("args", nargs="*", metavar="[CONFIG] key.path=value", help="preset + overrides")
    p.add_argument("--model", required=True, help="qwen2.5-0.5b[-instruct], qwen3-0.6b|1.7b|4b|8b, llama-3.2-1b|3b, "
                   "llama-3.1-8b, or a local model directory (its config.json)")  # fmt: skip
    p.add_argument("--gpus", type=_positive_int, default=1, help="GPUs (ranks), default 1")
    p.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="per GPU")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 256)")
    p.add_argument("--completion-len", type=int, default=None, help="overrides the config's")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="as model.gradient_checkpointing=true")  # fmt: skip
    p.add_argument("--reference-dtype", choices=["float32", "bfloat16"], default=None,
                   help="the frozen reference's dtype (default model.dtype, as today)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("doctor", help="check this machine: versions, devices, collectives, every "
                       "trainer, the rollout engine; one table + JSON (docs/doctor.md)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="the CI subset (docs/doctor.md)")
    p.add_argument("--out", default="doctor.json", metavar="PATH",
                   help="the report JSON (default doctor.json)")  # fmt: skip
    p.add_argument("--only", action="append", metavar="ROW",
                   help="run only this row (repeatable; rows that need the tiny model add "
                   "train/sft)")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=None, metavar="X",
                   help="the device's peak dense bf16 TFLOPS: the devices row reports its "
                   "measured matmul as a share of it")  # fmt: skip
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds per row (default 150 with --quick, else 240)")  # fmt: skip
    p.add_argument("--budget", type=float, default=None, metavar="S",
                   help="seconds for the whole run: rows left when it is spent are skipped, "
                   "saying so")  # fmt: skip
    p.set_defaults(func=_cmd_doctor)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by `build_parser`, with `train` overrides allowed after its options.

    argparse fills the `overrides` positional only up to the first option, so in
    `rlhflab train preset.yaml --nproc 8 parallel.strategy=fsdp2` the override after `--nproc 8`
    would be "unrecognized". Left-over `key=value` words of a `train` command are appended to its
    overrides, in order; anything else left over is still an error (exit 2, argparse's message).
    """
    parser = build_parser()
    argv = _resume_before_override(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command in ("train", "quickstart", "sweep", "replicate") and not any(
            e.startswith("-") for e in extra
        ):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


_OVERRIDE_WORD = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*=")


def _resume_before_override(argv: list[str]) -> list[str]:
    """`argv` with `train ... --resume KEY=VALUE` rewritten as `--resume=latest KEY=VALUE`:
    `--resume` without PATH (the newest checkpoint of this run), then the override.

    `--resume` takes an optional PATH (`nargs='?'`), so argparse would take the override after it
    as the run to resume. Rule: a separate word after `--resume` (or an unambiguous prefix of it,
    which argparse accepts) that starts like `dotted.key=` is an override; a path of that form must
    be written `--resume=PATH`. The same for `quickstart --resume [DIR]`. Other commands, and
    words after `--`, are left as they are.
    """
    if not argv or argv[0] not in ("train", "quickstart"):
        return argv
    out = list(argv)
    for i, word in enumerate(out[:-1]):
        if word == "--":
            break
        if len(word) >= 3 and "--resume".startswith(word) and _OVERRIDE_WORD.match(out[i + 1]):
            out[i] = "--resume=latest"
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse `argv`, run the command; user errors print one line and return 2.

    Every line the command prints, on stdout and stderr (results, summaries, the `next:` hint,
    errors, progress, warnings, tracebacks, argparse's messages), goes through the redaction of
    the files a run writes (`rlhflab.serialize.redacted_console`)."""
    from rlhflab.serialize import redacted_console

    with redacted_console():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv
    from rlhflab.quiet import quiet_transformers

    try:
        with quiet_transformers():  # transformers' bars and un-actionable FutureWarnings
            return args.func(args)
    except Interrupted as exc:
        _say(f"interrupted: {exc}")
        _say(_continue_line(args, exc))
        return exc.exit_code
    except HealthStop as exc:
        print(
            f"health: {exc}; stopped (health.on_fail: stop), checkpoint {exc.checkpoint}"
            + (f"; results in {exc.run_dir}/final_results.json" if exc.run_dir else ""),
            file=sys.stderr,
        )
        if getattr(exc, "results", None) and os.environ.get("RANK", "0") == "0":
            _print_summary(exc.results)
        return exc.exit_code
    except PeerRefused:  # under torchrun: rank 0 refused to start and prints why
        _after_shared_refusal()
        return EXIT_USER_ERROR
    except RlhfLabError as exc:
        from rlhflab.runs import redact

        shared = getattr(exc, "shared", False)
        _say_error(f"error: {redact(str(exc))}", shared=shared)
        if shared:
            _after_shared_refusal()
        return EXIT_USER_ERROR
    except OSError as exc:  # disk full, permissions, a path that vanished: one line, redacted
        from rlhflab.runs import redact

        what = "disk full: " if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        _say_error(f"error: {what}{redact(str(exc))}", every_rank=True)
        if getattr(exc, "shared", False):
            _after_shared_refusal()
        return EXIT_USER_ERROR
    except KeyboardInterrupt as exc:
        _say("interrupted")
        if getattr(exc, "resume_dir", None) is not None or args.command == "sweep":
            _say(_continue_line(args, exc))
        return 130
    except Exception:  # a bug: the traceback, with secrets redacted like every other stream
        import traceback

        from rlhflab.runs import redact

        print(redact(traceback.format_exc()), file=sys.stderr, end="")
        return 1
    finally:
        if "rlhflab.distributed" in sys.modules:
            sys.modules["rlhflab.distributed"].teardown()


def _continue_line(args: argparse.Namespace, exc: BaseException) -> str:
    """The command that continues an interrupted command, as one line for stderr.

    train: its own arguments with `--resume=<run directory>` (any `--resume` given before is
    replaced); quickstart: with `--resume=<quickstart directory>`; sweep: its own arguments with
    `--resume` (finished cells are skipped, the interrupted one continues from its checkpoint).
    The other commands do not resume: the line names the checkpoint of the run that stopped."""
    import shlex

    ckpt = getattr(exc, "checkpoint", None)
    if args.command == "train" and ckpt is not None:
        path = Path(ckpt).parent.parent  # <run_dir>/checkpoints/step-N
        return "continue with: " + _command([*_without_resume(args.argv), f"--resume={path}"])
    if args.command == "quickstart" and getattr(exc, "resume_dir", None) is not None:
        words = [*_without_resume(args.argv), f"--resume={exc.resume_dir}"]
        return "continue with: " + _command(words)
    if args.command == "sweep":
        words = args.argv if "--resume" in args.argv else [*args.argv, "--resume"]
        return "continue with: " + _command(words)
    where = f" (checkpoint {shlex.quote(str(ckpt))})" if ckpt is not None else ""
    return f"rlhflab {args.command} does not resume; run it again to start over{where}"


def _command(argv: list[str]) -> str:
    """`rlhflab` + argv, shell-quoted (a line the user can paste)."""
    import shlex

    return shlex.join(["rlhflab", *argv])


def _without_resume(argv: list[str]) -> list[str]:
    """`argv` without its `--resume` option: `--resume=X`, `--resume X` (X a path, not an option
    or override word) or a bare `--resume` (argparse's prefixes of it included)."""
    out, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
            continue
        name = word.split("=", 1)[0]
        if len(name) >= 3 and "--resume".startswith(name):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            skip = ("=" not in word and nxt is not None and not nxt.startswith("-")
                    and not _OVERRIDE_WORD.match(nxt))  # fmt: skip
            continue
        out.append(word)
    return out


def _after_shared_refusal() -> None:
    """Every rank waits here until rank 0 has printed the refusal it shared: torchrun stops the
    other workers (SIGTERM) as soon as one exits, which must not cut rank 0 off before it."""
    ours = sys.modules.get("rlhflab.distributed")
    if ours is not None:
        with contextlib.suppress(Exception):  # a peer already gone: nothing left to wait for
            ours.barrier()


def _rank_line(line: str, shared: bool = False) -> tuple[str, bool]:
    """`line` as this rank says it, and whether this rank prints it. Under torchrun: before the
    first collective every rank fails the same way (validation of the same config and data), so
    only rank 0 prints; after it, each failing rank prints its line prefixed with its rank.
    `shared`: a refusal rank 0 shared with every rank (`distributed.main_then_share`): rank 0
    prints it, unprefixed."""
    rank = os.environ.get("RANK")
    if rank is None or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return line, True
    ours = sys.modules.get("rlhflab.distributed")
    if ours is not None and ours.collectives_started() and not shared:
        return f"rank {rank}: {line}", True
    return line, rank == "0"


def _say(line: str, shared: bool = False) -> None:
    """Print a one-line message on stderr, on the ranks `_rank_line` says."""
    text, mine = _rank_line(line, shared)
    if mine:
        print(text, file=sys.stderr)


def _say_error(line: str, shared: bool = False, every_rank: bool = False) -> None:
    """A user error's one line (`_say`; `every_rank`: printed by every rank, unprefixed). Under
    torchrun it is also written to the rank's torchelastic error file
    (`distributed.launch.record_error`), the root cause torchrun reports; under
    `rlhflab train --nproc` the launcher prints it, once for all ranks, instead of the ranks."""
    text, mine = (line, True) if every_rank else _rank_line(line, shared)
    # Every failing rank records it, also a rank told of rank 0's refusal (`shared`): torchrun
    # may stop rank 0 (SIGTERM) before rank 0 records it, and then the launcher finds the line
    # only there (it printed nothing at all when only rank 0 recorded).
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from rlhflab.distributed.launch import record_error

        if record_error(text) and os.environ.get("RLHFLAB_NPROC_LAUNCHER") == "1":
            return  # the launcher prints it
    if mine:
        print(text, file=sys.stderr)
