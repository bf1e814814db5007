"""Loading a user's environment class from `env.class`, and the one-line errors of a bad path,
class, method or step result."""

import pytest

from rlhflab.config import config_from_dict
from rlhflab.envs import load_env
from rlhflab.envs.base import as_step_result
from rlhflab.errors import ConfigError

ENV_FILE = """
class Good:
    def __init__(self, k=1):
        self.k = k
    def reset(self, problem):
        return [{"role": "user", "content": str(problem)}]
    def step(self, messages, turn):
        return None, 1.0, True, {}

class NoStep:
    def reset(self, problem):
        return []

class Broken:
    def __init__(self):
        raise RuntimeError("no data")
    def reset(self, problem): ...
    def step(self, messages, turn): ...
"""


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE)
    return path


def test_load_env_from_a_file_with_args(env_file):
    env = load_env(f"{env_file}:Good", {"k": 3}, tool_timeout_s=2.0)
    assert env.k == 3 and env.tool_timeout_s == 2.0
    assert env.reset(5) == [{"role": "user", "content": "5"}]


def test_load_env_from_a_module():
    env = load_env("rlhflab.envs.arithmetic:CalculatorEnv", {"answer_format": "tags"})
    assert env.step([], "<tool>calc: 6*7</tool>") == ("42", -0.0, False, {"tool_call": 1})


@pytest.mark.parametrize(
    ("spec", "args", "message"),
    [
        ("no_colon.py", None, "must be 'path/to/file.py:ClassName'"),
        ("{dir}/missing.py:Good", None, "file '{dir}/missing.py' not found"),
        ("{file}:Nope", None, "has no class 'Nope'"),
        ("{file}:NoStep", None, "NoStep has no step() method"),
        ("{file}:Good", {"zzz": 1}, "env.args: Good(**args) failed: TypeError"),
        ("{file}:Broken", None, "env.args: Broken(**args) failed: RuntimeError: no data"),
        ("rlhflab.no_such_module:X", None, "importing 'rlhflab.no_such_module' failed"),
    ],
)
def test_load_env_errors_are_one_line(env_file, spec, args, message):
    fill = {"dir": env_file.parent, "file": env_file}
    with pytest.raises(ConfigError) as err:
        load_env(spec.format(**fill), args)
    text = str(err.value)
    assert message.format(**fill) in text and "\n" not in text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("done", "must return (observation | None, reward, done, info)"),
        ((None, 1.0, True), "must return (observation | None, reward, done, info)"),
        ((3, 1.0, True, {}), "observation must be a string"),
        ((None, "1", True, {}), "reward must be a number"),
        ((None, True, True, {}), "reward must be a number"),
        ((None, 1.0, True, []), "info must be a dict"),
    ],
)
def test_bad_step_results(value, message):
    with pytest.raises(ConfigError, match="episode 3") as err:
        as_step_result(value, "env: episode 3")
    assert message in str(err.value)


def test_step_result_string_observation_is_a_user_message():
    res = as_step_result(("42", 0, False, {"tool_call": 1}), "x")
    assert res.observation == {"role": "user", "content": "42"} and res.reward == 0.0


def test_env_config_section(tmp_path):
    from factories import tiny_pg

    raw = tiny_pg(tmp_path, tmp_path, env={"class": "a.py:B", "args": {"x": 1}, "max_turns": 3})
    cfg = config_from_dict(raw)
    assert cfg.env.class_ == "a.py:B" and cfg.env.max_turns == 3
    again = config_from_dict(cfg.model_dump(mode="json"))  # config.yaml round trip (resume)
    assert again.env == cfg.env
    raw["reward"] = {"components": [{"name": "format"}]}
    with pytest.raises(ConfigError, match="with `env` the reward is the environment's"):
        config_from_dict(raw)


def test_calculator_env_episode_by_hand():
    from rlhflab.data.tasks import make_splits

    p = make_splits("basic_arithmetic", config={"min_terms": 2, "max_terms": 2,
                    "operators": ["*"], "allow_parentheses": False, "allow_negation": False},
                    n_train=1, n_heldout=0).train[0]  # fmt: skip
    env = load_env("rlhflab.envs.arithmetic:CalculatorEnv", {"instruction": ""})
    assert env.reset(p) == [{"role": "user", "content": p.question}]
    expr = p.question.removeprefix("Calculate ").rstrip(".")
    obs, reward, done, info = env.step([], f"<tool>calc: {expr}</tool>")
    assert (obs, reward, done, info) == (str(p.answer), 0.0, False, {"tool_call": 1})
    assert env.step([], f"<answer>{p.answer}</answer>") == (None, 1.0, True, {"success": 1.0})
    assert env.step([], "<answer>-1</answer>") == (None, 0.0, True, {"success": 0.0})
