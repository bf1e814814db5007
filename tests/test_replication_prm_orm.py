"""PRM vs ORM replication (Lightman et al. 2023) on chained arithmetic: exact step labels, the
selectors, the paired statistics (all from their definitions), the former name, and one tiny run
through the cell runner."""

import json
import math
from pathlib import Path

import pytest

from rlhflab.errors import ConfigError
from rlhflab.replications import check_experiment
from rlhflab.replications.prm_orm import (
    ERROR_KINDS,
    Spec,
    chain_expressions,
    exact_step_labels,
    paired_difference,
    paired_gap_stats,
    selection_accuracies,
    solution_lines,
    top_pick_profile,
)

ROOT = Path(__file__).resolve().parents[1]


def test_solution_lines_split_on_newlines_and_flag_a_missing_last_newline():
    assert solution_lines("1 + 2 = 3\n<answer>3</answer>\n") == (
        ["1 + 2 = 3", "<answer>3</answer>"], True)  # fmt: skip
    assert solution_lines("1 + 2 = 3\n<answer>3") == (["1 + 2 = 3", "<answer>3"], False)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        # 4 - 1 + 7 - 2: 4-1 = 3, 3+7 = 10, 10-2 = 8, answer 8; all right -> all +1
        (["4 - 1 = 3", "3 + 7 = 10", "10 - 2 = 8", "<answer>8</answer>"], [1, 1, 1, 1]),
        # arithmetic slip at line 2: +1, -1, then unlabelled (0) even where locally right
        (["4 - 1 = 3", "3 + 7 = 11", "11 - 2 = 9", "<answer>9</answer>"], [1, -1, 0, 0]),
        # wrong operand (skipped the 7) at line 2
        (["4 - 1 = 3", "3 - 2 = 1", "<answer>1</answer>"], [1, -1, 0]),
        # every operation right, wrong answer copied: the answer line is the first error
        (["4 - 1 = 3", "3 + 7 = 10", "10 - 2 = 8", "<answer>7</answer>"], [1, 1, 1, -1]),
        # premature answer (line 3 is not an operation)
        (["4 - 1 = 3", "3 + 7 = 10", "<answer>10</answer>"], [1, 1, -1]),
        # a line after a right answer is wrong
        (["4 - 1 = 3", "3 + 7 = 10", "10 - 2 = 8", "<answer>8</answer>", "x"], [1, 1, 1, 1, -1]),
        # unparseable first line
        (["four minus one", "3 + 7 = 10"], [-1, 0]),
        # stops before the answer: no error among the lines written
        (["4 - 1 = 3", "3 + 7 = 10"], [1, 1]),
        ([], []),
    ],
)  # fmt: skip
def test_exact_step_labels_follow_lightmans_first_error_convention(lines, expected):
    assert exact_step_labels("4 - 1 + 7 - 2", "8", lines) == expected


def test_selection_accuracies_by_hand():
    # One problem, 3 samples: right, wrong, right. Answers "5", "7", "5".
    # N = 3 (the whole pool, any order): PRM's top (0.9) is sample 0 (right) -> 1; ORM's top
    # (0.8) is sample 1 (wrong) -> 0; majority "5" (right) -> 1; random = 2/3; oracle 1.
    correct = [[1.0, 0.0, 1.0]]
    answers = [["5", "7", "5"]]
    scores = {"PRM": [[0.9, 0.1, 0.5]], "ORM": [[0.2, 0.8, 0.1]]}
    got = selection_accuracies(scores, correct, answers, [3], n_resamples=5, seed=0)
    assert got["PRM"][3] == [1.0] and got["ORM"][3] == [0.0] and got["majority"][3] == [1.0]
    assert got["random"][3] == [pytest.approx(2 / 3, abs=1e-12)] and got["oracle"][3] == [1.0]
    # N = 1: every selector takes the one sample: all equal the random pick on every subset.
    one = selection_accuracies(scores, correct, answers, [1], n_resamples=50, seed=1)
    assert one["PRM"][1] == one["ORM"][1] == one["majority"][1] == one["random"][1]
    # Majority with no answer at all scores 0; a 1-1 tie goes to the answer met first in the
    # subset, so over many subsets of 2 from {right "5", wrong "7"} it is right half the time.
    none = selection_accuracies({}, [[1.0, 1.0]], [[None, None]], [2], n_resamples=3, seed=0)
    assert none["majority"][2] == [0.0]
    tie = selection_accuracies({}, [[1.0, 0.0]], [["5", "7"]], [2], n_resamples=4000, seed=0)
    assert tie["majority"][2][0] == pytest.approx(0.5, abs=0.03)
    with pytest.raises(ValueError, match="best-of-4 needs 4"):
        selection_accuracies({}, correct, answers, [4], n_resamples=1, seed=0)
    # An RM picks among the samples that state an answer: the top score (0.9) has none, so the
    # pick is the best answered one, right (0.5) for the PRM, wrong (0.8) for the ORM.
    ans = [[None, "7", "5"]]
    cut = {"PRM": [[0.9, 0.1, 0.5]], "ORM": [[0.9, 0.8, 0.1]]}
    got = selection_accuracies(cut, [[0.0, 0.0, 1.0]], ans, [3], n_resamples=3, seed=0)
    assert got["PRM"][3] == [1.0] and got["ORM"][3] == [0.0]
    # no sample of the subset answers: the top score all the same (wrong, as none can be right)
    got = selection_accuracies(cut, [[0.0, 0.0]], [[None, None]], [2], n_resamples=2, seed=0)
    assert got["PRM"][2] == [0.0]


def _cell(prm: dict[int, list[float]], orm: dict[int, list[float]]) -> dict:
    return {"PRM": prm, "ORM": orm}


def test_paired_gap_stats_pool_over_seeds_and_resample_problems_with_their_seeds():
    # 2 seeds × 3 problems. Gap at 64: seed 0 (1-0, 1-1, 0-0) = (1, 0, 0); seed 1 (1, 1, 0).
    # Pooled mean = 3/6 = 0.5. Gap at 4: seed 0 (0, 0, 0), seed 1 (0, 1, 0): growth per problem
    # seed 0 (1, 0, 0), seed 1 (1, 0, 0): mean 2/6.
    s0 = _cell({64: [1.0, 1.0, 0.0], 4: [0.0, 0.0, 0.0]}, {64: [0.0, 1.0, 0.0], 4: [0.0, 0.0, 0.0]})
    s1 = _cell({64: [1.0, 1.0, 0.0], 4: [0.0, 1.0, 0.0]}, {64: [0.0, 0.0, 0.0], 4: [0.0, 0.0, 0.0]})
    got = paired_gap_stats([s0, s1], n_max=64, n_small=4, n_boot=400, seed=0)
    est, lo, hi = got["prm_minus_orm_at_nmax"]
    assert est == pytest.approx(0.5, abs=1e-12) and 0.0 <= lo <= est <= hi <= 1.0
    assert got["gap_growth"][0] == pytest.approx(2 / 6, abs=1e-12)
    # Cluster resampling: the pair (problem, all seeds) moves together. Problem 0's growth is 1 in
    # both seeds, the others 0, so every resample's mean is a multiple of 1/3 (k of 3 draws are
    # problem 0): the interval's ends lie on that grid, as they would not if seeds were resampled.
    _, glo, ghi = got["gap_growth"]
    for end in (glo, ghi):
        assert min(abs(end - k / 3) for k in range(4)) < 1e-9 or 0 < end < 1
    # A gap that is the same on every problem has a degenerate interval at that value.
    flat = _cell({64: [1.0] * 4, 4: [0.5] * 4}, {64: [0.75] * 4, 4: [0.5] * 4})
    e, lo, hi = paired_gap_stats([flat, flat], n_max=64, n_small=4, n_boot=200)["gap_growth"]
    assert e == lo == hi == pytest.approx(0.25, abs=1e-12)
    with pytest.raises(ValueError, match="different problem counts"):
        paired_gap_stats([s0, flat], n_max=64, n_small=4, n_boot=200)


def test_paired_difference_between_any_two_selectors_by_hand():
    # seed 0: a (1, 0) b (0, 0) -> (1, 0); seed 1: a (1, 1) b (1, 0) -> (0, 1); mean 2/4.
    s0 = {"majority": {8: [1.0, 0.0]}, "PRM": {8: [0.0, 0.0]}}
    s1 = {"majority": {8: [1.0, 1.0]}, "PRM": {8: [1.0, 0.0]}}
    est, lo, hi = paired_difference([s0, s1], "majority", "PRM", 8, n_boot=200)
    assert est == pytest.approx(0.5, abs=1e-12) and lo == pytest.approx(0.5, abs=1e-12) == hi
    # every problem's pooled difference is 1/2 here, so every resample's mean is too


def test_top_pick_profile_by_hand():
    # Four problems of 3 operations (a full solution has 4 lines: 3 operations + the answer).
    def s(outcome, answer, n_lines):
        return {"outcome": outcome, "answer": answer, "lines": ["x"] * n_lines}

    samples = [
        [s(0, "3", 4), s(1, "8", 4)],  # top (0.9) right, though a wrong one is there
        [s(1, "8", 4), s(0, None, 2)],  # top (0.7) cut off: no answer
        [s(0, "5", 2), s(1, "8", 4)],  # top (0.6) an answer after 1 of 3 operations
        [s(0, "7", 4), s(0, "6", 5)],  # tie 0.5/0.5: the first, a slip after 4 lines
    ]
    scores = [[0.1, 0.9], [0.2, 0.7], [0.6, 0.4], [0.5, 0.5]]
    got = top_pick_profile(scores, samples, [3, 3, 3, 3])
    assert got == {"right": 0.25, "no_answer": 0.25, "too_few_lines": 0.25, "wrong_line": 0.25}
    # a right answer counts as right even with too few lines or none parsed beside it
    assert top_pick_profile([[1.0]], [[s(1, "8", 1)]], [3])["right"] == 1.0
    with pytest.raises(ValueError, match="equal, non-empty"):
        top_pick_profile(scores, samples, [3])


@pytest.mark.parametrize("max_value", [9, 12, 19])
def test_chain_expressions_keep_every_intermediate_value_in_range(max_value):
    # Evaluated left to right term by term (not by the code under test): every running value
    # stays in 0..max_value, the stated value is the last one, the lengths are as asked.
    rows = chain_expressions(500, min_terms=3, max_terms=5, max_value=max_value, seed=4)
    assert len(rows) == 500 and len({e for e, _ in rows}) == 500
    for expr, value in rows:
        t = expr.split()
        assert 3 <= (len(t) + 1) // 2 <= 5
        run = [int(t[0])]
        for op, k in zip(t[1::2], t[2::2], strict=True):
            assert op in "+-" and 1 <= int(k) <= 9
            run.append(run[-1] + int(k) if op == "+" else run[-1] - int(k))
        assert all(0 <= v <= max_value for v in run), expr
        assert run[-1] == value


def test_spec_refuses_repeated_seeds():
    with pytest.raises(ConfigError, match=r"experiment\.seeds: must be distinct"):
        check_experiment(Spec, {"seeds": [0, 0]}, "x.yaml")


def test_the_former_name_runs_the_same_replication(tmp_path, capsys, monkeypatch):
    from rlhflab.cli import main

    monkeypatch.chdir(ROOT)
    # The former name reaches prm-orm's own config check (a bad key named in one line).
    code = main(["replicate", "prm-orm-gsm8k", "experiment.nn=3", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "prm_orm.yaml: experiment.nn" in err[0], err


@pytest.mark.slow
def test_a_tiny_run_through_the_cell_runner(tmp_path, monkeypatch):
    import rlhflab.rollout.scored as scored
    from rlhflab.config import apply_overrides, read_yaml
    from rlhflab.data.prm import solution_text, solve_steps
    from rlhflab.replications import prm_orm
    from rlhflab.replications.cells import run_cells

    real = scored.sample_and_score

    def half_right(model, tokenizer, problems, verifier, **kw):
        # A 30-step policy is never right: every other sample becomes the worked solution, so
        # both classes exist (its token ids, eos included, replace the sampled ones).
        ss = real(model, tokenizer, problems, verifier, **kw)
        for i, p in enumerate(problems):
            for j in range(0, len(ss.texts[i]), 2):
                steps = solve_steps(p.entry["metadata"]["expression"])
                text = solution_text(steps, f"<answer>{p.answer}</answer>\n")
                ss.texts[i][j] = text
                ss.completion_ids[i][j] = [*tokenizer(text, add_special_tokens=False)["input_ids"],
                                           tokenizer.eos_token_id]  # fmt: skip
                ss.scores[i][j] = 1.0
        return ss

    monkeypatch.setattr(scored, "sample_and_score", half_right)
    monkeypatch.chdir(ROOT)
    spec = apply_overrides(
        read_yaml(ROOT / "configs/replications/prm_orm.yaml"),
        ["experiment.n_train=200", "experiment.rm_prompts=24", "experiment.samples_per_prompt=4",
         "experiment.rm_solutions=40", "experiment.n_heldout=6", "experiment.ns=[1,2,4]",
         "experiment.n_small=2", "experiment.n_resamples=2", "experiment.n_boot=100",
         "experiment.seeds=[0,1]", "experiment.min_terms=3", "experiment.max_terms=3",
         "experiment.temperature=1.5",
         "experiment.max_new_tokens=40",
         "sft.model.build.size=tiny", "sft.train.steps=30", "sft.train.batch_size=16",
         "sft.train.micro_batch_size=16", "orm.train.steps=3", "prm.train.steps=3",
         "orm.train.batch_size=8", "orm.train.micro_batch_size=8",
         "prm.train.batch_size=8", "prm.train.micro_batch_size=8"],
    )  # fmt: skip
    out = tmp_path / "out"
    res = run_cells("prm-orm", prm_orm, spec, out, "prm_orm.yaml", print_fn=lambda s: None)
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["name"] == "prm-orm" and verdict["seeds"] == [0, 1]
    assert set(verdict) >= {"claim", "criterion", "estimate", "ci95", "reproduced"}
    assert (out / "prm_orm.png").is_file() and "prm_orm.png" in (out / "report.md").read_text()
    cell = json.loads((out / "cells" / "seed0.json").read_text())
    rd = cell["rm_data"]
    assert rd["orm_positives"] * 2 == rd["train_solutions"]  # balanced
    assert len(cell["per_problem"]["PRM"]["4"]) == 6
    top = cell["diagnostics"]["top_pick"]
    assert set(top) == {"PRM", "ORM"} and math.isclose(sum(top["PRM"].values()), 1.0)
    assert "top-scored sample out of a problem's whole pool" in (out / "report.md").read_text()
    ek = cell["diagnostics"]["error_kinds"]
    assert set(ek["count"]) == set(ERROR_KINDS) and 0 <= ek["right_canonical_frac"] <= 1
    assert sum(ek["count"].values()) <= 6 * 4  # at most every sample of 6 problems × 4
    assert "| first error | wrong samples (per seed) |" in (out / "report.md").read_text()
    assert math.isfinite(res["verdict"]["estimate"])


def _token_only_rm(model64, num_labels):
    """A reward model whose head output at a position depends on that position's token only:
    every attention and MLP output projection is zero, so the residual stream is the token's
    embedding. A wrong reading position (off by one, the padding side) then shows as a wrong
    token's value."""
    import torch

    from rlhflab.models.reward import reward_model_from_causal_lm

    rm = reward_model_from_causal_lm(model64, num_labels=num_labels, pad_token_id=0).eval()
    with torch.no_grad():
        for layer in rm.base_model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = rm.score.weight
        head.copy_(0.2 * torch.randn(head.shape, generator=torch.Generator().manual_seed(3),
                                     dtype=head.dtype))  # fmt: skip
    return rm


def _alone(rm, token_id):
    """The head's class probabilities of a one-token sequence [token_id] (float64)."""
    import torch

    ids = torch.tensor([[token_id]])
    with torch.no_grad():
        h = rm.base_model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        return torch.softmax(rm.score(h)[0, 0].double(), -1)


def test_prm_and_orm_read_the_positions_their_labels_were_trained_on(tiny_model64, tiny_tokenizer):
    """The PRM's training loss sits on each line's newline, and the replication's scorer reads
    P(step correct) there and nowhere else, for prompts of different lengths in one padded batch
    and for a cut-off solution (its last line has no newline: no score); the ORM's score is read
    at the last real token (eos). Expected values from single-token forwards of a model whose
    output depends on the current token only (`_token_only_rm`)."""
    import types

    import torch

    from rlhflab.data.formatting import encode_completion, encode_prompt, render_prompt
    from rlhflab.data.prm import PRMExample, separator_id, tokenize_prm
    from rlhflab.data.reward_data import StepLabelledCompletion
    from rlhflab.eval.best_of_n import score_pool
    from rlhflab.replications.prm_orm import _prm_step_probs
    from rlhflab.rewards.reward_model import RewardModelScorer
    from rlhflab.trainers.reward_model import rm_losses

    tok = tiny_tokenizer
    sep = separator_id(tok)
    prm = _token_only_rm(tiny_model64, 2)
    p_sep = float(_alone(prm, sep)[1])  # P(correct) the PRM gives at any newline
    questions = ["4 - 1 + 7 =", "12 + 3 - 5 - 1 + 2 ="]  # two prompt lengths: left padding
    prompts = [encode_prompt(tok, render_prompt(tok, q)) for q in questions]
    assert len(prompts[0]) != len(prompts[1])
    full = ["4 - 1 = 3", "3 + 7 = 10", "<answer>10</answer>"]
    texts = ["\n".join(full) + "\n", "12 + 3 = 15\n15 - 5 = 10\n10 - 1"]  # the second: cut off
    comps = [encode_completion(tok, texts[0]), encode_completion(tok, texts[1])[:-1]]  # no eos

    # Training: 2-class CE at the newlines of [+1, −1, +1] and of a second row's one +1 line,
    # in one padded batch: −(3 log p + log(1 − p)).
    cfg = types.SimpleNamespace(kind="prm")
    ex = PRMExample(render_prompt(tok, questions[0]), full, [1, -1, 1], "")
    p_ids, c_ids, labels = tokenize_prm(tok, ex, num_classes=2)
    c_short = encode_completion(tok, "1 + 2 = 3\n")  # ends newline, eos: the newline is +1
    short = StepLabelledCompletion(prompts[1], c_short, [-100] * (len(c_short) - 2) + [1, -100])
    losses, _, _ = rm_losses(cfg, prm, [StepLabelledCompletion(p_ids, c_ids, labels), short],
                             0, "cpu", None)  # fmt: skip
    want = -(3 * math.log(p_sep) + math.log(1 - p_sep))
    assert float(losses.detach().sum()) == pytest.approx(want, rel=1e-6)  # the CE is float32

    # Scoring: one P(correct) per finished line, in both rows of one padded batch.
    ss = types.SimpleNamespace(prompt_ids=prompts, completion_ids=[[comps[0]], [comps[1]]])
    scorer = RewardModelScorer(prm, kind="prm", pad_token_id=0, sep_id=sep, prm_reduce="prod")
    got = _prm_step_probs(scorer, ss)
    assert [len(got[0][0]), len(got[1][0])] == [3, 2]
    for row in (got[0][0], got[1][0]):
        assert row == pytest.approx([p_sep] * len(row), rel=1e-6)  # softmax in float32

    # ORM: P(right) at the last real token: eos for a finished solution, the last digit if cut.
    orm = _token_only_rm(tiny_model64, 1)
    ss_orm = types.SimpleNamespace(prompt_ids=prompts, completion_ids=[[comps[0]], [comps[1]]])
    got = score_pool(RewardModelScorer(orm, kind="orm", pad_token_id=0), ss_orm)
    for row, last in ((got[0], comps[0][-1]), (got[1], comps[1][-1])):
        ids = torch.tensor([[last]])
        with torch.no_grad():
            h = orm.base_model(input_ids=ids, attention_mask=torch.ones_like(ids))
            z = float(orm.score(h.last_hidden_state)[0, 0, 0])
        assert row == pytest.approx([1 / (1 + math.exp(-z))], rel=1e-6)


@pytest.mark.parametrize(
    ("lines", "kind"),
    [
        (["4 - 1 = 3", "3 + 7 = 10", "<answer>10</answer>"], None),
        (["4 - 1 = 3", "3 + 7 = 11", "<answer>11</answer>"], "slip_by_1"),  # 10 expected
        (["4 - 1 = 2", "2 + 7 = 9", "<answer>9</answer>"], "slip_by_1"),  # 3 expected
        (["4 - 1 = 3", "3 + 7 = 13"], "slip_by_more"),
        (["4 - 1 = 3", "3 - 7 = -4"], "operands"),  # − instead of +
        (["4 + 1 = 5"], "operands"),
        (["4 - 1 = 3", "<answer>3</answer>"], "answer_line"),  # before the second operation
        (["4 - 1 = 3", "3 + 7 = 10", "<answer>11</answer>"], "answer_line"),  # a wrong value
        (["4 - 1 = 3", "3 + 7 ="], "unreadable"),
        (["4 - 1 = 3", "3 + 7 = 10", "10 + 1 = 11"], "unreadable"),  # a line after K = 2
    ],
)
def test_first_error_kind_by_hand(lines, kind):
    from rlhflab.replications.prm_orm import first_error_kind

    assert first_error_kind("4 - 1 + 7", "10", lines) == kind


def test_blind_spot_lines_give_each_kinds_auc_and_share_and_the_inverted_ones():
    from rlhflab.replications.prm_orm import ERROR_KINDS, _blind_spot_lines

    def diag(auc_slip, counts, acc):
        aucs = dict.fromkeys(ERROR_KINDS, 0.9) | {"slip_by_1": auc_slip, "unreadable": None}
        return {"pool_accuracy": acc,
                "error_kinds": {"prm_step_auc": aucs,
                                "count": dict(zip(ERROR_KINDS, counts, strict=True))}}  # fmt: skip

    # seed a: slips by 1 are 6 of 10 wrong samples, AUC 0.4; seed b: 2 of 10, AUC 0.5:
    # mean AUC 0.45 (< 0.5: inverted), mean share (0.6 + 0.2) / 2 = 40%. Operands: 1/10 and
    # 2/10 -> 15%. Pool accuracy (0.7 + 0.8) / 2 = 0.75 of 64 samples -> 16 wrong.
    res = {"pool_size": 64,
           "diagnostics": {"a": diag(0.4, [6, 1, 1, 1, 1], 0.7),
                           "b": diag(0.5, [2, 2, 2, 2, 2], 0.8)}}  # fmt: skip
    why, inv = _blind_spot_lines(res)
    assert "slip by 1 0.45 (40%)" in why and "operands 0.90 (15%)" in why
    assert "unreadable" not in why and "about 16 of a problem's 64 samples are wrong" in why
    assert inv.endswith("(step AUC < 0.5): slip by 1.")
    assert len(_blind_spot_lines(res, below=0.3)) == 1
