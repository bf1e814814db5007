"""The documentation site (issue #45): the generated references cover the code, and
`mkdocs build --strict` passes with a loss registered after the docs were written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs_hooks"))

import reference  # noqa: E402


def _schema_keys(schema: dict, node: dict, prefix: str, out: set[str]) -> None:
    """Dotted keys of a pydantic JSON schema, following $ref into its $defs (an independent
    walk from the reference generator's, which reads model_fields)."""
    for name, prop in node.get("properties", {}).items():
        key = f"{prefix}{name}"
        out.add(key)
        for sub in [prop, *prop.get("anyOf", []), *prop.get("allOf", [])]:
            ref = sub.get("$ref")
            if ref:
                target = schema["$defs"][ref.rsplit("/", 1)[-1]]
                if key.count(".") < 6:  # recursive sections stop somewhere
                    _schema_keys(schema, target, key + ".", out)


def test_every_config_key_is_in_the_configuration_reference():
    from rlhflab.config import CONFIG_CLASSES

    page = reference.config_reference()
    for trainer, cls in CONFIG_CLASSES.items():
        schema = cls.model_json_schema()
        keys: set[str] = set()
        _schema_keys(schema, schema, "", keys)
        assert len(keys) > 20, trainer
        section = page.split(f"## `trainer: {trainer}`", 1)[1].split("\n## ", 1)[0]
        missing = sorted(k for k in keys if f"| `{k}` |" not in section)
        assert not missing, f"{trainer}: {missing[:10]}"


def test_every_registered_name_is_in_the_registries_page(monkeypatch):
    import importlib

    from rlhflab.losses import policy

    page = reference.registries_reference()
    for mod, attr, _ in reference.REGISTRIES:
        for name in getattr(importlib.import_module(mod), attr):
            assert f"| `{name}` |" in page, (attr, name)

    def my_new_surrogate(logp, logp_old, adv, mask):
        """A surrogate registered after the docs were written."""

    monkeypatch.setitem(policy.POLICY_LOSSES, "my_new_surrogate",
                        policy.PolicyLoss(fn=my_new_surrogate))  # fmt: skip
    page = reference.registries_reference()
    assert "| `my_new_surrogate` |" in page
    assert "registered after the docs were written" in page


def test_every_cli_command_has_a_section():
    from rlhflab.cli import build_parser

    page = reference.cli_reference()
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name in sub.choices:
        assert f"## `rlhflab {name}`" in page
    assert "`--budget`" in page  # an option of `rlhflab controls`


@pytest.mark.slow
def test_mkdocs_build_strict_with_a_new_registered_loss(tmp_path):
    """`mkdocs build --strict` passes, and a loss registered in the building process (here by
    a sitecustomize module, as a user's plugin would) appears on the registries page with its
    docstring, with no edit to docs/."""
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        if os.environ.get("RLHFLAB_REQUIRE_DOCS") == "1":
            pytest.fail("mkdocs is not installed (pip install -e '.[docs]')")
        pytest.skip("mkdocs is not installed (the docs extra)")
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "sitecustomize.py").write_text(
        "from rlhflab.losses import policy\n"
        "def dummy_docs_surrogate(logp, logp_old, adv, mask):\n"
        '    """Dummy surrogate: it must appear in the built API reference."""\n'
        "policy.POLICY_LOSSES['dummy_docs_surrogate'] = policy.PolicyLoss(fn=dummy_docs_surrogate)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(plugin), str(ROOT / "src"),
               os.environ.get("PYTHONPATH")])), NO_MKDOCS_2_WARNING="1")  # fmt: skip
    site = tmp_path / "site"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    html = (site / "reference" / "registries" / "index.html").read_text()
    assert "dummy_docs_surrogate" in html and "it must appear in the built API reference" in html
    assert (site / "reference" / "api" / "losses.policy" / "index.html").is_file()
    assert "ppo_clip" in (site / "reference" / "api" / "losses.policy" / "index.html").read_text()
