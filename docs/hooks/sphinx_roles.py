"""MkDocs hook: Sphinx cross-reference roles in docstrings read as plain code names.

normlab's docstrings name other objects with Sphinx roles (``:func:`layer_norm```,
``:class:`~normlab.errors.NormlabError```), which Python's ``help()`` and IDEs show well but
Markdown renders literally (``:func:`` before a code span). This hook rewrites each rendered
role to its code span alone; a leading ``~`` keeps only the last dotted part, as in Sphinx.
"""

from __future__ import annotations

import re
from typing import Any, Final

#: A rendered role: ``:func:<code>name</code>``, the name possibly ``~``-prefixed.
ROLE: Final = re.compile(
    r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):<code>(~?)([^<]+)</code>"
)


def strip_roles(html: str) -> str:
    """``html`` with every rendered Sphinx role reduced to its code span."""

    def code(match: re.Match[str]) -> str:
        tilde, name = match.groups()
        return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}</code>"

    return ROLE.sub(code, html)


def on_page_content(html: str, **kwargs: Any) -> str:
    """MkDocs event: each page's HTML, docstrings rendered, before the theme wraps it."""
    return strip_roles(html)
