"""rlhflab: LLM post-training for people who study RLHF.

Reward models, policy-gradient RL and direct alignment, with every loss traceable to its paper.
"""

from rlhflab import _autoregister

__version__ = "0.1.0"

# Plain `AutoModelForCausalLM.from_pretrained` loads a saved rlhflab GPT once rlhflab is
# imported: registered on transformers' first import (standard library only here).
_autoregister.install()
