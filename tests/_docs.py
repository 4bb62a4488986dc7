"""The README and the docs' pages as the tests read them: their code blocks, by language.

The tests that run the code a page shows, or check what a page says, read it through here, so a
block that moves to another page moves one pointer.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def page(path: str) -> str:
    """The text of ``path``, relative to the repository root (``README.md``, ``docs/x.md``)."""
    return (ROOT / path).read_text()


def code_blocks(path: str, lang: str = "python") -> list[str]:
    """The fenced ``lang`` blocks of a page, in order, without their fences."""
    return re.findall(rf"^```{re.escape(lang)}\n(.*?)^```", page(path), re.S | re.M)


def code_block(path: str, needle: str, lang: str = "python") -> str:
    """The one ``lang`` block of a page that contains ``needle``."""
    found = [b for b in code_blocks(path, lang) if needle in b]
    assert len(found) == 1, f"{path} must hold one {lang} block with {needle!r}, found {len(found)}"
    return found[0]
