"""A mistyped local model path fails at once, in one line naming the config field and the path,
for every field that names a model: the policy (`model.name_or_path`), the distillation teacher
(`teacher.name_or_path`), the reward model's sampling policy (`data.policy`) and a
`reward_model` reward component (`...args.path`). Nothing asks the Hub (issue 36)."""

from pathlib import Path

import pytest

from rlhflab.cli import main

ROOT = Path(__file__).resolve().parents[1]
WHY = "(read as a local path: runs/ is a local directory)"


@pytest.fixture
def online_no_hub(monkeypatch, tmp_path):
    """The Hub online (as without HF_HUB_OFFLINE), every look-up failing the test; cwd holds a
    runs/ directory, as after a first run."""
    import huggingface_hub
    import huggingface_hub.constants
    import huggingface_hub.file_download as hf_download
    import transformers.utils.hub as tf_hub

    def asked(*args, **kwargs):
        raise AssertionError(f"a Hub look-up was made: {args}")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for module, name in [(huggingface_hub, "hf_hub_download"), (hf_download, "hf_hub_download"),
                         (hf_download, "get_hf_file_metadata"), (tf_hub, "hf_hub_download"),
                         (tf_hub, "snapshot_download")]:  # fmt: skip
        monkeypatch.setattr(module, name, asked)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()


@pytest.fixture
def saved_model(tiny_model, tiny_tokenizer, tmp_path):
    from rlhflab.models.build import save_pretrained

    path = tmp_path / "sft"
    save_pretrained(tiny_model, tiny_tokenizer, path)
    return str(path)


def _error_line(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == err[-1], err
    return errors[0]


SMALL = ["task.n_train=40", "task.n_heldout=8", "run.root=out"]


def test_policy_path(online_no_hub, capsys):
    line = _error_line(["train", str(ROOT / "configs/pg/grpo.yaml"),
                        "model.name_or_path=runs/sftmodel", *SMALL], capsys)  # fmt: skip
    assert line == f"error: model.name_or_path: no such directory: runs/sftmodel {WHY}"


def test_teacher_path(online_no_hub, saved_model, capsys):
    line = _error_line(["train", str(ROOT / "configs/distill/on_policy.yaml"),
                        f"model.name_or_path={saved_model}", "teacher.name_or_path=runs/grpoo",
                        *SMALL], capsys)  # fmt: skip
    assert line == f"error: teacher.name_or_path: no such directory: runs/grpoo {WHY}"


def test_reward_model_component_path(online_no_hub, saved_model, capsys):
    line = _error_line(["train", str(ROOT / "configs/rm/grpo_against_rm.yaml"),
                        f"model.name_or_path={saved_model}",
                        "reward.components=[{name: reward_model, args: {path: runs/rmm}}]",
                        *SMALL], capsys)  # fmt: skip
    assert line.startswith("error: reward.components[reward_model].args.path: ")
    assert line.endswith(f"'runs/rmm': no such directory: runs/rmm {WHY}")


def test_rm_sampling_policy_path(online_no_hub, saved_model, capsys):
    line = _error_line(["train", str(ROOT / "configs/rm/orm.yaml"),
                        f"model.name_or_path={saved_model}", "data.policy=runs/sftt",
                        "data.n_prompts=4", *SMALL], capsys)  # fmt: skip
    assert line == f"error: data.policy: no such directory: runs/sftt {WHY}"
