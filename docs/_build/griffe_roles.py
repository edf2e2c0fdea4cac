"""A griffe extension for the API reference: passkit's docstrings use Sphinx roles
(``:class:`~passkit.Config```, ``:func:`build_pipeline```), which Markdown would show as
typed; this turns each into a code span of the name as Sphinx would print it. A
``Class attributes:`` section is read as Google style's ``Attributes:`` (a table). The
reST the docstrings also use becomes Markdown (:func:`rest_to_markdown`): a literal block
(``text::`` or a lone ``::``, then an indented block) becomes a fenced code block, and a
definition list of ``literal`` terms (each term on its line, its definition indented below)
a bulleted list; ``tests/test_docs_render.py`` checks both."""

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
            text = rest_to_markdown(ROLE.sub(_replace, obj.docstring.value))
            obj.docstring.value = re.sub(r"^(\s*)Class attributes:$", r"\1Attributes:", text, flags=re.M)


TERM = re.compile(r"^(\s*)``[^`]+``$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rest_to_markdown(text: str) -> str:
    """reST literal blocks and definition lists of ``text`` as Markdown (see the module
    docstring); everything else is left as it is."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.rstrip()
        if stripped.endswith("::") and not stripped.endswith(":::"):
            base = _indent(line)
            lead = stripped[:-2].rstrip()
            if lead.strip():
                out.append(lead + ":")
            j = i + 1
            block: list[str] = []
            while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            body = [b for b in block if b.strip()]
            if body:
                cut = min(_indent(b) for b in body)
                pad = " " * base
                out += ["", pad + "```python", *[(pad + b[cut:]) if b.strip() else "" for b in block]]
                while out and not out[-1].strip():
                    out.pop()
                out += [pad + "```", ""]
                i = j
                continue
            i += 1
            continue
        term = TERM.match(line)
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if term and nxt.strip() and _indent(nxt) > _indent(line):
            base = _indent(line)
            j = i + 1
            definition: list[str] = []
            while j < len(lines) and lines[j].strip() and _indent(lines[j]) > base:
                definition.append(lines[j].strip())
                j += 1
            out.append(" " * base + f"- {line.strip().replace('``', '`')}: {' '.join(definition)}")
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)
