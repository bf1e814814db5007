"""rollout.mode "async" (rlhflab.rollout.async_rollouts): the schedule of behaviour versions, the
logged staleness and behaviour ratio, and that the background generation consumes the prompts
and the sampler's random stream exactly as a synchronous run does."""

import json
from pathlib import Path

import pytest
from factories import tiny_build, tiny_task

from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

REWARD = (
    "def text_len(prompts, completions, **kw):\n    return [len(c) / 10 for c in completions]\n"
)


def _raw(root, name, **rollout):
    reward_file = Path(root) / "reward.py"  # varies within a group, so the policy moves
    if Path(root).is_dir():
        reward_file.write_text(REWARD)
    return {
        "trainer": "policy_gradient",
        "model": {"build": tiny_build()},
        "task": tiny_task(n_train=200, n_heldout=8),
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 5, **rollout},
        "reward": {"components": [{"function": f"{reward_file}:text_len", "weight": 1.0}]},
        "train": {"steps": 4, "micro_batch_size": 8},
        "optim": {"lr": 5e-2},
        "eval": {"n": 0},
        "precision": {"threads": 1},
        "tracking": {"console": False, "samples_every": 1},
        "run": {"name": name, "root": str(root)},
    }


def _metrics(root, name, **rollout):
    res = run_config(config_from_dict(_raw(root, name, **rollout)))
    run_dir = Path(res["run_dir"])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    return [r for r in rows if "policy/loss" in r], samples


@pytest.mark.slow
def test_async_staleness_schedule_and_same_prompts_as_sync(tmp_path):
    sync, s_sync = _metrics(tmp_path, "sync")
    k1, s_k1 = _metrics(tmp_path, "k1", mode="async")
    k2, _ = _metrics(tmp_path, "k2", mode="async", max_staleness=2)
    assert [r["rollout/staleness"] for r in k1] == [0.0, 1.0, 1.0, 1.0]
    assert [r["rollout/staleness"] for r in k2] == [0.0, 1.0, 2.0, 2.0]
    assert [r["rollout/behaviour_version"] for r in k2] == [0.0, 0.0, 0.0, 1.0]
    assert "rollout/staleness" not in sync[0]
    # The sampler–trainer mismatch metrics would measure the lag under async (and trip the
    # logp_mismatch health check): the behaviour ratio replaces them there.
    assert "rollout/logp_diff_mean" in sync[0]
    assert all("rollout/logp_diff_mean" not in r and "rollout/sampler_kl" not in r for r in k1)
    # Step 1 is on-policy (staleness 0): the very batch of the synchronous run, so the same
    # rollout metrics and samples; behaviour ratio 1 up to the sampler's rounding.
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "rollout/reward_std"):
        assert k1[0][key] == sync[0][key]
    first = [s for s in s_sync if s.get("step") == 1]
    assert first and first == [s for s in s_k1 if s.get("step") == 1]
    assert abs(k1[0]["rollout/behav_ratio_mean"] - 1.0) < 1e-4
    # Later steps: the behaviour policy is one update behind, so the ratio moves off 1.
    assert any(abs(r["rollout/behav_ratio_max"] - 1.0) > 1e-3 for r in k1[1:])
    # Both modes draw the same prompts in the same order (the background thread consumes the
    # prompt stream in step order): the samples' prompts agree step by step.
    prompts = lambda ss: [(s["step"], s["prompt"]) for s in ss]  # noqa: E731
    assert prompts(s_sync) == prompts(s_k1)


def test_async_config_errors(tmp_path):
    base = _raw(tmp_path, "x")
    for rollout, msg in (
        ({"mode": "async", "engine": "vllm"}, "needs rollout.engine 'hf'"),
        ({"mode": "async", "dynamic_sampling": {"enabled": True}}, "dynamic_sampling"),
        ({"mode": "async", "max_staleness": 0}, "max_staleness"),
    ):
        raw = {**base, "rollout": {**base["rollout"], **rollout}}
        with pytest.raises(Exception, match=msg):
            config_from_dict(raw)
    raw = {**base, "rollout": {**base["rollout"], "mode": "async"}}
    raw["loss"] = {"tis": {"enabled": True}}
    with pytest.raises(Exception, match=r"disable loss\.tis"):
        config_from_dict(raw)


@pytest.mark.slow
def test_a_generation_process_draws_what_the_thread_draws(tmp_path):
    """rollout.async_worker "process" (rlhflab.rollout.async_process): the same prompts, seeds,
    tokens, losses and staleness schedule as the thread, step by step (2 steps stale)."""
    thread, s_thread = _metrics(tmp_path, "thread", mode="async", max_staleness=2)
    proc, s_proc = _metrics(tmp_path, "proc", mode="async", max_staleness=2, async_worker="process")
    assert len(thread) == len(proc) == 4
    assert [r["rollout/staleness"] for r in proc] == [0.0, 1.0, 2.0, 2.0]
    assert s_thread == s_proc  # every sampled completion, step by step
    for a, b in zip(thread, proc, strict=True):
        for k, v in a.items():
            if k.startswith(("rollout/", "policy/", "train/")) and isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k


def _broken_engine(model):
    raise ValueError("no engine here")


def _request(step):
    return [0], {"step": step}


def _never(*args):
    raise AssertionError("no batch can be finished")


def test_a_failed_or_dead_generation_process_stops_the_run_with_one_line(tiny_model):
    """The worker's exception comes back as one line; a worker that dies (SIGKILL) is noticed
    while the trainer waits, instead of a hang."""
    import os
    import signal
    from functools import partial

    from rlhflab.rollout.async_process import ProcessRollouts

    kw = dict(max_staleness=1, total_steps=3, threads=1)
    failed = ProcessRollouts(tiny_model, _broken_engine, None, _request, _never, **kw)
    try:
        with pytest.raises(RuntimeError, match="failed to start: ValueError: no engine here"):
            failed.next(1, tiny_model)
    finally:
        failed.close()
    from rlhflab.rollout.engines import make_engine

    dead = ProcessRollouts(tiny_model, partial(make_engine, None, tokenizer=None), None,
                           _request, _never, **kw)  # fmt: skip
    try:
        os.kill(dead.proc.pid, signal.SIGKILL)
        dead.proc.join()
        with pytest.raises(RuntimeError, match=r"process died \(exit code -9\)"):
            dead.next(1, tiny_model)
    finally:
        dead.close()
