"""Op schemas compared by what a dialect reads, and the schemas recorded from real packages.

A dialect reads each host op's arguments by position and name (``all_reduce(x, reduce_op,
group_name)``), so what must hold across versions is the *shape* of the schema, not its
text: torch 2.11 registers ``_c10d_functional::all_reduce(Tensor input, str reduce_op, str
group_name)`` and torch 2.13 ``... Any group_name``; both are read the same way (the
dialect checks at run time that the group is a string). :func:`schema_difference` compares
two schemas argument by argument:

* the arguments the dialect expects, in order, with the same names, keyword-only-ness,
  mutation (``Tensor(a!)``) and a compatible *kind* of type (:func:`type_kind`: a tensor,
  an optional tensor, a list of tensors, a number, a string; ``Any`` stands for a string
  or a number, never for a tensor);
* any argument a newer release appends must have a default (the graph may then omit it);
* the same number of returns, of the same kinds.

Anything else (an argument removed, renamed, moved, or a tensor where a string was) is a
difference the dialect declines on: it never reads arguments at positions the op may no
longer have.

The schemas of every version passkit supports are recorded in ``recorded/<dialect>.json``,
read from the real packages (``python -m passkit_fusion.dialects record``, run once in an
environment with that version installed; ``nox -s torch_versions`` does it for torch) and
tested against the dialects in the default suite (``tests/fusion/test_dialect_schemas.py``).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

__all__ = [
    "RECORDED_DIR",
    "recorded",
    "schema_difference",
    "supported_versions",
    "type_kind",
]

RECORDED_DIR = Path(__file__).with_name("recorded")
"""``<dialect>.json``: ``{"package": ..., "versions": {"2.11.0": {"ns::op": schema}}}``."""


def type_kind(type_str: str) -> str:
    """The kind of a schema type, as far as a dialect reading the argument cares:
    ``tensor``, ``tensor?``, ``tensor[]``, ``number`` (int, SymInt, float, bool, and their
    optionals), ``str``, ``any``, or the type itself for anything else."""
    t = type_str.replace(" ", "")
    optional = t.startswith("Optional[") or t.endswith("?")
    core = t.removeprefix("Optional[").removesuffix("]") if t.startswith("Optional[") else t.rstrip("?")
    if core == "Tensor":
        return "tensor?" if optional else "tensor"
    if core in ("List[Tensor]", "Tensor[]"):
        return "tensor[]"
    if core in ("int", "SymInt", "float", "bool", "Scalar"):
        return "number"
    if core == "str":
        return "str"
    if core == "Any":
        return "any"
    return core


def _compatible(expected: str, found: str) -> bool:
    a, b = type_kind(expected), type_kind(found)
    if a == b:
        return True
    scalars = {"str", "number"}
    return (a == "any" and b in scalars) or (b == "any" and a in scalars)


_ANONYMOUS_ALIAS = re.compile(r"\(\$(\d+)(!?)\s*->\s*\)")
"""An alias set torch names itself when it prints a live op's schema (``Tensor($0! -> )``, as
vLLM's CPU build's ``_C::shm_allreduce`` prints in a running vLLM server), which torch's own
schema parser does not read back: read as the named set ``a0`` (``Tensor(a0!)``)."""


@functools.lru_cache(maxsize=512)
def _parse(schema: str) -> Any:
    import torch

    return torch._C.parse_schema(_ANONYMOUS_ALIAS.sub(r"(a\1\2)", schema))


def _writes(arg: Any) -> bool:
    return bool(arg.alias_info is not None and arg.alias_info.is_write)


def schema_difference(expected: str, found: str) -> str | None:
    """What in ``found`` (a schema registered in this process) a dialect written against
    ``expected`` would read wrongly, or None when it reads both alike (see the module)."""
    if expected == found:
        return None
    try:
        want, have = _parse(expected), _parse(found)
    except RuntimeError as exc:  # not a schema at all
        return f"schema not understood ({exc})"
    if want.name != have.name:
        return f"op {have.name} is not {want.name}"
    for i, a in enumerate(want.arguments):
        if i >= len(have.arguments):
            return f"argument {i} ({a.name}) is gone"
        b = have.arguments[i]
        if a.name != b.name:
            return f"argument {i} is {b.name!r}, expected {a.name!r}"
        if not _compatible(str(a.type), str(b.type)):
            return f"argument {a.name!r} is {b.type}, expected {a.type}"
        if a.kwarg_only != b.kwarg_only:
            return f"argument {a.name!r} is{'' if b.kwarg_only else ' not'} keyword-only"
        if _writes(a) != _writes(b):
            return f"argument {a.name!r} is{'' if _writes(b) else ' not'} mutated"
    for b in have.arguments[len(want.arguments) :]:
        if not b.has_default_value():
            return f"new argument {b.name!r} has no default"
    if len(want.returns) != len(have.returns):
        return f"{len(have.returns)} return(s), expected {len(want.returns)}"
    for i, (a, b) in enumerate(zip(want.returns, have.returns)):
        if not _compatible(str(a.type), str(b.type)):
            return f"return {i} is {b.type}, expected {a.type}"
    return None


@functools.cache
def _load(dialect: str) -> dict[str, Any]:
    path = RECORDED_DIR / f"{dialect}.json"
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def recorded(dialect: str) -> dict[str, dict[str, str]]:
    """``{version: {"ns::op": schema}}`` recorded for ``dialect`` from the real packages
    (empty when nothing was recorded)."""
    versions: dict[str, dict[str, str]] = _load(dialect).get("versions", {})
    return versions


def supported_versions(dialect: str) -> tuple[str, ...]:
    """The package versions whose schemas are recorded for ``dialect``, oldest first."""

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) if p.isdigit() else 0 for p in v.split("+")[0].split("."))

    return tuple(sorted(recorded(dialect), key=key))
