"""The tables that programs write into the documentation: a page's text between
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` replaced by a fresh table (``bench all --docs``
writes docs/performance.md's, ``fault_report.py --docs`` docs/reliability.md's).

Whichever page of docs/ holds the markers is the one written, so a table that moves to another
page needs no change here; a page is rewritten whole through a temporary sibling (never half
written), and markers found on no page, or on two, are an error naming them.
"""

from __future__ import annotations

import os
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def page_with(name: str, docs: Path = DOCS) -> Path:
    """The one page of ``docs`` that holds the ``name`` markers."""
    begin = f"<!-- {name}:begin -->\n"
    found = [p for p in sorted(docs.glob("*.md")) if begin in p.read_text()]
    if len(found) != 1:
        where = ", ".join(str(p) for p in found) or "no page"
        raise ValueError(f"the {name}:begin/{name}:end markers must be on one page of {docs}, found: {where}")
    return found[0]


def write_table(name: str, body: str, docs: Path = DOCS) -> Path:
    """Replace what lies between the ``name`` markers with ``body``; returns the page written."""
    page = page_with(name, docs)
    text = page.read_text()
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    head, rest = text.split(begin, 1)
    if end not in rest:
        raise ValueError(f"{page}: {name}:begin without {name}:end")
    tmp = page.with_name(f".{page.name}.tmp")
    tmp.write_text(head + begin + body.rstrip("\n") + "\n" + end + rest.split(end, 1)[1])
    os.replace(tmp, page)
    return page
