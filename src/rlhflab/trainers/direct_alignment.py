"""Direct alignment: DPO and its relatives (cDPO, IPO, hinge, DPO-norm, SimPO, ORPO, APO, KTO).

Each step reads top to bottom:
    1. batch      `batch_size` pairs (KTO: labelled completions), micro-batches of `micro_batch_size`
    2. forward    chosen and rejected completions of a micro-batch in ONE forward
                  (KTO: the labelled completions and their mismatched (x_i, y_j) pairs), packed with
                  dynamic padding by `rollout.sampler.pack`, scored by `completion_logps` exactly as
                  SFT targets and sampled completions are; summed token log-probs and lengths
    3. loss       `loss.name` from rlhflab.losses.preference on (policy, cached reference) log-probs,
                  summed over the micro-batch and divided by the step's batch size
    4. log        dpo/* rewards, margin, accuracy, log-probs, loss-specific terms, grad norm, LR;
                  held-out preference accuracy every eval.pref_every steps; in-loop samples
Before training, a reference pass computes log π_ref of every sequence once (model in eval mode,
no gradients) and caches it with the dataset: no reference model is in memory while training.
Reference-free losses (SimPO, ORPO) skip it.

Data: a preference file (UltraFeedback, HH-RLHF, generic pairs, unpaired KTO rows), or verifiable
pairs — K samples per task prompt from the policy, best vs worst by the verifier (or the gold
answer). With `verifiable.rounds` > 1 this is iterative/online DPO: each round samples new pairs from
the current policy, which also becomes the reference for that round (Xu et al. 2023,
arXiv 2312.16682; Yuan et al. 2024, arXiv 2401.10020).

KTO: every labelled completion gets, once at data preparation, a fixed mismatched completion of
another prompt; z₀ is the mean reference-normalised log-ratio of the mismatched pairs of the
micro-batch (as TRL per device batch), so with KTO micro-batching changes z₀ slightly; for every
other loss k micro-batches give exactly the gradient of one batch (tested).
Sampled completions are decoded and re-encoded with `encode_completion` (eos appended), exactly as
SFT targets are, so a sample cut at max_new_tokens is trained as if it had ended there.

Held-out preference accuracy: fraction of held-out pairs whose implicit reward margin is positive,
measured against the initial model (reference-based losses: (log π_θ − log π_ref)(y_w) >
(log π_θ − log π_ref)(y_l), summed log-probs; reference-free losses: average log-prob of y_w >
that of y_l); ties count one half, so a reference-based method starts at exactly 0.5.
"""

from __future__ import annotations

import inspect
import random
import time

import torch

from rlhflab import distributed, faults
from rlhflab.checkpoint import Checkpointer, StopSignals
from rlhflab.config import DPOConfig
from rlhflab.data.formatting import encode_prompt, format_completion, task_instruction
from rlhflab.data.preference import (
    PreferencePair,
    TokenizedPair,
    UnpairedExample,
    load_preference_data,
    pairs_from_scored_samples,
    tokenize_pairs,
)
from rlhflab.data.prompts import load_prompt_source, render_row
from rlhflab.data.tasks import task_texts
from rlhflab.errors import DataError
from rlhflab.eval.accuracy import majority_baseline, majority_results
from rlhflab.fingerprint import data_fingerprint
from rlhflab.health import HealthMonitor
from rlhflab.losses.preference import PREFERENCE_LOSSES, REFERENCE_FREE
from rlhflab.models.loading import context_length
from rlhflab.models.lora import adapters_disabled, apply_lora
from rlhflab.ops import upcast
from rlhflab.plots import plot_run
from rlhflab.rewards.shaping import TextRewardScorer, score_components
from rlhflab.rewards.verifier import Verifier
from rlhflab.rollout.engines import SamplingParams, make_engine
from rlhflab.rollout.sampler import completion_logps, decode_completions, pack
from rlhflab.runs import SampleWriter, write_json_atomic
from rlhflab.tracking import Tracker, progress, read_metrics
from rlhflab.trainers.common import (
    NonFiniteGuard,
    ShuffledStream,
    TimeBudget,
    check_context_fit,
    default_device,
    grad_norm_and_clip,
    heldout_eval,
    make_optimizer,
    make_scheduler,
    open_run,
    prepare_model,
    resume_point,
    save_final_model,
    seed_everything,
    setup_precision,
)

#: Held-out margins closer to 0 than this are ties (float32 noise of summed log-probs is ~1e-5).
PREF_TIE_TOL = 1e-4


def sequence_logps(model, prompts, completions, pad_id, *, autocast_dtype=None):
    """Summed completion log-probs (N,) and completion lengths (N,) of N (prompt, completion)
    token lists, in one forward (dynamic padding to the longest row)."""
    device = next(model.parameters()).device
    batch = pack(prompts, completions, pad_id).to(device)
    logp, _ = completion_logps(model, batch, autocast_dtype=autocast_dtype)
    return logp.sum(1), batch.mask.sum(1)


@torch.no_grad()
def reference_logps(model, prompts, completions, pad_id, *, chunk: int, autocast_dtype=None):
    """log π(y|x) summed over tokens for every row, in eval mode without gradients → list[float]."""
    was_training = model.training
    model.eval()
    out: list[float] = []
    for s in range(0, len(prompts), chunk):
        lp, _ = sequence_logps(
            model,
            prompts[s : s + chunk],
            completions[s : s + chunk],
            pad_id,
            autocast_dtype=autocast_dtype,
        )
        out.extend(upcast(lp).cpu().tolist())
    model.train(was_training)
    return out


def paired_rows(tokenized: list[TokenizedPair]) -> list[dict]:
    """Tokenized pairs as row dicts {prompt, chosen, rejected} of token ids (the trainer's data rows)."""
    return [
        {"prompt": t.prompt_ids, "chosen": t.chosen_ids, "rejected": t.rejected_ids}
        for t in tokenized
    ]


def unpaired_rows(tokenized: list[TokenizedPair], rng: random.Random) -> list[dict]:
    """KTO rows from pairs: (x, y_w, desirable) and (x, y_l, undesirable), each with a fixed
    mismatched completion y' of another prompt for the z₀ estimate (KTO paper §4.1)."""
    rows = []
    for t in tokenized:
        rows.append({"prompt": t.prompt_ids, "completion": t.chosen_ids, "label": True})
        rows.append({"prompt": t.prompt_ids, "completion": t.rejected_ids, "label": False})
    return _with_mismatched(rows, rng)


def _with_mismatched(rows: list[dict], rng: random.Random) -> list[dict]:
    n = len(rows)
    if n < 2:
        raise DataError("data: KTO needs at least 2 examples to form mismatched pairs")
    shift = rng.randrange(1, n)
    for i, row in enumerate(rows):  # a cyclic shift never pairs a row with itself
        j = (i + shift) % n
        k = 1
        while rows[j]["prompt"] == row["prompt"] and k < n:
            j = (i + shift + k) % n
            k += 1
        row["kl_completion"] = rows[j]["completion"]
    return rows


def cache_reference(model, rows, pad_id, *, unpaired, chunk, autocast_dtype) -> None:
    """Add cached reference log-probs to every row (`ref_chosen`/`ref_rejected`, KTO: `ref`/`ref_kl`)."""
    keys = (
        (("completion", "ref"), ("kl_completion", "ref_kl"))
        if unpaired
        else (
            ("chosen", "ref_chosen"),
            ("rejected", "ref_rejected"),
        )
    )
    # Each data-parallel rank scores a contiguous share of the rows; the values are gathered so
    # that every rank holds the whole cache (its rows change from step to step).
    mine = distributed.shard(rows, even=False)
    for src, dst in keys:
        with distributed.gathered(model):
            values = reference_logps(
                model,
                [r["prompt"] for r in mine],
                [r[src] for r in mine],
                pad_id,
                chunk=chunk,
                autocast_dtype=autocast_dtype,
            )
        values = [v for part in distributed.all_gather_object(values) for v in part]
        for r, v in zip(rows, values, strict=True):
            r[dst] = v


def verifiable_pairs(
    model, tokenizer, problems, verifier, vcfg, task, *, generator, rng, chunk, autocast_dtype,
    system=None, instruction=None,
):  # fmt: skip
    """Sample K completions per prompt row from `model`, score them (the task's verifier, or
    `vcfg.reward` components: reward functions, a reward model), pair best with worst. Prompts
    carry `system` and the answer-format `instruction` (`render_row`).

    Returns (pairs, counts): `pairs_from_scored_samples`' counts plus the mean label of the
    sampled completions under one of three names: `sample_accuracy` (binary verifier: the
    fraction correct), `sample_verifier_score_mean` (partial-credit verifier) or
    `sample_reward_mean` (the weighted sum of the `verifiable.reward` components, e.g. a reward
    model's score: never an accuracy)."""
    prompts = [render_row(tokenizer, p, system=system, instruction=instruction) for p in problems]
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    K = vcfg.samples_per_prompt
    texts: list[str] = []
    scores: list[float] = []
    flat = [p for p in ids for _ in range(K)]
    rows = [p for p in problems for _ in range(K)]
    was_training = model.training
    model.eval()
    # Every data-parallel rank samples every prompt with the same draws (the generators are in
    # step), so all ranks build the same pairs; under FSDP2 the parameters are gathered once.
    # Through the hf rollout engine; a group's repeated prompt is prefilled once (prefix sharing).
    engine = make_engine(None, model, tokenizer, autocast_dtype=autocast_dtype)
    params = SamplingParams(max_new_tokens=vcfg.max_new_tokens, temperature=vcfg.temperature)
    with distributed.gathered(model):
        pieces = range(0, len(flat), chunk)
        for s in progress(pieces, f"sampling pairs ({len(problems)} prompts x {K})"):
            ro = engine.generate(flat[s : s + chunk], params, generator=generator)
            chunk_texts = decode_completions(tokenizer, ro, engine.stop_token_ids)
            texts.extend(chunk_texts)
            if vcfg.reward is not None:  # labelled by reward components, as in policy gradients
                total, _ = score_components(
                    vcfg.reward,
                    {
                        "texts": chunk_texts,
                        "problems": rows[s : s + chunk],
                        "verifier": verifier,
                        "lengths": ro.lengths.cpu(),
                        "truncated": ro.truncated.cpu(),
                        "max_new_tokens": vcfg.max_new_tokens,
                        "rollout": ro,
                    },
                    where="pair sampling",
                )
                scores.extend(total.tolist())
    model.train(was_training)
    if vcfg.reward is None:
        scores = verifier.score_batch(texts, rows)
    samples = [texts[i * K : (i + 1) * K] for i in range(len(problems))]
    score_rows = [scores[i * K : (i + 1) * K] for i in range(len(problems))]
    gold = [
        None
        if p.answer is None or getattr(p, "problem", True) is None  # dataset rows: no gold
        else format_completion(p.answer, answer_format=task.answer_format)
        for p in problems
    ]
    pairs, counts = pairs_from_scored_samples(
        prompts, samples, score_rows, gold=gold, chosen_source=vcfg.chosen, rng=rng
    )
    # The mean label of the sampled completions, named for what it is: an accuracy only when it
    # is the fraction a binary verifier marks correct; a partial-credit verifier gives a mean
    # score, reward components (functions, a reward model) a mean weighted-sum reward.
    mean = sum(scores) / max(1, len(scores))
    if vcfg.reward is not None:
        counts["sample_reward_mean"] = mean
    elif getattr(verifier, "reward", "binary") == "binary":
        counts["sample_accuracy"] = mean
    else:
        counts["sample_verifier_score_mean"] = mean
    return pairs, counts


def train(cfg: DPOConfig) -> dict:
    """Run direct alignment as configured; returns final results (also in final_results.json)."""
    t_start = time.perf_counter()
    # -- 0. Set-up and validation: nothing is written before the run directory.
    ckpt = resume_point(cfg)  # the verified checkpoint to continue from, or None
    seed_everything(cfg.seed)
    device = default_device()
    autocast_dtype = setup_precision(cfg.precision, device)
    loss_fn = PREFERENCE_LOSSES[cfg.loss.name]
    unpaired = cfg.loss.name == "kto"
    use_ref = cfg.loss.name not in REFERENCE_FREE
    wants_lengths = "chosen_lengths" in inspect.signature(loss_fn).parameters
    verifiable = cfg.data.source == "verifiable"
    t = cfg.task
    v = cfg.verifiable
    # Task accuracy only where a task is the run's own: verifiable pairs, or a `task` section
    # set explicitly beside a preference file (never the default task's).
    task_eval = cfg.eval.n > 0 and (verifiable or "task" in cfg.model_fields_set)
    splits = None
    if verifiable or task_eval or cfg.model.build is not None:
        splits = load_prompt_source(cfg.prompts, t, seed=cfg.seed)
    system = t.system if cfg.prompts.source == "task" else cfg.prompts.system
    # The answer-format instruction after each task question (task.instruction); none for datasets.
    instruction = task_instruction(t) if cfg.prompts.source == "task" else None
    tokenizer, model = prepare_model(
        cfg.model,
        device=device,
        seed=cfg.seed,
        tokenizer_texts=lambda: task_texts(splits, cfg.model.build.tokenizer_texts),
        sharded_later=not verifiable,  # verifiable pairs sample before wrap
    )
    pad = tokenizer.pad_token_id
    verifier = Verifier(answer_format=t.answer_format, reward=t.reward, extractor=t.extractor)
    # Held-out score: the task's verifier, or a prompt dataset's text-computable rewards.
    scorer = verifier
    if cfg.prompts.source == "dataset" and verifiable:
        scorer = TextRewardScorer(v.reward, verifier)
    heldout_tasks = splits.heldout[: cfg.eval.n] if splits is not None and task_eval else []
    # Beside every task accuracy: the most common training answer given to every held-out problem.
    baseline = (
        majority_baseline(splits.train, heldout_tasks, verifier)
        if heldout_tasks and scorer is verifier
        else None
    )
    chunk = 2 * cfg.train.micro_batch_size
    rng = random.Random(cfg.seed)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    tok_kw = {
        "max_prompt_len": cfg.data.max_prompt_len,
        "max_completion_len": cfg.data.max_completion_len,
        "truncation_side": cfg.data.truncation_side,
    }
    drops: dict[str, int] = {}
    data_counts: dict = {}

    def round_pairs() -> tuple[list[PreferencePair], dict]:
        problems = rng.sample(splits.train, min(v.n_prompts, len(splits.train)))
        return verifiable_pairs(
            model, tokenizer, problems, verifier, v, t,
            generator=generator, rng=rng, chunk=cfg.eval.batch_size, autocast_dtype=autocast_dtype,
            system=system, instruction=instruction,
        )  # fmt: skip

    file_unpaired = False  # a preference file of unpaired (KTO) rows
    if verifiable:
        heldout_pairs, data_counts["heldout"] = verifiable_pairs(
            model, tokenizer, splits.heldout[: cfg.data.heldout_pairs], verifier, v, t,
            generator=generator, rng=rng, chunk=cfg.eval.batch_size, autocast_dtype=autocast_dtype,
            system=system, instruction=instruction,
        )  # fmt: skip
        train_pairs, data_counts["round_1"] = round_pairs()
        examples = train_pairs
    else:
        examples, drops = load_preference_data(
            cfg.data.path,
            cfg.data.format,
            split=cfg.data.split,
            on_invalid=cfg.data.on_invalid,
            max_rows=cfg.data.max_rows,
        )
        rng.shuffle(examples)
        file_unpaired = isinstance(examples[0], UnpairedExample)  # format "unpaired" or detected
        if file_unpaired and not unpaired:
            raise DataError(f"data.path: {cfg.data.path} holds unpaired rows (prompt, completion, "
                            f"label): they need loss.name 'kto', not '{cfg.loss.name}'")  # fmt: skip
        n_held = cfg.data.heldout_pairs
        if not file_unpaired and n_held >= len(examples):
            raise DataError(f"data.heldout_pairs ({n_held}) must be smaller than the "
                            f"{len(examples)} pairs of {cfg.data.path}")  # fmt: skip
        heldout_pairs = [] if file_unpaired else examples[:n_held]
        train_pairs = examples if file_unpaired else examples[n_held:]
    if not train_pairs:
        raise DataError(
            f"data: no training pairs ({data_counts.get('round_1', {})}); with verifiable pairs "
            "the policy needs some correct and some wrong samples, or verifiable.chosen 'gold'"
        )

    def build_rows(pairs) -> tuple[list[dict], dict]:
        if file_unpaired:
            rows, counts = _tokenize_unpaired(tokenizer, pairs, tok_kw)
            return _with_mismatched(rows, rng), counts
        tokenized, counts = tokenize_pairs(tokenizer, pairs, **tok_kw)
        return (unpaired_rows(tokenized, rng) if unpaired else paired_rows(tokenized)), counts

    rows, trunc = build_rows(train_pairs)
    held_tok, _ = tokenize_pairs(tokenizer, heldout_pairs, **tok_kw)
    held_rows = paired_rows(held_tok)
    check_context_fit(rows, context_length(model), what="data (training rows)")
    check_context_fit(held_rows, context_length(model), what="data (held-out pairs)")
    distributed.check_split(cfg.train.batch_size, "train.batch_size", "rows")
    model = apply_lora(model, cfg.model.lora)  # model.lora unset: unchanged
    model = distributed.wrap(model, cfg.parallel)  # one process: unchanged
    optimizer = make_optimizer(model, cfg.optim)
    scheduler = make_scheduler(optimizer, cfg.optim, cfg.train.steps)

    # -- 1. Reference pass (once per round): cached log π_ref, no reference model kept. π_ref is
    #       the initial model: with LoRA, the base with its adapters disabled.
    t_ref = time.perf_counter()
    with adapters_disabled(model):
        if use_ref:
            cache_reference(
                model, rows, pad, unpaired=unpaired, chunk=chunk, autocast_dtype=autocast_dtype
            )
        if held_rows:  # held-out pairs are always scored against the initial model
            cache_reference(
                model, held_rows, pad, unpaired=False, chunk=chunk, autocast_dtype=autocast_dtype
            )
    t_ref = time.perf_counter() - t_ref

    # -- 2. Run directory (a resumed run continues in its own).
    run_dir = open_run(cfg, ckpt)
    tracker = Tracker.for_run(
        run_dir,
        cfg,
        headline=("train/loss", "dpo/accuracy", "eval/pref_accuracy", "eval/accuracy"),
        ckpt=ckpt,
    )
    samples = SampleWriter(run_dir, enabled=distributed.is_main(), tracker=tracker)
    health = HealthMonitor(cfg.health, model, print_fn=tracker.warn)
    tracker.print(
        f"run directory: {run_dir}  ({len(rows)} training rows, {len(held_rows)} held-out pairs, "
        f"dropped: {sum(drops.values()) if drops else 0}, truncated: {trunc}, "
        f"reference pass {t_ref:.1f}s)"
    )

    def run_eval(step: int) -> dict:
        res = heldout_eval(
            cfg,
            model,
            tokenizer,
            heldout_tasks,
            scorer,
            tracker,
            step,
            autocast_dtype,
            system=system,
            instruction=instruction,
            baseline=baseline,
        )
        health.observe_eval(step, res)  # held-out accuracy against dpo/margin: reward_hacking
        return res

    @torch.no_grad()
    def pref_eval(step: int) -> dict:
        if not held_rows:
            return {}
        was_training = model.training
        model.eval()
        with distributed.gathered(model):  # every rank scores every held-out pair
            margins = _held_margins(model, held_rows, cfg, pad, use_ref, autocast_dtype)
        model.train(was_training)
        m = torch.cat(margins)
        # Ties (|margin| within float32 noise, e.g. every pair while π_θ = π_ref) count one half.
        acc = ((m > PREF_TIE_TOL).float() + 0.5 * (m.abs() <= PREF_TIE_TOL).float()).mean()
        res = {
            "eval/pref_accuracy": acc.item(),
            "eval/pref_margin": m.mean().item(),
        }
        tracker.log(step, res)
        return res

    # -- 3. Training steps, in rounds (rounds > 1: new on-policy pairs and reference each round).
    #       Checkpoints hold model, optimizer, schedule, RNGs, the data position and, from round 2
    #       on, the round's pairs with their cached reference log-probs (round 1's are rebuilt
    #       exactly by the set-up above).
    steps_per_round = cfg.train.steps // v.rounds
    stream = ShuffledStream(  # shares rng with the rounds' prompt draws
        len(rows), rng,
        fingerprint=data_fingerprint([{k: v for k, v in r.items() if not k.startswith("ref")}
                                      for r in rows]),
        allow_change=cfg.run.allow_config_change,
    )  # fmt: skip
    last_loss = float("nan")
    B = cfg.train.batch_size
    guard = NonFiniteGuard(cfg.train.nan_policy, cfg.train.nan_max_skips)
    checkpointer = Checkpointer(
        run_dir,
        cfg.model_dump(mode="json"),
        modules={"model": model},
        optimizers={"optimizer": optimizer},
        schedulers={"scheduler": scheduler},
        generators={"sampler": generator},
        stateful={"data": stream, "nan": guard, "health": health, "tracker": tracker},
        every=cfg.checkpoint.every,
        keep_last=cfg.checkpoint.keep_last,
        resumed_from=ckpt,
        tokenizer=tokenizer,
    )

    def state() -> dict:
        later_round = verifiable and steps_done > steps_per_round
        return {
            "rows": rows if later_round else None,
            "data_counts": data_counts,
            "last_loss": last_loss,
            "initial_eval": initial_eval,
            "initial_pref": initial_pref,
        }

    steps_done = ckpt.step if ckpt is not None else 0
    if ckpt is not None:
        st = checkpointer.resume(ckpt, tracker, cfg.train.steps)
        last_loss, data_counts = st["last_loss"], st["data_counts"]
        initial_eval, initial_pref = st["initial_eval"], st["initial_pref"]
        if st["rows"] is not None:
            rows = st["rows"]
    else:
        initial_eval = run_eval(0) if heldout_tasks else {}
        initial_pref = pref_eval(0)
    budget = TimeBudget(cfg.train.max_seconds, cfg.train.steps, t_start)
    with StopSignals() as stop:  # SIGTERM / SIGINT: finish the step, checkpoint, exit
        for step in range(steps_done + 1, cfg.train.steps + 1):
            if verifiable and step > 1 and (step - 1) % steps_per_round == 0:
                r = (step - 1) // steps_per_round + 1
                new_pairs, data_counts[f"round_{r}"] = round_pairs()
                if new_pairs:
                    rows, _ = build_rows(new_pairs)
                    if use_ref:  # the reference of this round is the policy as it is now
                        cache_reference(
                            model,
                            rows,
                            pad,
                            unpaired=unpaired,
                            chunk=chunk,
                            autocast_dtype=autocast_dtype,
                        )
                    stream.restart(len(rows))
                tracker.print(f"round {r}: {data_counts[f'round_{r}']}")
            t0 = time.perf_counter()
            batch_idx = stream.take(B)  # the global batch; this rank trains on its share
            local_idx = distributed.shard(batch_idx)
            optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            n_tokens = 0
            for s in range(0, len(local_idx), cfg.train.micro_batch_size):
                mb = [rows[i] for i in local_idx[s : s + cfg.train.micro_batch_size]]
                n = len(mb)
                if unpaired:
                    comps = [r["completion"] for r in mb] + [r["kl_completion"] for r in mb]
                else:
                    comps = [r["chosen"] for r in mb] + [r["rejected"] for r in mb]
                logps, lengths = sequence_logps(
                    model, [r["prompt"] for r in mb] * 2, comps, pad, autocast_dtype=autocast_dtype
                )
                n_tokens += int(lengths.sum())
                pc, pr = logps[:n], logps[n:]
                if unpaired:
                    ref = torch.tensor([r["ref"] for r in mb], dtype=pc.dtype, device=device)
                    ref_kl = torch.tensor([r["ref_kl"] for r in mb], dtype=pc.dtype, device=device)
                    label = torch.tensor([r["label"] for r in mb], device=device)
                    losses, stats = loss_fn(pc, ref, label, pr, ref_kl, **cfg.loss.args)
                    d = stats["desirable"]
                    stats = {
                        "kto/kl": stats["kl"].expand(n),
                        "kto/kl_raw": stats["kl_raw"].expand(n),
                        "kto/reward_desirable_sum": stats["reward"] * d,
                        "kto/reward_undesirable_sum": stats["reward"] * (1 - d),
                        "kto/desirable_n": d,
                        "logps/completion": pc.detach(),
                    }
                else:
                    rc = rr = None
                    if use_ref:
                        rc = torch.tensor(
                            [r["ref_chosen"] for r in mb], dtype=pc.dtype, device=device
                        )
                        rr = torch.tensor(
                            [r["ref_rejected"] for r in mb], dtype=pc.dtype, device=device
                        )
                    kw = (
                        {"chosen_lengths": lengths[:n], "rejected_lengths": lengths[n:]}
                        if wants_lengths
                        else {}
                    )
                    losses, stats = loss_fn(pc, pr, rc, rr, **kw, **cfg.loss.args)
                    stats = {
                        (
                            f"dpo/{k}"
                            if k in ("chosen_reward", "rejected_reward", "margin", "accuracy")
                            else f"{cfg.loss.name}/{k}"
                        ): val
                        for k, val in stats.items()
                    }
                    stats["logps/chosen"] = pc.detach()
                    stats["logps/rejected"] = pr.detach()
                # the global step's mean over pairs (B counts every rank's pairs), whatever the
                # micro-batching and the number of ranks
                loss = losses.sum() / B
                loss = faults.corrupt("loss", step, loss)
                loss.backward()
                sums["train/loss"] = sums.get("train/loss", 0.0) + loss.item()
                for k, val in stats.items():
                    sums[k] = sums.get(k, 0.0) + upcast(val).sum().item() / B
            faults.hit("step_mid", step)
            sums = distributed.sum_dict({**sums, "n_tokens": n_tokens})  # global sums
            n_tokens = sums.pop("n_tokens")
            grad_norm = grad_norm_and_clip(model, cfg.optim.max_grad_norm)
            if guard.check(step, {"train/loss": sums["train/loss"], "optim/grad_norm": grad_norm}):
                optimizer.step()
                scheduler.step()
            steps_done = step
            last_loss = sums["train/loss"]
            if unpaired:  # means over desirable / undesirable examples
                nd = sums.pop("kto/desirable_n") * B
                sums["kto/chosen_reward"] = sums.pop("kto/reward_desirable_sum") * B / max(nd, 1)
                sums["kto/rejected_reward"] = (
                    sums.pop("kto/reward_undesirable_sum") * B / max(B - nd, 1)
                )
            dt = time.perf_counter() - t0
            if cfg.train.nan_policy == "skip":
                sums["train/nan_skips"] = guard.skipped
            metrics = {
                **sums,
                "optim/grad_norm": float(grad_norm),
                "optim/lr": scheduler.get_last_lr()[0],
                "perf/step_s": dt,
                "perf/tokens_per_s": n_tokens / dt,
            }
            metrics.update(health.check(step, metrics))
            if step % cfg.tracking.log_every == 0 or step == cfg.train.steps:
                tracker.log(step, metrics)
            if cfg.eval.pref_every and step % cfg.eval.pref_every == 0 and step < cfg.train.steps:
                metrics.update(pref_eval(step))
            if (
                heldout_tasks
                and cfg.eval.every
                and step % cfg.eval.every == 0
                and step < cfg.train.steps
            ):
                metrics.update({f"eval/{k}": val for k, val in run_eval(step).items()})
            if (
                step % cfg.tracking.samples_every == 0 or step == 1
            ) and cfg.tracking.samples_per_step:
                _write_samples(
                    samples,
                    step,
                    model,
                    tokenizer,
                    heldout_tasks,
                    scorer,
                    cfg,
                    autocast_dtype,
                    system,
                    instruction,
                )
            tracker.advance(step, metrics)
            checkpointer.end_step(
                step, stop, state, on_stop=(tracker.close, samples.close), halt=health.halt()
            )
            if budget.expired(step):  # per invocation; never after the last step
                break
    budget.say_stop(tracker)
    checkpointer.finish(steps_done, state(), stopped=budget.stopped_at is not None)

    # -- 4. Held-out evaluation, model, plots, results.
    final_pref = pref_eval(steps_done)
    final_eval = run_eval(steps_done) if heldout_tasks else {}
    tracker.close()
    samples.close()
    if cfg.run.save_model:
        save_final_model(model, tokenizer, run_dir / "model", cfg.model.lora)
    results = {
        "trainer": "direct_alignment",
        "loss": cfg.loss.name,
        "steps": steps_done,
        "status": budget.status,  # complete | stopped_by_max_seconds
        "final_loss": last_loss,
        "train_rows": len(rows),
        "dropped": drops,
        "truncated": trunc,
        "pairs": data_counts,
        "heldout_pref_accuracy_before": initial_pref.get("eval/pref_accuracy"),
        "heldout_pref_accuracy": final_pref.get("eval/pref_accuracy"),
        "heldout_pref_n": len(held_rows),
        "heldout_accuracy_before": initial_eval.get("accuracy"),
        "heldout_accuracy": final_eval.get("accuracy"),
        "heldout_accuracy_stderr": final_eval.get("accuracy_stderr"),
        "heldout_n": final_eval.get("n", 0),
        **majority_results(baseline),
        "heldout_overlap_dropped": splits.n_heldout_overlap_dropped if splits else None,
        "reference_pass_s": round(t_ref, 2),
        "health": health.summary(),
        "wall_s": round(time.perf_counter() - t_start, 2),
        "run_dir": str(run_dir),
        "model_dir": str(run_dir / "model") if cfg.run.save_model else None,
        "world_size": distributed.world_size(),
    }
    if distributed.is_main():
        plot_run(read_metrics(run_dir / "metrics.jsonl"), run_dir / "plots")
        write_json_atomic(run_dir / "final_results.json", results)
    return results


@torch.no_grad()
def _held_margins(model, held_rows, cfg, pad, use_ref, autocast_dtype) -> list[torch.Tensor]:
    """Implicit-reward margins of the held-out pairs: (log π − log π_ref)(y_w) − (same)(y_l), or
    the length-normalised log-prob margin for reference-free losses; one tensor per micro-batch."""
    margins = []
    for s in range(0, len(held_rows), cfg.train.micro_batch_size):
        b = held_rows[s : s + cfg.train.micro_batch_size]
        n = len(b)
        lp, ln = sequence_logps(
            model, [r["prompt"] for r in b] * 2,
            [r["chosen"] for r in b] + [r["rejected"] for r in b], pad,
            autocast_dtype=autocast_dtype,
        )  # fmt: skip
        lp = upcast(lp).cpu()
        if use_ref:
            rc = torch.tensor([r["ref_chosen"] for r in b], dtype=lp.dtype)
            rr = torch.tensor([r["ref_rejected"] for r in b], dtype=lp.dtype)
            margins.append((lp[:n] - rc) - (lp[n:] - rr))
        else:
            ln = ln.cpu()
            margins.append(lp[:n] / ln[:n] - lp[n:] / ln[n:])
    return margins


def _tokenize_unpaired(tokenizer, examples, tok_kw) -> tuple[list[dict], dict]:
    """KTO rows from UnpairedExamples (the completion is tokenized as a pair's chosen side)."""
    pseudo = [PreferencePair(e.prompt, e.completion, e.completion) for e in examples]
    tokenized, counts = tokenize_pairs(tokenizer, pseudo, **tok_kw)
    counts["completion_truncated"] //= 2  # each completion was counted twice
    rows = [
        {"prompt": tp.prompt_ids, "completion": tp.chosen_ids, "label": e.label}
        for tp, e in zip(tokenized, examples, strict=True)
    ]
    return rows, counts


@torch.no_grad()
def _write_samples(
    writer, step, model, tokenizer, problems, scorer, cfg, autocast_dtype, system=None,
    instruction=None,
) -> None:  # fmt: skip
    """Greedy completions of the first held-out prompts (in-loop samples), with their scores."""
    problems = problems[: cfg.tracking.samples_per_step]
    if not problems:
        return
    was_training = model.training
    model.eval()
    prompts = [
        encode_prompt(tokenizer, render_row(tokenizer, p, system=system, instruction=instruction))
        for p in problems
    ]
    engine = make_engine(None, model, tokenizer, autocast_dtype=autocast_dtype)
    with distributed.gathered(model):
        ro = engine.generate(
            prompts, SamplingParams(max_new_tokens=cfg.eval.max_new_tokens, greedy=True)
        )
    model.train(was_training)
    texts = decode_completions(tokenizer, ro, engine.stop_token_ids)
    scores = scorer.score_batch(texts, problems)
    writer.write(
        step,
        [
            {"prompt": p.question, "completion": c, "reward": r, "answer": p.answer}
            for p, c, r in zip(problems, texts, scores, strict=True)
        ],
    )
