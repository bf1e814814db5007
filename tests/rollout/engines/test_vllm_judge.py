"""An LLM judge decoded by its own vLLM engine (`reward.components[judge].args.engine: vllm`):
its greedy answers, hence scores, are the hf engine's, and the cache answers a repeat."""

import pytest
from factories import hand_wired_judge

from rlhflab.config import VLLMConfig
from rlhflab.rewards.judge import JudgeScorer

pytestmark = pytest.mark.vllm


def test_a_judge_on_vllm_scores_as_on_hf(vllm_engine, tiny_tokenizer, tmp_path):
    # vllm_engine: skips (or fails, with RLHFLAB_REQUIRE_VLLM) where vLLM is not installed
    hand_wired_judge(tiny_tokenizer, tmp_path / "judge", "Score: 4", size="small")
    prompts, completions = ["What is 2 + 3?", "1 + 1", "7 - 2"], ["5", "it is 2", ""]
    on_hf = JudgeScorer.from_pretrained(str(tmp_path / "judge"), max_new_tokens=8)
    on_vllm = JudgeScorer.from_pretrained(str(tmp_path / "judge"), max_new_tokens=8,
                                          engine="vllm", vllm=VLLMConfig())  # fmt: skip
    assert on_vllm.judge_id != on_hf.judge_id  # the engine is part of the cache key
    want = on_hf.score(prompts, completions)
    assert want == [4, 4, 4]
    assert on_vllm.score(prompts, completions) == want
    assert on_vllm.last_outputs == on_hf.last_outputs
    assert on_vllm.score(prompts, completions) == want and on_vllm.n_generated == 3  # cached


def test_the_judge_component_takes_its_engine(vllm_engine, tiny_tokenizer, tmp_path):
    from types import SimpleNamespace

    import torch

    from rlhflab.rewards import judge as jmod

    hand_wired_judge(tiny_tokenizer, tmp_path / "judge", "Score: 6", size="small")
    rollout = SimpleNamespace(completion_ids=torch.zeros(2, 1, dtype=torch.long))
    values, extras = jmod.judge_component(
        texts=["5", "x"], problems=["2 + 3?", "1 + 1?"], rollout=rollout,
        path=str(tmp_path / "judge"), judge_max_new_tokens=8, engine="vllm", vllm=VLLMConfig(),
    )  # fmt: skip
    assert values.tolist() == [6.0, 6.0] and extras["parse_failed"].tolist() == [0.0, 0.0]
    judge = next(j for k, j in jmod._JUDGES.items() if k[0] == str(tmp_path / "judge"))
    assert judge.judge_id.endswith("|vllm") and type(judge.engine).__name__ == "VLLMEngine"
