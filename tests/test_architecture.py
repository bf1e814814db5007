"""The import graph of src/rlhflab keeps the layering of docs/architecture.md.

The graph is built with `ast` from every module's imports, module-level and inside functions
(a lazy import is still a dependency). Conventions:
- an import of a package counts as an import of its `__init__`; `from pkg import name` counts as
  an import of `pkg.name` when that is a module, else of `pkg`;
- a package's `__init__` importing its own submodules is not an edge: the `__init__` is the
  package's face (re-exports, a factory such as `rollout.engines.make_engine`). The reverse (a
  submodule importing its package's `__init__`) is an edge;
- the root package `rlhflab` (it holds `__version__` and registers the GPT) is left out of the
  package-level graph: every module imports it implicitly.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Cycles accepted for now (none since checkpoint/ and rundir.py import only downward).
KNOWN_CYCLES: set[frozenset[str]] = set()
# Submodules that still import names defined in their package's __init__.py (none: every
# package's code lives in modules, its __init__.py is a face).
KNOWN_FACE_IMPORTS: set[str] = set()
# Private names imported across modules, in areas being rewritten (config.py → config/ package).
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str]] = set()

# trainers/common.py (shared plumbing) and trainers/loop.py (the run harness) are shared
# infrastructure every trainer may import (and import no trainer); trainers/__init__.py is the
# dispatcher over the trainer families (its imports of its own submodules are not edges, see above).
# Any other trainers/ module is a trainer family (it defines the entry point `train(cfg)`) or a
# helper of one family (e.g. da_data.py of direct_alignment.py), see
# test_no_trainer_imports_another_trainer.
TRAINER_SHARED = {"rlhflab.trainers", "rlhflab.trainers.common", "rlhflab.trainers.loop"}


# The layers of docs/architecture.md, lowest first: a module may import modules of its own unit
# (top-level module or subpackage) and of lower layers only. Keep this table and the doc's equal.
LAYERS: list[set[str]] = [
    {"errors", "fingerprint", "plots", "presets", "serialize", "stats"},  # leaves
    {"distributed", "rundir", "health", "ops", "optimizers"},
    {"faults", "tracking", "losses", "runs"},
    {"models"},
    {"data", "_autoregister", "checkpoint"},
    {"rollout", "quiet"},
    {"rewards"},
    {"config"},
    {"envs", "plan"},
    {"eval", "summary", "next_steps", "throughput"},
    {"experience"},
    {"trainers"},
    {"pipeline", "quickstart", "compare", "prm_vs_orm", "doctor", "controls"},
    {"sweep"},
    {"replications"},
    {"cli"},
    {"__main__"},
]
LAYER = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in (SRC / "rlhflab").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, list[str]]]:
    """(absolute module imported, names imported from it) for every import statement."""
    path, is_pkg = MODULES[module]
    package = module if is_pkg else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            out.append((full, [a.name for a in node.names]))
    return out


def _edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, (_, is_pkg) in MODULES.items():
        targets = set()
        for full, names in _imports(module):
            if not (full == "rlhflab" or full.startswith("rlhflab.")):
                continue
            if not names:
                targets.add(_resolve(full))
            for name in names:
                sub = f"{full}.{name}"
                targets.add(sub if sub in MODULES else _resolve(full))
        targets.discard(module)
        targets.discard(None)
        if is_pkg:  # a package's face over its own submodules
            targets = {t for t in targets if not t.startswith(module + ".")}
        graph[module] = targets
    return graph


GRAPH = _edges()


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _top(module: str) -> str:
    """The top-level unit of a module: `rlhflab.models.reward` → `rlhflab.models`."""
    return ".".join(module.split(".")[:2])


def test_graph_sees_the_package():
    assert len(MODULES) > 50
    assert "rlhflab.ops" in GRAPH["rlhflab.losses.policy"]
    assert "rlhflab.models.lora" in GRAPH["rlhflab.rollout.engines.vllm"]  # a function-level import


def test_no_import_cycle_between_modules():
    cycles = [c for c in _cycles(GRAPH) if frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}"


def test_no_submodule_imports_its_packages_face():
    """A package's __init__.py is its face (it re-exports its submodules), and the graph leaves
    the face's imports of its own submodules out; so a submodule that imports a name defined in
    the face (`from rlhflab.distributed import is_main` inside distributed/state.py) is a cycle
    the cycle tests cannot see. Code lives in modules; a submodule imports its siblings.
    (`__main__` modules run their package's face by design.)"""
    bad = []
    for module, targets in GRAPH.items():
        if module.endswith(".__main__") or module in KNOWN_FACE_IMPORTS:
            continue
        for t in targets:
            if t != "rlhflab" and MODULES[t][1] and module.startswith(t + "."):
                bad.append((module, t))
    assert not bad, f"submodules importing their package's __init__: {bad}"


def test_no_import_cycle_between_packages():
    """models/, data/, rollout/, rewards/, eval/, ... as units: none imports one that imports it."""
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        if module == "rlhflab":
            continue
        for t in targets:
            if t != "rlhflab" and _top(t) != _top(module):
                packages.setdefault(_top(module), set()).add(_top(t))
    cycles = [c for c in _cycles(packages) if frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, f"package import cycles: {[sorted(c) for c in cycles]}"


def test_imports_go_down_the_layers():
    units = {m.split(".")[1] for m in MODULES if m != "rlhflab"}
    missing = sorted(units - set(LAYER))
    assert not missing, f"add {missing} to LAYERS here and to docs/architecture.md"
    bad = []
    for module, targets in GRAPH.items():
        if module == "rlhflab":
            continue
        unit = module.split(".")[1]
        for t in targets:
            if t == "rlhflab" or t.split(".")[1] == unit:
                continue
            upward = LAYER[t.split(".")[1]] >= LAYER[unit]
            if upward and frozenset({_top(module), _top(t)}) not in KNOWN_CYCLES:
                bad.append((module, t))
    assert not bad, f"imports that go up or sideways: {bad}"


# Who samples through the rollout engines besides `experience/` (the trainers' sampler) and
# `eval/` (held-out evaluation), each for a reason: the engine table's names (the config's
# Literal and the CLI's --engine choices derive from it), the episode runner (one `generate` per
# turn), reward-model data (`rollout.scored`), and the tools that load a model to measure it
# outside any training run (doctor's engine row, the pipeline's comparison, two replications'
# evaluations).
ENGINE_IMPORTERS = {
    "rlhflab.config.policy_gradient": "ENGINE_NAMES: rollout.engine's Literal",
    "rlhflab.cli": "ENGINE_NAMES: the --engine choices",
    "rlhflab.envs.episodes": "SamplingParams of one turn",
    "rlhflab.rollout.scored": "sample_and_score (reward-model data, best-of-n)",
    "rlhflab.doctor": "the engine row measures the hf engine",
    "rlhflab.pipeline": "the comparison loads each final model and samples it",
    "rlhflab.replications.r1_zero": "samples a saved model",
    "rlhflab.replications.dpo_overopt": "samples a saved checkpoint",
    "rlhflab.rewards.judge": "an LLM judge answers through the hf engine (greedy)",
}


def test_trainers_sample_through_the_experience_layer():
    """Issue #40's rules: no trainers/ module imports the rollout engines or the environments
    (they draw through `rlhflab.experience`); besides experience/ and eval/, only the modules of
    ENGINE_IMPORTERS import rollout.engines (and rollout/ itself)."""

    def hits(prefix):
        return {m for m, ts in GRAPH.items() if any(t == prefix or t.startswith(prefix + ".")
                                                   for t in ts)}  # fmt: skip

    engines, envs = hits("rlhflab.rollout.engines"), hits("rlhflab.envs")
    trainers = sorted(m for m in engines | envs if m.startswith("rlhflab.trainers"))
    assert not trainers, f"trainers importing rollout.engines or envs: {trainers}"
    allowed = ("rlhflab.experience", "rlhflab.eval", "rlhflab.rollout")
    others = sorted(m for m in engines if not m.startswith(allowed) and m not in ENGINE_IMPORTERS)
    assert not others, f"modules sampling through rollout.engines outside experience/eval: {others}"
    stale = sorted(set(ENGINE_IMPORTERS) - engines)
    assert not stale, f"ENGINE_IMPORTERS entries that no longer import rollout.engines: {stale}"


def test_sampling_trainers_have_no_mode_specific_code():
    """Sync, dynamic, async and episodes live in `rlhflab.experience.Sampler`: the trainers that
    sample through it name none of the modes' machinery."""
    words = ("AsyncRollouts", "dynamic_sample", "run_episodes", "rlhflab.envs", "load_env",
             "rollout.mode", "dynamic_sampling", "async_rollouts", "engine.generate")  # fmt: skip
    for name in ("policy_gradient", "distill"):
        text = MODULES[f"rlhflab.trainers.{name}"][0].read_text()
        found = [w for w in words if w in text]
        assert not found, f"trainers/{name}.py names {found}"


def _defines_train(module: str) -> bool:
    path, _ = MODULES[module]
    body = ast.parse(path.read_text(), str(path)).body
    return any(isinstance(n, ast.FunctionDef) and n.name == "train" for n in body)


def test_no_trainer_imports_another_trainer():
    """A trainer family (a trainers/ module with the entry point `train(cfg)`) imports the shared
    infrastructure (TRAINER_SHARED) and helper modules of its own (any other trainers/ module),
    never another family; a helper belongs to one family (no two families import it) and, like
    the shared modules, imports no family; the shared modules import no helper."""
    trainers = [m for m in MODULES if m.startswith("rlhflab.trainers.")]
    families = {m for m in trainers if _defines_train(m)}
    helpers = set(trainers) - families - TRAINER_SHARED
    assert {"rlhflab.trainers.sft", "rlhflab.trainers.direct_alignment"} <= families
    assert "rlhflab.trainers.da_data" in helpers
    bad = [(m, t) for m in trainers for t in GRAPH[m] if t in families]
    assert not bad, f"trainer → trainer imports: {bad}"
    owners = {h: sorted(f for f in families if h in GRAPH[f]) for h in helpers}
    shared = {h: fs for h, fs in owners.items() if len(fs) > 1}
    assert not shared, f"helpers of more than one trainer family (move to common.py): {shared}"
    for m in TRAINER_SHARED - {"rlhflab.trainers"}:
        shared_bad = [t for t in GRAPH[m] if t in helpers]
        assert not shared_bad, f"{m} imports a trainer's helper: {shared_bad}"


def test_losses_and_ops_import_only_torch_and_stdlib():
    pure = ["rlhflab.ops"] + [m for m in MODULES if m.startswith("rlhflab.losses")]
    bad = []
    for m in pure:
        for full, _ in _imports(m):
            root = full.split(".")[0]
            inner = full == "rlhflab.ops" or full.startswith("rlhflab.losses")
            if not (root == "torch" or root in sys.stdlib_module_names or inner):
                bad.append((m, full))
    assert not bad, f"losses/ops import outside torch + stdlib: {bad}"


def test_only_distributed_imports_torch_distributed():
    bad = []
    for m in MODULES:
        if m == "rlhflab.distributed" or m.startswith("rlhflab.distributed."):
            continue
        for full, names in _imports(m):
            if full.startswith("torch.distributed") or (full == "torch" and "distributed" in names):
                bad.append((m, full))
    assert not bad, f"torch.distributed imported outside rlhflab/distributed/: {bad}"


def test_data_never_imports_rollout_or_trainers():
    bad = [
        (m, t)
        for m in MODULES
        if m.startswith("rlhflab.data")
        for t in GRAPH[m]
        if _top(t) in ("rlhflab.rollout", "rlhflab.trainers")
    ]
    assert not bad, f"data/ imports rollout/ or trainers/: {bad}"


def test_cli_modules_are_entry_points():
    """A `cli` module parses a command line; helpers two commands share live in a module below.
    The `rlhflab.cli` package (parser, command handlers, `python -m rlhflab.cli`) is the top entry
    point: its modules may import a `cli` module, as `rlhflab/__main__.py` may."""
    bad = [
        (m, t)
        for m in MODULES
        for t in GRAPH[m]
        if t.rpartition(".")[2] == "cli" and _top(m) != "rlhflab.cli" and m != "rlhflab.__main__"
    ]
    assert not bad, f"imports of a cli module: {bad}"


def _same_package(a: str, b: str) -> bool:
    """Both inside one subpackage of rlhflab (`rlhflab.config` and `rlhflab.config.base`)."""
    top = ".".join(a.split(".")[:2])
    return MODULES[top][1] and (b == top or b.startswith(top + "."))


def test_no_private_name_imported_across_modules():
    """`from a import _x` in module b: `_x` is a's own; share it under a public name instead.
    Modules of one package (`rlhflab.config.*`) may share private helpers among themselves."""
    bad = set()
    for m in MODULES:
        for full, names in _imports(m):
            if not full.startswith("rlhflab"):
                continue
            private = [
                n
                for n in names
                if n.startswith("_") and not n.startswith("__") and f"{full}.{n}" not in MODULES
            ]
            target = _resolve(full)
            if private and target != m and not _same_package(m, target):
                bad.add((m, target))
    bad -= KNOWN_PRIVATE_IMPORTS
    assert not bad, f"private names imported across modules: {sorted(bad)}"
