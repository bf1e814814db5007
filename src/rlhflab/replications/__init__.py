"""Small-scale replications of published RLHF results (`rlhflab replicate NAME [CONFIG]`).

Each replication is one module with a `run(spec: dict, out: Path) -> dict` and a config in
`configs/replications/<name>.yaml` (the CPU size run for docs/replications.md) beside
`<name>_gpu.yaml` (the size for a GPU). A config has an `experiment:` section (the replication's
own settings, checked by its pydantic model: unknown keys are errors) and one section per training
stage, each a complete training config (`rlhflab train`'s format) that the replication completes
(start model, run root) and validates before anything runs.

    rm-overopt     reward-model over-optimisation (Gao et al. 2022): best-of-n against proxies
                   trained on 4 data sizes and GRPO against the largest, gold against √KL with
                   the paper's fits (cells: one per proxy, one per RL seed)
    prm-orm        PRM vs ORM (Lightman et al. 2023) on chained arithmetic with exact step labels:
                   best-of-N selection accuracy against N (`prm-orm-gsm8k`: its former name)
    r1-zero        R1-Zero trends (DeepSeek-R1 §2.2): GRPO from a two-style base (short / worked
                   answers) with correctness + format rewards; do held-out correctness and length
                   rise together? Controls: Dr. GRPO, no format reward; seeds × arms as cells
    dpo-overopt    DPO over-optimisation (Rafailov et al. 2024): one offline run per β and seed,
                   gold and KL(π‖π_ref) on held-out problems every few steps; gold against √KL
"""

from rlhflab.replications.common import (  # noqa: F401
    Counts,
    Experiment,
    PositiveFloats,
    begin,
    check_experiment,
    stage,
)
from rlhflab.replications.registry import (  # noqa: F401
    ALIASES,
    DESCRIPTIONS,
    REPLICATIONS,
    describe,
    result_file,
    run_replication,
)
