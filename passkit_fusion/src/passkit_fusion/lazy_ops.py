"""``torch.ops.passkit_fusion``, defined at its first use.

The passes' custom ops (``torch.library`` definitions with their fake and reference
implementations, and the runtime modules behind them) cost tens of milliseconds to define.
A process pays for them only when it needs one: when a pass rewrites a graph (the pass
imports its ops module) or when anything looks an op up by name: the code Inductor restores
from its cache (compiled by an earlier process, where the pass ran), a pickled graph, a user.

Loading the plugin calls :func:`install`, which puts a namespace object at
``torch.ops.passkit_fusion`` that imports :data:`OP_MODULES` the first time an op it does
not know yet is looked up, then answers as torch's own namespace does.
"""

from __future__ import annotations

import importlib
import threading

import torch
from torch._ops import _OpNamespace

NAMESPACE = "passkit_fusion"
OP_MODULES = (
    "passkit_fusion.allreduce_rmsnorm.ops",
    "passkit_fusion.allreduce_layernorm.ops",
    "passkit_fusion.sequence_parallel.ops",
    "passkit_fusion.async_tp.ops",
    "passkit_fusion.allreduce_overlap.ops",
)
"""The modules whose import defines every ``passkit_fusion::*`` op."""

_lock = threading.Lock()
_loaded = False


def load() -> bool:
    """Import :data:`OP_MODULES` (once per process); True when this call imported them."""
    global _loaded
    with _lock:
        if _loaded:
            return False
        _loaded = True  # first: the imports below look ops up through the namespace
    for name in OP_MODULES:
        importlib.import_module(name)
    return True


class _LazyNamespace(_OpNamespace):
    """torch's op namespace, loading passkit-fusion's ops on the first unknown name."""

    def __getattr__(self, op_name: str):  # type: ignore[no-untyped-def]
        try:
            return super().__getattr__(op_name)
        except AttributeError:
            if op_name.startswith("__") or not load():
                raise
        return super().__getattr__(op_name)


def install() -> None:
    """Make ``torch.ops.passkit_fusion`` load the ops when one is looked up (idempotent).

    A namespace torch already created (an op was looked up before) is replaced by a lazy
    one holding the same ops."""
    ops = torch.ops
    current = ops.__dict__.get(NAMESPACE)
    if isinstance(current, _LazyNamespace):
        return
    lazy = _LazyNamespace(NAMESPACE)
    # torch names an op's packet after its namespace's module ("torch._ops.<ns>"), and
    # Inductor's generated code calls the op by that name ("torch.ops.<ns>.<op>")
    lazy.__module__ = _OpNamespace.__module__
    if current is not None:
        lazy.__dict__.update(
            {k: v for k, v in vars(current).items() if k not in ("__name__", "__spec__", "__module__")}
        )
    else:
        ops._dir.append(NAMESPACE)
    setattr(ops, NAMESPACE, lazy)
