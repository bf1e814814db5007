"""One top-to-bottom `train(cfg)` per trainer family. Nothing else in the package imports these."""

from __future__ import annotations


def run_config(cfg) -> dict:
    """Run the trainer named by `cfg.trainer`; returns its final results."""
    from rlhflab.trainers import policy_gradient, sft

    trainers = {"sft": sft.train, "policy_gradient": policy_gradient.train}
    return trainers[cfg.trainer](cfg)
