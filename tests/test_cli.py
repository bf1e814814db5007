"""CLI wiring: every command answers --help; bad input is one line on stderr, exit code 2, before
any training step, and no run directory is left behind."""

import argparse
import importlib.util
import json
import re
from pathlib import Path

import pytest

from rlhflab.cli import build_parser, main, parse_args
from rlhflab.config import load_config

ROOT = Path(__file__).resolve().parents[1]
GRPO = str(ROOT / "configs/pg/grpo.yaml")
SFT = str(ROOT / "configs/sft/tiny_scratch.yaml")


def _commands():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(sub.choices)


@pytest.mark.parametrize("command", [None, *_commands()])
def test_every_command_answers_help(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage: rlhflab" in capsys.readouterr().out


def test_version_is_the_installed_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"rlhflab {version('rlhflab')}"


def test_compare_help_says_both_families(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "direct-alignment" in out and "comparison.md" in out
    assert "policy-gradient only" not in out


def test_train_overrides_may_follow_options():
    # README: `rlhflab train configs/pg/grpo.yaml --nproc 8 parallel.strategy=fsdp2`
    args = parse_args(["train", GRPO, "a.b=1", "--nproc", "8", "c.d=2", "--resume", "runs/x"])
    assert args.overrides == ["a.b=1", "c.d=2"]
    assert (args.nproc, args.resume) == (8, "runs/x")  # --resume takes a path after it
    assert parse_args(["train", GRPO, "--allow-config-change", "x=1"]).overrides == ["x=1"]


@pytest.mark.parametrize(
    "argv",
    [
        ["train", SFT, "--nproc", "2", "a=1"],
        ["train", SFT, "--nproc=2", "a=1"],
        ["train", SFT, "--npro", "2", "a=1"],  # argparse's prefix: before, the ranks kept it
        ["train", SFT, "--np=2", "a=1"],
    ],
)
def test_the_ranks_command_has_no_nproc(argv):
    from rlhflab.cli.commands import without_nproc

    assert parse_args(argv).nproc == 2
    assert without_nproc(argv) == ["train", SFT, "a=1"]
    assert parse_args(without_nproc(argv)).nproc is None
    assert without_nproc(["train", SFT, "--", "--nproc"]) == ["train", SFT, "--", "--nproc"]


def test_a_rank_given_nproc_refuses_to_launch_again(tmp_path, monkeypatch, capsys):
    # Before: each rank started a torchrun of its own (2 ranks, each launching 2 more, ...); here
    # the nested ranks then refused the missing config, and torchrun exited 1.
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["train", str(tmp_path / "missing.yaml"), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --nproc 2: this process is already one of torchrun's ranks (LOCAL_RANK=0); "
        "drop --nproc or torchrun\n"
    )


def test_more_processes_than_gpus_is_refused_before_torchrun(monkeypatch, capsys):
    # On a one-GPU machine (an H200 here) rank 1 died in torch.cuda.set_device(1) with a CUDA
    # traceback. Simulated: CUDA available with one device; torchrun must never start.
    import torch

    import rlhflab.cli.commands as commands

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(commands, "_torchrun", lambda *a: pytest.fail("torchrun started"))
    assert main(["train", SFT, "--nproc", "2"]) == 2
    assert capsys.readouterr().err == (
        "error: --nproc 2: this machine shows 1 CUDA device(s); one process per GPU "
        "(--nproc 1 or fewer, or CUDA_VISIBLE_DEVICES)\n"
    )


@pytest.mark.parametrize("flag", ["--resume", "--res"])
def test_resume_never_takes_an_override_as_the_run(flag):
    # issue 23: `rlhflab train CONFIG --resume optim.lr=5e-4` resumed a run named "optim.lr=5e-4"
    args = parse_args(["train", GRPO, "a.b=1", flag, "optim.lr=5e-4", "c_d.e-f=x=y"])
    assert args.resume == "latest"  # --resume without PATH
    assert args.overrides == ["a.b=1", "optim.lr=5e-4", "c_d.e-f=x=y"]
    assert parse_args(["train", GRPO, "--resume", "runs/a=b"]).resume == "runs/a=b"  # a path
    assert parse_args(["train", GRPO, "--resume=lr=1"]).resume == "lr=1"  # explicit PATH
    assert parse_args(["train", GRPO, "x=1", "--resume"]).resume == "latest"


@pytest.mark.parametrize(
    "argv", [["train", GRPO, "--nproc", "2", "--bogus"], ["eval", "model", "stray=1"]]
)
def test_left_over_arguments_are_still_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def _fails_cleanly(argv, capsys, root, expected):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert expected in err[0], err[0]
    assert not root.exists() or not any(root.iterdir()), "a run directory was left behind"


def test_unknown_config_key(tmp_path, capsys):
    root = tmp_path / "runs"
    _fails_cleanly(
        ["train", GRPO, "rollout.grop_size=4", f"run.root={root}"],
        capsys,
        root,
        "unknown config key 'rollout.grop_size' (did you mean 'group_size'?)",
    )


def test_unknown_task_name(tmp_path, capsys):
    root = tmp_path / "runs"
    _fails_cleanly(
        ["train", SFT, "task.name=chain_summ", f"run.root={root}"],
        capsys,
        root,
        "task.name: unknown reasoning_gym dataset 'chain_summ' (did you mean 'chain_sum'?)",
    )


def test_model_path_does_not_exist(tmp_path, capsys):
    root = tmp_path / "runs"
    missing = tmp_path / "no_such_model"
    _fails_cleanly(
        ["train", GRPO, f"model.name_or_path={missing}", f"run.root={root}"],
        capsys,
        root,
        str(missing),
    )


def test_empty_dataset_after_filtering(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "completion": ""}) + "\n")
    root = tmp_path / "runs"
    _fails_cleanly(
        [
            "train",
            SFT,
            "data.source=jsonl",
            f"data.path={data}",
            "data.on_invalid=drop",
            "model.build.size=tiny",
            "model.build.tokenizer_texts=200",
            "task.n_train=200",
            "task.n_heldout=10",
            "eval.n=0",
            f"run.root={root}",
        ],
        capsys,
        root,
        "empty",
    )


def test_prompt_longer_than_context(tmp_path, capsys):
    root = tmp_path / "runs"
    _fails_cleanly(
        [
            "train",
            SFT,
            "model.build.size=tiny",
            "model.build.max_position_embeddings=16",
            "model.build.tokenizer_texts=200",
            "task.n_train=200",
            "task.n_heldout=10",
            "train.max_len=64",
            f"run.root={root}",
        ],
        capsys,
        root,
        "row 0",
    )


def test_run_name_cannot_escape_root(tmp_path, capsys):
    root = tmp_path / "runs"
    _fails_cleanly(
        [
            "train",
            SFT,
            "run.name=../escape",
            "model.build.size=tiny",
            "model.build.tokenizer_texts=200",
            "task.n_train=200",
            "task.n_heldout=10",
            f"run.root={root}",
        ],
        capsys,
        root,
        "run.name",
    )


def test_eval_command_on_a_saved_model(tmp_path, tiny_model, tiny_tokenizer, capsys):
    from rlhflab.models.build import save_pretrained

    save_pretrained(tiny_model, tiny_tokenizer, tmp_path / "model")
    cfg = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}'
    code = main(
        [
            "eval",
            str(tmp_path / "model"),
            "--task",
            "chain_sum",
            "--task-config",
            cfg,
            "--n",
            "6",
            "--k",
            "2",
            "--exclude-train",
            "50",
            "--max-new-tokens",
            "4",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 6 and out["k"] == 2
    assert 0.0 <= out["accuracy"] <= 1.0 and 0.0 <= out["pass@1"] <= out["pass@k"] <= 1.0


def test_eval_with_a_judge_reports_its_agreement_with_the_verifier(tmp_path, tiny_tokenizer,
                                                                   capsys):  # fmt: skip
    """A policy that answers "5" to everything (right where the sum is 5) and a judge that says
    "Score: 7" to everything: every judge verdict is "correct" (7 ≥ 5.5), so its accuracy is
    the verifier's, κ = 0 (p_o = p_e) and the AUC ½ (all ties)."""
    from factories import hand_wired_judge

    hand_wired_judge(tiny_tokenizer, tmp_path / "policy", "5")
    hand_wired_judge(tiny_tokenizer, tmp_path / "judge", "Score: 7")
    cfg = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}'
    code = main(["eval", str(tmp_path / "policy"), "--task", "chain_sum", "--task-config", cfg,
                 "--n", "60", "--exclude-train", "0", "--max-new-tokens", "4",
                 "--judge", str(tmp_path / "judge"),
                 "--json"])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    j = out["judge"]
    assert 0.0 < out["accuracy"] < 1.0  # both verdicts occur
    assert j["n"] == 60 and j["parse_failed"] == 0 and j["score_mean"] == 7.0
    assert j["threshold"] == 5.5 and j["verifier_correct"] == out["accuracy"]
    assert j["accuracy"] == out["accuracy"] and j["kappa"] == 0.0 and j["auc"] == 0.5


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--judge", "nope"], r"eval --judge nope: no such model or run directory"),
        (["--judge", "J", "--judge-low", "5", "--judge-high", "5"], r"low must be below high"),
        (["--judge", "J", "--judge-template", "{prompt} {answer}"], r"eval --judge-template"),
    ],
)
def test_a_bad_judge_is_one_line_before_the_evaluation(tmp_path, tiny_model, tiny_tokenizer,
                                                       capsys, monkeypatch, extra, match):  # fmt: skip
    from rlhflab.eval import cli
    from rlhflab.models.build import save_pretrained

    save_pretrained(tiny_model, tiny_tokenizer, tmp_path / "model")
    save_pretrained(tiny_model, tiny_tokenizer, tmp_path / "J")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "load_and_evaluate", lambda *a, **k: pytest.fail("evaluated"))
    code = main(["eval", "model", "--task", "chain_sum", "--n", "4", "--exclude-train", "0",
                 *extra])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and re.search(match, err), err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_eval_on_the_vllm_engine_without_vllm_is_one_config_error(tmp_path, tiny_model,
                                                                 tiny_tokenizer, capsys):  # fmt: skip
    from rlhflab.models.build import save_pretrained

    save_pretrained(tiny_model, tiny_tokenizer, tmp_path / "model")
    argv = ["eval", str(tmp_path / "model"), "--task", "chain_sum", "--n", "2", "--engine", "vllm"]
    assert main(argv) == 2
    lines = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()  # after the bars
    assert lines[-1].startswith("error: rollout.engine 'vllm' needs vLLM")
    assert "Traceback" not in "".join(lines)


def test_eval_command_on_a_prompt_dataset_with_reward_functions(tmp_path, tiny_tokenizer, capsys):
    from rlhflab.models.build import build_model, save_pretrained

    # GSM8K questions are up to ~240 tokens here: a context that holds them and the completion.
    model = build_model(tiny_tokenizer, size="tiny", max_position_embeddings=512, seed=0)
    save_pretrained(model, tiny_tokenizer, tmp_path / "model")
    (tmp_path / "r.py").write_text(
        "def half(prompts, completions, answer, **kw):\n"
        "    return [0.5 if a.strip().endswith(('18', '7', '3')) else None for a in answer]\n"
    )
    data = str(ROOT / "tests/data/fixtures/prompts/gsm8k_test.jsonl")
    argv = ["eval", str(tmp_path / "model"), "--data", data, "--prompt-column", "question"]
    argv += ["--reward-fn", f"{tmp_path}/r.py:half=2", "--reward-fn", "math_verify=0"]
    argv += ["--max-new-tokens", "3", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    # 4 GSM8K test rows (the file as is: no held-out filtering in eval), each 2 · 0.5 = 1.0;
    # math_verify has weight 0 and does not count in the sum, but it is the headline: a
    # correctness (0 for an untrained model), never the weighted sum called accuracy.
    assert out["n"] == 4 and out["reward"] == 1.0 and out["reward/half"] == 0.5
    assert out["metric"] == "accuracy" and out["accuracy"] == out["reward/math_verify"] == 0.0
    assert out["headline_name"] == "correctness (math_verify)" and out["headline"] == 0.0
    assert out["rewards"] == ["half=2", "math_verify=0"]
    assert main([*argv[:2], "--task", "chain_sum", *argv[2:]]) == 2
    assert "give exactly one of --task NAME and --data PATH" in capsys.readouterr().err
    assert main([*argv[:6], "--reward-fn", "nosuchmod_q:fn"]) == 2
    assert "--reward-fn 'nosuchmod_q:fn'" in capsys.readouterr().err


def test_prompt_dataset_errors_are_one_line_before_the_run(tmp_path, capsys):
    root = tmp_path / "runs"
    gsm8k = str(ROOT / "tests/data/fixtures/prompts/gsm8k_train.jsonl")
    base = ["train", GRPO, f"run.root={root}", "model.name_or_path=none"]
    _fails_cleanly(
        [*base, f"data.path={gsm8k}"], capsys, root, "data.source is 'task' (prompts from the task)"
    )
    _fails_cleanly(
        [
            *base,
            "data.source=dataset",
            f"data.path={gsm8k}",
            "reward.components=[{name: math_verify}]",
        ],
        capsys,
        root,
        "gsm8k_train.jsonl row 0: field 'prompt' is missing (columns: answer, question; "
        "set data.prompt_column)",
    )
    _fails_cleanly(
        [
            *base,
            "data.source=dataset",
            f"data.path={gsm8k}",
            "reward.components=[{function: x.py:f}]",
        ],
        capsys,
        root,
        "reward function 'x.py:f': file not found: x.py",
    )


def test_best_of_n_and_eval_read_answers_the_same_way_by_default():
    # issue 23: best-of-n defaulted to tags, eval and the trainers to plain
    from rlhflab.config import TaskConfig
    from rlhflab.eval.training_run import default_settings

    bon = parse_args(["best-of-n", "p", "--rm", "x:orm", "--task", "t"]).answer_format
    # eval: not given is None (the training run's when found, else the default)
    assert parse_args(["eval", "p", "--task", "t"]).answer_format is None
    ev = default_settings()["answer_format"]
    assert bon == ev == TaskConfig().answer_format == "plain"


@pytest.mark.parametrize("command", ["best-of-n"])  # eval: tests/eval/test_eval_training_run.py
def test_a_policy_trained_with_another_answer_format_is_warned_about(command, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("trainer: sft\ntask: {name: chain_sum, answer_format: tags}\n")
    argv = [command, str(run / "model"), "--task", "chain_sum", "--n", "2"]
    if command == "best-of-n":
        argv[2:2] = ["--rm", f"{tmp_path / 'no_rm'}:orm"]
    assert main(argv) == 2  # the model dir is empty / the RM is missing: one error line
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (
        f"warning: {run / 'model'} was trained with task.answer_format: tags "
        f"({run / 'config.yaml'}) but answers are read as plain; pass --answer-format tags to match"
    )
    assert len(err) == 2 and err[1].startswith("error: "), err
    assert main([*argv, "--answer-format", "tags"]) == 2  # the formats agree: no warning
    assert not capsys.readouterr().err.startswith("warning")


def test_compare_applies_each_override_to_the_presets_that_have_its_key():
    # issue 23: `compare grpo.yaml dpo.yaml rollout.group_size=4` failed on dpo.yaml
    from rlhflab.compare import overrides_per_preset

    dpo = str(ROOT / "configs/dpo/dpo.yaml")
    got = overrides_per_preset(
        [GRPO, dpo],
        ["rollout.group_size=4", "loss.args.beta=0.2", "task.config.min_terms=2", "seed=1"],
    )
    assert got[GRPO] == ["rollout.group_size=4", "task.config.min_terms=2", "seed=1"]
    assert got[dpo] == ["loss.args.beta=0.2", "task.config.min_terms=2", "seed=1"]


def test_compare_key_that_no_preset_has_is_one_line_naming_key_and_presets(tmp_path, capsys):
    dpo = str(ROOT / "configs/dpo/dpo.yaml")
    root = tmp_path / "runs"
    argv = ["compare", "--root", str(root), GRPO, dpo, "rollout.grop_size=2"]
    expected = f"no preset has the config key 'rollout.grop_size' ({GRPO}, {dpo})"
    _fails_cleanly(argv, capsys, root, expected)
    assert not root.exists()


@pytest.mark.parametrize("preset", ["configs/pg/grpo.yaml", "configs/rm/orm.yaml"])
def test_missing_sft_model_names_the_sft_command(preset, tmp_path, monkeypatch, capsys):
    # issue 23: presets start from runs/sft/model, which no command writes (runs are timestamped)
    import shlex

    monkeypatch.chdir(tmp_path)
    root = tmp_path / "out"
    _fails_cleanly(
        ["train", str(ROOT / preset), f"run.root={root}"],
        capsys,
        root,
        "model.name_or_path: runs/sft/model does not exist",
    )
    expected = "model.name_or_path: runs/sft/model does not exist"
    _fails_cleanly(["compare", "--root", str(root), GRPO], capsys, root, expected)
    main(["train", str(ROOT / preset)])
    err = capsys.readouterr().err
    sft = shlex.split(err.split("`")[1])  # the SFT command in the message, as a shell reads it
    assert sft[:3] == ["rlhflab", "train", "configs/sft/tiny_scratch.yaml"]
    sft_cfg = load_config(ROOT / sft[2], parse_args(sft[1:]).overrides)
    task = load_config(ROOT / preset, ["model.name_or_path=x"]).task
    assert sft_cfg.task == task  # the SFT model is made on the preset's task


def _run_hint(hint: str) -> argparse.Namespace:
    """The `rlhflab ...` command after `next:` in a hint, parsed by the CLI's parser."""
    import shlex

    words = shlex.split(hint.removeprefix("next:"), comments=True)
    assert words[0] == "rlhflab"
    return parse_args(words[1:])


def test_next_command_after_sft_trains_grpo_on_its_model_and_task():
    from rlhflab.next_steps import next_command

    task_over = ["task.name=chain_sum", 'task.config={"min_terms": 2, "max_terms": 2}']
    cfg = load_config(SFT, task_over)
    hint = next_command(cfg, {"model_dir": "runs/sft-1/model"})
    assert hint.startswith("next: rlhflab train configs/pg/grpo.yaml ") and "\n" not in hint
    args = _run_hint(hint)
    grpo = load_config(ROOT / args.config, args.overrides)
    assert grpo.model.name_or_path == "runs/sft-1/model"
    assert grpo.task == cfg.task
    assert next_command(cfg, {"model_dir": None}) is None  # run.save_model: false


def test_next_command_after_rl_evaluates_the_same_heldout_split():
    from rlhflab.next_steps import next_command

    over = ["model.name_or_path=x", "task.name=chain_sum", "task.seed=3", "task.n_train=500"]
    cfg = load_config(GRPO, [*over, "task.n_heldout=40", "task.answer_format=tags"])
    args = _run_hint(next_command(cfg, {"model_dir": "runs/g-1/model"}))
    assert (args.command, args.model, args.task) == ("eval", "runs/g-1/model", "chain_sum")
    assert (args.seed, args.exclude_train, args.n) == (3, 500, 40)
    assert (args.task_config or {}, args.answer_format, args.k) == (cfg.task.config, "tags", 8)


def test_next_commands_after_quickstart(tmp_path):
    from rlhflab.next_steps import after_quickstart
    from rlhflab.quickstart import build_configs
    from rlhflab.runs import write_yaml_atomic

    sft_cfg, _ = build_configs(fast=True, root=tmp_path)
    (tmp_path / "sft").mkdir()
    write_yaml_atomic(tmp_path / "sft" / "config.yaml", sft_cfg.model_dump(mode="json"))
    hint = after_quickstart({"model_dir": "q/grpo/model", "sft_run": str(tmp_path / "sft")})
    first, second = hint.splitlines()
    ev = _run_hint(first)
    assert (ev.command, ev.model, ev.task, ev.task_config) == (
        "eval",
        "q/grpo/model",
        sft_cfg.task.name,
        sft_cfg.task.config,
    )
    train = _run_hint("next: " + second.strip())
    rloo = load_config(ROOT / train.config, train.overrides)
    assert rloo.model.name_or_path == str(tmp_path / "sft" / "model")
    assert rloo.task == sft_cfg.task


def test_train_ends_with_the_next_command(tmp_path, capsys):
    root = tmp_path / "runs"
    argv = ["train", SFT, "model.build.size=tiny", "model.build.tokenizer_texts=200"]
    argv += ["task.n_train=200", "task.n_heldout=4", "train.steps=1", "train.batch_size=8"]
    argv += ["train.micro_batch_size=8", "eval.n=0", "tracking.console=false", f"run.root={root}"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    model_dir = json.loads((run_dir / "final_results.json").read_text())["model_dir"]
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith(
        f"next: rlhflab train configs/pg/grpo.yaml model.name_or_path={model_dir}"
    )
