"""Named benchmark protocols (issue #44): file formats, answer extraction, metrics against hand
arithmetic from known completions (no model), one-line errors, and `rlhflab eval --benchmark`
end to end on a tiny model."""

import json
import math
from pathlib import Path

import pytest

from rlhflab.cli import BENCHMARK_NAMES, main
from rlhflab.errors import DataError
from rlhflab.eval.benchmarks import (
    BENCHMARKS,
    ENV_DIR,
    benchmark_lines,
    gold_text,
    load_benchmark,
    math_scores,
    protocol_settings,
    score_benchmark,
)
from rlhflab.eval.ifeval import CHECKERS, UNSUPPORTED, follows

FIX = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "benchmarks"
FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "math500": "math500_test.jsonl",
    "aime24": "aime24.jsonl",
    "aime25": "aime25.jsonl",
    "ifeval": "ifeval_input_data.jsonl",
}


def test_cli_names_are_the_registry():
    assert list(BENCHMARKS) == BENCHMARK_NAMES
    assert len(CHECKERS) == 19 and not set(CHECKERS) & set(UNSUPPORTED)


@pytest.mark.parametrize("name", list(FILES))
def test_each_fixture_loads_in_its_published_schema(name):
    items = load_benchmark(name, FIX / FILES[name])
    assert len(items) == {"aime25": 2}.get(name, 3)
    assert [it.index for it in items] == list(range(len(items)))
    if name == "ifeval":
        assert items[0].gold is None and items[0].row["key"] == 1000
    else:
        assert items[0].gold.startswith("\\boxed{")


def test_gold_answers():
    gsm, math500 = BENCHMARKS["gsm8k"], BENCHMARKS["math500"]
    # GSM8K: the number after the last "####", thousands separator removed
    assert gold_text(gsm, "617 + 617 = 1234\n#### 1,234", "w") == "\\boxed{1234}"
    assert gold_text(gsm, "#### -5", "w") == "\\boxed{-5}"
    assert gold_text(math500, "\\frac{3}{4}", "w") == "\\boxed{\\frac{3}{4}}"
    assert gold_text(BENCHMARKS["aime24"], 204, "w") == "\\boxed{204}"  # an int answer
    with pytest.raises(DataError, match="w: field 'answer' has no '#### <number>'"):
        gold_text(gsm, "the answer is 4", "w")


@pytest.mark.parametrize(
    ("gold", "completion", "score"),
    [
        ("\\boxed{1234}", "So the total is \\boxed{1,234}.", 1.0),  # comma in the answer
        ("\\boxed{1234}", "#### 1,234", 1.0),  # GSM8K-style final line
        ("\\boxed{18}", "She makes 18 dollars every day.", 1.0),  # a unit after the number
        ("\\boxed{-5}", "The temperature is now \\boxed{-5} degrees.", 1.0),  # negative
        ("\\boxed{-5}", "The temperature is now \\boxed{5} degrees.", 0.0),
        ("\\boxed{\\frac{3}{4}}", "6/8 = \\boxed{0.75}", 1.0),  # fraction vs decimal
        ("\\boxed{\\frac{3}{4}}", "\\boxed{\\frac{3}{5}}", 0.0),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\boxed{\\frac{\\sqrt{2}}{2}}", 1.0),  # nested braces
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\boxed{(3, \\frac{\\pi}{2})}", 1.0),
        ("\\boxed{025}", "so $xy = \\boxed{25}$", 1.0),  # AIME's zero-padded answer
        ("\\boxed{204}", "first \\boxed{17}, no wait: \\boxed{204}", 1.0),  # the last box
        ("\\boxed{204}", "I do not know.", 0.0),
    ],
)
def test_math_extraction_on_tricky_answers(gold, completion, score):
    scores, votes = math_scores(gold, [completion])
    assert scores == [score]
    assert (votes == [None]) == (completion == "I do not know.")


def test_equivalent_answers_vote_together():
    # 0.75 and 3/4 are one answer for maj@k; nothing extracted: no vote
    scores, votes = math_scores("\\boxed{\\frac{3}{4}}", ["\\boxed{0.75}", "\\boxed{1}",
                                                          "\\boxed{\\frac{3}{4}}", "no idea"])  # fmt: skip
    assert scores == [1.0, 0.0, 1.0, 0.0]
    assert votes == [0, 1, 0, None]


def test_avg_pass_maj_at_k_by_hand():
    proto = BENCHMARKS["aime24"]
    items = load_benchmark("aime24", FIX / "aime24.jsonl")[:2]  # gold 204 and 025
    completions = [
        ["\\boxed{204}", "\\boxed{17}", "\\boxed{204}", "\\boxed{17}"],  # c = 2 of 4
        ["\\boxed{25}", "\\boxed{7}", "\\boxed{7}", "no answer"],  # c = 1 of 4
    ]
    r = score_benchmark(proto, items, completions, ks=[1, 2, 4])
    assert r["n"] == 2 and r["n_samples"] == 4
    # avg@4: (2/4 + 1/4) / 2 = 0.375; stderr: sample std of {0.5, 0.25} = 0.25/sqrt(2), / sqrt(2)
    assert r["avg@4"] == r["accuracy"] == pytest.approx(0.375)
    assert r["avg@4_stderr"] == pytest.approx(0.125)
    # pass@1 = c/n; pass@2: 1 - C(2,2)/C(4,2) = 5/6 and 1 - C(3,2)/C(4,2) = 1/2 -> 2/3
    assert r["pass@1"] == pytest.approx(0.375)
    assert r["pass@2"] == pytest.approx((5 / 6 + 0.5) / 2)
    assert r["pass@4"] == 1.0 and r["pass@4_stderr"] == 0.0
    # maj@1: each sample alone = avg; maj@2, blocks (204,17),(204,17): ties -> 0.5 each; blocks
    # (25,7): tie 0.5, (7,None): 7 wins -> 0: 0.25; mean (0.5 + 0.25)/2
    assert r["maj@1"] == pytest.approx(0.375)
    assert r["maj@2"] == pytest.approx(0.375)
    # maj@4: 204 vs 17 two each -> 0.5; 7 (2 votes) beats 25 (1) -> 0
    assert r["maj@4"] == pytest.approx(0.25)
    assert r["per_problem"]["maj@4"] == [0.5, 0.0]


def test_greedy_protocol_accuracy_by_hand():
    items = load_benchmark("gsm8k", FIX / "gsm8k_test.jsonl")  # gold 18, 1234, -5
    done = [["\\boxed{18}"], ["The shop sold 1,234 pens."], ["It is 5 degrees."]]
    r = score_benchmark(BENCHMARKS["gsm8k"], items, done)
    assert r["accuracy"] == pytest.approx(2 / 3)
    # binary scores {1, 1, 0}: sqrt(p(1-p)/(n-1)) = sqrt((2/3)(1/3)/2) = 1/3
    assert r["accuracy_stderr"] == pytest.approx(1 / 3)
    assert not any(k.startswith(("pass@", "maj@")) for k in r)  # greedy: avg@1 only
    with pytest.raises(ValueError, match="same n"):
        score_benchmark(BENCHMARKS["gsm8k"], items, [["a"], ["b", "c"], ["d"]])


def test_ifeval_checkers_and_metrics_by_hand():
    # the checkers on their own
    assert CHECKERS["punctuation:no_comma"]("no commas here") is True
    assert CHECKERS["punctuation:no_comma"]("one, two") is False
    assert CHECKERS["detectable_format:title"]("<<Sea>>\nwaves") is True
    assert CHECKERS["detectable_format:title"]("<<  >> empty") is False
    assert CHECKERS["detectable_format:number_highlighted_sections"](
        "*one* and **two** and *three*", num_highlights=3
    )
    assert CHECKERS["detectable_format:number_bullet_lists"]("* a\n* b\n- c", num_bullets=3)
    assert CHECKERS["keywords:frequency"]("Cat cat CAT", keyword="cat", frequency=3,
                                          relation="at least")  # fmt: skip
    assert not CHECKERS["keywords:frequency"]("Cat cat CAT", keyword="cat", frequency=3,
                                              relation="less than")  # fmt: skip
    assert CHECKERS["length_constraints:number_paragraphs"]("a\n***\nb", num_paragraphs=2)
    assert not CHECKERS["length_constraints:number_paragraphs"]("a\n***\n***\nb", num_paragraphs=2)
    assert CHECKERS["combination:two_responses"]("yes ****** no")
    assert CHECKERS["detectable_format:json_format"]('```json\n{"a": 1}\n```')
    assert CHECKERS["detectable_content:postscript"]("hi\nP.S. bye", postscript_marker="P.S.")
    assert follows("   ", ["punctuation:no_comma"], [{}]) == [False]  # empty: nothing followed

    items = load_benchmark("ifeval", FIX / "ifeval_input_data.jsonl")
    done = [
        ["anything"],  # row 1000: length_constraints:number_words is not supported -> left out
        ["<<The Sea>>\nWaves roll in and out"],  # both followed
        # letter a: "can", "anything" -> 2 >= 2 followed; ends with "*Done*": strict fails the
        # end phrase, loose (last line removed) follows it
        ["Is there anything else I can help with?\n*Done*"],
    ]
    r = score_benchmark(BENCHMARKS["ifeval"], items, done)
    assert r["n"] == 2 and r["n_skipped"] == 1 and r["comparable"] is False
    assert r["unsupported_ids"] == ["length_constraints:number_words"]
    assert r["prompt_level_strict_acc"] == pytest.approx(0.5)  # (1 + 0) / 2
    assert r["inst_level_strict_acc"] == pytest.approx(0.75)  # 3 of 4 instructions
    assert r["prompt_level_loose_acc"] == 1.0 and r["inst_level_loose_acc"] == 1.0
    assert r["n_instructions"] == 4


def test_departures_are_named_and_impossible_settings_refused():
    s, dep = protocol_settings(BENCHMARKS["aime24"])
    assert dep == [] and s["n_samples"] == 64 and s["temperature"] == 0.6 and s["top_p"] == 0.95
    assert s["max_new_tokens"] == 32768 and s["ks"] == [1, 64]
    s, dep = protocol_settings(BENCHMARKS["aime24"], n_samples=4, ks=[1, 4], limit=2)
    assert dep == ["n_samples 4 (protocol: 64)", "k 1,4 (protocol: 1,64)",
                   "first 2 rows only (protocol: every row)"]  # fmt: skip
    with pytest.raises(DataError, match="k 64 exceeds the 4 samples"):
        protocol_settings(BENCHMARKS["aime24"], n_samples=4)
    with pytest.raises(DataError, match="the protocol is greedy"):
        protocol_settings(BENCHMARKS["gsm8k"], n_samples=4)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    return err[0]


def test_a_missing_file_is_one_line_naming_where_and_the_schema(tmp_path, capsys, monkeypatch):
    nope = tmp_path / "nope.jsonl"
    err = _one_line_error(capsys, ["eval", "m", "--benchmark", "math500", "--benchmark-file",
                                   str(nope)])  # fmt: skip
    assert err.startswith(f"error: --benchmark math500: no file {nope}")
    assert "fields problem, solution, answer, subject, level, unique_id" in err
    assert "HuggingFaceH4/MATH-500" in err
    # the default location: $RLHFLAB_BENCHMARKS_DIR/<file name>
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    err = _one_line_error(capsys, ["eval", "m", "--benchmark", "gsm8k"])
    assert f"no file {tmp_path / 'gsm8k_test.jsonl'}" in err and f"set {ENV_DIR}" in err
    (tmp_path / "gsm8k_test.jsonl").write_text((FIX / "gsm8k_test.jsonl").read_text())
    assert len(load_benchmark("gsm8k")) == 3


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("gsm8k", '{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n',
         "line 2: missing field 'answer' (has question)"),
        ("gsm8k", '{"question": "q", "answer": "4"}\n', "line 1: field 'answer' has no '####"),
        ("gsm8k", '{"question": "q", "answer": "#### 1"}\n{"question": \n',
         "line 2: not valid JSON"),
        ("aime24", '{"problem": "", "answer": "1"}\n', "line 1: field 'problem' must be a non-empty"),
        ("aime25", '{"question": "q", "answer": null}\n', "line 1: field 'answer' must be"),
        ("math500", '["problem", "answer"]\n', "line 1: a row must be a JSON object"),
        ("ifeval", '{"key": 1, "prompt": "p", "instruction_id_list": ["a", "b"], "kwargs": [{}]}\n',
         "line 1: field 'kwargs' must be a list of 2 objects"),
        ("ifeval", "\n", "no rows"),
    ],
)  # fmt: skip
def test_a_malformed_row_is_one_line_naming_the_row_and_field(tmp_path, capsys, name, text,
                                                              message):  # fmt: skip
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    err = _one_line_error(capsys, ["eval", "m", "--benchmark", name, "--benchmark-file",
                                   str(path)])  # fmt: skip
    assert err.startswith(f"error: {path}") and message in err


@pytest.mark.parametrize(
    "extra", [["--temperature", "1.0"], ["--system", "hi"], ["--task", "chain_sum"], ["--passk"]]
)
def test_a_flag_the_protocol_fixes_is_refused_not_ignored(capsys, extra):
    argv = ["eval", "m", "--benchmark", "aime24", "--benchmark-file", str(FIX / "aime24.jsonl")]
    err = _one_line_error(capsys, [*argv, *extra])
    assert f"error: eval --benchmark aime24: {extra[0]} does not apply" in err


def test_aime25_accepts_opencompass_question_field(tmp_path):
    path = tmp_path / "aime25.jsonl"
    path.write_text('{"question": "Find 1+1.", "answer": "2"}\n')
    assert load_benchmark("aime25", path)[0].question == "Find 1+1."


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory, tiny_tokenizer):
    from rlhflab.models.build import build_model, save_pretrained

    path = tmp_path_factory.mktemp("bench") / "model"
    # GSM8K / AIME questions are a few hundred tokens with this tokenizer: a context that holds them
    model = build_model(tiny_tokenizer, size="tiny", max_position_embeddings=1024, seed=0)
    save_pretrained(model, tiny_tokenizer, path)
    return str(path)


def test_eval_benchmark_end_to_end_greedy(saved_tiny, capsys):
    argv = ["eval", saved_tiny, "--benchmark", "gsm8k", "--benchmark-file",
            str(FIX / "gsm8k_test.jsonl"), "--max-new-tokens", "4", "--threads", "1"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["benchmark"] == "gsm8k" and out["n"] == 3 and out["n_samples"] == 1
    assert {"accuracy", "accuracy_stderr", "avg@1", "avg@1_stderr", "headline"} <= set(out)
    assert out["headline_name"] == "avg@1" and 0.0 <= out["headline"] <= 1.0
    assert out["protocol"]["greedy"] is True and "Qwen2.5-Math" in out["protocol"]["source"]
    assert out["departures"] == ["max_new_tokens 4 (protocol: 2048)"]
    assert main(argv) == 0  # the table
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gsm8k: n=3 problems x 1 samples, greedy, max_new_tokens 4")
    assert lines[1].split() == ["metric", "value", "stderr"]
    assert lines[2].split()[0] == "avg@1"
    assert "departure from the protocol: max_new_tokens 4 (protocol: 2048)" in lines


def test_eval_benchmark_end_to_end_sampled(saved_tiny, capsys):
    argv = ["eval", saved_tiny, "--benchmark", "aime24", "--benchmark-file",
            str(FIX / "aime24.jsonl"), "--max-new-tokens", "3", "--n-samples", "2", "--k", "1,2",
            "--threads", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["n"] == 3 and out["n_samples"] == 2 and out["headline_name"] == "avg@2"
    for key in ("avg@2", "pass@1", "pass@2", "maj@1", "maj@2"):
        assert 0.0 <= out[key] <= 1.0 and f"{key}_stderr" in out
    assert out["pass@1"] == out["avg@2"] <= out["pass@2"]
    assert out["protocol"]["temperature"] == 0.6 and out["protocol"]["top_p"] == 0.95
    assert "n_samples 2 (protocol: 64)" in out["departures"]


def test_benchmark_lines_mark_an_incomparable_ifeval_subset():
    items = load_benchmark("ifeval", FIX / "ifeval_input_data.jsonl")
    res = score_benchmark(BENCHMARKS["ifeval"], items, [["x"], ["y"], ["z"]])
    res.pop("per_problem")
    res.update(benchmark="ifeval", model="m", departures=[],
               protocol={"greedy": True, "max_new_tokens": 1280, "source": "IFEval"})  # fmt: skip
    lines = benchmark_lines(res)
    assert any(line.startswith("prompt_level_strict_acc") for line in lines)
    assert any("1 prompts left out" in line and "not comparable" in line for line in lines)
    assert not math.isnan(res["inst_level_loose_acc"])


def test_eval_benchmark_over_a_runs_checkpoints(tmp_path, capsys):
    """`eval RUN_DIR --benchmark NAME --checkpoints`: every saved model of the run (here an SFT
    run from scratch: no initial model, checkpoints at steps 1 and 2, which is also the final
    step) on the same file and protocol, written to RUN_DIR/eval/benchmark_<name>.json."""
    from factories import tiny_build, tiny_sft

    from rlhflab.config import config_from_dict
    from rlhflab.trainers import run_config

    raw = tiny_sft(tmp_path, model={"build": tiny_build(max_position_embeddings=512)},
                   train={"steps": 2, "batch_size": 8, "micro_batch_size": 8, "max_len": 48},
                   checkpoint={"every": 1, "keep_last": None}, precision={"threads": 1})  # fmt: skip
    run_dir = Path(run_config(config_from_dict(raw))["run_dir"])
    argv = ["eval", str(run_dir), "--benchmark", "ifeval", "--checkpoints", "--benchmark-file",
            str(FIX / "ifeval_input_data.jsonl"), "--max-new-tokens", "4", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [p["step"] for p in out["points"]] == [1, 2]
    assert out["headline_name"] == "prompt_level_strict_acc" and out["n"] == 2
    for p in out["points"]:
        assert p["n_skipped"] == 1 and p["comparable"] is False
        assert p["departures"] == ["max_new_tokens 4 (protocol: 1280)"]
    saved = json.loads((run_dir / "eval" / "benchmark_ifeval.json").read_text())
    assert [p["headline"] for p in saved["points"]] == [p["headline"] for p in out["points"]]
    err = _one_line_error(capsys, [*argv[:1], str(tmp_path), *argv[2:]])
    assert "takes a run directory" in err


def test_ifeval_hub_kwargs_with_null_keys_are_read_like_the_original():
    # the Hub copy of google/IFEval fills every kwargs key, unused ones null
    kw = {"num_highlights": None, "relation": None, "num_bullets": 2, "end_phrase": None}
    assert follows("* a\n* b", ["detectable_format:number_bullet_lists"], [kw]) == [True]
    assert follows("* a", ["detectable_format:number_bullet_lists"], [kw]) == [False]
