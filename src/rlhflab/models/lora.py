"""LoRA adapters through peft: the one module that knows about them.

LoRA (Hu et al. 2021, arXiv 2106.09685, eq. 3) replaces a frozen linear layer's W x by

    h = W x + (alpha / r) · B A x,      A (r, in) random, B (out, r) = 0 at the start,

so the adapted model equals the base model until the first update, and only A and B are trained.
peft's `inject_adapter_in_model` puts `lora.Linear` layers into the model *in place*: the model
stays the transformers class it was (`model.base_model`, `get_output_embeddings`, `generate` and
`save_pretrained` keep working), with parameters `<layer>.base_layer.weight` (frozen) and
`<layer>.lora_A.default.weight` / `<layer>.lora_B.default.weight` (trained).

What the trainers call:
    * `apply_lora(model, cfg.model.lora)` — inject adapters, freeze everything else (None: no-op).
    * `adapters_disabled(model)` — a context in which the model is the base model: the reference
      policy π_ref of a LoRA run, without a second copy of the weights in memory.
    * `merged_state(model, state)` — a plain state dict with B A folded into W (`<run>/model`
      under `model.lora.save: merged`, PPO's value model, a reward model).
    * `save_adapter(model, tokenizer, path, state)` — an adapter directory that
      `peft.PeftModel.from_pretrained(base, path)` loads (`model.lora.save: adapter`).
The checkpoint module calls `is_lora`, `trainable_state` and `load_trainable_state`: a LoRA
model's checkpoint holds its trainable tensors only (adapters, and a head trained beside them),
since the frozen base is rebuilt from `model.name_or_path` / `model.build` on resume.

peft is imported only here and only when `model.lora` is set (`pip install 'rlhflab[lora]'`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from rlhflab.errors import ConfigError, ModelError
from rlhflab.serialize import match_umask

ADAPTER = "default"  # peft's adapter name; one adapter per model
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # key prefix of a PeftModel's state dict


def _peft():
    try:
        import peft
    except ImportError:
        raise ConfigError(
            "model.lora: needs the peft package (pip install 'rlhflab[lora]')"
        ) from None
    return peft


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the longest nn.ModuleList), [] when there is none."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def block_linear_names(model: nn.Module) -> list[str]:
    """Full names of every nn.Linear inside the transformer blocks: what "all-linear" adapts.

    The LM head, a reward model's score head and a value head lie outside the blocks and keep
    their plain layers (peft's own "all-linear" would adapt a classification head too)."""
    inside = {id(m) for block in _blocks(model) for m in block.modules()}
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) in inside]


def apply_lora(
    model: nn.Module, lora_cfg, *, keep_trainable: Iterable[nn.Module] = ()
) -> nn.Module:
    """Inject LoRA adapters into `model` in place and freeze every other parameter.

    Args:
        model: a transformers model (causal LM or sequence classifier) in fp32/bf16/fp16/fp64,
            any device.
        lora_cfg: the `model.lora` section (`rlhflab.config.LoRAConfig`) or None (no-op).
        keep_trainable: modules whose parameters stay trainable beside the adapters (a reward
            model's score head).

    Returns:
        The same object, with `lora_A` / `lora_B` (A Kaiming-uniform, B = 0, so the output is
        unchanged; float32 on a bf16/fp16 base, so their AdamW state is float32 too; the base's
        dtype on a float32/float64 base) on
        the targeted linear layers; `requires_grad` is True exactly for the adapters and
        `keep_trainable`.

    Raises:
        ConfigError: peft is not installed; `target_modules` matches no module or a module that
            is not nn.Linear (names `model.lora.target_modules`).
    """
    if lora_cfg is None:
        return model
    peft = _peft()
    targets = lora_cfg.target_modules
    if targets == "all-linear":
        targets = block_linear_names(model)
        if not targets:
            raise ConfigError(
                f"model.lora.target_modules: 'all-linear' found no linear layer in the "
                f"transformer blocks of {type(model).__name__}; name the modules"
            )
    config = peft.LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(targets),
        bias="none",
    )
    try:
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as exc:  # "Target modules {...} not found in the base model"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.lora.target_modules: {first}") from None
    from peft.tuners.lora import LoraLayer

    for name, layer in model.named_modules():
        if isinstance(layer, LoraLayer) and not isinstance(layer.get_base_layer(), nn.Linear):
            raise ConfigError(
                f"model.lora.target_modules: '{name}' is a "
                f"{type(layer.get_base_layer()).__name__}; adapters go on nn.Linear layers only"
            )
    keep = {id(p) for m in keep_trainable for p in m.parameters()}
    for name, p in model.named_parameters():
        p.requires_grad_(_is_adapter(name) or id(p) in keep)
        if _is_adapter(name) and p.dtype in (torch.bfloat16, torch.float16):  # fp32 adapters
            p.data = p.data.float()  # on a half base (peft casts the input to them, output back)
    return model


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: peft LoRA layer} ({} for a model without adapters; peft not imported)."""
    if not any(_is_adapter(n) for n, _ in model.named_parameters()):
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_lora(model: nn.Module | None) -> bool:
    """True when `model` carries LoRA adapters."""
    return model is not None and any(_is_adapter(n) for n, _ in model.named_parameters())


@contextlib.contextmanager
def adapters_disabled(model: nn.Module | None) -> Iterator[nn.Module | None]:
    """Within the context `model` computes the base model's outputs (every adapter bypassed);
    for a model without adapters nothing changes. `requires_grad` flags are restored on exit
    (peft's `enable_adapters` changes them)."""
    layers = list(lora_layers(model).values()) if model is not None else []
    if not layers:
        yield model
        return
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


# ---------------------------------------------------------------------------------------------
# State: checkpoints (trainable tensors only) and final saves (merged or adapter)
# ---------------------------------------------------------------------------------------------


def trainable_names(model: nn.Module) -> list[str]:
    """Names of the parameters that require gradients, in `named_parameters` order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def trainable_state(model: nn.Module, full: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """{name: CPU tensor} of the trainable parameters: what a LoRA model's checkpoint holds.

    `full` is a full state dict gathered from shards (`distributed.full_model_state`); None
    reads the module's own parameters."""
    params = dict(model.named_parameters())
    out = {}
    for name in trainable_names(model):
        t = full[name] if full is not None else params[name].detach()
        out[name] = t.cpu().clone().contiguous()
    return out


def load_trainable_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy a `trainable_state` back into the model (an FSDP2-sharded one too: a collective).

    Raises:
        KeyError: the names differ from the model's trainable parameters (names the first).
        RuntimeError: a shape differs.
    """
    from rlhflab import distributed

    names = trainable_names(model)
    missing = [n for n in names if n not in state]
    unexpected = [n for n in state if n not in set(names)]
    if missing or unexpected:
        raise KeyError(
            f"adapter state does not fit: missing {missing[:2]}, unexpected {unexpected[:2]}"
        )
    if distributed.is_sharded(model):
        distributed.load_full_model_state(model, state, strict=False)
        return
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            if params[name].shape != state[name].shape:
                raise RuntimeError(
                    f"{name}: shape {tuple(state[name].shape)} in the checkpoint, "
                    f"{tuple(params[name].shape)} in the model"
                )
            params[name].copy_(state[name])


def merged_weight(w: Tensor, a: Tensor, b: Tensor, scaling: float, dtype=None) -> Tensor:
    """W + scaling · B A: one LoRA layer folded into its base weight.

    Shapes: w (out, in), a (r, in), b (out, r). Computed in float32 (float64 for a float64 base)
    and returned in `dtype` (None: w's dtype). `scaling` is peft's alpha / r (alpha / √r with
    rsLoRA), the layer's `scaling[ADAPTER]`."""
    dt = torch.float64 if w.dtype == torch.float64 else torch.float32
    out = w.to(dt) + scaling * (b.to(dt) @ a.to(dt))
    return out.to(dtype or w.dtype)


def lora_scalings(model: nn.Module) -> dict[str, float]:
    """{module name: scaling} of every LoRA layer ({} without adapters): what
    `merged_weight` multiplies B A by."""
    return {name: float(layer.scaling[ADAPTER]) for name, layer in lora_layers(model).items()}


def merged_state(
    model: nn.Module, full: dict[str, Tensor] | None = None
) -> dict[str, Tensor] | None:
    """A plain state dict of `model` with every adapter folded in: W' = W + (alpha / r) · B A.

    Names lose `.base_layer` and the `lora_*` tensors are dropped, so the dict loads into the
    model class without adapters (`from_pretrained` of a merged save). The module itself is not
    changed (the frozen base stays the reference policy). `full`: a full state dict gathered from
    shards; None reads the module's own. Returns `full` unchanged (None included) for a model
    without adapters, so callers save it as before. W' is computed in float32 (float64 for a
    float64 base) and cast back to W's dtype.
    """
    layers = lora_layers(model)
    if not layers:
        return full
    sd = full if full is not None else model.state_dict()
    out: dict[str, Tensor] = {}
    for name, layer in layers.items():
        out[f"{name}.weight"] = merged_weight(
            sd[f"{name}.base_layer.weight"],
            sd[f"{name}.lora_A.{ADAPTER}.weight"],
            sd[f"{name}.lora_B.{ADAPTER}.weight"],
            layer.scaling[ADAPTER],
        )
    for key, value in sd.items():
        if ".lora_" in key:
            continue
        out.setdefault(key.replace(".base_layer.", "."), value)
    return out


def save_adapter(model: nn.Module, tokenizer, path: str | os.PathLike[str], full=None) -> None:
    """Write an adapter directory: `adapter_config.json`, `adapter_model.safetensors` (peft's
    names, `base_model.model.<layer>.lora_A.weight`) and the tokenizer.

    `PeftModel.from_pretrained(base, path)` on the base model (the run's `model.name_or_path`,
    or the same `model.build`) loads it and gives the trained model's logits; peft's
    `merge_and_unload()` then returns a plain model. `full`: a full state dict gathered from
    shards (None: the module's own).

    Raises:
        ModelError: `model` has no adapters.
    """
    from safetensors.torch import save_file

    layers = lora_layers(model)
    if not layers:
        raise ModelError("save_adapter: the model has no LoRA adapters")
    sd = full if full is not None else model.state_dict()
    tensors = {
        _PEFT_PREFIX + k.replace(f".{ADAPTER}.", "."): v.detach().cpu().contiguous()
        for k, v in sd.items()
        if _is_adapter(k)
    }
    os.makedirs(path, exist_ok=True)
    save_file(tensors, str(Path(path) / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = model.peft_config[ADAPTER]
    base = getattr(getattr(model, "config", None), "_name_or_path", None)
    config = dataclasses.replace(  # a copy: the live model's config is left as it is
        config,
        base_model_name_or_path=base or None,
        task_type=config.task_type or "CAUSAL_LM",
        inference_mode=True,
    )
    config.save_pretrained(str(path))
    tokenizer.save_pretrained(path)
    match_umask(path)  # safetensors writes its files 0600 whatever the umask
