"""`env: {openenv: ...}`: an OpenEnv environment (openenv-core's in-process `Environment`) run
inside rlhflab's episode loop. The environment is defined here: guess a number from a seed, told
"higher" / "lower" after each guess. Checked: episode rewards are the sums of the observations'
rewards, the rendered observations are the template's ids with loss mask 0, and GRPO trains a
few steps. Skipped without openenv-core (the `envs` extra), failed instead under
RLHFLAB_REQUIRE_ENVS=1 (CI)."""

import json
import os

import pytest
import torch

try:
    import openenv.core.env_server  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    if os.environ.get("RLHFLAB_REQUIRE_ENVS") == "1":
        raise RuntimeError(f"RLHFLAB_REQUIRE_ENVS=1 but openenv-core is missing: {exc}") from exc
    pytest.skip(f"needs openenv-core (the envs extra): {exc}", allow_module_level=True)

from rlhflab.envs.episodes import EpisodeLimits, observation_ids, run_episodes
from rlhflab.envs.openenv_env import OpenEnvEnv
from rlhflab.errors import ConfigError
from rlhflab.rollout.engines import SamplingParams, make_engine

ENV_SOURCE = """
import random

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class Guess(Action):
    value: int | None


class Feedback(Observation):
    text: str


class GuessEnv(Environment):
    def __init__(self, high=9):
        super().__init__()
        self.high = high
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = random.Random(seed).randint(0, self.high)
        self._state = State(episode_id=episode_id, step_count=0)
        return Feedback(text=f"Guess a number from 0 to {self.high}.")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.value == self.target:
            return Feedback(text="right", done=True, reward=1.0, metadata={"guesses": 1.0 *
                            self._state.step_count})
        hint = "no number" if action.value is None else (
            "higher" if action.value < self.target else "lower")
        return Feedback(text=hint, done=False, reward=-0.1)

    @property
    def state(self):
        return self._state


def make(high=9):
    return GuessEnv(high)


def action(text):
    digits = [c for c in text if c.isdigit()]
    return Guess(value=int(digits[0]) if digits else None)


def render(obs):
    return obs.text


def not_an_env():
    return object()
"""


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "guess_env.py"
    path.write_text(ENV_SOURCE)
    return str(path)


def _env(env_file, **kw):
    return OpenEnvEnv(f"{env_file}:make", f"{env_file}:action", f"{env_file}:render", **kw)


def test_episodes_sum_the_observations_rewards(env_file, tiny_model, tiny_tokenizer):
    env = _env(env_file, n_train=8, n_heldout=2)
    train, heldout = env.prompt_rows()
    assert [r.columns["seed"] for r in heldout] == [8, 9]
    engine = make_engine(None, tiny_model.eval(), tiny_tokenizer)
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=6, max_episode_tokens=80,
                           context_length=128)  # fmt: skip
    stops = tuple(range(7, len(tiny_tokenizer), 3))
    out = run_episodes(engine, tiny_tokenizer, env, train, SamplingParams(n=1, stop_token_ids=stops),
                       limits, generator=torch.Generator().manual_seed(0))  # fmt: skip
    traj = out.trajectory
    assert max(out.turns) > 1
    for i in range(len(train)):
        msgs = out.messages[i]
        assert msgs[0]["content"] == "Guess a number from 0 to 9."
        obs = msgs[2::2]  # the rendered observations after each assistant turn
        assert all(m["content"] in ("higher", "lower", "no number") for m in obs)
        want = [t for m in obs for t in observation_ids(tiny_tokenizer, m)]
        env_tokens = traj.completion_ids[i][traj.attend[i].bool() & (traj.mask[i] == 0)].tolist()
        assert env_tokens == want  # rendered observations, as template ids, no loss
        assert traj.logp[i][traj.mask[i] == 0].abs().sum() == 0
        # replay the turns on a fresh environment: the same rewards
        replay = _env(env_file)
        replay.reset(train[i])
        total = 0.0
        for text in out.texts[i].split(" | "):
            _, r, done, _ = replay.step([], text)
            total += r
            if done:
                break
        assert out.rewards[i].item() == pytest.approx(total, abs=1e-6)


def test_bad_specs_are_one_line_errors(env_file):
    with pytest.raises(ConfigError, match=r"env\.openenv\.action: .* has no function 'nope'"):
        OpenEnvEnv(f"{env_file}:make", f"{env_file}:nope", f"{env_file}:render")
    with pytest.raises(ConfigError, match="not an OpenEnv Environment"):
        OpenEnvEnv(f"{env_file}:not_an_env", f"{env_file}:action", f"{env_file}:render")
    with pytest.raises(ConfigError, match=r"env.args: make\(\*\*args\) failed"):
        _env(env_file, args={"bogus": 1})


def _raw(root, model_dir, env_file, **sections):
    """GRPO on the number-guessing environment: 2 prompts x 4 episodes of up to 3 turns."""
    from factories import tiny_pg

    spec = {"make": f"{env_file}:make", "action": f"{env_file}:action",
            "render": f"{env_file}:render", "n_train": 16, "n_heldout": 4}  # fmt: skip
    raw = tiny_pg(
        root / "runs", model_dir,
        env={"openenv": spec, "max_turns": 3, "max_turn_tokens": 6},
        data={"source": "env"},
        rollout={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6,
                 "stop_token_ids": list(range(7, 300, 3))},
        tracking={"console": False},
    )  # fmt: skip
    raw.update(sections)
    return raw


def test_grpo_trains_on_an_openenv_env(tmp_path, env_file, tiny_model, tiny_tokenizer):
    from rlhflab.config import config_from_dict
    from rlhflab.models.build import save_pretrained
    from rlhflab.trainers import policy_gradient

    save_pretrained(tiny_model, tiny_tokenizer, tmp_path / "model")
    raw = _raw(tmp_path, tmp_path / "model", env_file,
               train={"steps": 2, "micro_batch_size": 8}, eval={"n": 4, "every": 0})  # fmt: skip
    res = policy_gradient.train(config_from_dict(raw))
    with open(f"{res['run_dir']}/metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    steps = [r for r in rows if "rollout/turns_mean" in r]
    assert len(steps) == 2 and all(r["rollout/turns_mean"] > 1 for r in steps)
    assert any(r.get("eval/n") == 4 for r in rows)  # held-out seeds, greedy episodes


def test_killed_mid_run_resumes_bitwise(tmp_path, env_file, tiny_model, tiny_tokenizer):
    """A GRPO run on the OpenEnv environment SIGKILLed after step 3 and resumed equals an
    uninterrupted run bit for bit (metrics, samples, weights): every episode builds a fresh
    environment from its seed, so nothing of an environment's state needs a checkpoint."""
    from test_checkpoint_resume import assert_same_run, run_cli, run_dir_of

    from rlhflab.config import config_from_dict
    from rlhflab.models.build import save_pretrained
    from rlhflab.trainers import run_config

    save_pretrained(tiny_model, tiny_tokenizer, tmp_path / "model")

    def raw(root):
        return _raw(root, tmp_path / "model", env_file,
                    train={"steps": 4, "micro_batch_size": 8}, precision={"threads": 1},
                    tracking={"console": False, "samples_every": 1},
                    checkpoint={"every": 2, "keep_last": 1})  # fmt: skip

    ref = run_config(config_from_dict(raw(tmp_path / "ref")))["run_dir"]
    (tmp_path / "runs").mkdir()
    killed = raw(tmp_path)
    assert run_cli(tmp_path, killed, fault="step_end@3=sigkill", check=False).returncode == -9
    run_cli(tmp_path, killed, "--resume")
    assert_same_run(ref, run_dir_of(tmp_path / "runs", "grpo"))
