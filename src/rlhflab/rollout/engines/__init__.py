"""Rollout engines: one seam between the trainers and whatever generates completions.

An engine takes token-id prompts and `SamplingParams` and returns the `Rollout` the trainers use
(token ids, sampler log-probs, completion mask, truncated flags), `n` completions per prompt,
group-contiguous. It receives the policy's new weights after an update (`update_weights`) and may
free its memory while the trainer updates (`sleep` / `wake`, colocated mode). Trainers never import
an inference library; an engine never computes a loss.

Engines (`rollout.engine`; the table is `registry.ENGINES`):
- `hf`   — our KV-cache sampler (`rlhflab.rollout.sampler.sample`) on the live policy module: the
           default, the CPU and teaching path. Sampler log-probs equal the trainer's by
           construction (same module, same arithmetic), so the training–inference mismatch is 0.
- `vllm` — vLLM's offline `LLM` in the trainer's process (colocated; one per torchrun rank),
           weights pushed in place after every update (LoRA merged in the push).
           Optional: `pip install rlhflab[vllm]` (see docs/engines.md).
"""

from rlhflab.rollout.engines.base import (  # noqa: F401
    RolloutEngine,
    SamplingParams,
    stop_ids_for,
    unwrapped,
)
from rlhflab.rollout.engines.lifecycle import (  # noqa: F401
    awake,
    generating,
    reusing_prefixes,
    sample_chunks,
)
from rlhflab.rollout.engines.registry import (  # noqa: F401
    ENGINE_NAMES,
    ENGINES,
    engine_class,
    make_engine,
)
