"""Verifiable tasks from reasoning_gym: problems, datasets and leak-free train/held-out splits.

Source: reasoning_gym (https://github.com/open-thought/reasoning-gym), 0.1.25. Traps handled here
(measured reasoning_gym behaviour):

* Item i of a dataset is generated from `Random(seed + i)`, so two datasets whose seeds are closer
  than their sizes share items. Held-out data is drawn from `seed + heldout_seed_offset` (1e9 by
  default) and, because small configurations have small problem spaces anyway, deduplicated
  against the training questions by normalised text (`dedup_key`: Unicode NFKC, case-folded,
  whitespace collapsed), so "Bird" and "bird" count as the same question.
* `composite` wants `reasoning_gym.composite.DatasetSpec` objects, not dicts.
* Some verifiers raise on malformed answers (prime_factorization); scoring through
  `rlhflab.rewards.Verifier` catches that. `Problem.score` is the raw call.

reasoning_gym is imported lazily (it takes ~1 s), so importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from rlhflab.errors import ConfigError, DataError


@dataclass(frozen=True)
class Problem:
    """One task instance.

    Attributes:
        question: the prompt text, as reasoning_gym wrote it (not yet chat-formatted).
        answer: the reference answer, or None for tasks checked only by their verifier
            (propositional_logic, graph_color, boxnet, rush_hour, rubiks_cube).
        entry: the raw reasoning_gym item `{"question", "answer", "metadata"}`, passed to
            `score_answer`. Excluded from hashing.
        task: source dataset name; for composite items the sub-dataset (`metadata.source_dataset`).
        dataset: the reasoning_gym dataset object that made the item (for composite, the
            composite, whose `score_answer` dispatches on the sub-dataset). Not compared.
    """

    question: str
    answer: str | None
    entry: dict = field(hash=False, repr=False)
    task: str = ""
    dataset: Any = field(default=None, compare=False, hash=False, repr=False)

    def score(self, answer_text: str | None) -> float:
        """reasoning_gym's `score_answer(answer_text, entry)` in [0, 1]. May raise (see module doc).

        `answer_text` is the already extracted answer (see `rlhflab.rewards.extract_answer`);
        it is passed through unchanged, so strip it first: " 42 " can score less than "42".
        """
        if self.dataset is None:
            raise DataError(f"problem of task '{self.task}' has no dataset to score with")
        return float(self.dataset.score_answer(answer_text, self.entry))


def score_answer(problem: Problem, answer_text: str | None) -> float:
    """Same as `problem.score(answer_text)`."""
    return problem.score(answer_text)


_WHITESPACE = re.compile(r"\s+")


def dedup_key(text: str) -> str:
    """The form two questions (or prompts) are compared in when held-out data is deduplicated
    against training data: Unicode NFKC, case-folded, every run of whitespace one space, no
    leading or trailing whitespace.

    Questions that differ only by case (spell_backward's "Bird" and "bird"), by spacing or by
    Unicode compatibility forms (full-width letters, ligatures) test the same skill on what is
    for the model almost the same input, so a held-out question equal to a training question
    under this key is not held out. Example: `dedup_key("  Spell  BIRD\u00a0") == "spell bird"`.
    """
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def dataset_names() -> list[str]:
    """Names registered in `reasoning_gym.factory.DATASETS` (106 in 0.1.25), sorted."""
    import reasoning_gym  # noqa: F401  (registers the datasets)
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _did_you_mean(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_name(name: Any, key: str) -> str:
    names = dataset_names()
    if not isinstance(name, str) or name not in names:
        hint = _did_you_mean(name, names) if isinstance(name, str) else ""
        raise ConfigError(f"{key}: unknown reasoning_gym dataset {name!r}{hint}")
    return name


def _check_options(name: str, options: Any, key: str) -> dict:
    """Reject option names the dataset's config dataclass does not have (with a did-you-mean)."""
    from reasoning_gym.factory import DATASETS

    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ConfigError(f"{key}: expected a mapping of options, got {type(options).__name__}")
    _, config_cls = DATASETS[name]
    valid = [f.name for f in dataclasses.fields(config_cls)]
    for opt in options:
        if opt not in valid:
            raise ConfigError(
                f"{key}: unknown option {opt!r} for reasoning_gym dataset '{name}'"
                f"{_did_you_mean(str(opt), valid)}; valid: {', '.join(valid)}"
            )
    return dict(options)


def _composite_specs(config: dict, key: str) -> list:
    from reasoning_gym.composite import DatasetSpec

    unknown = set(config) - {"datasets"}
    if unknown:
        raise ConfigError(
            f"{key}: unknown option {sorted(unknown)[0]!r} for composite; only 'datasets' is allowed"
        )
    entries = config.get("datasets")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"{key}.datasets: composite needs a non-empty list of {{name, weight, config}} entries"
        )
    specs = []
    for i, spec in enumerate(entries):
        skey = f"{key}.datasets[{i}]"
        if not isinstance(spec, dict):
            raise ConfigError(f"{skey}: expected a mapping with 'name', 'weight', 'config'")
        extra = set(spec) - {"name", "weight", "config"}
        if extra:
            raise ConfigError(
                f"{skey}: unknown key {sorted(extra)[0]!r}; allowed: name, weight, config"
            )
        sub_name = _check_name(spec.get("name"), f"{skey}.name")
        if sub_name == "composite":
            raise ConfigError(f"{skey}.name: a composite cannot contain a composite")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise ConfigError(f"{skey}.weight: must be a positive number, got {weight!r}")
        sub_config = _check_options(sub_name, spec.get("config"), f"{skey}.config")
        specs.append(DatasetSpec(name=sub_name, weight=float(weight), config=sub_config))
    return specs


def make_task_dataset(name: str, *, size: int, seed: int, config: dict | None = None) -> Any:
    """Create a reasoning_gym dataset, with config errors turned into one-line `ConfigError`s.

    Args:
        name: a reasoning_gym dataset name (see `dataset_names()`), or "composite".
        size: number of items (`len(ds)`); item i is generated from `Random(seed + i)`.
        seed: base seed.
        config: the dataset's options (fields of its config dataclass, e.g. chain_sum's
            `min_terms`, `max_digits`). For "composite":
            `{"datasets": [{"name": str, "weight": float = 1.0, "config": dict = {}}, ...]}`;
            sub-dataset j gets seed `seed + j + 1` unless its config sets one.

    Returns:
        A `reasoning_gym.dataset.ProceduralDataset`: `ds[i]` → `{"question", "answer", "metadata"}`,
        `ds.score_answer(answer, entry)` → float in [0, 1].

    Raises:
        ConfigError: unknown name ("task.name: unknown reasoning_gym dataset 'x' (did you mean
            'y'?)"), unknown option or an option value reasoning_gym rejects (names `task.config`).
    """
    name = _check_name(name, "task.name")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ConfigError(f"task.size: must be a positive integer, got {size!r}")
    if config is not None and not isinstance(config, dict):
        raise ConfigError(
            f"task.config: expected a mapping of options, got {type(config).__name__}"
        )
    config = dict(config or {})
    for reserved in ("size", "seed"):
        if reserved in config:
            raise ConfigError(
                f"task.config: {reserved!r} is set by rlhflab (task.{reserved}/splits); remove it"
            )

    import reasoning_gym
    from reasoning_gym.composite import CompositeConfig, CompositeDataset

    try:
        if name == "composite":
            specs = _composite_specs(config, "task.config")
            comp_config = CompositeConfig(size=size, seed=seed, datasets=specs)
            return CompositeDataset(comp_config)
        options = _check_options(name, config, "task.config")
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
    except ConfigError:
        raise
    except Exception as exc:
        msg = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"task.config: reasoning_gym rejected the {name} config: {msg}") from exc


def _problem(entry: dict, dataset: Any, name: str) -> Problem:
    metadata = entry.get("metadata") or {}
    answer = entry.get("answer")
    return Problem(
        question=entry["question"],
        answer=None if answer is None else str(answer),
        entry=entry,
        task=str(metadata.get("source_dataset", name)),
        dataset=dataset,
    )


def problems_from_dataset(
    dataset: Any, name: str, start: int = 0, stop: int | None = None
) -> list[Problem]:
    """`Problem`s for items `start..stop-1` of a reasoning_gym dataset (default: all of it)."""
    from rlhflab.tracking import phase

    stop = len(dataset) if stop is None else stop
    out = []
    with phase(f"{name}: items", stop - start) as bar:
        for i in range(start, stop):
            out.append(_problem(dataset[i], dataset, name))
            bar.advance()
    return out


@dataclass
class Splits:
    """Training and held-out problems of one task, with what deduplication removed.

    Attributes:
        train: `n_train` problems from `train_seed`; may repeat questions (that is the training
            distribution of a small problem space).
        heldout: `n_heldout` problems with distinct questions, none of which occurs in `train`.
        n_heldout_overlap_dropped: held-out draws dropped because their question is in `train`
            (compared by `dedup_key`: NFKC, case-folded, whitespace collapsed).
        n_heldout_internal_dupes_dropped: held-out draws dropped as repeats of an earlier held-out
            question (same comparison).
        train_seed, heldout_seed: the reasoning_gym seeds used.
    """

    train: list[Problem]
    heldout: list[Problem]
    n_heldout_overlap_dropped: int
    n_heldout_internal_dupes_dropped: int
    train_seed: int
    heldout_seed: int


def make_splits(
    name: str,
    *,
    config: dict | None = None,
    n_train: int,
    n_heldout: int,
    seed: int = 0,
    heldout_seed_offset: int = 10**9,
    max_draws_factor: int = 20,
) -> Splits:
    """Draw training problems and held-out problems whose questions never occur in training.

    Train items are `make_task_dataset(name, seed=seed)[0:n_train]`. Held-out items come from
    `seed + heldout_seed_offset`: draws are taken in index order and a draw is dropped if its
    question, normalised by `dedup_key` (NFKC, case-folded, whitespace collapsed), is a training
    question (counted in `n_heldout_overlap_dropped`) or an earlier
    held-out question (`n_heldout_internal_dupes_dropped`), until `n_heldout` are kept.

    Args:
        name, config: as `make_task_dataset`.
        n_train: number of training problems (≥ 0).
        n_heldout: number of held-out problems (≥ 0).
        seed: training seed.
        heldout_seed_offset: distance between the two seeds; keep it larger than any dataset size.
        max_draws_factor: give up after `max_draws_factor * n_heldout` held-out draws.

    Raises:
        ConfigError: as `make_task_dataset`; negative sizes.
        DataError: fewer than `n_heldout` unseen distinct questions found within the draw budget
            (the task's problem space is too small for this config); the message says how many.

    Cost: simple tasks generate ≤ 0.04 s per 1000 items; deduplication is a set lookup.
    """
    for key, n in (("n_train", n_train), ("n_heldout", n_heldout)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"task.{key}: must be a non-negative integer, got {n!r}")
    heldout_seed = seed + heldout_seed_offset

    train: list[Problem] = []
    if n_train > 0:
        train_ds = make_task_dataset(name, size=n_train, seed=seed, config=config)
        train = problems_from_dataset(train_ds, name)
    seen = {dedup_key(p.question) for p in train}

    heldout: list[Problem] = []
    n_overlap = n_dupes = 0
    if n_heldout > 0:
        cap = max_draws_factor * n_heldout
        heldout_questions: set[str] = set()
        drawn = 0
        size = n_heldout
        while len(heldout) < n_heldout and drawn < cap:
            # Item i depends only on (seed, i), so a bigger dataset continues the same sequence.
            ds = make_task_dataset(name, size=size, seed=heldout_seed, config=config)
            while drawn < size and len(heldout) < n_heldout:
                problem = _problem(ds[drawn], ds, name)
                drawn += 1
                q = dedup_key(problem.question)
                if q in seen:
                    n_overlap += 1
                elif q in heldout_questions:
                    n_dupes += 1
                else:
                    heldout_questions.add(q)
                    heldout.append(problem)
            size = min(cap, size * 4)
        if len(heldout) < n_heldout:
            raise DataError(
                f"task '{name}': only {len(heldout)} distinct held-out questions absent from the "
                f"{n_train} training problems were found in {drawn} draws (wanted {n_heldout}; "
                f"{n_overlap} were training questions, {n_dupes} repeats); the problem space of "
                "this config is too small: lower task.n_heldout or n_train, or make the task harder"
            )
    return Splits(
        train=train,
        heldout=heldout,
        n_heldout_overlap_dropped=n_overlap,
        n_heldout_internal_dupes_dropped=n_dupes,
        train_seed=seed,
        heldout_seed=heldout_seed,
    )


def task_texts(splits: Splits, limit: int) -> list[str]:
    """Question and answer strings of the first `limit` training problems of `splits`, for
    training a tokenizer (a from-scratch `model.build`): 1–2 strings per problem, questions first."""
    texts = []
    for p in splits.train[:limit]:
        texts.append(p.question)
        if p.answer is not None:
            texts.append(str(p.answer))
    return texts
