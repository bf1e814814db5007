"""Rewards: verifiable rewards from reasoning_gym (`Verifier`, `extract_answer`)."""

from rlhflab.rewards.verifier import REWARD_KINDS, Verifier, extract_answer

__all__ = ["REWARD_KINDS", "Verifier", "extract_answer"]
