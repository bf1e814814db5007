"""Multi-turn episodes as trajectories: observation tokens are appended as ids and carry no loss,
the trajectory's log-probs are those of one forward pass over its token ids (and the sampler's),
and a policy-gradient run with an environment trains and evaluates by episodes."""

import json

import pytest
import torch
from fixtures_envs import OBS, ScriptEnv

from rlhflab.envs.episodes import EpisodeLimits, observation_ids, run_episodes
from rlhflab.losses.aggregate import aggregate
from rlhflab.losses.policy import POLICY_LOSSES
from rlhflab.rollout.engines import SamplingParams, make_engine
from rlhflab.rollout.sampler import completion_logps


def _episodes(model, tokenizer, n=4, seed=0):
    engine = make_engine(None, model, tokenizer)
    # Stop on a third of the vocabulary, so turns end after a few tokens.
    stops = tuple(range(7, len(tokenizer), 3))
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=6, max_episode_tokens=80,
                           context_length=128)  # fmt: skip
    return run_episodes(
        engine, tokenizer, ScriptEnv(), list(range(n)),
        SamplingParams(n=1, stop_token_ids=stops), limits,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip


def test_observation_tokens_are_ids_with_zero_loss_mask(tiny_model64, tiny_tokenizer):
    out = _episodes(tiny_model64.eval(), tiny_tokenizer)
    traj = out.trajectory
    obs = observation_ids(tiny_tokenizer, {"role": "user", "content": OBS})
    assert tiny_tokenizer.decode(obs) == f"<|user|>{OBS}<|end|><|assistant|>"
    for i in range(traj.mask.size(0)):
        real = traj.attend[i].bool()
        env_tokens = traj.completion_ids[i][real & (traj.mask[i] == 0)].tolist()
        assert env_tokens == obs * (out.turns[i] - 1)  # every observation, as ids, unmasked
        assert traj.logp[i][traj.mask[i] == 0].abs().sum() == 0
    for calls, turns, cut in zip(out.tool_calls, out.turns, traj.truncated.tolist(), strict=True):
        # a call whose result a limit cut off still counts as a call
        assert calls == (turns if cut else turns - 1)
    assert any(t == 3 for t in out.turns)  # some episodes reached the third turn


def test_env_tokens_get_zero_loss_weight(tiny_model64, tiny_tokenizer):
    """d loss / d logp is 0 on every environment token and nonzero on model tokens, for each
    aggregation."""
    traj = _episodes(tiny_model64.eval(), tiny_tokenizer).trajectory
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    for agg in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        logp, _ = completion_logps(tiny_model64, traj)
        logp.retain_grad()
        loss_tok, _ = POLICY_LOSSES["ppo_clip"](logp, logp.detach(), adv, traj.mask)
        loss = aggregate(loss_tok, traj.mask, agg, num_tokens=traj.mask.sum(), num_seqs=4,
                         max_len=traj.mask.size(1))  # fmt: skip
        loss.backward()
        env = (traj.mask == 0) & (traj.attend == 1)
        assert env.any() and logp.grad[env].abs().max() == 0
        assert (logp.grad[traj.mask == 1] != 0).all()


def test_trajectory_logps_equal_one_forward_pass(tiny_model64, tiny_tokenizer):
    """completion_logps of the padded trajectory batch = log-softmax of one unpadded forward
    over each trajectory's ids (float64), and = the sampler's turn-by-turn log-probs."""
    model = tiny_model64.eval()
    traj = _episodes(model, tiny_tokenizer).trajectory
    with torch.no_grad():
        logp, _ = completion_logps(model, traj)
    assert logp.dtype == torch.float64
    for i in range(traj.mask.size(0)):
        prompt = traj.prompt_ids[i][traj.prompt_mask[i].bool()]
        comp = traj.completion_ids[i][traj.attend[i].bool()]
        ids = torch.cat([prompt, comp])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].double()
        ref = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        ref = ref[len(prompt) - 1 :]  # predictions of the completion tokens
        m = traj.mask[i][: len(comp)].bool()
        torch.testing.assert_close(logp[i][: len(comp)][m], ref[m], rtol=0, atol=1e-10)
    # The sampler's log-probs (float32 storage, KV cache, turn by turn) agree too.
    torch.testing.assert_close(logp.float(), traj.logp, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_policy_gradient_with_an_environment(tmp_path):
    """SFT → GRPO with an environment from a file: metrics of episodes each step, held-out
    evaluation by episodes (success, turns, tool calls)."""
    from factories import tiny_pg, tiny_sft

    from rlhflab.config import config_from_dict
    from rlhflab.trainers import policy_gradient, sft

    env_file = tmp_path / "script_env.py"
    env_file.write_text(
        f"OBS = {OBS!r}\n\n"
        "class ScriptEnv:\n"
        "    def reset(self, problem):\n"
        "        self.n = 0\n"
        "        return [{'role': 'user', 'content': problem.question}]\n"
        "    def step(self, messages, turn):\n"
        "        self.n += 1\n"
        "        if self.n < 2:\n"
        "            return OBS, 0.0, False, {'tool_call': 1}\n"
        "        return None, float(len(turn) % 2), True, {}\n"
    )
    model_dir = sft.train(config_from_dict(tiny_sft(tmp_path)))["model_dir"]
    raw = tiny_pg(
        tmp_path, model_dir, env={"class": f"{env_file}:ScriptEnv", "max_turns": 2},
        train={"steps": 2, "micro_batch_size": 16}, eval={"n": 4, "every": 0},
    )  # fmt: skip
    res = policy_gradient.train(config_from_dict(raw))
    with open(f"{res['run_dir']}/metrics.jsonl") as f:
        rows = [json.loads(x) for x in f]
    steps = [r for r in rows if "rollout/turns_mean" in r]
    assert len(steps) == 2 and all(1 <= r["rollout/turns_mean"] <= 2 for r in steps)
    assert all(r["rollout/tool_calls_mean"] == 1.0 for r in steps)  # every first turn calls
    evals = [r for r in rows if "eval/tool_calls" in r]
    assert evals and all(r["eval/n"] == 4 for r in evals)
    assert res["heldout_accuracy"] is not None
