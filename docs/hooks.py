"""MkDocs hook (mkdocs.yml ``hooks:``): the package's docstrings are written with Sphinx roles
(:class:`RunConfig`), which mkdocstrings renders as the role's text before a code span. This
drops the role and keeps the code span, so the API pages read ``RunConfig``."""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:class|func|mod|meth|attr|data|exc|obj):(<code>)~?")


def on_page_content(html: str, **_: object) -> str:
    return _ROLE.sub(r"\1", html)
