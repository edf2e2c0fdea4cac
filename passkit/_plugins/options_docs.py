"""Field descriptions from attribute docstrings, read when someone asks for them.

A pass's options model documents each field with the string literal under it::

    class Options(pydantic.BaseModel):
        min_numel: int = 0
        \"\"\"Fuse only outputs this large or larger.\"\"\"

pydantic can turn those into descriptions (``use_attribute_docstrings=True``), but it reads
the class's source when the class is created: every process that loads the plugin pays for
it (100-150 ms once torch is imported, where pydantic's stack walk scans ``sys.modules``),
though only ``passkit list`` / ``passkit show`` / ``passkit schema`` show them.
:func:`documented` reads them then, from the class's source file, once per model.
"""

from __future__ import annotations

from typing import TypeVar

import pydantic

M = TypeVar("M", bound=pydantic.BaseModel)

_DONE = "__passkit_documented__"


def documented(model: type[M]) -> type[M]:
    """``model`` with each field's attribute docstring as its ``description``, where the
    field has none (a field's own ``description=`` wins). Cheap after the first call; a
    model whose source cannot be read is left as it is."""
    if model.__dict__.get(_DONE):
        return model
    try:
        from pydantic._internal._docs_extraction import extract_docstrings_from_cls

        docs = extract_docstrings_from_cls(model, use_inspect=True)
    except (OSError, TypeError, ImportError):  # no source (a REPL, a frozen app)
        docs = {}
    changed = False
    for name, field in model.model_fields.items():
        if field.description is None and docs.get(name):
            field.description = docs[name]
            changed = True
    if changed:
        model.model_rebuild(force=True)
    setattr(model, _DONE, True)
    return model
