"""Imports of the checkpoint package and the run-directory modules run one way only (#24):
`rlhflab.checkpoint` may import `rlhflab.rundir` and `rlhflab.serialize`, never the reverse, and
inside the package each module imports only the modules listed below it. Read from the source
with `ast`, so imports inside functions count too."""

import ast
from pathlib import Path

import pytest

import rlhflab

SRC = Path(rlhflab.__file__).parent

#: Lowest first: a module may import only modules before it in this list.
CHECKPOINT_LAYERS = [
    "signals",
    "state",
    "sharded",
    "format",
    "config_diff",
    "disk",
    "hf_files",
    "resume",
    "checkpointer",
    "__init__",
]


def _imports(path: Path) -> set[str]:
    """Every `rlhflab...` module named by an import statement anywhere in `path`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("rlhflab")}


@pytest.mark.parametrize("name", ["rundir.py", "serialize.py", "runs.py"])
def test_run_directory_modules_do_not_import_checkpoint(name):
    bad = sorted(m for m in _imports(SRC / name) if m.startswith("rlhflab.checkpoint"))
    assert bad == [], f"rlhflab/{name} imports {bad}: the checkpoint package sits above it"


def test_serialize_imports_no_run_directory_module():
    above = ("rlhflab.rundir", "rlhflab.runs", "rlhflab.checkpoint")
    bad = sorted(m for m in _imports(SRC / "serialize.py") if m.startswith(above))
    assert bad == [], f"rlhflab/serialize.py imports {bad}: it sits below them"


def test_checkpoint_package_imports_only_downward():
    files = {p.stem for p in (SRC / "checkpoint").glob("*.py")}
    assert files == set(CHECKPOINT_LAYERS), "a module was added: place it in CHECKPOINT_LAYERS"
    for i, name in enumerate(CHECKPOINT_LAYERS):
        below = {f"rlhflab.checkpoint.{m}" for m in CHECKPOINT_LAYERS[:i]}
        inside = {
            ".".join(m.split(".")[:3])
            for m in _imports(SRC / "checkpoint" / f"{name}.py")
            if m.startswith("rlhflab.checkpoint.")
        }
        assert inside <= below, f"checkpoint/{name}.py imports {sorted(inside - below)}"
        assert "rlhflab.checkpoint" not in _imports(SRC / "checkpoint" / f"{name}.py")
