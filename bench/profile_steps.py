"""Where the time of a GRPO / DPO / RM step goes, for rlhflab and TRL (torch.profiler).

    python bench/profile_steps.py grpo|dpo|rm|generation [--rows 15]

Runs one warm-up step of each framework, then profiles one step of each and prints the operators
with the most self CPU time, and the share of matrix multiplications (aten::mm / addmm / bmm)
and attention in each step. The rows are `bench/steps.py`'s: rlhflab's profiled step is the
trainer's own, one `rlhflab.trainers.loop.Run.step()` (`bench/ours.py`), TRL's one step of its
`train()` loop.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.profiler import ProfilerActivity, profile

from bench import common, steps

GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int")
ATTN = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_flash_attention_backward")


class _Profiled:
    """Wraps a step function: the call with index `at` runs under torch.profiler."""

    def __init__(self, fn, at: int):
        self.fn, self.at, self.i, self.prof = fn, at, 0, None

    def __call__(self, *a, **k):
        self.i += 1
        if self.i != self.at:
            return self.fn(*a, **k)
        with profile(activities=[ProfilerActivity.CPU]) as p:
            out = self.fn(*a, **k)
        self.prof = p
        return out


def summarise(name: str, prof, rows: int) -> None:
    ka = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ka)
    gemm = sum(e.self_cpu_time_total for e in ka if e.key.startswith(GEMM))
    attn = sum(e.self_cpu_time_total for e in ka if e.key in ATTN or "attention" in e.key)
    print(
        f"\n=== {name}: {total / 1e6:.2f} s self CPU; GEMM {gemm / total:.0%}, attention {attn / total:.0%}"
    )
    print(ka.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["grpo", "dpo", "rm", "generation"])
    ap.add_argument("--rows", type=int, default=15)
    args = ap.parse_args()
    common.setup()
    import transformers

    from bench import trl_driver

    captured = {}
    orig_alt = trl_driver.Alternate

    class ProfAlternate(orig_alt):
        def __init__(self, ours, *args, **kwargs):
            super().__init__(_Profiled(ours, at=2), *args, **kwargs)
            captured["ours"] = self.ours
            self._trl_prof = None

        def on_step_begin(self, args, state, control, **kw):
            super().on_step_begin(args, state, control, **kw)
            if state.global_step == 1:  # second TRL step
                self._trl_prof = profile(activities=[ProfilerActivity.CPU])
                self._trl_prof.__enter__()

        def on_step_end(self, args, state, control, **kw):
            if self._trl_prof is not None:
                self._trl_prof.__exit__(None, None, None)
                captured["trl"] = self._trl_prof
                self._trl_prof = None
            super().on_step_end(args, state, control, **kw)

    steps.Alternate = ProfAlternate
    del transformers
    if args.what == "grpo":
        steps.grpo(common.TINY, beta=0.0, warmup=1, reps=1)
    elif args.what == "dpo":
        steps.dpo(common.TINY, precompute=True, warmup=1, reps=1)
    elif args.what == "rm":
        steps.reward_model(common.TINY, warmup=1, reps=1)
    else:
        from bench import steps as s

        with tempfile.TemporaryDirectory():
            s.generation(common.TINY, warmup=1, reps=1)
        return
    summarise("rlhflab", captured["ours"].prof, args.rows)
    summarise("TRL", captured["trl"], args.rows)
    torch.set_num_threads(common.THREADS)


if __name__ == "__main__":
    main()
