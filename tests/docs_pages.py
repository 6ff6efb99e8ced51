"""The documentation as the tests read it: the README (the front page) and the pages under docs/.

Tests that run a page's commands or compare a page with the code find the page and the section
here, so a section that moves to another page is found by its heading, not by a file name
written in ten tests.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: A fenced block, with the marker line before it if there is one:
#: ``<!-- doc-test: skip, WHY -->`` (not run here, and why) or ``<!-- doc-test: output -->`` (a
#: ```text block: what the runnable block before it prints).
FENCE = re.compile(r"(?:<!-- doc-test: (?P<marker>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)\n```", re.S)


def pages() -> list[Path]:
    """The README and every Markdown page of the site (the generated config reference included)."""
    return [
        ROOT / "README.md",
        *sorted(p for p in DOCS.rglob("*.md") if p.is_file() and "benchmarks" not in p.parts),
    ]


def text(name: str) -> str:
    """A page's text: ``"README.md"`` or a page under docs/ (``"rewards.md"``)."""
    return (ROOT / name if name == "README.md" else DOCS / name).read_text()


def section(name: str, heading: str) -> str:
    """The body of the section of page ``name`` whose heading line is ``heading`` (with its
    ``#``s), up to the next heading of the same or a higher level."""
    body = text(name)
    level = len(heading) - len(heading.lstrip("#"))
    start = body.index(heading + "\n") + len(heading) + 1
    rest = body[start:]
    ends = [m.start() for m in re.finditer(r"^(#{1,%d}) " % level, rest, re.M)]
    # headings inside fenced blocks (shell comments) do not end a section
    fences = [(m.start(), m.end()) for m in re.finditer(r"^```.*?^```", rest, re.M | re.S)]
    ends = [e for e in ends if not any(a <= e < b for a, b in fences)]
    return rest[: ends[0]] if ends else rest


def blocks(body: str) -> list[tuple[str, str, str | None]]:
    """``(language, body, marker or None)`` of every fenced block of ``body``, in order."""
    return [(m["lang"], m["body"], m["marker"]) for m in FENCE.finditer(body)]
