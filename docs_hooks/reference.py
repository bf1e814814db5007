"""The documentation site's generated pages: the configuration reference (from the pydantic
models), the CLI reference (from the argument parser), the registries and the API reference
(from the docstrings, through mkdocstrings). Called by `docs_hooks/hooks.py` at every
`mkdocs build`, and by tests/test_docs_site.py; nothing here is written into docs/."""

from __future__ import annotations

import argparse
import inspect
import types
import typing
from typing import Any

from pydantic import BaseModel

#: The modules of `rlhflab.losses` with an API page each (mkdocstrings renders their docstrings).
LOSS_MODULES = ("policy", "advantages", "aggregate", "kl", "preference", "reward_model", "value",
                "distill", "correction")  # fmt: skip

#: (module, registry attribute, what a key names) of every registry the config validates against.
REGISTRIES = (
    ("rlhflab.losses.policy", "POLICY_LOSSES", "`loss.surrogate`"),
    ("rlhflab.losses.advantages", "ADVANTAGES", "`loss.advantage`"),
    ("rlhflab.losses.aggregate", "AGGREGATIONS", "`loss.aggregation`"),
    ("rlhflab.losses.kl", "KL_ESTIMATORS", "`kl.estimator`"),
    ("rlhflab.losses.preference", "PREFERENCE_LOSSES", "`loss.name` (direct alignment)"),
    ("rlhflab.losses.reward_model", "RM_LOSSES", "the reward-model losses"),
    ("rlhflab.losses.distill", "DIVERGENCES", "`loss.divergence` (distillation)"),
    ("rlhflab.losses.correction", "CORRECTIONS", "the off-policy corrections"),
    ("rlhflab.rewards.shaping", "REWARD_COMPONENTS", "`reward.components[].name`"),
    ("rlhflab.rewards.functions", "REWARD_FUNCTIONS", "`reward.components[].name` (functions)"),
)


def _md(text: str) -> str:
    """One table cell: no pipes or newlines."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    return getattr(tp, "__name__", str(tp))


def _submodel(tp: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (directly or inside Optional/list), or None."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        sub = _submodel(arg)
        if sub is not None:
            return sub
    return None


def _default(field) -> str:
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
        if isinstance(value, BaseModel):
            return "(section)"
        return f"`{value!r}`"
    if field.is_required():
        return "required"
    return f"`{field.default!r}`"


def _constraints(field) -> str:
    out = []
    for m in field.metadata:
        for name in ("gt", "ge", "lt", "le", "min_length", "max_length"):
            v = getattr(m, name, None)
            if v is not None:
                sym = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}.get(name, name + " ")
                out.append(f"{sym} {v}")
    return ", ".join(out)


def _written_name(name: str, field) -> str:
    """The key a config file writes: the field's alias, or its first validation alias
    (`env.class` for the field `class_`), else its name."""
    if field.alias:
        return field.alias
    va = field.validation_alias
    choices = getattr(va, "choices", None)
    if choices:
        return str(choices[0])
    return va if isinstance(va, str) else name


def config_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any, type]]:
    """Every (dotted key, pydantic FieldInfo, owning model) of `model`, depth first."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{_written_name(name, field)}"
        rows.append((key, field, model))
        sub = _submodel(field.annotation)
        if sub is not None and sub is not model:
            rows += config_keys(sub, key + ".")
    return rows


def config_reference() -> str:
    """The configuration reference: one section per trainer (`CONFIG_CLASSES`), one row per
    dotted key with its type, default, constraint and description (the field's description, or
    the docstring of the section it opens)."""
    from rlhflab.config import CONFIG_CLASSES

    lines = ["# Configuration reference", "",
             "Generated from the pydantic models in `rlhflab.config` at every documentation "
             "build: every key a config file may set, per trainer (`trainer:` at the top of the "
             "file). Dotted keys are what overrides take (`rlhflab train CONFIG key.path=value`). "
             "Unknown keys are errors that name the closest valid key.", ""]  # fmt: skip
    for trainer, cls in CONFIG_CLASSES.items():
        lines += [f"## `trainer: {trainer}`", "", _md(inspect.getdoc(cls) or ""), "",
                  "| key | type | default | constraint | description |", "|---|---|---|---|---|"]  # fmt: skip
        for key, field, _owner in config_keys(cls):
            sub = _submodel(field.annotation)
            desc = field.description or (inspect.getdoc(sub) if sub is not None else "") or ""
            desc = desc.split("\n\n")[0]
            lines.append(f"| `{key}` | {_md(_type_name(field.annotation))} | {_md(_default(field))} "
                         f"| {_md(_constraints(field))} | {_md(desc)} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def _function_of(entry: Any):
    """The function a registry entry stands for: its `fn` (the registries' dataclass entries),
    or the entry itself when it is a function."""
    fn = getattr(entry, "fn", None)
    if fn is None and inspect.isroutine(entry):
        fn = entry
    return fn if inspect.isroutine(fn) else None


def registries_reference() -> str:
    """Every name of every registry (`REGISTRIES`) with the function it runs and the first
    paragraph of that function's docstring. A new entry appears here with no edit to the docs."""
    import importlib

    lines = ["# Registries", "",
             "Generated at every documentation build from the registries the configs are "
             "validated against: a name you may write in a config, the function it runs (with "
             "its full docstring in the API reference), and that docstring's first paragraph.",
             ""]  # fmt: skip
    for mod_name, attr, what in REGISTRIES:
        reg = getattr(importlib.import_module(mod_name), attr)
        lines += [f"## `{attr}` ({what})", "", f"`{mod_name}.{attr}`", "",
                  "| name | function | summary |", "|---|---|---|"]  # fmt: skip
        for name, entry in reg.items():
            fn = _function_of(entry)
            if fn is None:
                lines.append(f"| `{name}` | – | {_md(type(entry).__name__)} |")
                continue
            where = f"{fn.__module__}.{fn.__qualname__}"
            summary = (inspect.getdoc(fn) or "").split("\n\n")[0]
            lines.append(f"| `{name}` | `{where}` | {_md(summary)} |")
        lines.append("")
    return "\n".join(lines)


def api_pages() -> dict[str, str]:
    """{path under docs: markdown} of the API reference: one page per `rlhflab.losses` module
    (mkdocstrings' `:::` renders every public function with its docstring)."""
    pages = {}
    for mod in LOSS_MODULES:
        pages[f"reference/api/losses.{mod}.md"] = (
            f"# `rlhflab.losses.{mod}`\n\n::: rlhflab.losses.{mod}\n"
            "    options:\n      show_source: false\n      members_order: source\n"
        )
    return pages


def cli_reference() -> str:
    """One section per `rlhflab` command: its description, usage and every option, from the
    CLI's own argument parser."""
    from rlhflab.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    lines = ["# Command-line reference", "",
             "Generated from `rlhflab`'s argument parser at every documentation build. "
             "`rlhflab COMMAND --help` prints the same.", ""]  # fmt: skip
    for name, p in sub.choices.items():
        lines += [f"## `rlhflab {name}`", "", _md(p.description or ""), "", "```text",
                  p.format_usage().strip(), "```", "", "| argument | default | help |",
                  "|---|---|---|"]  # fmt: skip
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(action.option_strings) or action.metavar or action.dest
            default = (
                ""
                if action.default in (None, argparse.SUPPRESS, False)
                else f"`{action.default!r}`"
            )
            lines.append(f"| `{_md(flags)}` | {_md(default)} | {_md(action.help or '')} |")
        lines.append("")
    return "\n".join(lines)


def generated_pages() -> dict[str, str]:
    """{path under docs: markdown} of every generated page."""
    return {
        "reference/config.md": config_reference(),
        "reference/cli.md": cli_reference(),
        "reference/registries.md": registries_reference(),
        **api_pages(),
    }
