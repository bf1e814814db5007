"""PRM data: worked solutions and their step labels, separator-token alignment, PRM800K loader."""

import json
import random
from pathlib import Path

import pytest

from rlhflab.data.prm import (
    IGNORE_INDEX,
    PRMExample,
    label_steps,
    load_prm800k,
    plant_error,
    separator_id,
    solve_steps,
    tokenize_prm,
    worked_solution_examples,
)
from rlhflab.data.tasks import make_splits
from rlhflab.errors import ConfigError, DataError

FIXTURE = str(Path(__file__).parent / "fixtures" / "prm800k.jsonl")


def test_solve_steps_follows_precedence_and_left_associativity():
    assert solve_steps("4 - 1 - 7") == ["4 - 1 = 3", "3 - 7 = -4"]
    assert solve_steps("2 - -1") == ["2 - -1 = 3"]
    assert solve_steps("(3 + 4) * 2 - 6 / 3") == [
        "3 + 4 = 7",
        "7 * 2 = 14",
        "6 / 3 = 2",
        "14 - 2 = 12",
    ]
    with pytest.raises(ValueError):
        solve_steps("7 / 2")  # non-integer intermediate


def test_label_steps_ratings():
    expr = "4 - 1 - 7 + 5"
    assert label_steps(expr, solve_steps(expr)) == [1, 1, 1]
    # arithmetic error at step 1, later steps valid on the wrong path: −1 then 0
    assert label_steps(expr, ["4 - 1 = 5", "5 - 7 = -2", "-2 + 5 = 3"]) == [-1, 0, 0]
    # wrong operands (skipped a term) is an error even with right arithmetic
    assert label_steps(expr, ["4 - 1 = 3", "3 + 5 = 8"]) == [1, -1]
    # unparseable step and an extra step after the end
    assert label_steps("4 - 1", ["garbage"]) == [-1]
    assert label_steps("4 - 1", ["4 - 1 = 3", "3 + 0 = 3"]) == [1, -1]


def test_plant_error_has_exactly_one_minus_one_then_neutral():
    rng = random.Random(0)
    expr = "1 + 2 + 3 + 4 + 5"
    for _ in range(20):
        ratings = label_steps(expr, plant_error(solve_steps(expr), expr, rng))
        k = ratings.index(-1)
        assert ratings[:k] == [1] * k and ratings[k + 1 :] == [0] * (len(ratings) - k - 1)


@pytest.mark.parametrize("num_classes", [2, 3])
def test_prm_labels_land_on_separators_only(tiny_tokenizer, num_classes):
    ex = PRMExample(
        prompt="<|user|>4 - 1 - 7 + 5 =<|end|><|assistant|>",
        steps=["4 - 1 = 5", "5 - 7 = -2", "-2 + 5 = 3"],
        ratings=[1, -1, 0],
        final="<answer>3</answer>",
    )
    _prompt, comp, labels = tokenize_prm(tiny_tokenizer, ex, num_classes=num_classes)
    sep = separator_id(tiny_tokenizer)
    assert len(labels) == len(comp) and comp[-1] == tiny_tokenizer.eos_token_id
    positions = [i for i, t in enumerate(comp) if t == sep]
    assert [i for i, lab in enumerate(labels) if lab != IGNORE_INDEX] == positions
    expect = [2, 0, 1] if num_classes == 3 else [1, 0, 0]
    assert [labels[i] for i in positions] == expect
    # the text between separators decodes back to the steps
    assert tiny_tokenizer.decode(comp[: positions[0]]) == "4 - 1 = 5"


def test_separator_must_be_one_token(tiny_tokenizer):
    with pytest.raises(ConfigError, match="one token"):
        separator_id(tiny_tokenizer, "<step>")


def test_worked_solution_examples_from_tasks(tiny_tokenizer):
    splits = make_splits(
        "basic_arithmetic", config={"min_terms": 2, "max_terms": 4}, n_train=40, n_heldout=1
    )
    exs, counts = worked_solution_examples(splits.train, tiny_tokenizer, error_frac=0.5, seed=1)
    assert counts["planted"] > 0 and counts["clean"] > 0
    assert len(exs) + counts["unsupported"] == 40
    for ex in exs:
        clean = all(r == 1 for r in ex.ratings)
        assert clean or ex.ratings.count(-1) == 1
        tokenize_prm(tiny_tokenizer, ex)  # one separator token per step


def test_prm800k_loader_takes_chosen_completions(tiny_tokenizer):
    exs, drops = load_prm800k(FIXTURE, tiny_tokenizer, on_invalid="drop")
    assert len(exs) == 3 and drops["unknown_rating"] == 1 and drops["missing_field"] == 1
    assert exs[0].steps == ["We add 2 and 2.", "So the answer is 4."] and exs[0].ratings == [1, 1]
    assert exs[1].steps == ["3*3 is 9.", "Alternative.", "Then 9+1 = 11."]
    assert exs[1].ratings == [1, 0, -1]
    assert exs[2].steps == ["5-1 = 4"] and exs[2].ratings == [1]  # human completion
    _p, _c, labels = tokenize_prm(tiny_tokenizer, exs[1], num_classes=3)
    assert [lab for lab in labels if lab != IGNORE_INDEX] == [2, 1, 0]


def test_prm800k_errors_name_row_and_field(tiny_tokenizer):
    with pytest.raises(DataError, match=r"row 3: field 'label.steps\[0\].completions\[0\].rating'"):
        load_prm800k(FIXTURE, tiny_tokenizer)


def test_samples_to_pairs_orm_prm_and_truncation(tiny_tokenizer):
    from rlhflab.data.preference import TokenizedPair
    from rlhflab.data.reward_data import (
        ScoredSamples,
        orm_from_samples,
        pairs_from_samples,
        prm_from_samples,
        truncate_items,
    )

    problems = make_splits(
        "chain_sum", config={"min_terms": 3, "max_terms": 3}, n_train=1, n_heldout=1
    ).train
    expr = problems[0].entry["metadata"]["expression"]
    sep, eos = separator_id(tiny_tokenizer), tiny_tokenizer.eos_token_id

    def enc(steps):
        ids = []
        for s in steps:
            ids += tiny_tokenizer(s, add_special_tokens=False)["input_ids"] + [sep]
        return [*ids, eos]

    good, bad = enc(solve_steps(expr)), enc(plant_error(solve_steps(expr), expr, random.Random(0)))
    ss = ScoredSamples(problems, [[3, 4]], [[good, bad, bad]], [["g", "b", "b"]], [[1.0, 0.0, 0.0]])
    pairs, counts = pairs_from_samples(ss)
    assert counts["pairs"] == 2 and all(
        p.chosen_ids == good and p.rejected_ids == bad for p in pairs
    )
    assert [x.label for x in orm_from_samples(ss)] == [1.0, 0.0, 0.0]
    prm, _ = prm_from_samples(ss, tiny_tokenizer, sep_id=sep, num_classes=3)
    assert [lab for lab in prm[0].labels if lab != IGNORE_INDEX] == [2, 2]
    bad_labels = [lab for lab in prm[1].labels if lab != IGNORE_INDEX]
    assert bad_labels.count(0) == 1 and set(bad_labels) <= {0, 1, 2}
    # pairs identical after truncation are dropped and counted
    same_start = TokenizedPair([3] * 98, [7, 8, 9], [7, 8, 1])
    kept, c = truncate_items([same_start, *pairs], max_len=100)
    assert c["identical_after_truncation"] == 1 and len(kept) == 2


def _step_rows(tmp_path, rows):
    path = tmp_path / "steps.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_step_labelled_rows_give_ratings_on_separators_and_outcomes(tiny_tokenizer, tmp_path):
    from rlhflab.data.prm import load_step_labelled

    rows = [
        {"prompt": "1+2+3?", "steps": ["1+2 = 3", "3+3 = 7"], "ratings": [1, -1],
         "final": "<answer>7</answer>", "outcome": 0},
        {"prompt": "2+2?", "steps": ["2+2 = 4"], "ratings": [1], "final": "<answer>4</answer>"},
        {"prompt": "x", "steps": ["a"], "ratings": [2]},
    ]  # fmt: skip
    exs, outcomes, drops = load_step_labelled(
        _step_rows(tmp_path, rows), tiny_tokenizer, on_invalid="drop"
    )
    assert outcomes == [0.0, 1.0] and drops["unknown_rating"] == 1  # outcome defaults to all +1
    _p, comp, labels = tokenize_prm(tiny_tokenizer, exs[0])
    assert [lab for lab in labels if lab != IGNORE_INDEX] == [1, 0]
    assert tiny_tokenizer.decode(comp, skip_special_tokens=True).endswith("<answer>7</answer>")


@pytest.mark.parametrize(
    ("row", "expected"),
    [
        ({"prompt": "q", "steps": ["a", "b"], "ratings": [1]}, "row 0: field 'ratings' must be"),
        ({"prompt": "q", "steps": ["a\nb"], "ratings": [1]}, "field 'steps[0]' contains the step"),
        ({"steps": ["a"], "ratings": [1]}, "row 0: field 'prompt' is missing"),
        ({"prompt": "q", "steps": ["a"], "ratings": [1], "outcome": 2}, "field 'outcome' is 2"),
    ],
)
def test_step_labelled_errors_name_row_and_field(tiny_tokenizer, tmp_path, row, expected):
    from rlhflab.data.prm import load_step_labelled

    with pytest.raises(DataError) as err:
        load_step_labelled(_step_rows(tmp_path, [row]), tiny_tokenizer)
    assert expected in str(err.value) and "\n" not in str(err.value)
