"""Held-out evaluation (greedy accuracy, pass@k)."""
