"""Benchmarks 1-4: GRPO, DPO, reward-model and SFT steps against TRL; generation against `generate`.

rlhflab's side of the step rows is the trainer itself, stepped through the run harness
(`bench/ours.py`, `OursRun`); TRL's side is its trainer's own `train()` (`bench/trl_driver.py`,
`Alternate` runs one rlhflab step after each TRL step)."""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

from bench import common
from bench.common import Pair, vowel_reward
from bench.ours import OursRun, dpo_config, grpo_config, rm_config, sft_config, write_jsonl
from bench.trl_driver import Alternate, common_args, grpo_args

LR = 1e-5

# Per scale: GRPO (prompts, group, new tokens), DPO/RM pairs and completion words, generation batch.
SETTINGS = {
    common.TINY: dict(grpo=(8, 8, 64), pairs=32, comp_words=(6, 14), gen=(64, 64), prompt_len=None),
    common.SMOL: dict(grpo=(2, 4, 32), pairs=4, comp_words=(6, 14), gen=(8, 32), prompt_len=None),
}
if common.SMOKE:  # the smallest sizes: the rows' code runs, nothing is measured
    SETTINGS = {k: dict(grpo=(2, 2, 4), pairs=2, comp_words=(2, 4), gen=(2, 4), prompt_len=None)
                for k in SETTINGS}  # fmt: skip


def _trl_reward(completions, **kwargs):
    return vowel_reward(completions)


def trl_grpo_trainer(path, args, tok, prompts: list[str], callback):
    """TRL's GRPOTrainer on the bench's prompts and text reward (`_trl_reward`), with one
    callback (the timer); `args` is its GRPOConfig."""
    from datasets import Dataset
    from trl import GRPOTrainer

    return GRPOTrainer(
        model=str(path),
        reward_funcs=_trl_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        callbacks=[callback],
    )


def _phase_means(ours: OursRun, warmup: int) -> dict:
    return {"ours_perf_mean": ours.perf_means(warmup)}


def _ours_only(name: str, ours: OursRun, *, warmup: int, reps: int) -> Pair:
    """Without TRL (smoke test in an environment without the `bench` extra): rlhflab's side of
    a step row alone, its TRL value NaN."""
    for _ in range(warmup + reps):
        ours.step()
    ours.finish()
    return Pair(
        name,
        ours.step_s[warmup:],
        [float("nan")],
        "s/step",
        note="TRL side not run: trl is not installed",
        extra={"trl": None, **_phase_means(ours, warmup)},
    )


def grpo(scale: str, *, beta: float, warmup: int, reps: int, max_new: int | None = None) -> Pair:
    """GRPO step at fixed completion length; `max_new` overrides the scale's new tokens."""
    n_prompts, group, default_new = SETTINGS[scale]["grpo"]
    max_new = max_new or default_new
    if common.SMOKE:
        max_new = default_new
    path = common.model_dir(scale)
    tok, _ = common.load(path)
    plen = common.modal_prompt_length(tok)
    prompts = common.prompt_texts(tok, 64, seed=1, length=plen)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_jsonl(Path(tmp) / "prompts.jsonl", [{"prompt": p} for p in prompts])
        ours = OursRun(
            grpo_config(path, f"{tmp}/runs", data, steps=warmup + reps, n_prompts=n_prompts,
                        group=group, max_new=max_new, beta=beta, lr=LR),
            fixed_length=True,
        )  # fmt: skip
        name = f"grpo_step_{'ref' if beta > 0 else 'noref'}_{scale}"
        if not common.have_trl():
            return _ours_only(name, ours, warmup=warmup, reps=reps)
        from trl import GRPOConfig

        alt = Alternate(ours.step, ours.model)
        args = GRPOConfig(
            **common_args(f"{tmp}/trl", steps=warmup + reps, lr=LR),
            **grpo_args(
                n_prompts=n_prompts, group=group, max_new=max_new, beta=beta, fixed_length=True
            ),
        )
        trainer = trl_grpo_trainer(path, args, tok, prompts, alt)
        trainer.train()
        ours.finish()
        trl_lengths = trainer._metrics["train"].get("completions/mean_length", [])
    return Pair(
        name,
        alt.our_times[warmup:],
        alt.trl_times[warmup:],
        "s/step",
        target=0.5,
        note=(
            f"{n_prompts} prompts x group {group}, {max_new} new tokens (fixed), prompt {plen} tokens, "
            f"{'k3 KL beta=' + str(beta) + ' with reference model' if beta > 0 else 'no reference model'}"
        ),
        extra={
            "ours_completion_len_mean": ours.response_len[warmup:],
            "trl_completion_len_mean": trl_lengths[warmup:],
            **_phase_means(ours, warmup),
        },
    )


def _pairs(tok, n: int, scale: str, seed: int = 0) -> list[dict]:
    """n preference pairs: a spell_backward-like question (`question`, user text), its
    chat-rendered prompt (`prompt`, what TRL gets: a standard-format prompt is used as it is),
    random-word chosen and rejected completions."""
    from rlhflab.data.formatting import render_prompt

    rng = random.Random(seed)
    lo, hi = SETTINGS[scale]["comp_words"]
    out = []
    for w in common.words(n, seed=seed + 5):
        q = common.question(w)
        chosen = common.random_completion(rng, rng.randint(lo, hi))
        rejected = common.random_completion(rng, rng.randint(lo, hi))
        out.append({"question": q, "prompt": render_prompt(tok, q), "chosen": chosen,
                    "rejected": rejected})  # fmt: skip
    return out


def _pairs_file(path: Path, pairs: list[dict]) -> Path:
    """rlhflab's data file of `pairs` (format pairs: the prompt is user text, rendered with the
    chat template by the trainer, giving TRL's `prompt` text)."""
    return write_jsonl(path, [{"prompt": p["question"], "chosen": p["chosen"],
                               "rejected": p["rejected"]} for p in pairs])  # fmt: skip


def _trl_pairs(pairs: list[dict]):
    from datasets import Dataset

    return Dataset.from_dict({k: [p[k] for p in pairs] for k in ("prompt", "chosen", "rejected")})


def dpo(scale: str, *, precompute: bool, warmup: int, reps: int) -> Pair:
    B = SETTINGS[scale]["pairs"]
    path = common.model_dir(scale)
    tok, _ = common.load(path)
    pairs = _pairs(tok, B * (warmup + reps), scale)
    with tempfile.TemporaryDirectory() as tmp:
        data = _pairs_file(Path(tmp) / "pairs.jsonl", pairs)
        ours = OursRun(dpo_config(path, f"{tmp}/runs", data, steps=warmup + reps, batch=B,
                                  beta=0.1, lr=LR))  # fmt: skip
        kind = "cached" if precompute else "ref"
        if not common.have_trl():
            return _ours_only(f"dpo_step_{kind}_{scale}", ours, warmup=warmup, reps=reps)
        from trl import DPOConfig, DPOTrainer

        alt = Alternate(ours.step, ours.model)
        args = DPOConfig(
            **common_args(f"{tmp}/trl", steps=warmup + reps, lr=LR),
            per_device_train_batch_size=B,
            beta=0.1,
            loss_type=["sigmoid"],
            precompute_ref_log_probs=precompute,
            max_length=None,
            padding_free=False,  # TRL 1.16 turns it back off anyway; rlhflab packs (its design)
            label_smoothing=0.0,
            use_weighting=False,
            ld_alpha=None,
            sync_ref_model=False,
            activation_offloading=False,
            remove_unused_columns=True,  # TRL's default for DPO / RM: only its own columns
        )
        trainer = DPOTrainer(
            model=str(path),
            args=args,
            train_dataset=_trl_pairs(pairs),
            processing_class=tok,
            callbacks=[alt],
        )
        trainer.train()
        ours.finish()
    toks = sum(
        len(tok(p["prompt"], add_special_tokens=False)["input_ids"]) * 2
        + len(tok(p["chosen"], add_special_tokens=False)["input_ids"])
        + len(tok(p["rejected"], add_special_tokens=False)["input_ids"])
        for p in pairs[:B]
    )
    return Pair(
        f"dpo_step_{kind}_{scale}",
        alt.our_times[warmup:],
        alt.trl_times[warmup:],
        "s/step",
        target=0.6,
        note=(
            f"{B} pairs, sigmoid loss beta 0.1, ~{toks // B} tokens per pair; TRL: "
            + (
                "reference log-probs precomputed (precompute_ref_log_probs=True)"
                if precompute
                else "reference model forward every step (TRL default)"
            )
            + "; rlhflab: reference log-probs cached before training (its only mode)"
        ),
        extra=_phase_means(ours, warmup),
    )


def reward_model(scale: str, *, warmup: int, reps: int) -> Pair:
    from rlhflab.models.reward import save_reward_model

    B = SETTINGS[scale]["pairs"]
    path = common.model_dir(scale)
    tok, _ = common.load(path)
    pairs = _pairs(tok, B * (warmup + reps), scale, seed=3)
    with tempfile.TemporaryDirectory() as tmp:
        data = _pairs_file(Path(tmp) / "pairs.jsonl", pairs)
        # rlhflab's trainer builds the reward model (backbone + fresh head, seeded) at set-up;
        # TRL loads exactly these weights.
        ours = OursRun(rm_config(path, f"{tmp}/runs", data, steps=warmup + reps, batch=B, lr=LR))
        if not common.have_trl():
            return _ours_only(f"rm_step_{scale}", ours, warmup=warmup, reps=reps)
        from trl import RewardConfig, RewardTrainer

        rm_dir = f"{tmp}/rm"
        save_reward_model(ours.model, tok, rm_dir)
        alt = Alternate(ours.step, ours.model)
        args = RewardConfig(
            **common_args(f"{tmp}/out", steps=warmup + reps, lr=LR),
            per_device_train_batch_size=B,
            center_rewards_coefficient=None,
            max_length=None,
            activation_offloading=False,
            remove_unused_columns=True,
        )
        trainer = RewardTrainer(
            model=rm_dir,
            args=args,
            train_dataset=_trl_pairs(pairs),
            processing_class=tok,
            callbacks=[alt],
        )
        trainer.train()
        ours.finish()
    return Pair(
        f"rm_step_{scale}",
        alt.our_times[warmup:],
        alt.trl_times[warmup:],
        "s/step",
        target=0.8,
        note=f"Bradley-Terry, {B} pairs, chosen and rejected in one forward on both sides",
        extra=_phase_means(ours, warmup),
    )


def sft(scale: str, *, padding_free: bool, warmup: int, reps: int) -> Pair:
    """SFT on prompt/completion rows of uneven length (the DPO rows' chosen completions): our
    trainer (padding-free packing, its default) against TRL's SFTTrainer, padded (its default)
    or `padding_free=True` (one flattened row, boundaries from position ids)."""
    B = SETTINGS[scale]["pairs"]
    path = common.model_dir(scale)
    tok, _ = common.load(path)
    rows = _pairs(tok, B * (warmup + reps), scale, seed=7)
    kind = "padding_free" if padding_free else "padded"
    name = f"sft_step_{kind}_{scale}"
    with tempfile.TemporaryDirectory() as tmp:
        data = write_jsonl(Path(tmp) / "sft.jsonl", [{"prompt": r["question"],
                                                      "completion": r["chosen"]} for r in rows])  # fmt: skip
        ours = OursRun(sft_config(path, f"{tmp}/runs", data, steps=warmup + reps, batch=B, lr=LR))
        if not common.have_trl():
            return _ours_only(name, ours, warmup=warmup, reps=reps)
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        alt = Alternate(ours.step, ours.model)
        # SFTConfig has no `disable_dropout` (the models' dropout probabilities are 0 anyway)
        shared = {k: v for k, v in common_args(f"{tmp}/trl", steps=warmup + reps, lr=LR).items()
                  if k != "disable_dropout"}  # fmt: skip
        args = SFTConfig(
            **shared,
            per_device_train_batch_size=B,
            max_length=None,
            packing=False,
            padding_free=padding_free,
            completion_only_loss=True,  # rlhflab trains the completion (and its eos) only
            assistant_only_loss=False,
            loss_type="nll",
            shuffle_dataset=False,
            activation_offloading=False,
            remove_unused_columns=True,
        )
        # TRL leaves a standard prompt unrendered: it gets the text rlhflab's trainer renders
        trainer = SFTTrainer(
            model=str(path),
            args=args,
            train_dataset=Dataset.from_dict(
                {"prompt": [r["prompt"] for r in rows], "completion": [r["chosen"] for r in rows]}
            ),
            processing_class=tok,
            callbacks=[alt],
        )
        trainer.train()
        ours.finish()
    toks = sum(len(tok(r["prompt"] + r["chosen"], add_special_tokens=False)["input_ids"])
               for r in rows[:B])  # fmt: skip
    return Pair(
        name,
        alt.our_times[warmup:],
        alt.trl_times[warmup:],
        "s/step",
        target=0.6,
        note=(
            f"{B} prompt/completion rows, ~{toks // B} tokens each, completion-only NLL; TRL: "
            + ("padding_free=True" if padding_free else "padded batches (its default)")
            + "; rlhflab: packed padding-free (its default)"
        ),
        extra=_phase_means(ours, warmup),
    )


def generation(scale: str, *, warmup: int, reps: int) -> Pair:
    from rlhflab.data.formatting import encode_prompt
    from rlhflab.rollout.sampler import left_pad, sample

    batch, max_new = SETTINGS[scale]["gen"]
    path = common.model_dir(scale)
    tok, model = common.load(path)
    model.eval()
    plen = common.modal_prompt_length(tok)
    prompts = [encode_prompt(tok, p) for p in common.prompt_texts(tok, batch, seed=2, length=plen)]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    gen_a = torch.Generator().manual_seed(0)
    n_tokens = batch * max_new

    def ours():
        t0 = __import__("time").perf_counter()
        ro = sample(
            model,
            prompts,
            max_new_tokens=max_new,
            eos_token_id=-1,
            pad_token_id=tok.pad_token_id,
            temperature=1.0,
            generator=gen_a,
        )
        dt = __import__("time").perf_counter() - t0
        assert int(ro.mask.sum()) == n_tokens
        return n_tokens / dt

    def theirs():
        t0 = __import__("time").perf_counter()
        out = common.generate_sampled(
            model, ids, mask, pad_token_id=tok.pad_token_id, max_new=max_new
        )
        dt = __import__("time").perf_counter() - t0
        assert out.size(1) - ids.size(1) == max_new
        return n_tokens / dt

    a, b = common.alternate(ours, theirs, warmup=warmup, reps=reps)
    return Pair(
        f"generation_{scale}",
        a,
        b,
        "completion tokens/s",
        higher_is_better=True,
        target=2.0,
        note=f"batch {batch}, prompt {plen} tokens, {max_new} sampled tokens each (temperature 1, no EOS stop); theirs = model.generate(do_sample=True)",
    )


def generation_groups(scale: str, *, warmup: int, reps: int, groups: int = 8, group: int = 8,
                      max_new: int = 32) -> Pair:  # fmt: skip
    """Rollout of `groups` prompts × `group` samples (GRPO's layout): the sampler with prefix
    sharing (each prompt prefilled once, its KV cache copied to the group) against the same
    sampler prefilling every row. Same tokens on both sides (fixed length, EOS never matches)."""
    import time

    from rlhflab.data.formatting import encode_prompt
    from rlhflab.rollout.sampler import sample

    if common.SMOKE:
        groups, group, max_new = 2, 2, 4
    path = common.model_dir(scale)
    tok, model = common.load(path)
    model.eval()
    plen = common.modal_prompt_length(tok)
    distinct = [
        encode_prompt(tok, p) for p in common.prompt_texts(tok, groups, seed=3, length=plen)
    ]
    prompts = [p for p in distinct for _ in range(group)]
    n_tokens = len(prompts) * max_new

    def run(share: bool):
        def fn():
            t0 = time.perf_counter()
            ro = sample(model, prompts, max_new_tokens=max_new, eos_token_id=-1,
                        pad_token_id=tok.pad_token_id, generator=torch.Generator().manual_seed(0),
                        share_prefix=share)  # fmt: skip
            dt = time.perf_counter() - t0
            assert int(ro.mask.sum()) == n_tokens
            return n_tokens / dt

        return fn

    a, b = common.alternate(run(True), run(False), warmup=warmup, reps=reps)
    return Pair(
        f"generation_groups_{scale}",
        a,
        b,
        "completion tokens/s",
        higher_is_better=True,
        target=1.0,
        note=f"{groups} prompts x {group} samples, prompt {plen} tokens, {max_new} sampled tokens; theirs = the same sampler without prefix sharing (every row prefilled)",
    )


def generation_eos(*, warmup: int, reps: int, batch: int = 64, max_new: int = 24) -> Pair:
    """Generation with natural stopping: the quickstart's SFT model answers and emits EOS after a
    few tokens, at temperature 1 some completions run on. Both sides count real completion tokens
    (up to and including the first EOS); `generate` keeps decoding finished rows until the last
    row stops, rlhflab's sampler drops them."""
    import time

    from bench.learning import _splits, sft_model
    from rlhflab.data.formatting import encode_prompt, render_prompt
    from rlhflab.rollout.sampler import left_pad, sample

    if common.SMOKE:
        batch, max_new = 2, 4

    tok, model = common.load(sft_model())
    model.eval()
    problems = _splits().train[:batch]
    prompts = [encode_prompt(tok, render_prompt(tok, p.question)) for p in problems]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    gen = torch.Generator().manual_seed(0)
    lengths = {"ours": [], "theirs": []}

    def ours():
        t0 = time.perf_counter()
        ro = sample(
            model,
            prompts,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=pad,
            temperature=1.0,
            generator=gen,
        )
        dt = time.perf_counter() - t0
        n = int(ro.mask.sum())
        lengths["ours"].append(n / batch)
        return n / dt

    def theirs():
        t0 = time.perf_counter()
        out = common.generate_sampled(
            model, ids, mask, pad_token_id=pad, max_new=max_new, eos_token_id=eos
        )
        dt = time.perf_counter() - t0
        comp = out[:, ids.size(1) :]
        is_eos = comp == eos
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, comp.size(1))
        n = int(first.sum())
        lengths["theirs"].append(n / batch)
        return n / dt

    a, b = common.alternate(ours, theirs, warmup=warmup, reps=reps)
    return Pair(
        "generation_eos_sft",
        a,
        b,
        "completion tokens/s",
        higher_is_better=True,
        target=2.0,
        note=(
            f"quickstart SFT model (0.5 M params, vocab 300), batch {batch} spell_backward prompts, up to {max_new} "
            "tokens, stop at EOS, temperature 1; tokens counted up to EOS on both sides; mean completion length "
            f"ours {sum(lengths['ours']) / len(lengths['ours']):.1f}, generate {sum(lengths['theirs']) / len(lengths['theirs']):.1f}"
        ),
    )


def grpo_eos(*, warmup: int, reps: int) -> Pair:
    """The GRPO step in the quickstart's setting: its SFT model, 16 task prompts x group 8, up to
    10 new tokens with natural EOS, the binary verifier reward, no reference model — the shape of
    a real RL step, where completions stop early and a group shares its prompt. rlhflab's side
    is the trainer on the quickstart's task (`correctness`: the task's verifier); TRL gets the
    same prompts (rendered as the trainer renders them) and the trainer's verifier."""
    from datasets import Dataset

    from bench.learning import _task, sft_model
    from rlhflab.data.prompts import render_row

    path = sft_model()
    tok, _ = common.load(path)
    n_prompts, group, max_new = (2, 2, 4) if common.SMOKE else (16, 8, 10)
    with tempfile.TemporaryDirectory() as tmp:
        ours = OursRun(
            grpo_config(path, f"{tmp}/runs", None, steps=warmup + reps, n_prompts=n_prompts,
                        group=group, max_new=max_new, beta=0.0, lr=LR, task=_task())
        )  # fmt: skip
        if not common.have_trl():
            return _ours_only("grpo_step_eos_sft", ours, warmup=warmup, reps=reps)
        from trl import GRPOConfig, GRPOTrainer

        tr = ours.trainer
        problems = tr.splits.train[:2000]
        prompts = [
            render_row(tok, p, system=tr.prompts.system, instruction=tr.prompts.instruction)
            for p in problems
        ]

        def trl_reward(completions, idx, **kwargs):
            return [
                tr.verifier.score(c, problems[i]) for c, i in zip(completions, idx, strict=True)
            ]

        alt = Alternate(ours.step, ours.model)
        args = GRPOConfig(
            **common_args(f"{tmp}/trl", steps=warmup + reps, lr=LR),
            **grpo_args(
                n_prompts=n_prompts, group=group, max_new=max_new, beta=0.0, fixed_length=False
            ),
        )
        trainer = GRPOTrainer(
            model=str(path),
            reward_funcs=trl_reward,
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts, "idx": list(range(len(prompts)))}),
            processing_class=tok,
            callbacks=[alt],
        )
        trainer.train()
        ours.finish()
    lens = ours.response_len[warmup:]
    return Pair(
        "grpo_step_eos_sft",
        alt.our_times[warmup:],
        alt.trl_times[warmup:],
        "s/step",
        target=0.5,
        note=(
            f"quickstart SFT model (0.5 M params, vocab 300), {n_prompts} spell_backward prompts x group {group}, "
            f"up to {max_new} new tokens with natural EOS (ours: {sum(lens) / max(1, len(lens)):.1f} "
            "tokens per completion on average), binary verifier reward, no reference model"
        ),
        extra={"ours_completion_len_mean": lens, **_phase_means(ours, warmup)},
    )
