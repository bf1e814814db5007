"""Sandbox modes of the python tool for the tests in tests/envs/.

`sandbox`: each test once under the isolated sandbox (bubblewrap; skipped with the reason where
it does not work here, failed instead under RLHFLAB_REQUIRE_BWRAP=1, as in CI) and once under
`unsafe_local` with bwrap hidden from PATH (the machine without an isolation tool); it gives
the keyword arguments to pass to `python_sandbox`. `isolated`: the isolated sandbox only.
`no_bwrap`: PATH without bwrap (`unshare` kept)."""

import os
import shutil

import pytest

from rlhflab.envs import tools


def _require_bwrap() -> None:
    try:
        tools.check_sandbox()
    except tools.SandboxUnavailable as exc:
        if os.environ.get("RLHFLAB_REQUIRE_BWRAP") == "1":
            pytest.fail(f"RLHFLAB_REQUIRE_BWRAP=1 but the isolated sandbox does not work: {exc}")
        pytest.skip(f"needs bubblewrap with unprivileged user namespaces: {exc}")


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if shutil.which("unshare"):
        (bin_dir / "unshare").symlink_to(shutil.which("unshare"))
    monkeypatch.setenv("PATH", str(bin_dir))
    tools._isolation.cache_clear()
    yield
    monkeypatch.undo()
    tools._isolation.cache_clear()


@pytest.fixture(params=["bwrap", "unsafe_local"])
def sandbox(request):
    if request.param == "bwrap":
        _require_bwrap()
        return {}
    request.getfixturevalue("no_bwrap")
    return {"unsafe_local": True}


@pytest.fixture
def isolated():
    _require_bwrap()
