"""reasoning_gym tasks: dataset creation errors, composite, leak-free splits, scoring."""

import pytest
import reasoning_gym

from rlhflab.data.tasks import Problem, dedup_key, make_splits, make_task_dataset, score_answer
from rlhflab.errors import ConfigError, DataError

# 2 terms of 1 digit joined by + or -: at most 10 * 10 * 2 = 200 distinct questions.
SMALL_SPACE = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_unknown_task_name_suggests_the_closest():
    with pytest.raises(
        ConfigError,
        match=r"^task.name: unknown reasoning_gym dataset 'chain_summ' \(did you mean 'chain_sum'\?\)$",
    ):
        make_task_dataset("chain_summ", size=4, seed=0)


def test_unknown_option_and_bad_value_name_task_config():
    with pytest.raises(
        ConfigError, match=r"^task.config: unknown option 'min_term' .*did you mean 'min_terms'"
    ):
        make_task_dataset("chain_sum", size=4, seed=0, config={"min_term": 2})
    with pytest.raises(ConfigError) as info:
        make_task_dataset("chain_sum", size=4, seed=0, config={"min_terms": 0})
    assert str(info.value) == (
        "task.config: reasoning_gym rejected the chain_sum config: min_terms must be positive"
    )
    with pytest.raises(ConfigError, match=r"^task.config: 'seed' is set by rlhflab"):
        make_task_dataset("chain_sum", size=4, seed=0, config={"seed": 3})


def test_dataset_matches_reasoning_gym():
    ours = make_task_dataset("chain_sum", size=5, seed=3, config=SMALL_SPACE)
    theirs = reasoning_gym.create_dataset("chain_sum", size=5, seed=3, **SMALL_SPACE)
    assert [ours[i] for i in range(5)] == [theirs[i] for i in range(5)]


def test_composite_builds_specs_and_scores_through_dispatch():
    config = {
        "datasets": [
            {"name": "chain_sum", "weight": 1, "config": SMALL_SPACE},
            {"name": "spell_backward", "weight": 1.0},
        ]
    }
    splits = make_splits("composite", config=config, n_train=40, n_heldout=5, seed=1)
    tasks = {p.task for p in splits.train}
    assert tasks == {"chain_sum", "spell_backward"}
    for p in splits.train[:10]:
        assert score_answer(p, p.answer) == 1.0
        assert p.score("definitely wrong") < 1.0
    with pytest.raises(
        ConfigError,
        match=r"^task.config.datasets\[1\].name: unknown reasoning_gym dataset 'spell_backwards' \(did you mean 'spell_backward'\?\)",
    ):
        make_task_dataset(
            "composite",
            size=4,
            seed=0,
            config={"datasets": [{"name": "chain_sum"}, {"name": "spell_backwards"}]},
        )
    with pytest.raises(
        ConfigError, match=r"^task.config.datasets\[0\].weight: must be a positive number"
    ):
        make_task_dataset(
            "composite", size=4, seed=0, config={"datasets": [{"name": "chain_sum", "weight": 0}]}
        )


def test_problem_fields():
    splits = make_splits("chain_sum", config=SMALL_SPACE, n_train=3, n_heldout=0)
    p = splits.train[0]
    assert isinstance(p, Problem)
    assert p.task == "chain_sum" and p.answer == p.entry["answer"]
    assert p.question == p.entry["question"]
    assert p.score(p.answer) == 1.0
    hash(p)  # usable in sets / as dict keys despite the dict field


def test_splits_drop_heldout_questions_seen_in_training():
    n_train, n_heldout, seed = 150, 20, 5
    splits = make_splits(
        "chain_sum", config=SMALL_SPACE, n_train=n_train, n_heldout=n_heldout, seed=seed
    )
    train_q = {p.question.strip() for p in splits.train}
    held_q = [p.question.strip() for p in splits.heldout]
    assert len(splits.train) == n_train and len(held_q) == n_heldout
    assert not train_q & set(held_q)
    assert len(set(held_q)) == n_heldout
    assert splits.train_seed == seed and splits.heldout_seed == seed + 10**9

    # Recount with a naive loop over the held-out sequence.
    ds = reasoning_gym.create_dataset("chain_sum", size=1000, seed=seed + 10**9, **SMALL_SPACE)
    kept, overlap, dupes, i = [], 0, 0, 0
    while len(kept) < n_heldout:
        q = ds[i]["question"].strip()
        i += 1
        if q in train_q:
            overlap += 1
        elif q in kept:
            dupes += 1
        else:
            kept.append(q)
    assert kept == held_q
    assert splits.n_heldout_overlap_dropped == overlap > 0
    assert splits.n_heldout_internal_dupes_dropped == dupes


def test_dedup_key_normalises_case_whitespace_and_unicode_forms():
    assert dedup_key("  Spell  this\tword:\nBIRD ") == "spell this word: bird"
    # NFKC: full-width letters and the "fi" ligature become their plain forms; non-breaking
    # space is whitespace; German sharp s case-folds to "ss".
    assert dedup_key("\uff22ird\u00a0\ufb01sh Stra\u00dfe") == "bird fish strasse"
    assert dedup_key("bird") != dedup_key("bard")


def test_heldout_drops_questions_that_differ_from_training_only_by_case():
    # spell_backward draws capitalised and lower-case forms of the same word: at these sizes
    # exact-match deduplication kept 3 held-out words whose question is a training question
    # up to case ("... : Bird" vs "... : bird").
    splits = make_splits(
        "spell_backward",
        config={"min_word_len": 3, "max_word_len": 5},
        n_train=2000,
        n_heldout=200,
        seed=0,
    )
    train_q = {p.question.casefold() for p in splits.train}
    assert len(splits.heldout) == 200
    assert not [p.question for p in splits.heldout if p.question.casefold() in train_q]
    # The count reported counts those drops too: recount with a naive loop.
    ds = reasoning_gym.create_dataset(
        "spell_backward", size=1000, seed=10**9, min_word_len=3, max_word_len=5
    )
    train_norm = {" ".join(q.split()) for q in train_q}
    kept, overlap, i = [], 0, 0
    while len(kept) < 200:
        q = " ".join(ds[i]["question"].split()).casefold()
        i += 1
        if q in train_norm:
            overlap += 1
        elif q not in kept:
            kept.append(q)
    assert kept == [" ".join(p.question.split()).casefold() for p in splits.heldout]
    assert splits.n_heldout_overlap_dropped == overlap


def test_splits_are_deterministic():
    a = make_splits("chain_sum", config=SMALL_SPACE, n_train=30, n_heldout=10, seed=2)
    b = make_splits("chain_sum", config=SMALL_SPACE, n_train=30, n_heldout=10, seed=2)
    assert [p.question for p in a.train + a.heldout] == [p.question for p in b.train + b.heldout]


def test_too_small_problem_space_is_an_error():
    with pytest.raises(
        DataError,
        match=r"^task 'chain_sum': only \d+ distinct held-out questions .* in 1000 draws \(wanted 50;",
    ):
        make_splits("chain_sum", config=SMALL_SPACE, n_train=2000, n_heldout=50)
