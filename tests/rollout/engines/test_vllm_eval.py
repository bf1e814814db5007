"""Held-out evaluation through the vllm engine (`rlhflab eval --engine vllm`, and a policy-gradient
run's evaluations on `rollout.engine: vllm`): greedy completions, hence accuracy, are the hf
engine's."""

import pytest

from rlhflab.data.tasks import make_splits
from rlhflab.eval.accuracy import evaluate
from rlhflab.rewards import Verifier

pytestmark = pytest.mark.vllm


def test_evaluation_on_vllm_equals_evaluation_on_hf(vllm_engine, contract_model, tiny_tokenizer):
    splits = make_splits("chain_sum", config={"min_terms": 2, "max_terms": 2, "max_digits": 1},
                         n_train=10, n_heldout=12, seed=0)  # fmt: skip
    verifier = Verifier(answer_format="plain", reward="binary")
    kw = dict(max_new_tokens=12, batch_size=5, return_completions=True)
    on_hf = evaluate(contract_model, tiny_tokenizer, splits.heldout, verifier, **kw)
    on_vllm = evaluate(contract_model, tiny_tokenizer, splits.heldout, verifier,
                       engine=vllm_engine, **kw)  # fmt: skip
    assert on_vllm["n"] == on_hf["n"] == 12
    assert on_vllm["completions"] == on_hf["completions"]
    assert any(on_hf["completions"])  # the comparison is over real text, not 12 empty strings
    assert on_vllm["accuracy"] == on_hf["accuracy"]
