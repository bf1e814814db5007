"""The command handlers of `rlhflab <command>`: each takes the parsed arguments (`build_parser`
in `rlhflab.cli`), calls the module that does the work, prints its results, returns the exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rlhflab.errors import ConfigError


def _dumps(results: dict) -> str:
    """Results as JSON for stdout, secrets redacted in string values, NaN / inf as null with a
    `<key>_note` (`rlhflab.runs.to_json`)."""
    from rlhflab.runs import to_json

    return to_json(results, indent=2, default=str)


def _emit(args: argparse.Namespace, results: dict, lines: list[str]) -> None:
    """A command's results: its summary `lines` on stdout; with `--json` the whole results
    object on stdout (one JSON document, for jq and scripts) and the summary lines on stderr.
    Secrets are redacted on both streams (`rlhflab.serialize.redacted_console`)."""
    if getattr(args, "json", False):
        for line in lines:
            print(line, file=sys.stderr)
        print(_dumps(results))
    else:
        for line in lines:
            print(line)


def _cmd_train(args: argparse.Namespace) -> int:
    from rlhflab.config import load_config
    from rlhflab.next_steps import check_start_model, next_command
    from rlhflab.trainers import run_config

    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"run.resume={args.resume}")
    if args.allow_config_change:
        overrides.append("run.allow_config_change=true")
    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {args.nproc}")
    if args.nproc is not None and "LOCAL_RANK" in os.environ:  # a rank must not launch again
        raise ConfigError(
            f"--nproc {args.nproc}: this process is already one of torchrun's ranks "
            f"(LOCAL_RANK={os.environ['LOCAL_RANK']}); drop --nproc or torchrun"
        )
    # With --nproc the config is checked here first: a config error is one line before any
    # process starts; each rank loads the same config again.
    cfg = load_config(args.config, overrides)
    check_start_model(cfg)
    if args.nproc is not None:
        _check_gpus_for(args.nproc)
        return _torchrun(args.nproc, args.argv, one_rank_group=cfg.parallel.strategy in SHARDED)
    results = run_config(cfg)
    if os.environ.get("RANK", "0") == "0":
        from rlhflab.summary import summary_lines

        _emit(args, results, summary_lines(results))
    _print_next(next_command(cfg, results))
    return 0


def _print_next(hint: str | None) -> None:
    """Print the next-command hint (`rlhflab.next_steps`) on stderr, on rank 0 only."""
    if hint and os.environ.get("RANK", "0") == "0":
        print(hint, file=sys.stderr)


def _print_summary(results: dict) -> None:
    """A few lines on stdout (`rlhflab.summary.summary_lines`, secrets redacted); the full
    results are in the run's final_results.json."""
    from rlhflab.runs import redact
    from rlhflab.summary import summary_lines

    for line in summary_lines(results):
        print(redact(line))


def _check_gpus_for(nproc: int) -> None:
    """On a CUDA machine, one process per visible GPU at most: `--nproc 2` on a one-GPU machine
    is refused here, before torchrun starts (each rank would also refuse, in `distributed.setup`).

    Raises:
        ConfigError: nproc exceeds `torch.cuda.device_count()` while CUDA is available.
    """
    import torch

    if torch.cuda.is_available() and nproc > (visible := torch.cuda.device_count()):
        raise ConfigError(
            f"--nproc {nproc}: this machine shows {visible} CUDA device(s); one process per GPU "
            f"(--nproc {visible} or fewer, or CUDA_VISIBLE_DEVICES)"
        )


#: The strategies for which `--nproc 1` joins a process group of one (`distributed.ONE_RANK_ENV`).
SHARDED = ("ddp", "fsdp2")


def _torchrun(nproc: int, argv: list[str], one_rank_group: bool = False) -> int:
    """Run `rlhflab <argv without --nproc>` under torchrun with `nproc` processes; its exit code.

    With `nproc` 1 and `one_rank_group` (the config's strategy is ddp or fsdp2) the rank joins a
    process group of one (`rlhflab.distributed.ONE_RANK_ENV`): the launched code path (NCCL on a
    GPU, FSDP2 sharding over one rank, sharded checkpoints) on a one-GPU machine. Without it (a
    strategy of none or auto) `--nproc 1` runs the single-process path under torchrun.

    The launcher is torchrun's own (`torch.distributed.run`) behind `rlhflab.distributed.launch`,
    which turns a worker's failure into the worker's exit code (2 for a user error, which the
    worker printed in one line) instead of torchrun's `ChildFailedError` traceback and exit 1."""
    import subprocess

    cmd = [sys.executable, "-m", "rlhflab.distributed.launch", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "-m", "rlhflab", *without_nproc(argv)]
    from rlhflab.distributed import arm_parent_death_signal

    # torchrun's own default for several ranks (1 OpenMP thread each; `precision.threads` sets
    # torch's), set here so that torchrun does not print its 5-line banner about it.
    # the ranks record a user error for the launcher to print once (distributed.launch)
    env = dict(os.environ, RLHFLAB_NPROC_LAUNCHER="1")
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    if nproc == 1 and one_rank_group:
        from rlhflab.distributed import ONE_RANK_ENV

        env[ONE_RANK_ENV] = "1"
    # torchrun follows this process: killed (even by SIGKILL), it takes torchrun and the workers
    # with it instead of leaving them training as orphans.
    return subprocess.call(cmd, env=env, preexec_fn=arm_parent_death_signal)


def without_nproc(argv: list[str]) -> list[str]:
    """`argv` without its `--nproc N` / `--nproc=N`, argparse's prefixes of `--nproc` (`--np 2`)
    included, so that the ranks do not launch again; words after `--` are kept."""
    out, skip, positional = [], False, False
    for word in argv:
        if skip:
            skip = False
            continue
        positional = positional or word == "--"
        name = word.split("=", 1)[0]
        if not positional and len(name) >= 3 and "--nproc".startswith(name):
            skip = "=" not in word
            continue
        out.append(word)
    return out


def _cmd_eval(args: argparse.Namespace) -> int:
    from rlhflab.errors import ConfigError
    from rlhflab.eval.cli import run_eval_command, run_prompt_eval_command
    from rlhflab.summary import eval_lines

    if args.benchmark is not None:
        return _eval_benchmark(args)
    if args.benchmark_file is not None:
        raise ConfigError("eval --benchmark-file: give --benchmark NAME too")
    sampling = bool(args.k) or args.passk
    if sampling and args.temperature is not None and args.temperature <= 0:
        raise ConfigError(
            f"eval --temperature {args.temperature}: pass@k sampling needs a temperature > 0 "
            "(greedy accuracy is always reported; use --k 0 for greedy only)"
        )
    if args.passk or args.checkpoints:
        return _eval_run_dir(args)

    if args.task is not None and args.data is not None:
        raise ConfigError("eval: give exactly one of --task NAME and --data PATH")
    if args.data is not None:
        given = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                 "seed": args.seed}  # fmt: skip
        results = run_prompt_eval_command(
            args.model,
            data=args.data,
            name=args.data_name,
            split=args.split,
            prompt_column=args.prompt_column,
            prompt_format=args.prompt_format,
            template=args.template,
            system=args.system,
            rewards=args.reward_fn,
            n=500 if args.n is None else args.n,
            k=args.k,
            n_samples=args.n_samples,
            batch_size=args.batch_size,
            engine=args.engine,
            **{k: v for k, v in given.items() if v is not None},
        )
        _emit(args, results, eval_lines(results))
        return 0
    results = run_eval_command(
        args.model,
        task=args.task,
        task_config=args.task_config,
        n=args.n,
        n_train_exclude=args.exclude_train,
        seed=args.seed,
        k=args.k,
        n_samples=args.n_samples,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        answer_format=args.answer_format,
        reward=args.reward,
        batch_size=args.batch_size,
        system=args.system,
        extractor=args.extractor,
        instruction=args.instruction,
        threads=args.threads,
        show=args.show,
        gguf_file=args.gguf_file,
        engine=args.engine,
        judge=None
        if args.judge is None
        else {
            "path": args.judge,
            "template": args.judge_template,
            "low": args.judge_low,
            "high": args.judge_high,
            "threshold": args.judge_threshold,
        },
        print_fn=_completion_lines,
    )
    _emit(args, results, eval_lines(results))
    return 0


def _eval_benchmark(args: argparse.Namespace) -> int:
    """`rlhflab eval MODEL --benchmark NAME` (rlhflab.eval.benchmarks), or over the saved models
    of a run with `--checkpoints` (rlhflab.eval.run_dir.benchmark_curve)."""
    from rlhflab.eval.benchmarks import benchmark_lines, run_benchmark

    # the protocol fixes the prompt, decoding and scoring: these would be silently ignored
    fixed = {
        "--task": args.task, "--data": args.data, "--passk": args.passk,
        "--temperature": args.temperature, "--answer-format": args.answer_format,
        "--extractor": args.extractor, "--instruction": args.instruction,
        "--system": args.system, "--template": args.template, "--reward-fn": args.reward_fn,
        "--reward": args.reward, "--task-config": args.task_config,
        "--gguf-file": args.gguf_file, "--show": args.show,
    }  # fmt: skip
    for flag, value in fixed.items():
        if value:
            raise ConfigError(
                f"eval --benchmark {args.benchmark}: {flag} does not apply (the protocol sets "
                "the prompt, decoding and scoring; docs/benchmarks.md)"
            )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    kw = dict(
        path=args.benchmark_file,
        n_samples=args.n_samples or None,
        max_new_tokens=args.max_new_tokens,
        ks=args.k if isinstance(args.k, list) else ([args.k] if args.k else None),
        limit=args.n,
        batch_size=args.batch_size,
        seed=args.seed or 0,
        engine=args.engine,
    )
    if args.checkpoints:
        from rlhflab.eval.run_dir import benchmark_curve, is_run_dir

        if not is_run_dir(args.model):
            raise ConfigError(
                f"eval {args.model} --benchmark --checkpoints: takes a run directory (config.yaml "
                "and metrics.jsonl), e.g. runs/grpo-20261126-081500"
            )
        say = lambda line: print(line, file=sys.stderr)  # noqa: E731
        out = benchmark_curve(args.model, args.benchmark, print_fn=say, **kw)
        _emit(args, out, out["lines"])
        return 0
    results = run_benchmark(args.model, args.benchmark, **kw)
    _emit(args, results, benchmark_lines(results))
    return 0


def _completion_lines(line: str) -> None:
    """`run_eval_command`'s lines on stderr (the `note:` and `warning:` lines about the training
    run's settings, the held-out episodes note, the `--show` completions); its closing result line
    ("accuracy …" / "success …") is left out: the summary on stdout, `summary.eval_lines`, says
    the same with its name."""
    if not line.startswith(("accuracy ", "success ")):
        print(line, file=sys.stderr)


def _eval_run_dir(args: argparse.Namespace) -> int:
    """`rlhflab eval RUN_DIR --passk | --checkpoints` (rlhflab.eval.run_dir)."""
    from rlhflab.errors import ConfigError
    from rlhflab.eval.run_dir import checkpoint_curve, is_run_dir, passk_before_after

    if not is_run_dir(args.model):
        raise ConfigError(
            f"eval {args.model}: --passk and --checkpoints take a run directory (config.yaml "
            "and metrics.jsonl), e.g. runs/grpo-20261126-081500"
        )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    out = {}
    if args.checkpoints:
        out["checkpoints"] = checkpoint_curve(args.model, engine=args.engine, print_fn=say)
    if args.passk:
        ks = args.k if isinstance(args.k, list) else [1, 2, 4, 8] if not args.k else [1, args.k]
        out["passk"] = passk_before_after(
            args.model, ks=ks, n_samples=args.n_samples, temperature=args.temperature,
            engine=args.engine, print_fn=say,
        )  # fmt: skip
    from rlhflab.summary import eval_run_dir_lines

    _emit(args, out, eval_run_dir_lines(out))
    return 0


def _cmd_quickstart(args: argparse.Namespace) -> int:
    from rlhflab.next_steps import after_quickstart
    from rlhflab.quickstart import run_quickstart, summary_lines

    results = run_quickstart(
        fast=args.fast, root=args.root, overrides=args.overrides, resume=args.resume
    )
    _emit(args, results, summary_lines(results))
    _print_next(after_quickstart(results))
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from rlhflab.compare import run_compare
    from rlhflab.summary import compare_lines

    overrides = [a for a in args.args if "=" in a]
    presets = [a for a in args.args if "=" not in a]
    results = run_compare(presets, seeds=args.seeds, overrides=overrides, root=args.root)
    _emit(args, results, compare_lines(results))
    return 0


def _cmd_controls(args: argparse.Namespace) -> int:
    from rlhflab.controls import conclusion, run_controls, run_controls_over_runs, table_lines

    echo = lambda line: print(line, file=sys.stderr)  # noqa: E731
    if len(args.run_dirs) > 1:
        if args.out is None:
            raise ConfigError("controls: several run directories need --out (the combined report)")
        results = run_controls_over_runs(args.run_dirs, out=args.out, arms=args.arms,
                                         budget=args.budget, print_fn=echo)  # fmt: skip
        lines = table_lines(results, over_runs=True)
    else:
        results = run_controls(args.run_dirs[0], arms=args.arms, budget=args.budget,
                               out=args.out, print_fn=echo)  # fmt: skip
        lines = table_lines(results)
    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "controls"
    _emit(args, results, [*lines, conclusion(results), f"report: {out}/README.md"])
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from rlhflab.summary import sweep_lines
    from rlhflab.sweep import run_sweep

    if args.report and args.only is not None:
        raise ConfigError("sweep: --report gathers every run; it does not take --only")
    results = run_sweep(
        args.config,
        grid_items=args.grid,
        seeds=args.seeds,
        overrides=args.overrides,
        root=args.root,
        slug=args.slug,
        metric=args.metric,
        only=args.only,
        report_only=args.report,
        resume=args.resume,
        baseline=args.baseline,
        ci=args.ci,
        question=args.question,
        until_ci_width=args.until_ci_width,
        max_seeds=args.max_seeds,
        print_fn=lambda line: print(line, file=sys.stderr),
    )
    _emit(args, results, sweep_lines(results))
    return 0


def _cmd_replicate(args: argparse.Namespace) -> int:
    from rlhflab.replications import REPLICATIONS, describe, result_file, run_replication
    from rlhflab.summary import replicate_lines
    from rlhflab.tracking import announce_runs

    if args.list:
        for line in describe():
            print(line)
        return 0
    if args.name is None:
        raise ConfigError(
            "replicate: give a replication NAME and --out DIR, e.g. `rlhflab replicate r1-zero "
            f"--out runs/r1-zero` (NAME: {' | '.join(REPLICATIONS)}; --list describes each)"
        )
    if args.out is None:
        raise ConfigError(
            f"replicate {args.name}: --out DIR is required (where its JSON, plot and runs/ go), "
            f"e.g. --out runs/{args.name}"
        )
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # an override, no config given
        config, overrides = None, [config, *overrides]
    # every training stage reports on stderr: a start line, progress every 30 s, an end line
    with announce_runs(f"replicate {args.name}"):
        results = run_replication(
            args.name, config, args.out, overrides, only=args.only, report_only=args.report,
            jobs=args.jobs, print_fn=lambda line: print(line, file=sys.stderr),
        )  # fmt: skip
    _emit(args, results, replicate_lines(args.name, results, result_file(args.name, args.out)))
    return 0


def _cmd_pipeline(args: argparse.Namespace) -> int:
    from rlhflab.pipeline import run_pipeline

    results = run_pipeline(args.pipeline, overrides=args.overrides, root=args.root)
    print(_dumps(results))
    return 0


def _cmd_best_of_n(args: argparse.Namespace) -> int:
    from rlhflab.errors import ConfigError
    from rlhflab.eval.best_of_n import run_best_of_n_command

    if (args.task is None) == (args.data is None):
        raise ConfigError("best-of-n: give exactly one of --task NAME and --data PATH")
    if args.task is not None:
        _warn_answer_format(args.policy, args.answer_format)
    data = None
    if args.data is not None:
        data = {
            "path": args.data,
            "name": args.data_name,
            "split": args.split,
            "prompt_column": args.prompt_column,
            "prompt_format": args.prompt_format,
            "heldout_split": args.heldout_split,
        }
    results = run_best_of_n_command(
        args.policy,
        args.rm,
        task=args.task,
        task_config=args.task_config or {},
        problems=args.problems,
        exclude_train=args.exclude_train,
        seed=args.seed,
        ns=args.n,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        answer_format=args.answer_format,
        instruction=args.instruction,
        prm_reduce=args.prm_reduce,
        out_dir=args.out,
        write_sft=args.write_sft,
        min_score=args.min_score,
        threads=args.threads,
        data=data,
        reward_fns=args.reward_fn,
        judges=args.judge,
    )
    print(_dumps(results))
    return 0


def _warn_answer_format(model: str, answer_format: str) -> None:
    """Print `answer_format_warning`'s line on stderr, if any."""
    from rlhflab.eval.cli import answer_format_warning

    line = answer_format_warning(model, answer_format)
    if line is not None:
        print(line, file=sys.stderr)


def _cmd_prm_vs_orm(args: argparse.Namespace) -> int:
    from rlhflab.prm_vs_orm import run_prm_vs_orm

    results = run_prm_vs_orm(
        root=args.root,
        policy=args.policy,
        task=args.task,
        task_config=args.task_config,
        size=args.size,
        sft_steps=args.sft_steps,
        n_prompts=args.prompts,
        samples_per_prompt=args.samples_per_prompt,
        rm_steps=args.rm_steps,
        problems=args.problems,
        ns=args.n,
        prm_reduce=args.prm_reduce,
        seed=args.seed,
        threads=args.threads,
    )
    print(_dumps(results))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from rlhflab.plan import plan, render

    over = [a for a in args.args if "=" in a]
    cfgs = [a for a in args.args if "=" not in a]
    if len(cfgs) > 1:
        raise ConfigError(f"plan: at most one CONFIG, got {' '.join(cfgs)}")
    model = args.model
    result = plan(model, gpus=args.gpus, gpu_memory_gib=args.gpu_memory,
                  config=cfgs[0] if cfgs else None, overrides=over, prompt_len=args.prompt_len,
                  completion_len=args.completion_len, reference_dtype=args.reference_dtype,
                  activation_checkpointing=args.activation_checkpointing)  # fmt: skip
    print(json.dumps(result, indent=2)) if args.json else render(result)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    """`rlhflab doctor`: the table on stdout, a line per finished row on stderr, the JSON at
    --out; exit code 1 when any row failed."""
    from rlhflab.doctor import render, run_doctor

    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout: must be > 0 seconds, got {args.timeout}")
    if args.budget is not None and not args.budget > 0:
        raise ConfigError(f"--budget: must be > 0 seconds, got {args.budget}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ConfigError(f"--peak-tflops: must be > 0, got {args.peak_tflops}")

    def echo(row) -> None:
        print(f"doctor: {row.name}: {row.status} ({row.seconds:.0f} s)", file=sys.stderr,
              flush=True)  # fmt: skip

    report = run_doctor(quick=args.quick, out=args.out, only=args.only,
                        peak_tflops=args.peak_tflops, timeout_s=args.timeout,
                        budget_s=args.budget, echo=echo)  # fmt: skip
    render(report)
    print(f"report: {args.out}")
    return report["exit_code"]
