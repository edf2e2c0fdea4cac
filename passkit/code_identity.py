"""A hash of what a pass's code does, read from its bytecode: part of its cache identity.

A pass's identity hashes the file defining it (:func:`passkit.pass_base.source_hash`), and
that is not always enough: a pass defined in a script read from stdin (``python - <
script.py``) or in a notebook has no file to read, and a pass whose helper functions live in
another module keeps its hash when only the helper changes. Either way a warm Inductor cache
would serve the code the old pass compiled. :func:`code_hash` hashes the class itself: the
bytecode, constants and names of every function in its ``__dict__`` and its bases' (nested
functions and comprehensions included), its simple class attributes, and, followed from the
globals those functions name, the functions and classes they call that are defined outside
the standard library, the installed packages, torch and passkit (a helper module of the
plugin, a function of the script). What changes with the code changes the hash; what does
not (a comment, a file's path) leaves it.

Not followed: code reached otherwise than by a global name (an attribute of an imported
module, ``helpers.fuse(...)``), and data a helper module reads: list such files in the pass's
``source_files``.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any

_SIMPLE = (type(None), bool, int, float, complex, str, bytes)
_OWN_PACKAGES = frozenset({"passkit", "torch"})
_SKIPPED = frozenset(
    {
        "__dict__",
        "__weakref__",
        "__module__",
        "__doc__",
        "__qualname__",
        "__abstractmethods__",
        "__signature__",
    }
)
"""Class attributes that are no code of the class (pydantic's and abc's bookkeeping too)."""


def code_hash(obj: Any) -> str:
    """The hash of ``obj``'s code (a class, a function or a module's functions named by it),
    stable across processes; 16 hex digits."""
    h = hashlib.sha256()
    _Walker(h).visit(obj)
    return h.hexdigest()[:16]


class _Walker:
    def __init__(self, h: Any):
        self.h = h
        self.seen: set[int] = set()

    def feed(self, *parts: object) -> None:
        for part in parts:
            self.h.update(str(part).encode("utf-8", "backslashreplace"))
            self.h.update(b"\0")

    def visit(self, obj: Any) -> None:
        if id(obj) in self.seen:
            self.feed("seen", getattr(obj, "__qualname__", type(obj).__name__))
            return
        self.seen.add(id(obj))
        if isinstance(obj, types.MethodType):  # a hookimpl of a plugin object
            self.visit(obj.__func__)
        elif isinstance(obj, type):
            self.visit_class(obj)
        elif isinstance(obj, types.FunctionType):
            self.feed("function", obj.__qualname__)
            self.visit_code(obj.__code__, obj.__globals__)
            for default in (obj.__defaults__ or ()) + tuple((obj.__kwdefaults__ or {}).values()):
                self.feed(_constant(default))
            for cell in obj.__closure__ or ():
                try:
                    self.visit_value(cell.cell_contents, obj.__globals__)
                except ValueError:  # an empty cell
                    self.feed("empty cell")
        elif isinstance(obj, types.ModuleType):
            self.feed("module", obj.__name__)

    def visit_class(self, cls: type) -> None:
        self.feed("class", cls.__qualname__)
        for base in cls.__mro__:
            if base is object or not _followed(base):
                self.feed("base", f"{base.__module__}.{base.__qualname__}")
                continue
            self.feed("own", base.__qualname__)
            namespace = getattr(sys.modules.get(base.__module__), "__dict__", {})
            for name, value in sorted(vars(base).items(), key=lambda kv: kv[0]):
                if name in _SKIPPED or name.startswith(("__pydantic", "_abc_")):
                    continue
                self.feed("attr", name)
                self.visit_value(value, namespace)

    def visit_value(self, value: Any, namespace: dict[str, Any]) -> None:
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for fn in (value.fget, value.fset, value.fdel):
                if fn is not None:
                    self.visit(fn)
            return
        if not isinstance(value, (types.FunctionType, type)):
            self.feed(_constant(value))
        elif _followed(value):
            self.visit(value)
        else:
            self.feed(_qualified(value))

    def visit_code(self, code: types.CodeType, namespace: dict[str, Any]) -> None:
        self.feed("code", code.co_name, code.co_code.hex(), code.co_names, code.co_varnames, code.co_freevars)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self.visit_code(const, namespace)
            else:
                self.feed(_constant(const))
        for name in code.co_names:  # the helpers it calls by a global name
            value = namespace.get(name)
            if isinstance(value, (types.FunctionType, type)) and _followed(value):
                self.visit(value)


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def _constant(value: Any) -> str:
    """A process-independent text of a constant (no addresses; sets sorted)."""
    if isinstance(value, _SIMPLE):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_constant(v) for v in value)})"
    if isinstance(value, (frozenset, set)):
        return f"{type(value).__name__}({', '.join(sorted(_constant(v) for v in value))})"
    if isinstance(value, dict):
        items = sorted((_constant(k), _constant(v)) for k, v in value.items())
        return f"dict({', '.join(f'{k}: {v}' for k, v in items)})"
    if isinstance(value, type) or callable(value):
        return _qualified(value)
    return type(value).__qualname__


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(str(Path(r).resolve()) for r in roots if r)


_ROOTS: tuple[str, ...] | None = None


@functools.cache
def _distributed_packages() -> frozenset[str]:
    """Top-level packages of the installed distributions (editable installs too, whose
    source trees lie outside site-packages): their code is identified by the distribution's
    version and the pass's ``source_files``, the same in every process; walking it would make
    the identity depend on what this process imported or patched first."""
    import importlib.metadata

    return frozenset(importlib.metadata.packages_distributions())


def _followed(obj: Any) -> bool:
    """Whether ``obj``'s code is followed: defined in the program or a plugin's own source
    tree, not in the standard library, an installed package, torch or passkit (their versions
    are in the identity already)."""
    global _ROOTS
    module_name = getattr(obj, "__module__", None) or ""
    top = module_name.split(".")[0]
    if top in _OWN_PACKAGES or module_name == "builtins" or top in _distributed_packages():
        return False  # an installed distribution, editable ones included: versioned, file-hashed
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if not path:  # __main__ read from stdin, a notebook, code made by exec
        return True
    if _ROOTS is None:
        _ROOTS = _library_roots()
    try:
        resolved = str(Path(path).resolve())
    except OSError:
        return True
    return not resolved.startswith(_ROOTS)


__all__ = ["code_hash"]
