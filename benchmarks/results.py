"""A benchmark's result as the scripts leave it: the table printed, then ``OUT.md`` (the
table) and ``OUT.json`` (the numbers behind it) beside each other, the folder made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write(
    out: Path | None,
    text: str,
    data: Any,
    *,
    indent: int = 1,
    json_newline: bool = False,
    default: Any = None,
) -> None:
    """Print ``text``; with ``out``, write it to ``out.md`` and ``data`` to ``out.json``
    (``json.dumps(data, indent=indent, default=default)``, a newline after it with
    ``json_newline``)."""
    print(text, flush=True)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(
        json.dumps(data, indent=indent, default=default) + ("\n" if json_newline else "")
    )
