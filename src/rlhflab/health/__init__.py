"""Health checks, live: the RL debugging checklist, evaluated every step by every trainer.

Each check has a name, a threshold in the `health` config section and a meaning documented in
docs/health.md. The checks read what a trainer already has — its step metrics, the rollout, the
advantages, the completion texts — plus one cheap sampled check (a forward pass over one sequence
every `health.sample_every` steps) that the model's output distributions sum to 1.

    health = HealthMonitor(cfg.health, model, print_fn=tracker.warn)
    ...
    metrics.update(health.check(step, metrics, rollout=rollout, adv=adv, ...))
    checkpointer.end_step(step, stop, state, halt=health.halt())
    results["health"] = health.summary()

`check` returns `health/<name>` = 1.0 for each check failing at this step (0.0 otherwise; checks
without their inputs this step are left out). "Sustained" checks fail only after the condition
held `health.patience` steps in a row (one all-equal-reward batch is not a problem; ten are);
"immediate" checks fail at once (NaN, log-probs > 0, probabilities not summing to 1). The first
failure of a check prints one warning line naming the value, the threshold and what to look at;
later failures are counted and reported in the summary. With `health.on_fail: stop`, `halt()`
returns a `HealthStop` after the first failure: the trainer commits a checkpoint and the CLI exits
with code 3 (EXIT_HEALTH).

The pure functions (`prob_sum_error`, `repetition`, `degeneracy`, `relative_change`) import only
torch and the standard library; the monitor holds the little state the checks need (a sample of
the parameters, short histories of loss and reward, held-out evaluations).

The package: `checks.py` (the pure functions, the `CHECKS` table, `training_signal`),
`monitor.py` (`HealthMonitor`); this module re-exports both.
"""

from rlhflab.errors import EXIT_HEALTH, HealthStop
from rlhflab.health.checks import (
    CHECK_NAMES,
    CHECKS,
    Check,
    degeneracy,
    prob_sum_error,
    relative_change,
    repetition,
    sampled_distribution,
    training_signal,
)
from rlhflab.health.monitor import HealthMonitor

__all__ = [
    "CHECKS",
    "CHECK_NAMES",
    "EXIT_HEALTH",
    "Check",
    "HealthMonitor",
    "HealthStop",
    "degeneracy",
    "prob_sum_error",
    "relative_change",
    "repetition",
    "sampled_distribution",
    "training_signal",
]
