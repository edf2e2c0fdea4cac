"""Options models whose fields are documented by attribute docstrings, cheaply.

pydantic's ``use_attribute_docstrings=True`` finds a class's source by walking the stack
and calling ``inspect.getmodule`` on each frame, which scans every module in ``sys.modules``
the first time: 100-150 ms once torch and Inductor are imported (about 2,500 modules), paid
by every process that loads the plugin. :func:`attribute_docstrings` reads the same
docstrings from the class's source file instead (a few milliseconds), for ``passkit list``
and the options' JSON schema.
"""

from __future__ import annotations

from typing import TypeVar

import pydantic

M = TypeVar("M", bound=type[pydantic.BaseModel])


def attribute_docstrings(model: M) -> M:
    """Class decorator: each field's docstring (the string literal under it) becomes its
    ``description``, unless the field has one."""
    from pydantic._internal._docs_extraction import extract_docstrings_from_cls

    docs = extract_docstrings_from_cls(model, use_inspect=True)
    changed = False
    for name, field in model.model_fields.items():
        if field.description is None and docs.get(name):
            field.description = docs[name]
            changed = True
    if changed:
        model.model_rebuild(force=True)
    return model
