"""The gold-vs-proxy frontier of an RL run, measured as it trains: gold and proxy reward against
d = √KL(π‖π_init), the variable of Gao et al. 2022's functional forms for the gold score
(arXiv 2210.10760, §1: R_bon(d) = d(α − βd), R_RL(d) = d(α − β log d)).

A run whose reward includes a learned component (a reward model: the proxy) on a task with a
verifier (the gold) logs, at every evaluation, on the same held-out problems:

    frontier/proxy    mean training reward (Σ weight · component, as in training, but each reward
                      model's score unnormalised: `raw_scores`) of the samples
    frontier/gold     mean verifier score of the same samples, or with `eval.frontier_gold` (a
                      reward component, e.g. an LLM judge) that component's mean raw score
    frontier/verifier with `eval.frontier_gold` only: the mean verifier score of the same
                      samples, beside the component's (how the gold itself fares)
    frontier/kl       mean over the samples of Σ_t log π(o_t | ·) − log π_init(o_t | ·): the
                      Monte-Carlo (k1) estimate of KL(π‖π_init), nats per completion
    frontier/sqrt_kl  √max(kl, 0), Gao et al.'s d

with one sample per problem at the rollout temperature, drawn from a generator seeded by the run's
seed (the same draws at every evaluation until the policy moves). `rlhflab.plots.plot_frontier`
draws gold and proxy against √KL from `metrics.jsonl` (plots/frontier.png): over-optimisation
shows as the gold turning down while the proxy keeps rising.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def frontier_point(policy, initial_scoring, tokenizer, problems: list, reward, gold, *, engine,
                   system, instruction: str, max_new_tokens: int, temperature: float,
                   seed: int, batch: int = 64, verifier=None) -> dict:  # fmt: skip
    """One point of the frontier on held-out `problems` (task Problems).

    Args:
        policy: the trained policy (its own forward; sharded models too).
        initial_scoring: a callable returning a context manager that yields the module computing
            π_init (`trainers.common.Reference.scoring`); entered only to score π_init, since
            for a LoRA policy it is the policy itself with its adapters disabled.
        reward: the run's reward (`score(texts, rollout, problems, where=..., raw_scores=True)`
            → (total (B,), components)): the proxy, reward models unnormalised (a running
            normalisation's statistics are not moved by the measurement).
        gold: the gold, a scorer of the same samples (`experience.scoring`'s protocol:
            `score(texts, rollout, problems, where=..., raw_scores=True)` → (total (B,), parts)):
            the task verifier (`VerifierOnly`), or the reward component of `eval.frontier_gold`
            (`RewardComponents`, e.g. an LLM judge).
        engine: the rollout engine to sample with.
        verifier: when the gold is not the verifier, the task verifier as a scorer
            (`VerifierOnly`): the same samples' verifier scores are returned beside the gold.
    Returns:
        {"proxy", "proxy_stderr", "gold", "gold_stderr", "kl", "sqrt_kl", "n", "proxy_values"}
        (and "verifier", "verifier_stderr" when `verifier` is given):
        means over the n sampled completions (one per problem) and their standard errors
        (`eval.accuracy.mean_and_stderr`: NaN with one problem); kl in nats per completion;
        proxy_values the n per-problem proxies in problem order (the same problems and seed at
        every evaluation, so two evaluations' proxies pair by problem: `reward_hacking` judges
        a rise by its paired standard error).
    Raises:
        ValueError: no problems.
    """
    from rlhflab.data.formatting import encode_prompt
    from rlhflab.data.prompts import render_row
    from rlhflab.eval.accuracy import mean_and_stderr
    from rlhflab.rollout.engines import SamplingParams, sample_chunks
    from rlhflab.rollout.sampler import completion_logps

    if not problems:
        raise ValueError("frontier_point: no held-out problems")
    device = next(policy.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=temperature)
    proxy, golds, verified, kls = [], [], [], []
    for s in range(0, len(problems), batch):
        chunk = problems[s : s + batch]
        ids = [encode_prompt(tokenizer, render_row(tokenizer, p, system=system,
                                                   instruction=instruction)) for p in chunk]  # fmt: skip
        [(_, ro, texts)] = sample_chunks(policy, engine, tokenizer, ids, params, generator=gen)
        total, _ = reward.score(texts, ro, chunk, where="frontier", raw_scores=True)
        proxy += total.tolist()
        g_total, _ = gold.score(texts, ro, chunk, where="frontier gold", raw_scores=True)
        golds += [float(x) for x in g_total.tolist()]
        if verifier is not None:
            v_total, _ = verifier.score(texts, ro, chunk, where="frontier verifier")
            verified += [float(x) for x in v_total.tolist()]
        lp, _ = completion_logps(policy, ro)
        with initial_scoring() as initial:
            li, _ = completion_logps(initial, ro)
        kls += ((lp - li).double() * ro.mask).sum(dim=1).tolist()
    n = len(kls)
    kl = math.fsum(kls) / n
    (p, p_se), (g, g_se) = mean_and_stderr(proxy), mean_and_stderr(golds)
    out = {"proxy": p, "proxy_stderr": p_se, "gold": g, "gold_stderr": g_se, "kl": kl,
           "sqrt_kl": math.sqrt(max(kl, 0.0)), "n": n, "proxy_values": proxy}  # fmt: skip
    if verifier is not None:
        out["verifier"], out["verifier_stderr"] = mean_and_stderr(verified)
    return out
