"""A griffe extension for the API reference: passkit's docstrings use Sphinx roles
(``:class:`~passkit.Config```, ``:func:`build_pipeline```), which Markdown would show as
typed; this turns each into a code span of the name as Sphinx would print it. A
``Class attributes:`` section is read as Google style's ``Attributes:`` (a table)."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([^`]+)`")


def _replace(match: re.Match[str]) -> str:
    short, target = match.groups()
    if short:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = ROLE.sub(_replace, obj.docstring.value)
            obj.docstring.value = re.sub(r"^(\s*)Class attributes:$", r"\1Attributes:", text, flags=re.M)
