"""Multi-turn episodes (rlhflab.envs) through every rollout engine: each turn is one
`engine.generate` call on the episode's token ids so far, observations are appended as ids, and the
sampler's turn-by-turn log-probs must equal those of one trainer forward over the trajectory.

Parametrised over engines (conftest.py): `hf` always, `vllm` when installed (CI runs this file in
the vllm environment too).
"""

import torch
from fixtures_envs import OBS, ScriptEnv

from rlhflab.envs.episodes import EpisodeLimits, observation_ids, run_episodes
from rlhflab.rollout.engines import SamplingParams
from rlhflab.rollout.sampler import completion_logps


def test_episode_logps_equal_one_trainer_forward(engine, contract_model, tiny_tokenizer):
    stops = tuple(range(7, len(tiny_tokenizer), 3))  # turns end after a few tokens
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=6, max_episode_tokens=80,
                           context_length=128)  # fmt: skip
    out = run_episodes(
        engine, tiny_tokenizer, ScriptEnv(), list(range(6)),
        SamplingParams(n=1, stop_token_ids=stops), limits,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    traj = out.trajectory
    assert any(t == 3 for t in out.turns)  # observations were appended between model turns
    obs = observation_ids(tiny_tokenizer, {"role": "user", "content": OBS})
    model_tok = traj.mask == 1
    env_tok = (traj.mask == 0) & (traj.attend == 1)
    for i in range(traj.mask.size(0)):
        assert traj.completion_ids[i][env_tok[i]].tolist() == obs * (out.turns[i] - 1)
    assert traj.logp[env_tok].abs().sum() == 0
    with torch.no_grad():  # one forward over [prompt; trajectory]
        logp, _ = completion_logps(contract_model, traj)
    # fp32 on CPU: the engine's log-probs are the trainer's up to kernel rounding
    torch.testing.assert_close(traj.logp[model_tok], logp[model_tok], atol=1e-4, rtol=0)
