"""The LLM judge (`rlhflab.rewards.judge`): the parse rule on adversarial outputs, the cache, the
failure policies and the rubric's weighted mean on a scripted judge, the config checks, and a
GRPO run whose reward is a tiny hand-wired judge model that always answers "Score: 7"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factories import hand_wired_judge

from rlhflab.errors import ConfigError, RewardError
from rlhflab.rewards import judge as jmod
from rlhflab.rewards.judge import JudgeScorer, parse_choice, parse_score


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Score: 7", 7),
        ("score:7", 7),  # marker case-insensitive, no space
        ("  Score:\t**10**  \n", 10),  # whitespace and markdown around the number
        ("**Score:** `7`", 7),
        ("### Score: 3/10.", 3),  # "out of high" suffix
        ("The sum is 4.\nScore: 6", 6),  # digits before the marker do not count
        ("Score: 3\nScore: 3", 3),  # repeated, consistent
        ("7", None),  # no marker
        ("", None),
        ("Score:", None),
        ("Score: I cannot rate this response.", None),  # refusal
        ("I'm sorry, I can't help with that.", None),
        ("Score: 7 or 8", None),  # two numbers on the line
        ("Score: 7.5", None),  # not an integer
        ("Score: 3\nScore: 9", None),  # conflicting occurrences
        ("Score: 11", None),  # out of range, above
        ("Score: 0", None),  # out of range, below
        ("Score: -3", None),
        ("Score: 7/5", None),  # out of another scale
    ],
)
def test_parse_score_rule(text, want):
    assert parse_score(text, low=1, high=10) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("Choice: A", "A"),
        ("**Choice:** b.", "B"),
        ("choice: A\nbecause it is shorter", "A"),
        ("Choice: A or B", None),
        ("Choice: Response A", None),
        ("Choice: A\nChoice: B", None),
        ("A", None),
        ("I refuse to choose.", None),
    ],
)
def test_parse_choice_rule(text, want):
    assert parse_choice(text) == want


class _Scripted:
    """Stands in for the hf engine: answers every judge prompt with `answer(prompt_text)`,
    counting the calls and the prompts it ran on."""

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer = tokenizer, answer
        self.calls, self.rows = 0, 0
        self.stop_token_ids = (tokenizer.eos_token_id,)

    def generate(self, prompts, params, *, generator=None):
        from rlhflab.rollout.sampler import pack

        self.calls += 1
        self.rows += len(prompts)
        assert params.greedy and params.n == 1
        outs = [self.answer(self.tokenizer.decode(p)) for p in prompts]
        ids = [self.tokenizer(o, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
               for o in outs]  # fmt: skip
        return pack(prompts, ids, self.tokenizer.pad_token_id)


def _scripted_judge(tiny_model, tiny_tokenizer, answer) -> tuple[JudgeScorer, _Scripted]:
    tiny_model.config.max_position_embeddings = 4096  # never run: the context check passes
    judge = JudgeScorer(tiny_model, tiny_tokenizer, judge_id="scripted", batch_size=2)
    judge.engine = _Scripted(tiny_tokenizer, answer)
    return judge, judge.engine


def test_a_second_identical_call_does_not_run_the_model(tiny_model, tiny_tokenizer):
    judge, engine = _scripted_judge(tiny_model, tiny_tokenizer, lambda p: "Score: 5")
    prompts, texts = ["1 + 2 = ?", "3 + 4 = ?", "1 + 2 = ?"], ["3", "7", "3"]
    assert judge.score(prompts, texts) == [5, 5, 5]
    assert (engine.rows, judge.n_generated) == (2, 2)  # the repeated pair ran once
    calls = engine.calls
    assert judge.score(prompts, texts) == [5, 5, 5]
    assert engine.calls == calls and judge.n_generated == 2 and judge.n_cached == 1 + 3
    judge.score(prompts, texts, template="Rate {completion} for {prompt}. Score:")  # new template
    assert judge.n_generated == 4


def test_the_cache_runs_the_real_engine_once(tiny_model, tiny_tokenizer):
    judge = JudgeScorer(tiny_model, tiny_tokenizer, judge_id="tiny", max_new_tokens=3)
    real, calls = judge.engine.generate, []

    def counted(prompts, params, **kw):
        calls.append(len(prompts))
        return real(prompts, params, **kw)

    judge.engine.generate = counted
    first = judge.generate("Q: {prompt} A: {completion}", [{"prompt": "1+1", "completion": "2"}])
    again = judge.generate("Q: {prompt} A: {completion}", [{"prompt": "1+1", "completion": "2"}])
    assert calls == [1] and first == again


def _component(monkeypatch, tiny_model, tiny_tokenizer, answer, **args):
    judge, _ = _scripted_judge(tiny_model, tiny_tokenizer, answer)
    monkeypatch.setattr(jmod, "_judge", lambda *a, **k: judge)

    class Row:
        def __init__(self, q):
            self.question = q

    rollout = type("R", (), {"completion_ids": torch.zeros(3, 1)})()
    return jmod.judge_component(texts=["a", "b", "c"], problems=[Row("x"), Row("y"), Row("z")],
                                rollout=rollout, path="judge-dir", **args), judge  # fmt: skip


def _by_completion(scores: dict):
    """An answer function: the score of the completion named in the judge prompt."""

    def answer(prompt):
        for k, v in scores.items():
            if f"Response: {k}" in prompt:
                return v
        raise AssertionError(prompt)

    return answer


def test_parse_failure_policies(monkeypatch, tiny_model, tiny_tokenizer):
    answer = _by_completion({"a": "Score: 8", "b": "Sorry, I can't.", "c": "**Score:** 2"})
    with pytest.raises(RewardError, match=r"1 of 3 outputs did not parse.*Sorry"):
        _component(monkeypatch, tiny_model, tiny_tokenizer, answer)
    (values, extras), judge = _component(monkeypatch, tiny_model, tiny_tokenizer, answer,
                                         on_parse_failure="min")  # fmt: skip
    assert values.tolist() == [8.0, 1.0, 2.0]  # the failure gets low = 1
    assert extras["parse_failed"].tolist() == [0.0, 1.0, 0.0]
    assert (judge.n_parsed, judge.n_failed) == (2, 1)
    (values, _), _ = _component(monkeypatch, tiny_model, tiny_tokenizer, answer,
                                on_parse_failure="nan")  # fmt: skip
    assert values[0] == 8.0 and values[1].isnan() and values[2] == 2.0


def test_rubric_is_the_weighted_mean_and_logs_each_criterion(monkeypatch, tiny_model,
                                                             tiny_tokenizer):  # fmt: skip
    from rlhflab.config.sections import RewardComponentConfig
    from rlhflab.rewards.shaping import score_components

    def answer(prompt):  # correct: 9 for "a", 3 otherwise; clear: 6 always
        if "criterion, correct" in prompt:
            return "Score: 9" if "Response: a" in prompt else "Score: 3"
        return "Score: 6"

    judge, _ = _scripted_judge(tiny_model, tiny_tokenizer, answer)
    monkeypatch.setattr(jmod, "_judge", lambda *a, **k: judge)
    comp = RewardComponentConfig(
        name="judge", weight=0.5,
        args={"path": "judge-dir", "mode": "rubric",
              "criteria": [{"name": "correct", "weight": 2}, {"name": "clear"}]},
    )  # fmt: skip
    rows = [type("Row", (), {"question": q})() for q in ("x", "y")]
    rollout = type("R", (), {"completion_ids": torch.zeros(2, 1)})()
    total, parts = score_components([comp], {"texts": ["a", "b"], "problems": rows,
                                             "rollout": rollout})  # fmt: skip
    # (2·9 + 1·6) / 3 = 8 and (2·3 + 1·6) / 3 = 4; weight 0.5 in the total
    assert parts["judge"].tolist() == [8.0, 4.0]
    assert total.tolist() == [4.0, 2.0]
    assert parts["judge/correct"].tolist() == [9.0, 3.0]
    assert parts["judge/clear"].tolist() == [6.0, 6.0]
    assert parts["judge/parse_failed"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    ("args", "weight", "match"),
    [
        ({}, 1.0, r"args\.path: Field required"),
        ({"path": "j", "mode": "pairwise"}, 1.0, r"args\.mode"),
        ({"path": "j", "low": 5, "high": 5}, 1.0, r"args: low: must be below high"),
        ({"path": "j", "mode": "rubric"}, 1.0, r"criteria: a rubric needs"),
        ({"path": "j", "criteria": [{"name": "c"}]}, 1.0, r"only a rubric takes criteria"),
        ({"path": "j", "template": "{prompt} {answer}"}, 1.0, r"unknown field\(s\) \['answer'\]"),
        ({"path": "j", "template": "Rate {prompt}. Score:"}, 1.0, r"must show \{completion\}"),
        ({"path": "j", "on_parse_failure": "zero"}, 1.0, r"args\.on_parse_failure"),
        (
            {"path": "j", "mode": "rubric", "criteria": [{"name": "a"}, {"name": "a"}]},
            1.0,
            r"criteria: names repeat",
        ),
        (
            {"path": "j", "mode": "rubric", "criteria": [{"name": "parse_failed"}]},
            1.0,
            r"not a metric name",
        ),
        (
            {"path": "j", "mode": "rubric", "criteria": [{"name": "c", "weight": 0}]},
            1.0,
            r"criteria\.0\.weight",
        ),
        ({"path": "j", "on_parse_failure": "nan"}, 1.0, r"'nan' needs weight 0"),
        ({"path": "j", "temperature": 0.5}, 1.0, r"args\.temperature: not an argument"),
        ({"path": "j", "engine": "sglang"}, 1.0, r"args\.engine"),
        ({"path": "j", "engine": "vllm", "dtype": "float64"}, 1.0, r"float64 is not a vLLM dtype"),
    ],
)
def test_bad_judge_args_are_one_line_config_errors(args, weight, match):
    from factories import tiny_pg

    from rlhflab.config import config_from_dict

    raw = tiny_pg("/tmp/unused", "/tmp/unused-model")
    raw["reward"] = {"components": [{"name": "judge", "weight": weight, "args": args}]}
    with pytest.raises(ConfigError, match=match) as err:
        config_from_dict(raw)
    assert "\n" not in str(err.value).strip()


def test_nan_policy_with_weight_zero_loads():
    from rlhflab.config.sections import RewardComponentConfig

    comp = RewardComponentConfig(name="judge", weight=0.0,
                                 args={"path": "j", "on_parse_failure": "nan"})  # fmt: skip
    assert comp.args == {"path": "j", "on_parse_failure": "nan"}


def test_the_hand_wired_judge_answers_score_7_from_a_run_dir(tmp_path, tiny_tokenizer):
    hand_wired_judge(tiny_tokenizer, tmp_path / "run" / "model")
    judge = JudgeScorer.from_pretrained(str(tmp_path / "run"), max_new_tokens=8)  # its model/
    assert judge.score(["What is 2 + 3?", "1 + 1"], ["5", "it is 2"]) == [7, 7]
    assert judge.n_generated == 2 and judge.n_failed == 0


def test_a_missing_judge_path_is_a_config_error_before_the_run(tmp_path, tiny_model,
                                                              tiny_tokenizer):  # fmt: skip
    from factories import tiny_pg

    from rlhflab.config import config_from_dict
    from rlhflab.trainers import run_config

    tiny_model.save_pretrained(tmp_path / "policy")
    tiny_tokenizer.save_pretrained(tmp_path / "policy")
    raw = tiny_pg(tmp_path / "runs", tmp_path / "policy")
    raw["reward"] = {"components": [{"name": "judge", "args": {"path": str(tmp_path / "nope")}}]}
    with pytest.raises(
        ConfigError, match=r"reward.components\[judge\].args.path: cannot load a judge"
    ):
        run_config(config_from_dict(raw))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_grpo_with_a_judge_reward_logs_its_scores(tmp_path, tiny_tokenizer, tiny_model):
    from factories import tiny_pg

    from rlhflab.config import config_from_dict
    from rlhflab.trainers import run_config

    hand_wired_judge(tiny_tokenizer, tmp_path / "judge")
    tiny_model.save_pretrained(tmp_path / "policy")
    tiny_tokenizer.save_pretrained(tmp_path / "policy")
    judge = str(tmp_path / "judge")
    raw = tiny_pg(tmp_path / "runs", tmp_path / "policy",
                  train={"steps": 2, "micro_batch_size": 16})  # fmt: skip
    raw["reward"] = {"components": [
        {"name": "judge", "weight": 1.0, "args": {"path": judge, "judge_max_new_tokens": 8}},
        {"name": "judge", "label": "rubric", "weight": 0.0,
         "args": {"path": judge, "mode": "rubric", "judge_max_new_tokens": 8, "on_parse_failure": "nan",
                  "criteria": [{"name": "correct", "weight": 2.0}, {"name": "clear"}]}},
        {"name": "correctness", "weight": 0.0},
    ]}  # fmt: skip
    raw["eval"] = {"n": 4, "every": 2, "frontier": True, "frontier_n": 4}  # the judge: a proxy
    res = run_config(config_from_dict(raw))
    rows = [json.loads(line) for line in (Path(res["run_dir"]) / "metrics.jsonl").open()]
    points = [r for r in rows if "frontier/proxy" in r]
    assert points and all(r["frontier/proxy"] == 7.0 for r in points)
    steps = [r for r in rows if "rollout/reward/judge_mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/reward/judge_mean"] == 7.0 == r["rollout/reward_mean"]
        assert r["rollout/reward/judge/parse_failed_mean"] == 0.0
        assert r["rollout/reward/rubric/correct_mean"] == 7.0
        assert r["rollout/reward/rubric/clear_mean"] == 7.0


def test_pairwise_choices_and_their_position_bias(tiny_model, tiny_tokenizer):
    from rlhflab.eval.agreement import position_bias_rate

    def longer(prompt):  # a position-consistent judge: the longer response wins
        a = prompt.split("Response A: ")[1].split("\n\nResponse B")[0]
        b = prompt.split("Response B: ")[1].split("\n\n")[0]
        return "Choice: A" if len(a) > len(b) else "Choice: B"

    ys1, ys2, qs = ["long one", "x"], ["y", "longer two"], ["q1", "q2"]
    judge, _ = _scripted_judge(tiny_model, tiny_tokenizer, longer)
    ab, ba = judge.choose(qs, ys1, ys2), judge.choose(qs, ys2, ys1)
    assert (ab, ba) == (["A", "B"], ["B", "A"])
    assert position_bias_rate(ab, ba)["rate"] == 0.0
    first, _ = _scripted_judge(tiny_model, tiny_tokenizer, lambda p: "Choice: A")  # always A
    got = position_bias_rate(first.choose(qs, ys1, ys2), first.choose(qs, ys2, ys1))
    assert got["rate"] == 1.0 == got["first"]


def test_best_of_n_picks_by_the_judge_and_ranks_failures_last(tiny_model, tiny_tokenizer):
    from types import SimpleNamespace

    from rlhflab.eval.best_of_n import score_pool, selection_curve

    scores = {"right": "Score: 9", "wrong": "Score: 2", "???": "no idea"}
    judge, _ = _scripted_judge(tiny_model, tiny_tokenizer, _by_completion(scores))
    rows = [SimpleNamespace(question="1 + 1"), SimpleNamespace(question="2 + 2")]
    pool = SimpleNamespace(problems=rows, texts=[["wrong", "right"], ["???", "wrong"]])
    got = score_pool(judge, pool)
    assert got == [[2.0, 9.0], [float("-inf"), 2.0]]
    curve = selection_curve(got, [[0.0, 1.0], [0.0, 1.0]], [2], n_resamples=4)
    assert curve[2]["accuracy"] == 1.0  # the judge's pick is the right one in both problems


def test_best_of_n_command_with_a_judge(tmp_path, tiny_model, tiny_tokenizer):
    from rlhflab.eval.best_of_n import run_best_of_n_command

    hand_wired_judge(tiny_tokenizer, tmp_path / "judge")
    tiny_model.save_pretrained(tmp_path / "policy")
    tiny_tokenizer.save_pretrained(tmp_path / "policy")
    common = dict(task="chain_sum", problems=3, exclude_train=50, ns=[1, 2], max_new_tokens=4)
    summary = run_best_of_n_command(str(tmp_path / "policy"), [], judges=[str(tmp_path / "judge")],
                                    **common)  # fmt: skip
    assert set(summary["curves"]) == {"judge"} and set(summary["curves"]["judge"]) == {1, 2}
    with pytest.raises(ConfigError, match="at least one --rm PATH:KIND or --judge PATH"):
        run_best_of_n_command(str(tmp_path / "policy"), [], **common)


def test_a_judge_is_the_frontiers_gold(tmp_path, tiny_tokenizer):
    """`eval.frontier_gold`: the frontier's gold is the judge's raw score of the same samples
    (the hand-wired judge says 7 to everything), the proxy the run's reward (correctness here),
    the verifier's score of the samples is logged beside it, and the frontier is on without
    `eval.frontier`. The policy, hand-wired too, answers "-3": right on the first held-out
    problem (2 - 5), the frontier's only one, so proxy and verifier are 1 (after the final
    RMSNorm its logit margin is 10·√hidden, so it samples "-3" at temperature 1 too)."""
    from factories import tiny_pg, tiny_task

    from rlhflab.config import config_from_dict
    from rlhflab.data.tasks import make_splits
    from rlhflab.trainers import run_config

    task = tiny_task()
    first = make_splits(task["name"], config=task["config"], n_train=task["n_train"],
                        n_heldout=task["n_heldout"], seed=task["seed"]).heldout[0]  # fmt: skip
    assert first.answer == "-3"
    hand_wired_judge(tiny_tokenizer, tmp_path / "judge")
    hand_wired_judge(tiny_tokenizer, tmp_path / "policy", "-3")
    raw = tiny_pg(tmp_path / "runs", tmp_path / "policy",
                  train={"steps": 2, "micro_batch_size": 16})  # fmt: skip
    raw["eval"] = {"n": 4, "every": 2, "frontier_n": 1,
                   "frontier_gold": {"name": "judge", "weight": 0.0,
                                     "args": {"path": str(tmp_path / "judge"),
                                              "judge_max_new_tokens": 8}}}  # fmt: skip
    res = run_config(config_from_dict(raw))
    rows = [json.loads(line) for line in (Path(res["run_dir"]) / "metrics.jsonl").open()]
    points = [r for r in rows if "frontier/gold" in r]
    assert [r["step"] for r in points] == [0, 2]
    assert all(r["frontier/gold"] == 7.0 for r in points)  # the judge, not the verifier
    assert all(0.0 <= r["frontier/proxy"] <= 1.0 for r in points)  # correctness
    # the verifier on the same samples, beside the judge: the proxy here is that same verifier
    assert all(r["frontier/verifier"] == r["frontier/proxy"] == 1.0 for r in points)


def test_a_vllm_judge_without_vllm_settings_is_one_config_error(tiny_model, tiny_tokenizer):
    with pytest.raises(ConfigError, match="judge engine 'vllm': no vLLM settings here"):
        JudgeScorer(tiny_model, tiny_tokenizer, judge_id="j", engine="vllm")
    with pytest.raises(ConfigError, match="judge engine: 'hf' or 'vllm', got 'sglang'"):
        JudgeScorer(tiny_model, tiny_tokenizer, judge_id="j", engine="sglang")


@pytest.mark.parametrize(
    ("text", "cut", "high", "want"),
    [
        ("Score: 1", True, 10, True),  # 10 is in [1, 10]: it may have been "Score: 10"
        ("**Score:** 1", True, 10, True),
        ("Score: 1", False, 10, False),  # ended with EOS: complete
        ("Score: 7", True, 10, False),  # 70-79 > 10: no longer score is possible
        ("Score: 10", True, 10, False),  # 100-109 > 10
        ("Score: 7", True, 100, True),  # 70-79 are in [1, 100]
        ("Score: 1\nThe response", True, 10, False),  # the answer went on after its number
        ("Score: 1 ", True, 10, False),
        ("The answer is 1", True, 10, False),  # no marker
    ],
)
def test_cut_score_rule(text, cut, high, want):
    assert jmod.cut_score(text, cut, low=1, high=high) is want


def test_a_score_cut_by_the_budget_is_a_parse_failure(tmp_path, tiny_tokenizer):
    """A judge that answers "Score: 10": with a budget one token short the decoded answer is
    "Score: 1" with no EOS, which parse_score alone reads as a 1; it is a failure instead. With
    the whole answer (with or without its EOS) it is a 10."""
    hand_wired_judge(tiny_tokenizer, tmp_path / "judge", answer="Score: 10")
    n = len(tiny_tokenizer("Score: 10", add_special_tokens=False)["input_ids"])
    got = {}
    for budget in (n - 1, n, n + 1):
        judge = JudgeScorer.from_pretrained(str(tmp_path / "judge"), max_new_tokens=budget)
        scores = judge.score(["What is 2 + 3?"], ["5"])
        got[budget] = (judge.last_outputs["score"][0], judge.last_cut[0], scores[0])
    assert parse_score(got[n - 1][0], low=1, high=10) == 1  # the misreading the rule prevents
    assert got == {n - 1: ("Score: 1", True, None), n: ("Score: 10", True, 10),
                   n + 1: ("Score: 10", False, 10)}  # fmt: skip


def test_parse_score_with_cut_applies_the_cut_rule():
    assert parse_score("Score: 1", low=1, high=10, cut=True) is None  # may be a cut "10"
    assert parse_score("Score: 1", low=1, high=10) == 1
    assert parse_score("Score: 7", low=1, high=10, cut=True) == 7  # no longer score fits
