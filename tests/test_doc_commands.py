"""Every `rlhflab train <preset> key=value ...` command in README.md and docs/*.md loads.

The docs' measured runs (docs/real_models.md) are long command lines with quoted JSON; a renamed
key or a bad quote would only show when a reader pastes one. This parses each command as a shell
would (line continuations joined) and builds its config with the same `load_config` the CLI
uses (argv parsed by the CLI's own parser). Placeholders are kept out: `...` tokens and
overrides whose value is `...` or starts with a `<...>` are dropped, and a command whose preset
path holds a `<...>` is left out.
"""

import re
import shlex
from pathlib import Path

import pytest

from rlhflab.cli import parse_args
from rlhflab.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _shell_blocks(text: str) -> list[str]:
    """The bodies of fenced blocks labelled bash/sh/console (or unlabelled), in order."""
    blocks, body, lang = [], None, None
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if body is None:
                body, lang = [], line.strip()[3:].strip()
            else:
                if lang in ("", "bash", "sh", "console"):
                    blocks.append("\n".join(body))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def _train_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `rlhflab train`) for every train command in a fenced shell block.

    `<...>` placeholders become the word PLACEHOLDER, and `...` tokens are dropped.
    """
    found = []
    for path in DOCS:
        for block in _shell_blocks(path.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                if "rlhflab train" not in line:
                    continue
                toks = shlex.split(re.sub(r"<[^<>]*>", "PLACEHOLDER", line), comments=True)
                for i in range(len(toks) - 1):
                    if toks[i] == "rlhflab" and toks[i + 1] == "train":
                        argv = [t for t in toks[i + 2 :] if t != "..."]
                        found.append((f"{path.name}: {line.strip()[:60]}", argv))
    return found


def _is_placeholder(value: str) -> bool:
    # `seed=<s>` or `model.name_or_path=...`: the key is the reader's to fill in
    return value == "..." or value.startswith("PLACEHOLDER")


COMMANDS = _train_commands()
# `rlhflab train configs/dpo/<preset>.yaml ...`: a preset for the reader to pick; nothing to load
LOADABLE = [(w, argv) for w, argv in COMMANDS if "PLACEHOLDER" not in argv[0]]


def test_docs_have_train_commands():
    # guards the extraction itself: the docs pages and docs/real_models.md each have several
    assert sum(not w.startswith("real_models.md") for w, _ in LOADABLE) >= 10
    assert sum(w.startswith("real_models.md") for w, _ in LOADABLE) == 6
    assert len(COMMANDS) - len(LOADABLE) == 1


@pytest.mark.parametrize(("where", "argv"), LOADABLE, ids=[w for w, _ in LOADABLE])
def test_doc_train_command_loads(where, argv):
    args = parse_args(["train", *argv])
    overrides = [o for o in args.overrides if not _is_placeholder(o.split("=", 1)[-1])]
    load_config(ROOT / args.config, overrides)


def _folders_docs_create() -> set[str]:
    """Top-level folders that commands in README.md / docs/*.md write into: `pip download -d D`,
    `python -m zipfile -e WHEEL D`, `bench/make_hh_fixture.py D`, `save_pretrained('D')`."""
    patterns = [
        r"pip download .*?-d (\S+)",
        r"-m zipfile -e \S+ (\S+)",
        r"make_hh_fixture\.py (\S+)",
        r"save_pretrained\('([^']+)'\)",
    ]
    found = set()
    for path in DOCS:
        for block in _shell_blocks(path.read_text()):
            for pat in patterns:
                found |= {m.strip("/").split("/")[0] for m in re.findall(pat, block)}
    return found


def test_gitignore_covers_the_folders_the_docs_create():
    # issue 23: .gitignore lacked data/, wheels/ and the SmolLM2 folder
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    folders = _folders_docs_create()
    assert {"data", "wheels", "smollm2"} <= folders
    for name in sorted(folders):
        probe = f"{name}/probe.txt"
        res = subprocess.run(["git", "check-ignore", "-q", "--no-index", probe], cwd=ROOT)
        assert res.returncode == 0, f".gitignore does not cover {name}/"
    # anchored at the root: the package's and the tests' own data folders stay tracked
    for tracked in ("src/rlhflab/data/probe.py", "tests/data/probe.py"):
        res = subprocess.run(["git", "check-ignore", "-q", "--no-index", tracked], cwd=ROOT)
        assert res.returncode == 1, f"{tracked} is ignored"


def _rlhflab_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `rlhflab`) for every `rlhflab <command>` in a fenced shell block of
    README.md and docs/*.md (placeholders as in `_train_commands`)."""
    found = []
    for path in DOCS:
        for block in _shell_blocks(path.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                if not re.search(r"(^|[\s/])rlhflab\s", line):
                    continue
                try:
                    toks = shlex.split(re.sub(r"<[^<>]*>", "PLACEHOLDER", line), comments=True)
                except ValueError:  # an unbalanced quote: `_train_commands` reports those
                    continue
                for i, tok in enumerate(toks):
                    if tok.rsplit("/", 1)[-1] == "rlhflab" and i + 1 < len(toks):
                        argv = [t for t in toks[i + 1 :] if t != "..."]
                        for stop in ("&&", "|", ";", ">", "2>&1", "&"):
                            if stop in argv:
                                argv = argv[: argv.index(stop)]
                        found.append((f"{path.name}: {line.strip()[:80]}", argv))
                        break
    return found


@pytest.mark.parametrize("where,argv", _rlhflab_commands(), ids=lambda x: str(x)[:60])
def test_every_documented_rlhflab_command_parses(where, argv):
    """Every `rlhflab ...` command in the docs' shell blocks is accepted by the CLI's own parser
    (a renamed flag or command would show here, not when a reader pastes it)."""
    try:
        parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}: `rlhflab {' '.join(argv)}` is refused by the parser ({exc})")
