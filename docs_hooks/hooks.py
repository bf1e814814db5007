"""mkdocs hooks (mkdocs.yml `hooks:`): the home page is README.md; the reference pages are
generated (`docs_hooks/reference.py`); links that leave docs/ (to configs/, experiments/, bench/,
CHANGELOG.md ...) must name a file or folder that exists in the repository — a missing one fails
`mkdocs build --strict` — and are shown as the path, since the site holds only docs/."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import reference  # noqa: E402

log = logging.getLogger("mkdocs.plugins.rlhflab")
LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)")


def _home() -> str:
    """README.md with its links made relative to docs/ (the site's pages are docs/*.md)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")

    def rep(m):
        label, target = m.group(1), m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return m.group(0)
        new = target[5:] if target.startswith("docs/") else "../" + target
        return f"[{label}]({new})"

    return LINK.sub(rep, text)


def on_files(files, config):
    files.append(File.generated(config, "index.md", content=_home()))
    for path, content in reference.generated_pages().items():
        files.append(File.generated(config, path, content=content))
    return files


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    where = (ROOT / "docs" / src).parent
    docs = (ROOT / "docs").resolve()

    def rep(m):
        label, target = m.group(1), m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return m.group(0)
        path = target.split("#", 1)[0]
        resolved = (where / path).resolve()
        if resolved == docs or docs in resolved.parents:
            return m.group(0)  # inside the site: mkdocs checks it
        if not resolved.exists():
            log.warning("%s: link to %s, which does not exist in the repository", src, target)
            return m.group(0)
        shown = resolved.relative_to(ROOT).as_posix() + ("/" if resolved.is_dir() else "")
        return f"{label} (`{shown}`)" if label.strip("`") != shown.rstrip("/") else f"`{shown}`"

    return LINK.sub(rep, markdown)
