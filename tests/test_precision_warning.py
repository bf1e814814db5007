"""Full fine-tuning with 16-bit weights gets a one-line warning at config load (issue 36): AdamW
updates the weights in their own dtype, and a step below half a unit in the last place rounds
away. The rounding claim is checked here from the definition of the float format."""

import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhflab.config import config_from_dict, full_finetune_precision_warning, load_config
from rlhflab.config import loader as config_loader

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "configs/pg/grpo.yaml"


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(config_loader, "_WARNED", set())  # once per process: start afresh


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "rlhflab.config.loader"]


def test_bf16_full_finetuning_warns_once_in_one_line(fresh, caplog):
    caplog.set_level(logging.WARNING)
    for _ in range(2):  # a sweep or a resume loads the same config again: one warning
        load_config(GRPO, ["model.dtype=bfloat16", "optim.lr=1e-5"])
    (msg,) = _warnings(caplog)
    assert "\n" not in msg
    assert msg.startswith("warning: model.dtype: bfloat16 with full fine-tuning (no model.lora)")
    assert "|w| > 2^9·lr = 0.00512" in msg  # 2^9 · 1e-5
    assert "set model.dtype: float32 with precision.autocast: bf16" in msg
    assert "parallel.mixed_precision: bf16" in msg


@pytest.mark.parametrize(
    "overrides, bits",
    [
        (["model.dtype=bfloat16"], 8),
        (["model.dtype=float16"], 11),
        (["model.dtype=float32"], None),
        (["model.dtype=float64"], None),
        (["model.dtype=float32", "precision.autocast=bf16"], None),  # the recommended form
        (["model.dtype=bfloat16", "model.lora.r=8"], None),  # adapters are float32
    ],
)
def test_which_configs_warn(overrides, bits):
    cfg = load_config(GRPO, overrides)
    msg = full_finetune_precision_warning(cfg)
    if bits is None:
        assert msg is None
    else:
        assert f"keeps {bits} significant bits" in msg and f"2^{bits + 1}·lr" in msg


def test_every_family_is_checked(fresh, caplog):
    caplog.set_level(logging.WARNING)
    for path in ("configs/sft/tiny_scratch.yaml", "configs/rm/orm.yaml", "configs/dpo/dpo.yaml",
                 "configs/distill/sdpo.yaml"):  # fmt: skip
        raw = load_config(ROOT / path).model_dump(mode="json")
        raw["model"]["dtype"] = "bfloat16"
        config_loader._WARNED.clear()
        config_from_dict(raw)
    assert len(_warnings(caplog)) == 4


def test_the_cli_shows_the_warning_as_one_line(tmp_path):
    # logging without handlers (the CLI configures none) prints the bare message to stderr
    code = (
        "from rlhflab.config import load_config\n"
        f"load_config({str(GRPO)!r}, ['model.dtype=bfloat16'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    # with torchao installed (the lowmem extra), importing transformers makes torchao log its
    # optional CUDA kernels that do not load on a CPU and torch's pytree note about torchao's
    # enums (not rlhflab's output; the CLI silences them, rlhflab.quiet.QUIET_LOGGERS)
    (line,) = [x for x in out.stderr.splitlines()
               if not (x.startswith("Failed to load") and "torchao" in x) and "_pytree.py" not in x]  # fmt: skip
    assert line.startswith("warning: model.dtype: bfloat16 with full fine-tuning")


def _half_ulp(w: float, bits: int) -> float:
    """Half the spacing of floats with `bits` significant bits at w (w not a power of two):
    |w| = m·2^e with m in [0.5, 1) has spacing 2^(e - bits)."""
    _, e = math.frexp(w)
    return 2.0 ** (e - bits) / 2


def test_adamw_steps_on_bf16_weights_round_away_below_half_an_ulp():
    """One AdamW step moves each weight by lr·m̂/(√v̂ + ε) = lr·g/|g| (bias-corrected, first
    step; ε negligible for |g| ~ 1). Stored in bf16 (8 significant bits), a weight changes iff
    lr > ulp(w)/2; in float32 (24 bits) every weight changes. lr = 1e-5 lies between 2^-17
    and 2^-16, at least 30% from any half-ulp, so no weight sits near the boundary."""
    lr = 1e-5
    gen = torch.Generator().manual_seed(0)
    w0 = (0.02 * torch.randn(20000, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    w0 = w0[[math.frexp(x)[0] not in (0.5, -0.5) and x != 0 for x in w0.double().tolist()]]
    grad = torch.where(torch.rand(w0.shape, generator=gen) < 0.5, -1.0, 1.0)
    changed = {}
    for dtype in (torch.bfloat16, torch.float32):
        p = torch.nn.Parameter(w0.to(dtype).clone())
        p.grad = grad.to(dtype)
        torch.optim.AdamW([p], lr=lr, weight_decay=0.0).step()
        changed[dtype] = (p.detach() != w0.to(dtype)).tolist()
    expected = [lr > _half_ulp(x, 8) for x in w0.double().tolist()]
    assert changed[torch.bfloat16] == expected
    assert all(changed[torch.float32])
    lost = 1 - sum(expected) / len(expected)
    assert lost > 0.7  # weights ~ N(0, 0.02): P(|w| > 2^9 · 1e-5 = 0.00512) ≈ 0.80
