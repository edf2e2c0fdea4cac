"""Recognising a static per-tensor FP8 (``float8_e4m3fn``) quantization after a given node.

:func:`match_fp8_quant` finds, after ``y`` (an RMSNorm's output), the post-grad ATen form of::

    q = (y / scale).clamp(-448, 448).to(torch.float8_e4m3fn)           # plain torch
    q = (y * inv_scale).clamp(-448, 448).to(torch.float8_e4m3fn)       # an inverse scale
    q = (y.float() / scale).clamp(min=-448., max=448.).to(float8_e4m3fn)   # torchao

as Inductor's decompositions leave it: a chain of single-use nodes made of dtype
conversions (``convert_element_type`` to fp32 or back), one scaling op (``div.Tensor`` by
the scale, or ``mul.Tensor`` by an inverse scale), a clamp to ``[-448, 448]``
(``clamp_min`` + ``clamp_max`` in either order, or ``clamp``), and the final conversion to
``float8_e4m3fn``. The last form is what torchao's ``_quantize_affine_float8`` (its
``Float8Tensor`` static-activation-scale inference path) produces.

The scale must be *static*: one element (shape ``[]``, ``[1]``, ``[1, 1]``...), a floating
dtype, and not computed from the activations (its ancestors, read from the graph, contain
none of the nodes the caller says are the site's). Anything shaped like an FP8
quantization that the fused kernel computes differently raises
:class:`~passkit_fusion.patterns.graph.Mismatch` with the reason (dynamic or per-row /
per-block scales, ``float8_e5m2`` or another FP8 format, a clamp range that is not
e4m3's, no clamp, a pre-quantization value used elsewhere); nothing shaped like one raises
:class:`NoQuant`.

Numerics of the kernel this stands for (flashinfer's trtllm all-reduce fusion, FP8
patterns): it rounds the norm output to the activation dtype, multiplies it in fp32 by
``1 / scale`` (``scale`` read from a device fp32 tensor at run time) and converts with
saturation to ``float8_e4m3fn``. So ``scale`` is the *dequantization* scale, the one
``torch._scaled_mm`` takes as ``scale_a``: ``q * scale ~ y``.
"""

from __future__ import annotations

import dataclasses
import numbers

import torch
import torch.fx as fx

from .graph import Mismatch, dtype_str, same_shape, shape_str, val
from .rmsnorm import cast_dtype

__all__ = ["E4M3_MAX", "Fp8Quant", "NoQuant", "match_fp8_quant"]

aten = torch.ops.aten

E4M3_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value: the clamp bound the kernel saturates to."""

FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, name)
)

_MAX_SCALE_ANCESTORS = 64
"""How far back the scale's origin is read; a longer computation is not called static."""


class NoQuant(Mismatch):
    """Nothing shaped like an FP8 quantization follows the node."""

    def __init__(self, detail: str = "") -> None:
        super().__init__("no FP8 quantization after the norm" + (f" ({detail})" if detail else ""))


@dataclasses.dataclass(frozen=True)
class Fp8Quant:
    """A static per-tensor FP8 quantization found after a node."""

    scale: fx.Node
    """The scale operand as the graph has it (an inverse scale when ``inverse``)."""
    inverse: bool
    """The graph multiplies by ``scale`` (an inverse scale) instead of dividing by it."""
    out: fx.Node
    """The ``float8_e4m3fn`` node."""
    nodes: tuple[fx.Node, ...]
    """The quantization's nodes after its input, ``out`` last; all used only inside."""
    form: str
    """``"div"``, ``"mul-inverse"``, or with an fp32 upcast first (torchao) ``"fp32-div"`` /
    ``"fp32-mul-inverse"``: for reports and tests."""


def match_fp8_quant(y: fx.Node, site_nodes: frozenset[fx.Node] | set[fx.Node] = frozenset()) -> Fp8Quant:
    """The static per-tensor FP8 quantization of ``y`` (one of ``y``'s users starts it).

    ``site_nodes``: nodes the scale must not be computed from (the all-reduce, the norm...;
    ``y`` always counts). Raises :class:`NoQuant` when no user of ``y`` starts anything
    shaped like an FP8 quantization, else the first other :class:`Mismatch`."""
    if not _reaches_fp8(y):
        raise NoQuant()
    first: Mismatch = NoQuant()
    for user in list(y.users):
        try:
            return _match_from(y, user, frozenset(site_nodes) | {y})
        except Mismatch as exc:
            if isinstance(first, NoQuant) and not isinstance(exc, NoQuant):
                first = exc
    raise first


def _match_from(y: fx.Node, start: fx.Node, avoid: frozenset[fx.Node]) -> Fp8Quant:
    nodes: list[fx.Node] = []
    node, prev = start, y
    scale: fx.Node | None = None
    inverse = upcast_first = False
    bounds: dict[str, float] = {}
    while True:
        if prev is not y and len(prev.users) > 1:
            raise Mismatch(f"{prev.name}, inside the FP8 quantization, is also used outside it")
        nodes.append(node)
        target_dtype = cast_dtype(node)
        if target_dtype is not None and target_dtype in FP8_DTYPES:
            if target_dtype != torch.float8_e4m3fn:
                raise Mismatch(f"quantization to {dtype_str(target_dtype)} (the kernel writes float8_e4m3fn)")
            break
        if target_dtype is not None:
            if not target_dtype.is_floating_point:
                raise NoQuant(f"conversion to {dtype_str(target_dtype)}")
            upcast_first |= scale is None and target_dtype == torch.float32
        elif node.target in (aten.div.Tensor, aten.mul.Tensor):
            if scale is not None or bounds:
                raise NoQuant("a second scaling op")
            scale, inverse = _scale_operand(node, prev)
        elif node.target in (aten.div.Scalar, aten.mul.Scalar) or (
            node.target in (aten.div.Tensor, aten.mul.Tensor) and not isinstance(node.args[1], fx.Node)
        ):
            raise Mismatch("scale is a Python number, not a tensor (the kernel reads the scale from memory)")
        elif node.target in (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default):
            _read_clamp(node, prev, bounds)
        else:
            raise NoQuant(f"unexpected {node.target}")
        prev = node
        users = list(node.users)
        if not users:
            raise NoQuant("the chain ends before a float8 conversion")
        node = users[0]
    out = node
    if scale is None:
        raise NoQuant("no scale before the float8 conversion")
    _check_clamp(bounds)
    if list(bounds) and nodes.index(_first_clamp(nodes)) < nodes.index(_scaling_node(nodes)):
        raise Mismatch("the clamp comes before the scaling")
    _check_scale(scale, avoid)
    if not same_shape(val(out).shape, val(y).shape):
        raise Mismatch(
            f"scale {shape_str(val(scale).shape)} broadcasts the output to {shape_str(val(out).shape)}"
        )
    form = ("fp32-" if upcast_first else "") + ("mul-inverse" if inverse else "div")
    if inverse and (direct := _reciprocal_of(scale)) is not None:
        scale, inverse = direct, False  # y * (1 / s): hand the kernel s itself
    return Fp8Quant(scale=scale, inverse=inverse, out=out, nodes=tuple(nodes), form=form)


def _scale_operand(node: fx.Node, prev: fx.Node) -> tuple[fx.Node, bool]:
    a, b = node.args[:2]
    if node.target is aten.div.Tensor:
        if a is not prev:
            raise NoQuant("the activations are the divisor")
        if not isinstance(b, fx.Node):
            raise Mismatch("scale is a Python number, not a tensor (the kernel reads the scale from memory)")
        return b, False
    other = b if a is prev else a
    if other is prev:
        raise NoQuant("a square")
    if not isinstance(other, fx.Node):
        raise Mismatch("scale is a Python number, not a tensor (the kernel reads the scale from memory)")
    return other, True


def _read_clamp(node: fx.Node, prev: fx.Node, bounds: dict[str, float]) -> None:
    if node.args[0] is not prev:
        raise NoQuant("clamp of another value")
    if node.target is aten.clamp.default:
        lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
        hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
        pairs = (("min", lo), ("max", hi))
    else:
        pairs = (("min" if node.target is aten.clamp_min.default else "max", node.args[1]),)
    for name, bound in pairs:
        if bound is None:
            continue
        if not isinstance(bound, numbers.Real) or isinstance(bound, bool):
            raise Mismatch(f"clamp {name} is not a constant")
        if name in bounds:
            raise Mismatch(f"two clamp {name} bounds")
        bounds[name] = float(bound)


def _check_clamp(bounds: dict[str, float]) -> None:
    if not bounds:
        raise Mismatch(
            "no clamp before the float8_e4m3fn conversion (torch's cast does not saturate, the kernel does)"
        )
    lo, hi = bounds.get("min"), bounds.get("max")
    if lo != -E4M3_MAX or hi != E4M3_MAX:
        shown = f"[{'-inf' if lo is None else f'{lo:g}'}, {'inf' if hi is None else f'{hi:g}'}]"
        raise Mismatch(f"clamp range {shown} is not float8_e4m3fn's [-448, 448]")


def _first_clamp(nodes: list[fx.Node]) -> fx.Node:
    return next(
        n for n in nodes if n.target in (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default)
    )


def _scaling_node(nodes: list[fx.Node]) -> fx.Node:
    return next(n for n in nodes if n.target in (aten.div.Tensor, aten.mul.Tensor))


def _check_scale(scale: fx.Node, avoid: frozenset[fx.Node]) -> None:
    sval = val(scale)
    if not sval.dtype.is_floating_point:
        raise Mismatch(f"scale is {dtype_str(sval.dtype)}")
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if not statically_known_true(sval.numel() == 1):
        raise Mismatch(
            f"scale of shape {shape_str(sval.shape)} is not per-tensor (per-row / per-block scales)"
        )
    if _depends_on(scale, avoid):
        raise Mismatch("dynamic scale: computed from the activations being quantized")


def _reciprocal_of(node: fx.Node) -> fx.Node | None:
    """``s`` when ``node`` is ``reciprocal(s)`` or ``reciprocal(s) * 1.0`` (how ``1 / s``
    traces), else None."""
    if node.target is aten.mul.Tensor and 1.0 in node.args[:2]:
        inner = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        node = inner[0] if len(inner) == 1 else node
    if node.target is aten.reciprocal.default and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _reaches_fp8(y: fx.Node, depth: int = 8) -> bool:
    """Whether a conversion to an FP8 dtype follows ``y`` within ``depth`` nodes."""
    frontier = list(y.users)
    for _ in range(depth):
        if any(cast_dtype(n) in FP8_DTYPES for n in frontier):
            return True
        frontier = [u for n in frontier for u in n.users][:64]
    return False


def _depends_on(node: fx.Node, avoid: frozenset[fx.Node]) -> bool:
    """Whether ``node`` is computed from one of ``avoid`` (True also when its computation is
    longer than :data:`_MAX_SCALE_ANCESTORS` nodes: not a static scale, then)."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in avoid:
            return True
        if current in seen:
            continue
        seen.add(current)
        if len(seen) > _MAX_SCALE_ANCESTORS:
            return True
        stack.extend(current.all_input_nodes)
    return False
