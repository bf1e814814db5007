"""The R1-Zero replication (`rlhflab replicate r1-zero`): the two answer styles and their
classification, the held-out summary from per-sample lists, the paired estimates and the
precondition from constructed cells, the base documents' prompt boundary, and one tiny run
through the cell runner."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from rlhflab.replications import r1_zero as R

ROOT = Path(__file__).resolve().parents[1]


def test_worked_steps_rewrite_the_chain_left_to_right_modulo_10():
    # 7+3*2-4: 7+3 = 10 -> 0; 0*2 = 0; 0-4 = -4 -> 6 (mod 10), one step per operation.
    chain = [7, "+", 3, "*", 2, "-", 4]
    assert R.evaluate_chain(chain) == ((7 + 3) * 2 - 4) % 10 == 6
    assert R.worked_steps(chain) == "7+3=0 0*2=0 0-4=6"
    assert R.worked_steps([5, "*", 3, "-", 2]) == "5*3=5 5-2=3"  # 15 -> 5; 5-2 = 3
    assert R.completion([5, "*", 3, "-", 2], worked=True) == (
        "<think> 5*3=5 5-2=3 </think> <answer> 3 </answer>"
    )
    assert R.completion([5, "*", 3, "-", 2], worked=False) == (
        "<think> </think> <answer> 3 </answer>"
    )
    for r in R.chain_problems(50, terms=(3, 4), max_term=9, seed=1):
        chain = r["terms"]
        assert r["question"] == "".join(map(str, chain)) + " mod 10"
        assert 3 <= len(chain[::2]) <= 4 and all(1 <= x <= 9 for x in chain[::2])
        acc = chain[0]  # the naive loop: Python's own arithmetic, reduced at the end
        for op, x in zip(chain[1::2], chain[2::2], strict=True):
            acc = acc + x if op == "+" else acc - x if op == "-" else acc * x
        assert int(r["answer"]) == acc % 10


def test_both_styles_satisfy_the_format_reward_and_are_told_apart():
    from rlhflab.rewards.functions import exact_match, think_format

    chain = [7, "+", 3, "*", 2, "-", 4]
    short, worked = R.completion(chain, worked=False), R.completion(chain, worked=True)
    assert think_format(None, [short, worked]) == [1.0, 1.0]
    assert exact_match(None, [short, worked, "6"], answer=["6", "6", "6"]) == [1.0, 1.0, 1.0]
    assert R.style_of(short) == "short" and R.style_of(worked) == "worked"
    assert R.style_of("<answer> 6 </answer>") == "other"  # no think block
    assert R.style_of("<think> hmm </think> <answer> 2 </answer>") == "other"  # no step
    assert R.style_of("<think> 0*2") == "other"  # truncated inside the block


def test_heldout_summary_by_hand():
    # 2 problems x k=2 samples: right [1, 0 | 1, 1], lengths [10, 30 | 12, 40],
    # styles [short, worked | short, worked]. pass1 = 3/4; len = 92/4 = 23;
    # len_correct = (10+12+40)/3; len_incorrect = 30; worked acc 1/2, short acc 2/2.
    got = R.summarize_samples(
        [1.0, 0.0, 1.0, 1.0], [10, 30, 12, 40], ["short", "worked", "short", "worked"],
        [1.0, 1.0, 1.0, 0.0], [1.0, 0.0], [11, 33], ["short", "worked"], k=2,
    )  # fmt: skip
    assert got["pass1"] == 0.75 and got["greedy"] == 0.5 and got["len"] == 23.0
    assert got["len_correct"] == pytest.approx(62 / 3, abs=1e-12)
    assert got["len_incorrect"] == 30.0 and got["greedy_len"] == 22.0 and got["format"] == 0.75
    assert got["style_acc"] == {"short": 1.0, "worked": 0.5, "other": None}
    assert got["style_frac"] == {"short": 0.5, "worked": 0.5, "other": 0.0}
    assert got["style_len"]["worked"] == 35.0


def _ev(pass1, length, greedy=0.0):
    return {"pass1": pass1, "len": length, "greedy": greedy}


def test_gains_are_final_minus_base_per_seed_and_the_criterion_reads_the_grpo_arm():
    # grpo gains over 3 seeds: pass1 +0.15, +0.20, +0.25 (mean 0.2, s = 0.05, half-width
    # t_{0.975,2} * 0.05 / sqrt(3) = 4.302653 * 0.028868 = 0.124207, so the interval is above 0);
    # length +5, +6, +7. The no-format arm loses 0.1 and 1 token on every seed.
    cells = {}
    for s, (dp, dl) in enumerate([(0.15, 5), (0.2, 6), (0.25, 7)]):
        cells[f"seed{s}-grpo"] = {
            "arm": "grpo",
            "steps": 40,
            "evals": {"0": _ev(0.2, 20), "40": _ev(0.2 + dp, 20 + dl)},
        }
        cells[f"seed{s}-no_format"] = {"arm": "no_format", "steps": 40,
                                       "evals": {"0": _ev(0.2, 20), "40": _ev(0.1, 19)}}  # fmt: skip
    assert R.gains(cells, "grpo", "len") == pytest.approx([5, 6, 7], abs=1e-12)
    est = R.estimates(cells, ["grpo", "no_format"])
    mean, _lo, hi = est["correctness_gain"]
    assert mean == pytest.approx(0.2, abs=1e-12)
    assert hi - mean == pytest.approx(4.302653 * 0.05 / math.sqrt(3), abs=1e-5)
    assert est["length_gain"] == est["grpo_length_gain"]
    assert est["no_format_correctness_gain"][0] == pytest.approx(-0.1, abs=1e-12)
    verdict = R.judge("r1-zero", R.CRITERION, est, [0, 1, 2])
    assert verdict["reproduced"] is True and verdict["estimate"] == pytest.approx(0.2, abs=1e-12)
    # One seed's correctness falling instead (+0.15, +0.20, -0.05): the interval straddles 0.
    cells["seed2-grpo"]["evals"]["40"] = _ev(0.15, 27)
    assert (
        R.judge("r1-zero", R.CRITERION, R.estimates(cells, ["grpo"]), [0, 1, 2])["reproduced"]
        is False
    )


def test_precondition_is_worked_minus_short_per_seed_with_a_t_interval():
    def base(seed, worked, short):
        return {"seed": seed, "eval": {"style_acc": {"worked": worked, "short": short},
                                       "style_n": {"worked": 100, "short": 300},
                                       "style_frac": {"worked": 0.25}, "pass1": 0.3,
                                       "len": 25.0}}  # fmt: skip

    pre = R.precondition([base(0, 0.6, 0.2), base(1, 0.5, 0.2), base(2, 0.7, 0.2)])
    mean, lo, _hi = pre["worked_minus_short"]
    # diffs 0.4, 0.3, 0.5: mean 0.4, s 0.1
    assert mean == pytest.approx(0.4, abs=1e-12)
    assert mean - lo == pytest.approx(4.302653 * 0.1 / math.sqrt(3), abs=1e-5)
    assert [r["seed"] for r in pre["per_seed"]] == [0, 1, 2]


def test_short_documents_carry_a_wrong_guess_at_the_configured_rate_worked_ones_never():
    # The designed precondition: every document is parsed back (question -> the sum modulo 10 by
    # Python's own arithmetic; the answer and style read from the text). Worked documents are
    # always right and every step of their scratchpad is right; a short document's answer is
    # wrong in a share near short_error (4000 documents, about 2800 short: the binomial standard
    # error of the share is sqrt(0.6 * 0.4 / 2800) = 0.0093, so +-0.04 is over 4 of them), and a
    # wrong guess is the right answer +-1..3 modulo 10, each offset present.
    rows = R.chain_problems(4000, terms=(3, 4), max_term=9, seed=3, ops=["+"])
    assert all(set(r["terms"][1::2]) == {"+"} for r in rows)
    docs, counts = R.base_documents(rows, "Q: {prompt} A:", worked_frac=0.3, seed=7,
                                    short_error=0.6)  # fmt: skip
    doc_re = re.compile(r"^Q: ([0-9+]+) mod 10 A: <think> (.*?)</think> <answer> (\d) </answer>$")
    short = wrong = worked = 0
    offsets = set()
    for row, doc in zip(rows, docs, strict=True):
        m = doc_re.match(doc["text"])
        assert m is not None, doc
        assert f"{m.group(1)} mod 10" == row["question"]
        nums = [int(x) for x in m.group(1).split("+")]
        right, said = sum(nums) % 10, int(m.group(3))
        if R.style_of(doc["text"]) == "worked":
            worked += 1
            assert said == right
            steps = m.group(2).strip().split(" ")
            assert len(steps) == len(nums) - 1
            for i, step in enumerate(steps):  # step i: "a+b=c", a the running sum, b number i + 1
                a, b, c = (int(x) for x in re.split(r"[+=]", step))
                assert (a, b, c) == (sum(nums[: i + 1]) % 10, nums[i + 1], sum(nums[: i + 2]) % 10)
        else:
            assert m.group(2) == ""
            short += 1
            if said != right:
                wrong += 1
                offsets.add((said - right) % 10)
    assert counts == {"documents": 4000, "worked": worked, "short": short, "short_wrong": wrong}
    assert abs(worked / 4000 - 0.3) < 0.04 and abs(wrong / short - 0.6) < 0.04
    assert offsets == {1, 2, 3, 7, 8, 9}  # +-1..3 modulo 10
    # short_error 0 (the default): every document right; 1: every short one wrong.
    _, c0 = R.base_documents(rows[:200], "Q: {prompt} A:", worked_frac=0.3, seed=7)
    _, c1 = R.base_documents(rows[:200], "Q: {prompt} A:", worked_frac=0.3, seed=7,
                             short_error=1.0)  # fmt: skip
    assert c0["short_wrong"] == 0 and c1["short_wrong"] == c1["short"] > 0


def test_base_documents_share_the_rl_prompt_boundary(tmp_path, tiny_tokenizer):
    # An R1-Zero base model has seen plain text, never a chat template: each base document, read
    # and tokenized as the base stage trains on it, starts with exactly the token ids the RL stage
    # prompts with (r1_zero.yaml's template, loaded by the RL prompt loader); the rest is one of
    # the two styles (both rewarded by think_format), then eos.
    from rlhflab.config import read_yaml
    from rlhflab.data.formatting import encode_prompt
    from rlhflab.data.prompts import load_prompt_source, render_row
    from rlhflab.data.sft import load_sft_data, tokenize_sft
    from rlhflab.errors import ConfigError
    from rlhflab.replications import stage
    from rlhflab.rewards.functions import think_format
    from rlhflab.serialize import to_json

    path = ROOT / "configs/replications/r1_zero.yaml"
    spec = read_yaml(path)
    rows = R.chain_problems(12, terms=(3, 4), max_term=9, seed=5)
    train_path, held_path = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train_path.write_text("".join(to_json(r) + "\n" for r in rows[:8]))
    held_path.write_text("".join(to_json(r) + "\n" for r in rows[8:]))
    train = rows[:8]
    docs, counts = R.base_documents(train, spec["rl"]["data"]["template"], worked_frac=0.5,
                                    seed=0, short_error=0.5)  # fmt: skip
    worked_n = counts["worked"]
    assert len(docs) == 8 and 0 < worked_n < 8
    docs_path = tmp_path / "docs.jsonl"
    docs_path.write_text("".join(to_json(d) + "\n" for d in docs))
    examples, _ = load_sft_data(str(docs_path), tiny_tokenizer)
    features = tokenize_sft(tiny_tokenizer, examples, max_len=1024)
    rl = stage(spec, "rl", str(path), model={"name_or_path": "x"},
               data={"path": str(train_path), "heldout_path": str(held_path)})  # fmt: skip
    prompts = load_prompt_source(rl.data, seed=0).train
    worked_seen = 0
    for row, feats in zip(prompts, features, strict=True):
        problem = train[row.index]
        assert problem["question"] in row.prompt
        prompt_ids = encode_prompt(tiny_tokenizer, render_row(tiny_tokenizer, row))
        ids = feats["input_ids"]
        assert ids[: len(prompt_ids)] == prompt_ids
        assert ids[-1] == tiny_tokenizer.eos_token_id
        rest = tiny_tokenizer.decode(ids[len(prompt_ids) : -1])
        assert think_format([None], [rest]) == [1.0]
        worked_seen += R.style_of(rest) == "worked"
    assert worked_seen == worked_n
    with pytest.raises(ConfigError, match=r"^rl\.data\.template: ends with whitespace"):
        R.base_documents(train, "Q: {prompt} A: ", worked_frac=0.5, seed=0)


def test_arms_replace_whole_sections_of_the_rl_stage():
    from rlhflab.config import read_yaml
    from rlhflab.replications import check_experiment, stage

    path = ROOT / "configs/replications/r1_zero.yaml"
    spec = read_yaml(path)
    exp = check_experiment(R.Spec, spec["experiment"], str(path))
    assert R.cells(spec, str(path))[:3] == ["seed0-grpo", "seed0-dr_grpo", "seed0-no_format"]
    over = dict(model={"name_or_path": "x"}, data={"path": "x", "heldout_path": "x"})
    dr = stage(R.arm_spec(spec, exp, "dr_grpo"), "rl", str(path), **over)
    assert dr.loss.advantage == "group_mean" and dr.loss.advantage_args == {}
    assert dr.loss.aggregation == "seq_mean_token_sum_norm"
    nf = stage(R.arm_spec(spec, exp, "no_format"), "rl", str(path), **over)
    assert [c.name for c in nf.reward.components] == ["exact_match"]
    grpo = stage(R.arm_spec(spec, exp, "grpo"), "rl", str(path), **over)
    assert [c.name for c in grpo.reward.components] == ["exact_match", "think_format"]
    assert grpo.loss.aggregation == "seq_mean_token_mean"


@pytest.mark.slow
def test_a_tiny_run_through_the_cell_runner(tmp_path):
    # Every stage shrunk to a few steps: two seeds, two arms; the report, verdict.json and the
    # plot are written and every estimate is computed from the cells.
    from rlhflab.config import apply_overrides, read_yaml
    from rlhflab.replications.cells import run_cells

    path = ROOT / "configs/replications/r1_zero.yaml"
    spec = apply_overrides(read_yaml(path), [
        "experiment.seeds=[0,1]", "experiment.n_train=200", "experiment.n_heldout=6",
        "experiment.k=2", "experiment.eval_steps=[2]", "experiment.eval_max_new_tokens=8",
        "base.train.steps=3", "base.train.batch_size=8", "base.train.micro_batch_size=8",
        "base.model.build.size=tiny", "base.model.build.tokenizer_texts=200",
        "rl.train.steps=4", "rl.rollout.prompts_per_step=2", "rl.rollout.group_size=2",
        "rl.rollout.max_new_tokens=8", "rl.checkpoint.every=2",
    ])  # fmt: skip
    spec["experiment"]["arms"] = {"grpo": {}, "no_format": spec["experiment"]["arms"]["no_format"]}
    res = run_cells("r1-zero", R, spec, tmp_path, str(path), print_fn=lambda s: None)
    verdict = json.loads((tmp_path / "verdict.json").read_text())
    assert verdict["name"] == "r1-zero" and verdict["seeds"] == [0, 1]
    assert isinstance(verdict["reproduced"], bool) and len(verdict["ci95"]) == 2
    assert (tmp_path / "r1_zero.png").is_file() and "r1_zero.png" in res["report"]
    cell = json.loads((tmp_path / "cells" / "seed1-no_format.json").read_text())
    assert sorted(cell["evals"], key=int) == ["0", "2", "4"]
    # one base shared by the seeds (the default), evaluated by each seed with its own draws
    assert len(list((tmp_path / "runs").glob("base-*"))) == 1
    b0, b1 = (json.loads((tmp_path / "bases" / f"seed{s}.json").read_text()) for s in (0, 1))
    assert b0["model_dir"] == b1["model_dir"] and b0["base"] == b1["base"] == "shared"
    assert (b0["seed"], b1["seed"]) == (0, 1)


def test_base_keys_one_shared_base_or_one_per_seed():
    from rlhflab.config import read_yaml
    from rlhflab.replications import check_experiment

    spec = read_yaml(ROOT / "configs/replications/r1_zero.yaml")
    spec["base"]["seed"] = 7
    shared = check_experiment(R.Spec, {**spec["experiment"], "seeds": [0, 1, 2]}, "x")
    assert R.base_keys(spec, shared) == {"shared": 7}
    own = check_experiment(R.Spec, {**spec["experiment"], "seeds": [0, 2], "shared_base": False},
                           "x")  # fmt: skip
    assert R.base_keys(spec, own) == {"seed0": 0, "seed2": 2}
