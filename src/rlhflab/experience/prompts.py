"""The prompt set of a sampling trainer: the rows to train on (a task's problems or a prompt
dataset's rows), the system turn and answer-format instruction rendered into every prompt, the
held-out rows and further evaluation sets, the encoded prompts and the shuffled stream that
hands out their indices (its position is checkpointed). Part of `rlhflab.experience`."""

from __future__ import annotations

import random

from rlhflab.data.formatting import encode_prompt, task_instruction
from rlhflab.data.prompts import load_prompt_source, render_row
from rlhflab.data.tasks import task_texts
from rlhflab.errors import ConfigError, DataError
from rlhflab.experience.stream import ShuffledStream
from rlhflab.fingerprint import data_fingerprint
from rlhflab.rewards.verifier import Verifier

__all__ = ["PromptSet", "check_generation_budget", "check_lengths", "eval_sets"]


def check_lengths(lengths: list[int], limit: int, *, what: str, field: str) -> None:
    """Raise DataError naming the first row whose length exceeds `limit`."""
    for i, n in enumerate(lengths):
        if n > limit:
            raise DataError(f"{field}: {what} of row {i} has {n} tokens > limit {limit}")


def check_generation_budget(context: int, max_new_tokens: int, *, field: str) -> None:
    """Raise ConfigError when `max_new_tokens` leaves no room for a prompt in the model's
    context (names the field and both numbers)."""
    if max_new_tokens >= context:
        raise ConfigError(
            f"{field} ({max_new_tokens}) must be smaller than the model's context length "
            f"({context}): no room is left for the prompt"
        )


class PromptSet:
    """The prompts of a run with a `data` section (`PromptDataConfig`) and a `task`.

    Attributes:
        splits: `PromptSplits` (train rows, held-out rows, the overlap dropped).
        is_task: data.source is "task" (rows are task problems with a verifier).
        system, instruction: rendered into every prompt (`render_row`); the instruction is the
            task's answer-format instruction, None for datasets.
        ids: the encoded training prompts (token ids), row-aligned with `splits.train`, once
            `encode` ran.
        stream: the `ShuffledStream` of training-row indices, once `encode` ran.
    """

    def __init__(self, cfg, *, seed: int) -> None:
        """Load the rows of `cfg.data` (task problems or a dataset) with the held-out split.
        Raises ConfigError / DataError naming the key, file or row (`load_prompt_source`)."""
        t = cfg.task
        self.env = None  # data.source "env": the environment built for its rows (the sampler's)
        if cfg.data.source == "env":
            self.env, self.splits = env_prompt_splits(cfg.env, cfg.data)
        else:
            self.splits = load_prompt_source(cfg.data, t, seed=seed)
        self.is_task = cfg.data.source == "task"
        self.system = t.system if self.is_task else cfg.data.system
        self.instruction = task_instruction(t) if self.is_task else None
        self.ids: list[list[int]] = []
        self.stream: ShuffledStream | None = None

    def tokenizer_texts(self, n: int) -> list[str]:
        """Texts to train a from-scratch tokenizer on (`model.build.tokenizer_texts`)."""
        return task_texts(self.splits, n)

    def render(self, tokenizer, row) -> str:
        """The chat-formatted prompt text of a row (`data.prompts.render_row`)."""
        return render_row(tokenizer, row, system=self.system, instruction=self.instruction)

    def encode(self, tokenizer, *, context: int, max_new_tokens: int, seed: int,
               allow_change: bool = False) -> None:  # fmt: skip
        """Encode the training prompts and start the stream (shuffled by `seed`; a resume with
        other rows is refused unless `allow_change`, `ShuffledStream.load`).

        Raises:
            ConfigError: `max_new_tokens` leaves no room for a prompt in `context`.
            DataError: a prompt longer than `context − max_new_tokens`, naming its row.
        """
        self.ids = [encode_prompt(tokenizer, self.render(tokenizer, p)) for p in self.splits.train]
        check_generation_budget(context, max_new_tokens, field="rollout.max_new_tokens")
        check_lengths([len(p) for p in self.ids], context - max_new_tokens, what="prompt",
                      field=f"{self.splits.source} train")  # fmt: skip
        self.stream = ShuffledStream(
            len(self.ids), random.Random(seed), fingerprint=data_fingerprint(self.ids),
            allow_change=allow_change,
        )  # fmt: skip

    def problems_of(self, chosen: list[int], group_size: int) -> list:
        """The row-aligned rows of the training indices `chosen`, each repeated `group_size`
        times (group-contiguous)."""
        return [self.splits.train[i] for i in chosen for _ in range(group_size)]


def env_prompt_splits(env_cfg, data) -> tuple:
    """`data.source: env`: build the environment of `env_cfg` (an `EnvConfig`) and take its
    `prompt_rows()` (train rows, held-out rows), `data.max_rows` / `n_heldout` applied, held-out
    rows equal to a training prompt dropped. Returns (the environment, `PromptSplits`).

    Raises:
        ConfigError: the environment cannot be built (`rlhflab.envs.load_env`), has no
            `prompt_rows()`, or gives no training rows."""
    from rlhflab.data.prompts import PromptSplits, prompt_key
    from rlhflab.envs import load_env
    from rlhflab.errors import ConfigError

    spec, args = env_cfg.target()
    env = load_env(spec, args, tool_timeout_s=env_cfg.tool_timeout_s,
                   unsafe_local=env_cfg.tools.unsafe_local)  # fmt: skip
    if not callable(getattr(env, "prompt_rows", None)):
        raise ConfigError(
            f"data.source: 'env' needs an environment with prompt_rows(); {spec} has none"
        )
    train, heldout = env.prompt_rows()
    if not train:
        raise ConfigError(f"data.source: the environment {spec} gave no training rows")
    train = train[: data.max_rows]
    seen = {prompt_key(r.prompt) for r in train}
    kept = [r for r in heldout if prompt_key(r.prompt) not in seen]
    splits = PromptSplits(train, kept[: data.n_heldout], source=f"env {spec.split(':')[-1]}",
                          n_heldout_overlap_dropped=len(heldout) - len(kept))  # fmt: skip
    return env, splits


def eval_sets(cfg, splits) -> list[dict]:
    """The further held-out sets of `eval.sets`: for each, {"name", "task" (its task name),
    "rows" (its first n held-out problems whose questions are not among the run's training
    prompts), "verifier", "system", "instruction"}.

    Raises:
        ConfigError / DataError: the set's task cannot be built (unknown task or config), as
            `make_splits` says, prefixed by the set's name.
    """
    from rlhflab.data.prompts import task_prompt_splits
    from rlhflab.data.tasks import dedup_key

    seen = {dedup_key(str(r.question)) for r in splits.train}
    out = []
    for i, s in enumerate(cfg.eval.sets):
        task = cfg.eval_set_task(i)
        try:
            held = task_prompt_splits(task).heldout
        except (ConfigError, DataError) as exc:
            raise type(exc)(f"eval.sets[{i}] ({s.name}): {exc}") from None
        rows = [r for r in held if dedup_key(str(r.question)) not in seen][: s.n or cfg.eval.n]
        out.append(
            {
                "name": s.name,
                "task": task.name,
                "rows": rows,
                "verifier": Verifier(
                    answer_format=task.answer_format, reward=task.reward, extractor=task.extractor
                ),
                "system": task.system,
                "instruction": task_instruction(task),
            }
        )
    return out
