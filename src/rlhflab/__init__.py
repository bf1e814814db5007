"""rlhflab: LLM post-training for people who study RLHF.

Reward models, policy-gradient RL and direct alignment, with every loss traceable to its paper.
"""

__version__ = "0.1.0"
