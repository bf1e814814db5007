"""TRL-convention reward functions: math-verify on hand-picked (non-)equivalent answers, user
functions by import path, composition with weights, and the named errors."""

import math
import textwrap

import pytest
import torch

from rlhflab.config import ConfigError, RewardComponentConfig, config_from_dict
from rlhflab.data.prompts import PromptRow
from rlhflab.errors import RewardError
from rlhflab.rewards.functions import exact_match, load_reward_function, math_verify, think_format
from rlhflab.rewards.shaping import TextRewardScorer, score_components

GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
GSM8K_GOLD_COMMA = "It pays 1,200*2 = <<1200*2=2400>>2,400 dollars.\n#### 2,400"
MATH_GOLD = "$\\frac{1}{2} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$."
MATH_GOLD_TWO_BOXES = "e.g. $\\boxed{-3}$ is not positive, so $x = \\boxed{3}$."


@pytest.mark.parametrize(
    ("gold", "completion", "want"),
    [
        (GSM8K_GOLD, "<answer>72</answer>", 1.0),
        (GSM8K_GOLD, "<think>48+24</think><answer>72.0</answer>", 1.0),  # 72.0 = 72
        (GSM8K_GOLD, "<answer>71</answer>", 0.0),
        (GSM8K_GOLD_COMMA, "so the answer is 2400", 1.0),  # gold's thousands separator
        (GSM8K_GOLD_COMMA, "<answer>240</answer>", 0.0),
        (MATH_GOLD, "<answer>0.75</answer>", 1.0),  # 3/4 = 0.75
        (MATH_GOLD, "The sum is $\\boxed{\\dfrac{3}{4}}$", 1.0),
        (MATH_GOLD, "$\\boxed{\\frac{3}{5}}$", 0.0),
        (MATH_GOLD_TWO_BOXES, "$\\boxed{3}$", 1.0),  # the gold's LAST box
        (MATH_GOLD_TWO_BOXES, "$\\boxed{-3}$", 0.0),
        (GSM8K_GOLD, "no number here", 0.0),
    ],
)
def test_math_verify_equivalence(gold, completion, want):
    assert math_verify(["p"], [completion], answer=[gold]) == [want]


def test_math_verify_gold_column_and_missing_gold():
    got = math_verify(
        ["p", "p"],
        ["$\\boxed{3/4}$", "$\\boxed{1}$"],
        gold_column="solution",
        solution=[MATH_GOLD, None],
    )
    assert got == [1.0, None]
    with pytest.raises(ValueError, match="no column 'answer'"):
        math_verify(["p"], ["1"], solution=[MATH_GOLD])


def test_exact_match_and_think_format():
    assert exact_match(
        ["p"] * 3, ["<answer> 72 </answer>", "72.0", "x"], answer=[GSM8K_GOLD] * 3
    ) == [
        1.0,
        0.0,
        0.0,
    ]
    assert think_format(
        [],
        [
            "<think>a\nb</think> <answer>1</answer>",
            "<answer>1</answer>",
            "<think>a</think><answer>1</answer> trailing",
            [{"role": "assistant", "content": "<think>x</think><answer>2</answer>"}],
        ],
    ) == [1.0, 0.0, 0.0, 1.0]
    # exactly one block of each: repeated or nested blocks are not the format
    assert think_format(
        [],
        [
            "<think>a</think><answer>1</answer><answer>2</answer>",
            "<think>a</think><think>b</think><answer>1</answer>",
            "<think>a<answer>1</answer></think><answer>1</answer>",
            "<think>a</think>\n<answer>x < y, 1</answer>\n",
        ],
    ) == [0.0, 0.0, 0.0, 1.0]


def _user_file(tmp_path, body):
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_user_function_by_file_path_composed_with_weights(tmp_path):
    path = _user_file(
        tmp_path,
        """
        def count_a(prompts, completions, answer, **kwargs):
            # TRL convention: one float (or None) per completion; columns by name.
            return [None if a is None else float(c.count("a")) for c, a in zip(completions, answer)]
        """,
    )
    comps = [
        RewardComponentConfig(function=f"{path}:count_a", weight=0.5),
        RewardComponentConfig(name="exact_match", weight=2.0),
        RewardComponentConfig(name="think_format", weight=0.0),  # logged only
    ]
    assert comps[0].name == "count_a"
    rows = [PromptRow("q1", {"answer": "#### aa"}), PromptRow("q2", {"answer": None})]
    texts = ["<answer>aa</answer>", "banana"]
    total, parts = score_components(comps, {"texts": texts, "problems": rows}, where="step 1")
    # count_a row 1: "<answer>aa</answer>".count("a") = 1 + 2 + 1 = 4; row 2 has no answer: None.
    assert parts["count_a"][0].item() == 4.0 and math.isnan(parts["count_a"][1].item())
    # exact_match row 1: "aa" == "aa" after '####'; row 2 has no gold: None.
    assert parts["exact_match"][0].item() == 1.0 and math.isnan(parts["exact_match"][1].item())
    assert parts["think_format"].tolist() == [0.0, 0.0]
    # total = 0.5·4 + 2·1 = 4 ; row 2: 0.5·(None→0) + 2·0 = 0
    assert total.tolist() == [4.0, 0.0]


def test_user_function_by_module_path(tmp_path, monkeypatch):
    _user_file(
        tmp_path,
        """
        def first_char_is_digit(prompts, completions, **kw):
            return [float(c[:1].isdigit()) for c in completions]
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_function("my_rewards:first_char_is_digit")
    assert fn(None, ["1a", "a1"]) == [1.0, 0.0]


def test_trl_style_function_without_prompts_is_called_by_keyword(tmp_path):
    # TRL calls reward_func(prompts=..., completions=..., completion_ids=..., **columns), so its
    # docs' functions often take only `completions` and **kwargs; a positional call would hand
    # them the prompts as completions (here: a TypeError for two positional arguments)
    path = _user_file(
        tmp_path,
        """
        def reward_len(completions, **kwargs):
            return [-abs(5 - len(c)) for c in completions]
        """,
    )
    comps = [RewardComponentConfig(function=f"{path}:reward_len", weight=1.0)]
    rows = [PromptRow("a long prompt", {}), PromptRow("q", {})]
    total, _ = score_components(comps, {"texts": ["abcde", "ab"], "problems": rows}, where="t")
    assert total.tolist() == [0.0, -3.0]


def test_conversational_rows_get_message_completions(tmp_path):
    path = _user_file(
        tmp_path,
        """
        def role_check(prompts, completions, **kw):
            return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant")
                    for p, c in zip(prompts, completions)]
        """,
    )
    rows = [PromptRow([{"role": "user", "content": "hi"}], {})]
    comps = [RewardComponentConfig(function=f"{path}:role_check")]
    total, _ = score_components(comps, {"texts": ["x"], "problems": rows})
    assert total.tolist() == [1.0]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (
            "raise KeyError('boom')",
            r"reward function 'bad \(.*:bad\)' raised KeyError: 'boom' \(on step 7, 2 completions\)",
        ),
        (
            "return [1.0]",
            r"reward function 'bad .*' returned length 1 for 2 completions \(on step 7\)",
        ),
        ("return [1.0, float('nan')]", r"returned NaN at index 1 \(on step 7\)"),
        ("return [1.0, 'x']", r"returned str at index 1"),
        ("return 1.0", r"returned float for 2 completions"),
    ],
)
def test_reward_function_errors_are_one_named_line(tmp_path, body, match):
    path = _user_file(tmp_path, f"def bad(prompts, completions, **kw):\n    {body}\n")
    comps = [RewardComponentConfig(function=f"{path}:bad", weight=0.0)]  # even log-only
    rows = [PromptRow("a", {}), PromptRow("b", {})]
    with pytest.raises(RewardError, match=match):
        score_components(comps, {"texts": ["1", "2"], "problems": rows}, where="step 7")


def test_config_errors_for_reward_functions(tmp_path):
    path = _user_file(tmp_path, "def ok(prompts, completions, **kw):\n    return [0.0]\n")
    base = {
        "trainer": "policy_gradient",
        "model": {"name_or_path": "x"},
        "data": {"source": "dataset", "path": "p.jsonl"},
    }
    for function, match in [
        (f"{path}:nope", r"has no attribute 'nope'"),
        (f"{tmp_path}/missing.py:fn", r"file not found"),
        ("no_such_module_xyz:fn", r"cannot import no_such_module_xyz: ModuleNotFoundError"),
        ("justaname", r"expected 'package.module:function'"),
    ]:
        with pytest.raises(ConfigError, match=match):
            config_from_dict({**base, "reward": {"components": [{"function": function}]}})
    with pytest.raises(ConfigError, match=r"'correctness' scores with the task's verifier"):
        config_from_dict({**base, "reward": {"components": [{"name": "correctness"}]}})
    with pytest.raises(ConfigError, match=r"gold_colum: not an argument of math_verify"):
        config_from_dict(
            {
                **base,
                "reward": {"components": [{"name": "math_verify", "args": {"gold_colum": "x"}}]},
            }
        )


def test_text_scorer_skips_token_components():
    comps = [
        RewardComponentConfig(name="exact_match", weight=1.0),
        RewardComponentConfig(name="length", weight=1.0),
    ]
    scorer = TextRewardScorer(comps)
    assert scorer.skipped == ["length"]
    rows = [PromptRow("q", {"answer": "#### 5"})] * 2
    assert scorer.score_batch(["<answer>5</answer>", "4"], rows) == [1.0, 0.0]
    assert torch.is_tensor(score_components(comps[:1], {"texts": ["5"], "problems": rows[:1]})[0])
