"""The experience layer: prompts in, scored and gathered batches out, for every trainer that
samples (policy gradient, distillation; docs/architecture.md).

- `PromptSet` (prompts.py): the rows, system turn, instruction, held-out rows, encoded prompts and
  the shuffled stream of a run; `eval_sets`, the further held-out sets of `eval.sets`.
- `Sampler` (sampler.py): `next_batch(step, model)` in the mode the `rollout` section asks for
  (sync, dynamic sampling, async; episodes with an `env`), greedy baselines, the engine's life
  cycle, its own checkpointed state.
- `RewardComponents` / `VerifierOnly` (scoring.py): the scorer protocol.
- `ShuffledStream` (stream.py): the data position of every trainer.

Only this package and `rlhflab.eval` sample through `rlhflab.rollout.engines`; trainers draw
through the `Sampler` (tests/test_architecture.py).
"""

from rlhflab.experience.prompts import PromptSet, check_generation_budget, check_lengths, eval_sets
from rlhflab.experience.sampler import Sampler, check_engine_layout
from rlhflab.experience.scoring import RewardComponents, Scorer, VerifierOnly
from rlhflab.experience.stream import ShuffledStream

__all__ = [
    "PromptSet",
    "RewardComponents",
    "Sampler",
    "Scorer",
    "ShuffledStream",
    "VerifierOnly",
    "check_engine_layout",
    "check_generation_budget",
    "check_lengths",
    "eval_sets",
]
