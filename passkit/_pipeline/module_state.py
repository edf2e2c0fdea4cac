"""The graph module's state beside its graph: what a failed pass is undone to besides nodes.

A pass gets a :class:`~torch.fx.GraphModule`, and may change more than its graph: rebind an
attribute (``setattr(gm, "_tensor_constant0", t)``), register or delete a buffer, a
parameter or a submodule, or write into a tensor constant in place. :class:`ModuleState`
records, for the module and every submodule, the contents of its ``__dict__`` and of the
containers in it (``_parameters``, ``_buffers``, ``_modules``, ``meta``, hooks), by
reference, and for every tensor reachable from them its version counter and storage
pointer; :meth:`ModuleState.restore` puts all of it back.

Values written in place need a copy to be undone. Copying every weight before every pass
would double a frozen model's memory, so only tensors up to :data:`COPY_TENSOR_BYTES` each,
:data:`COPY_TOTAL_BYTES` in all, are copied (the constants a post-grad graph lifts:
scalars, small tables); a copy is taken once and reused by later states while the tensor's
version and storage are unchanged. A larger tensor is watched through its version counter:
written in place, it cannot be restored, and :meth:`ModuleState.unrestorable` names it
(the pipeline then refuses to go on with the compile, rather than run the changed values).
A write that bypasses the version counter (``t.data.add_()``) into an uncopied tensor is not
seen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

COPY_TENSOR_BYTES = 1 << 20
"""Tensors up to this size are copied (so an in-place write to one can be undone)."""
COPY_TOTAL_BYTES = 16 << 20
"""At most this much is copied per module state (the smallest tensors first)."""

_CONTAINERS = (dict, list, set)
_FROM_THE_GRAPH = frozenset(
    {"_graph", "_code", "_lineno_map", "_prologue_start", "_in_spec", "_out_spec", "meta"}
)
"""Attributes of a GraphModule its graph determines (or that annotate it): a pass that
recompiles or installs a graph changes them; restored, never counted as a change of the
module (its graph's change is measured on its own)."""


@dataclasses.dataclass
class _Tensor:
    tensor: torch.Tensor
    name: str
    version: int | None
    pointer: int | None
    copy: torch.Tensor | None


@dataclasses.dataclass
class ModuleState:
    modules: list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]]
    """Per module: its ``__dict__`` (shallow) and the contents of the containers in it."""
    tensors: dict[int, _Tensor]
    """Every tensor reachable from the modules' attributes, by ``id``."""

    @classmethod
    def take(cls, gm: torch.nn.Module, reuse: ModuleState | None = None) -> ModuleState:
        """The state of ``gm`` now; copies of ``reuse`` serve tensors unchanged since."""
        from torch.utils._python_dispatch import _disable_current_modes

        modules: list[tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]] = []
        found: dict[int, tuple[str, torch.Tensor]] = {}
        for path, module in _modules(gm):
            attrs = dict(vars(module))
            contents = {k: _copy_container(v) for k, v in attrs.items() if isinstance(v, _CONTAINERS)}
            modules.append((module, attrs, contents))
            for name, value in _tensor_attributes(attrs):
                found.setdefault(id(value), (f"{path}{name}", value))
        tensors: dict[int, _Tensor] = {}
        budget = COPY_TOTAL_BYTES
        old = reuse.tensors if reuse is not None else {}
        with _disable_current_modes(), torch.no_grad():
            for key, (name, t) in sorted(found.items(), key=lambda kv: _nbytes(kv[1][1])):
                version, pointer = _version(t), _pointer(t)
                copy = None
                kept = old.get(key)
                if (
                    kept is not None
                    and kept.tensor is t
                    and kept.copy is not None
                    and version is not None
                    and (kept.version, kept.pointer) == (version, pointer)
                ):
                    copy = kept.copy
                elif _nbytes(t) <= min(COPY_TENSOR_BYTES, budget):
                    copy = _clone(t)
                if copy is not None:
                    budget -= _nbytes(t)
                tensors[key] = _Tensor(t, name, version, pointer, copy)
        return cls(modules, tensors)

    def changed(self, gm: torch.nn.Module) -> list[str]:
        """What differs in ``gm`` from this state (attribute and tensor names; empty: nothing
        seen). Cheap: references, version counters and storage pointers, no values (a copied
        tensor without a version counter, an inference tensor, is compared by value)."""
        from torch.utils._python_dispatch import _disable_current_modes

        out: list[str] = []
        seen = {id(m) for m, _, _ in self.modules}
        for path, module in _modules(gm):
            if id(module) not in seen:
                out.append(f"submodule {path.rstrip('.') or '<root>'} (new)")
        for module, attrs, contents in self.modules:
            now = vars(module)
            for key in (set(now) ^ set(attrs)) - _FROM_THE_GRAPH:
                out.append(f"attribute {key!r}")
            for key, value in attrs.items():
                if key in _FROM_THE_GRAPH:
                    continue
                if key in now and now[key] is not value:
                    out.append(f"attribute {key!r}")
                elif key in contents and not _same_container(value, contents[key]):
                    out.append(f"attribute {key!r} (its contents)")
        with _disable_current_modes(), torch.no_grad():
            for entry in self.tensors.values():
                if _tensor_changed(entry):
                    out.append(f"tensor {entry.name!r} (written in place)")
        return sorted(set(out))

    def unrestorable(self) -> list[str]:
        """The tensors written in place since this state that have no copy to restore."""
        return [
            f"{e.name} ({_nbytes(e.tensor) / 2**20:.1f} MiB)"
            for e in self.tensors.values()
            if e.copy is None and _tensor_changed(e)
        ]

    def restore(self) -> None:
        """Put every module's attributes, containers and every copied tensor's values back."""
        from torch.utils._python_dispatch import _disable_current_modes

        for module, attrs, contents in self.modules:
            now = vars(module)
            for key in list(now):
                if key not in attrs:
                    del now[key]
            for key, value in attrs.items():
                now[key] = value
                if key in contents:
                    _refill(value, contents[key])
        with _disable_current_modes(), torch.no_grad():
            for entry in self.tensors.values():
                if entry.copy is not None and _tensor_changed(entry, by_value=True):
                    _write_back(entry)
                    entry.version, entry.pointer = _version(entry.tensor), _pointer(entry.tensor)

    def value_of(self, gm: torch.nn.Module, target: str) -> Any:
        """What attribute ``target`` (dotted) of ``gm`` held when this state was taken, with
        the values it had then (the copy of a tensor written in place since): for running
        the graph before a pass (``verify = "numeric"``)."""
        saved = {id(m): (a, c) for m, a, c in self.modules}
        obj: Any = gm
        for part in target.split("."):
            found = saved.get(id(obj))
            obj = _lookup(*found, part) if found is not None else getattr(obj, part)
        if isinstance(obj, torch.Tensor):
            entry = self.tensors.get(id(obj))
            if entry is not None and entry.copy is not None:
                from torch.utils._python_dispatch import _disable_current_modes

                with _disable_current_modes(), torch.no_grad():
                    if _tensor_changed(entry, by_value=True):
                        return entry.copy.clone()  # the graph may write into it
        return obj


def _lookup(attrs: dict[str, Any], contents: dict[str, Any], name: str) -> Any:
    """Attribute ``name`` as ``nn.Module.__getattr__`` finds it, in a saved ``__dict__``."""
    if name in attrs:
        return attrs[name]
    for container in ("_parameters", "_buffers", "_modules"):
        inner = contents.get(container)
        if isinstance(inner, dict) and name in inner:
            return inner[name]
    raise AttributeError(f"the module had no attribute {name!r} before the pass")


def _modules(gm: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for path, module in gm.named_modules(remove_duplicate=True):
        yield (f"{path}." if path else ""), module


def _tensor_attributes(attrs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in attrs.items():
        if isinstance(value, torch.Tensor):
            yield key, value
        elif key in ("_parameters", "_buffers") and isinstance(value, dict):
            for name, t in value.items():
                if isinstance(t, torch.Tensor):
                    yield name, t


def _copy_container(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    return list(value) if isinstance(value, list) else set(value)


def _same_container(value: Any, saved: Any) -> bool:
    if isinstance(value, dict):
        return len(value) == len(saved) and all(k in saved and saved[k] is v for k, v in value.items())
    if isinstance(value, list):
        return len(value) == len(saved) and all(a is b for a, b in zip(value, saved))
    return value == saved


def _refill(value: Any, saved: Any) -> None:
    if _same_container(value, saved):
        return
    value.clear()
    if isinstance(value, dict):
        value.update(saved)
    elif isinstance(value, list):
        value.extend(saved)
    else:
        value.update(saved)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except Exception:
        return 1 << 62


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except Exception:  # an inference tensor has no version counter
        return None


def _pointer(t: torch.Tensor) -> int | None:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # a fake or meta tensor, a subclass without storage
        return None


def _clone(t: torch.Tensor) -> torch.Tensor | None:
    if _pointer(t) is None:
        return None
    try:
        with _as_inference(t):
            return t.detach().clone()
    except Exception:
        return None


def _as_inference(t: torch.Tensor) -> Any:
    """An inference tensor is copied and written inside inference mode only (and entering
    ``inference_mode(False)`` would turn grad mode back on)."""
    import contextlib

    return torch.inference_mode() if torch.is_inference(t) else contextlib.nullcontext()


def _tensor_changed(entry: _Tensor, by_value: bool = False) -> bool:
    t = entry.tensor
    if (_version(t), _pointer(t)) != (entry.version, entry.pointer):
        return True
    if entry.copy is None or (entry.version is not None and not by_value):
        return False
    try:
        return t.shape != entry.copy.shape or not torch.equal(t, entry.copy)
    except Exception:
        return True


def _write_back(entry: _Tensor) -> None:
    t, copy = entry.tensor, entry.copy
    assert copy is not None
    with _as_inference(t):
        if t.untyped_storage().data_ptr() != entry.pointer or t.shape != copy.shape:
            t.set_(copy.clone())  # a pass that resized or re-stored it
        else:
            t.copy_(copy)


__all__ = ["COPY_TENSOR_BYTES", "COPY_TOTAL_BYTES", "ModuleState"]
