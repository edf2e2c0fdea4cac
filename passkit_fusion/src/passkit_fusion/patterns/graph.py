"""FX graph helpers shared by the passes' matchers.

Reading nodes (:func:`val`, :func:`module_path`, :func:`sole_user`), comparing symbolic
shapes without adding guards (:func:`same_shape`), formatting dtypes and shapes for
rejection reasons, resolving a graph's process group name to its world size
(:func:`group_world_size`), and :class:`Mismatch`, the exception a matcher raises with the
reason a candidate is rejected. Everything is decided from the graph and the process
group's size, never from rank-local state, so every rank decides the same.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

from passkit.graph_utils import module_path as _module_path

__all__ = [
    "Mismatch",
    "dtype_str",
    "group_world_size",
    "module_path",
    "same_shape",
    "shape_str",
    "sole_user",
    "val",
]


class Mismatch(Exception):
    """Why a candidate is not a match (the message is the report's reason)."""


def module_path(node: fx.Node) -> str:
    """The innermost module ``node`` was traced in, as a dotted path (``""`` if unknown):
    passkit's :func:`passkit.graph_utils.module_path`, which reads Dynamo's source strings
    (``L['fn'].__closure__[1].cell_contents.__self__.layers.1`` reads ``layers.1``)."""
    return _module_path(node)


def val(node: fx.Node) -> torch.Tensor:
    """The tensor (fake) value ``node`` carries; :class:`Mismatch` when it has none."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise Mismatch(f"{node.name} has no tensor metadata")
    return value


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_str(shape: Iterable[object]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def same_shape(a: Iterable[object], b: Iterable[object]) -> bool:
    """Shapes equal for every value of their symbols (no guard is added)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def sole_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def group_world_size(group_name: str) -> int:
    """The size of the process group a graph names; :class:`Mismatch` if it cannot be resolved."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name).size()  # type: ignore[arg-type]
    except Exception as exc:
        raise Mismatch(f"process group {group_name!r} cannot be resolved ({type(exc).__name__})") from None
