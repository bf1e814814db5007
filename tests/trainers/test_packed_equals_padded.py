"""Padding-free packing (`rlhflab.models.packing`, the CPU's layout: sequences of uneven lengths
in shared rows, a GRPO group's or a pair's prompt written once) against the padded layout, per
trainer: the same gradients at every step and the same weights after 3 steps, in float64.

The padded arm turns packing off (`MIN_SAVING` 1.0: no layout saves enough); the packed arm must
actually pack (counted). One process here (the tree layout). Under FSDP2 ranks pack in the
varlen layout: one process against 2 FSDP2 ranks is tests/distributed
(test_two_ranks_equal_one_process per trainer, and test_fsdp2_ranks_pack_varlen_and_equal_one_
padded_process for the log-prob and reward paths, checked to pack). A mask that let a token see
another sequence's tokens would change that token's log-prob and every gradient: these
comparisons fail.
"""

from __future__ import annotations

import json

import pytest
import torch
from factories import tiny_dpo, tiny_pg, tiny_sft, tiny_task, uneven_step_rows
from safetensors.torch import load_file

import rlhflab.models.packing as packing
from rlhflab.config import config_from_dict
from rlhflab.trainers import run_config

EPS = torch.finfo(torch.float64).eps


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed_base")
    sft = tiny_sft(root, train={"steps": 30, "batch_size": 8, "micro_batch_size": 8, "max_len": 48})
    return run_config(config_from_dict(sft))["model_dir"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A stronger model with the base's tokenizer (SFT 60 steps), for distillation."""
    root = tmp_path_factory.mktemp("packed_teacher")
    sft = tiny_sft(root, train={"steps": 60, "batch_size": 8, "micro_batch_size": 8, "max_len": 48})
    return run_config(config_from_dict(sft))["model_dir"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Preference pairs of very different lengths (1 to 12 characters a side), and beside them
    `sft.jsonl`, prompt-completion rows of 1 to 30 completion characters."""
    path = tmp_path_factory.mktemp("packed_pairs") / "pairs.jsonl"
    rows = [
        {"prompt": f"What is {i} + {i % 3}?", "chosen": str(i) * (1 + i % 4),
         "rejected": "x" * (1 + (5 * i) % 12)}
        for i in range(24)
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(r) for r in rows))
    sft = [{"prompt": f"Say {i}.", "completion": "y" * (1 + (7 * i) % 30)} for i in range(24)]
    (path.parent / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in sft))
    steps = uneven_step_rows()  # PRM and ORM data
    (path.parent / "steps.jsonl").write_text("\n".join(json.dumps(r) for r in steps))
    return path


def _raw(family: str, root, base, pairs, teacher=None) -> dict:
    f64 = {"name_or_path": base, "dtype": "float64"}
    if family == "distill":  # GKD: full-distribution generalized JSD, student and teacher samples
        return {
            "trainer": "distill", "model": f64, "task": tiny_task(),
            "teacher": {"source": "model", "name_or_path": teacher, "dtype": "float64"},
            "rollout": {"prompts_per_step": 8, "group_size": 1, "max_new_tokens": 8},
            "loss": {"divergence": "generalized_jsd", "divergence_args": {"beta": 0.5},
                     "lmbda": 0.5},
            "train": {"steps": 3, "micro_batch_size": 8}, "optim": {"lr": 1e-3},
            "eval": {"n": 0}, "tracking": {"console": False},
            "run": {"name": "distill", "root": str(root)},
        }  # fmt: skip
    if family == "sft":  # prompt-completion rows of 1 to 30 completion characters
        data = {"source": "dataset", "path": str(pairs.parent / "sft.jsonl")}
        return tiny_sft(root, model=f64, data=data,
                        train={"steps": 3, "batch_size": 8, "micro_batch_size": 8, "max_len": 64})  # fmt: skip
    if family.startswith("grpo") or family == "ppo":
        # a length term beside correctness, so that every group's rewards vary
        reward = {"components": [{"name": "correctness", "weight": 1.0},
                                 {"name": "length", "weight": 0.5}]}  # fmt: skip
        more = {
            "grpo": {},
            # the entropy bonus: its (N, V) logits pass with gradients
            "grpo_entropy": {"loss": {"entropy_coef": 0.05}},
            # OTB: Σπ² of every completion position, a no-grad logits pass
            "grpo_otb": {"loss": {"advantage": "optimal_token_baseline"}},
            # PPO: the critic's values and their gradients
            "ppo": {"loss": {"advantage": "gae", "advantage_args": {"gamma": 1.0, "lam": 0.95}},
                    "value": {"clip_range": 0.2, "optim": {"lr": 1e-3}}},
        }[family]  # fmt: skip
        return tiny_pg(root, base, model=f64, reward=reward,
                       train={"steps": 3, "micro_batch_size": 8}, **more)  # fmt: skip
    if family == "dpo":
        return tiny_dpo(root, base, model=f64,
                        train={"steps": 3, "batch_size": 4, "micro_batch_size": 2})  # fmt: skip
    if family in ("prm", "orm"):  # token logits: the PRM's at every step, the ORM's token BCE
        loss = {"num_classes": 2} if family == "prm" else {"orm_loss": "orm_bce"}
        return {
            "trainer": "reward_model", "kind": family, "model": f64, "loss": loss,
            "data": {"source": "step_labelled", "path": str(pairs.parent / "steps.jsonl"),
                     "heldout_frac": 0.25, "max_len": 96},
            "train": {"steps": 3, "batch_size": 8, "micro_batch_size": 4}, "optim": {"lr": 1e-3},
            "tracking": {"console": False}, "run": {"name": family, "root": str(root)},
        }  # fmt: skip
    return {
        "trainer": "reward_model", "kind": "preference", "model": f64,
        "data": {"source": "preference", "path": str(pairs), "format": "pairs", "max_len": 64},
        "train": {"steps": 3, "batch_size": 8, "micro_batch_size": 4}, "optim": {"lr": 1e-3},
        "eval": {"n_problems": 4}, "tracking": {"console": False},
        "run": {"name": "rm", "root": str(root)},
    }  # fmt: skip


@pytest.mark.parametrize(
    "family",
    ["sft", "grpo", "grpo_entropy", "grpo_otb", "ppo", "dpo", "rm", "prm", "orm", "distill"],
)
def test_packed_equals_padded(family, base, pairs, tmp_path, monkeypatch, request):
    teacher = request.getfixturevalue("teacher") if family == "distill" else None
    packed_calls = []
    real = packing.packed_layout

    def counted(*args, **kwargs):
        lay = real(*args, **kwargs)
        packed_calls.append(lay is not None)
        return lay

    monkeypatch.setattr(packing, "packed_layout", counted)  # what layout_for calls
    # the pass this family adds must itself pack, not only the log-prob passes beside it
    own_pass = {"grpo_entropy": "entropy", "grpo_otb": "entropy", "ppo": "critic",
                "prm": "token", "orm": "token"}.get(family)  # fmt: skip
    own_packed = []
    if own_pass == "entropy":  # logps_with_entropy / no_grad_sum_pi_squared → completion_head
        import rlhflab.trainers.pg_phases as pg_phases

        real_head = pg_phases.completion_head

        def head_spy(model, rollout, *args, **kwargs):
            own_packed.append(packing.layout_for(model, rollout, sharded=False) is not None)
            return real_head(model, rollout, *args, **kwargs)

        monkeypatch.setattr(pg_phases, "completion_head", head_spy)
    elif own_pass == "token":  # completion_token_logits reads packing.token_positions
        real_positions = packing.token_positions

        def positions_spy(*args, **kwargs):
            own_packed.append(True)
            return real_positions(*args, **kwargs)

        monkeypatch.setattr(packing, "token_positions", positions_spy)
    elif own_pass == "critic":  # ValueModel.forward reads packing.backbone_layout at call time
        real_backbone = packing.backbone_layout

        def backbone_spy(*args, **kwargs):
            lay = real_backbone(*args, **kwargs)
            own_packed.append(lay is not None)
            return lay

        monkeypatch.setattr(packing, "backbone_layout", backbone_spy)
    runs = {}
    for arm in ("packed", "padded"):
        # distillation's rows (one completion a prompt) pack wherever a layout exists
        saving = {"padded": 1.0, "packed": float("-inf") if family == "distill" else 0.15}[arm]
        monkeypatch.setattr(packing, "MIN_SAVING", saving)
        monkeypatch.setenv("RLHFLAB_GRAD_DUMP", str(tmp_path / f"grads-{arm}"))
        raw = _raw(family, tmp_path / arm, base, pairs, teacher)
        runs[arm] = run_config(config_from_dict(raw))
        if arm == "packed":
            assert any(packed_calls), "the packed arm never packed"
            assert own_pass is None or any(own_packed), f"the {own_pass} pass never packed"
            packed_calls.clear()
            own_packed.clear()
    assert not any(packed_calls), "the padded arm packed"
    assert not any(own_packed), "the padded arm packed its own pass"

    def step_of(path):  # grads-<n>.safetensors, n counted per process (not per run)
        return int(path.stem.split("-")[1])

    dumps = {
        arm: [load_file(p) for p in
              sorted((tmp_path / f"grads-{arm}").glob("*.safetensors"), key=step_of)]
        for arm in runs
    }  # fmt: skip
    # one dump per optimizer step (PPO: the policy's and the critic's)
    assert len(dumps["packed"]) == len(dumps["padded"]) == (6 if family == "ppo" else 3)
    g_max = []
    for ga, gb in zip(dumps["packed"], dumps["padded"], strict=True):
        g_max.append(max(g.abs().max().item() for g in gb.values()))
        for k in gb:
            assert ga[k].dtype == torch.float64
            # float64 rounding of sums of up to ~1e4 terms, relative to the largest gradient
            torch.testing.assert_close(ga[k], gb[k], atol=1e4 * EPS * g_max[-1], rtol=0,
                                       msg=lambda m, k=k: f"{k}: {m}")  # fmt: skip
    assert min(g_max) > 0
    # AdamW moves a weight by lr·m/(sqrt(v) + eps): a gradient difference δ by at most lr·δ/eps
    # per step (the worst case, g ≈ 0)
    lr, eps_adam = 1e-3, 1e-8
    atol = sum(lr / eps_adam * 1e4 * EPS * g for g in g_max)
    wa, wb = (load_file(f"{runs[a]['model_dir']}/model.safetensors") for a in ("packed", "padded"))
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], atol=atol, rtol=0, msg=lambda m, k=k: f"{k}: {m}")
