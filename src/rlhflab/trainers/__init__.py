"""One top-to-bottom `train(cfg)` per trainer family. Nothing else in the package imports these."""

from __future__ import annotations

import sys
import time

from rlhflab.errors import HealthStop


def train_recording_stops(train, cfg) -> dict:
    """`train(cfg)` (a trainer family's `train`); when a health check stops the run (HealthStop,
    exit code 3), its final_results.json (`"status": "stopped_by_health"`) and plots are written
    (`common.write_stopped_results`) before the exception propagates."""
    t0 = time.perf_counter()
    try:
        return train(cfg)
    except HealthStop as exc:
        from rlhflab.trainers.common import write_stopped_results

        exc.results = write_stopped_results(cfg, exc, time.perf_counter() - t0)
        raise


def run_config(cfg) -> dict:
    """Run the trainer named by `cfg.trainer`; returns its final results.

    Under torchrun every rank calls this with the same config: the process group is joined here
    (`parallel.strategy`), before the trainer; the CLI leaves it when the command ends.
    """
    from rlhflab import distributed
    from rlhflab.trainers import direct_alignment, distill, policy_gradient, reward_model, sft
    from rlhflab.trainers.loop import RunComplete, check_launch

    trainers = {
        "sft": sft.train,
        "policy_gradient": policy_gradient.train,
        "direct_alignment": direct_alignment.train,
        "reward_model": reward_model.train,
        "distill": distill.train,
    }
    from rlhflab.rundir import release_locks

    strategy = cfg.parallel.strategy
    if strategy == "auto":
        strategy = "ddp" if distributed.launched() else "none"
    distributed.setup(strategy, timeout_s=cfg.parallel.timeout_s)
    from rlhflab.quiet import quiet_transformers

    try:
        check_launch(cfg)  # config-only refusals, before any model is loaded
        with quiet_transformers():  # transformers' progress bars and log lines
            return train_recording_stops(trainers[cfg.trainer], cfg)
    except RunComplete as done:  # --resume of a finished run: nothing more to do
        if distributed.is_main():
            print(f"{done}; its results: {done.run_dir / 'final_results.json'}", file=sys.stderr)
        return done.results
    finally:
        release_locks()  # the run directory's lock (also dropped by the OS at process exit)
