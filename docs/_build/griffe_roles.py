"""A griffe extension for the API reference: passkit's docstrings use Sphinx roles
(``:class:`~passkit.Config```, ``:func:`build_pipeline```), which Markdown would show as
typed; this turns each into a code span of the name as Sphinx would print it."""

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
            obj.docstring.value = ROLE.sub(_replace, obj.docstring.value)
