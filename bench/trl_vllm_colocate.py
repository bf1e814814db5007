"""Does TRL's GRPOTrainer run with vLLM colocated (`use_vllm=True, vllm_mode="colocate"`) on the
CPU build of vLLM? A probe, not a benchmark: two GRPO steps on the `tiny` bench model.

    python -m bench.trl_vllm_colocate      # in the vLLM environment, with trl and accelerate

TRL 1.16 imports `accelerate`, which the vLLM environment does not have: install both there, or
put them on PYTHONPATH (`pip install --no-deps --target DIR trl==1.16.0 accelerate==1.15.0`).
TRL builds its own `LLM` (dtype "auto": vLLM runs a float32 checkpoint in bfloat16 on CPU; torch
compile on; `max_num_batched_tokens=4096`) and pushes weights with the model runner's
`load_weights`, one parameter at a time.

8 prompts × group 8 × 256 new tokens, fp32, one thread, the settings of `bench/steps.py`'s GRPO
rows (fixed length: vLLM's `ignore_eos`). The outcome (s/step, or the exception with its
traceback's last frames) is added to `bench/engines_results.json` under "trl_vllm_colocate".
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench import common
from bench.steps import LR, trl_grpo_trainer
from bench.trl_driver import common_args

N_PROMPTS, GROUP, MAX_NEW, STEPS = 8, 8, 256, 2


class StepTimes:
    """A TrainerCallback (built lazily: transformers is imported late) timing each step."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Times(TrainerCallback):
            def __init__(self):
                self.times: list[float] = []
                self._t0 = None

            def on_step_begin(self, args, state, control, **kwargs):
                self._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                self.times.append(time.perf_counter() - self._t0)

        return _Times()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(common.BENCH_DIR / "engines_results.json"))
    a = ap.parse_args()
    common.setup(threads=1)
    out: dict = {
        "settings": dict(prompts=N_PROMPTS, group=GROUP, max_new_tokens=MAX_NEW, steps=STEPS)
    }
    try:
        import trl

        out["trl"] = trl.__version__
        from trl import GRPOConfig

        path = common.model_dir(common.TINY)
        tok, _ = common.load(path)
        plen = common.modal_prompt_length(tok)
        prompts = common.prompt_texts(tok, 64, seed=1, length=plen)
        times = StepTimes()
        with tempfile.TemporaryDirectory() as tmp:
            args = GRPOConfig(
                **common_args(tmp, steps=STEPS, lr=LR),
                per_device_train_batch_size=N_PROMPTS * GROUP,
                num_generations=GROUP,
                steps_per_generation=1,
                num_iterations=1,
                max_completion_length=MAX_NEW,
                temperature=1.0,
                top_p=1.0,
                beta=0.0,
                epsilon=0.2,
                loss_type="grpo",
                scale_rewards="group",
                use_vllm=True,
                vllm_mode="colocate",
                vllm_max_model_length=plen + MAX_NEW,
                generation_kwargs={"ignore_eos": True},  # fixed length, as the bench's other rows
                model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
            )
            trainer = trl_grpo_trainer(path, args, tok, prompts, times)
            trainer.train()
            logged = {k: v for e in trainer.state.log_history for k, v in e.items()}
        out.update(ok=True, step_s=times.times)
        out["trl_metrics"] = {
            k: v
            for k, v in logged.items()
            if k.startswith(("sampling/", "completions/mean_length", "step_time"))
        }
    except BaseException as e:  # the probe's answer is the exception
        tb = traceback.extract_tb(e.__traceback__)
        out.update(
            ok=False,
            error=f"{type(e).__name__}: {e}",
            where=[
                f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in tb[-6:]
            ],
        )
        traceback.print_exc()
    print(json.dumps(out, indent=2))
    path = Path(a.out)
    data = json.loads(path.read_text()) if path.exists() else {}
    data["trl_vllm_colocate"] = out
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
