"""Batched sampling into `Rollout`s and the trainer's recomputed log-probs."""
