"""Recognising a LayerNorm in a post-grad ATen graph, after a given node.

:func:`match_layernorm` finds a LayerNorm over the last dim whose input is a given node
``s``, in the forms ``torch.compile`` leaves in a post-grad graph:

* Inductor's decomposition of ``nn.LayerNorm`` / ``F.layer_norm`` (``native_layer_norm``)::

      c    = convert_element_type(s, float32)             # absent when s is fp32
      vm   = var_mean.correction(c, [-1], correction=0, keepdim=True)
      n    = mul(sub(c, vm[1]), rsqrt(add(vm[0], eps)))
      out  = add(mul(n, W), B)                            # W, B optionally upcast; B optional
      out  = convert_element_type(out, dtype)             # absent when s is fp32

* Cohere's hand-written LayerNorm (``mean``, ``(h - mean).pow(2).mean``, ``(h - mean) *
  rsqrt(var + eps)``, ``weight.float() * ...``, no bias);

* the op itself, where a graph keeps it: ``native_layer_norm(s, [H], W, B, eps)[0]`` or
  ``layer_norm(s, [H], W, B, eps)``.

Commutative operands may come in either order; eps, dims and dtypes are read from the graph.
A LayerNorm the fused op would compute differently (over more dims or another dim, no
bias without a weight, a weight or bias in another dtype than the activations, an intermediate used outside
the norm) raises :class:`~passkit_fusion.patterns.graph.Mismatch` with the reason; nothing
shaped like a LayerNorm raises :class:`NoLayerNorm`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from .graph import Mismatch, dtype_str, same_shape, shape_str, val
from .rmsnorm import NoNorm, cast_dtype, number_operand, tensor_other

__all__ = ["LayerNorm", "NoLayerNorm", "match_layernorm"]

aten = torch.ops.aten


class NoLayerNorm(NoNorm):
    """Nothing shaped like a LayerNorm follows the node."""

    def __init__(self, detail: str = "") -> None:
        Mismatch.__init__(self, "no LayerNorm after the all-reduce" + (f" ({detail})" if detail else ""))


@dataclasses.dataclass(frozen=True)
class LayerNorm:
    """A LayerNorm found after a given node."""

    weight: fx.Node | None
    """None: a LayerNorm without affine parameters (OLMo's)."""
    bias: fx.Node | None
    eps: float
    out: fx.Node
    nodes: tuple[fx.Node, ...]
    """The norm's nodes after its input (weight/bias upcasts used only here included), ``out`` last."""
    weight_bias: float = 0.0
    """Always 0: the shape :class:`~passkit_fusion.patterns.rmsnorm.RMSNorm` has too."""


_OPS = (aten.native_layer_norm.default, aten.layer_norm.default)


def match_layernorm(total: fx.Node) -> LayerNorm:
    """The LayerNorm whose input is ``total`` (its other users are fine; every node inside
    the norm must be used only by the norm). Raises :class:`NoLayerNorm` when nothing shaped
    like a LayerNorm follows, else the first other :class:`Mismatch`."""
    dtype = val(total).dtype
    for user in total.users:
        if user.target in _OPS and user.args[0] is total:
            return _op_form(total, user)
    starts = [total] if dtype == torch.float32 else [u for u in total.users if cast_dtype(u) == torch.float32]
    first: Mismatch = NoLayerNorm()
    for h in starts:
        for user in h.users:  # the op on the upcast value (mixed-dtype models)
            if user.target in _OPS and user.args[0] is h:
                first = Mismatch("LayerNorm on the fp32 upcast of its input (not fused)")
        for form in (_decomposed, _manual):
            try:
                return form(total, h)
            except Mismatch as exc:
                first = exc if isinstance(first, NoNorm) else first
    raise first


def _op_form(total: fx.Node, op: fx.Node) -> LayerNorm:
    args = list(op.args) + [None] * (5 - len(op.args))
    shape, weight, bias, eps = args[1], args[2], args[3], args[4]
    eps = op.kwargs.get("eps", eps if eps is not None else 1e-5)
    tval = val(total)
    if not isinstance(shape, (list, tuple)) or len(shape) != 1 or not same_shape(shape, tval.shape[-1:]):
        raise Mismatch(f"LayerNorm over {shape_str(shape or [])}, not the last (hidden) dim")  # type: ignore[arg-type]
    if not isinstance(eps, (int, float)):
        raise Mismatch("the norm's epsilon is not a constant (a graph input?)")
    if op.target is aten.native_layer_norm.default:
        outs = list(op.users)
        if any(u.target is not operator.getitem for u in outs):
            raise Mismatch("native_layer_norm read other than by index")
        if any(u.args[1] != 0 and u.users for u in outs):
            raise Mismatch("LayerNorm's mean or rstd is used outside the norm")
        mains = [u for u in outs if u.args[1] == 0]
        if len(mains) != 1:
            raise NoLayerNorm("native_layer_norm without its output")
        out, nodes = mains[0], (op, *outs)
    else:
        out, nodes = op, (op,)
    weight, bias = _check_affine(weight, bias, tval.dtype, tval.shape[-1])
    return LayerNorm(weight, bias, float(eps), out, tuple(nodes))


def _check_affine(
    weight: object, bias: object, dtype: torch.dtype, hidden: object
) -> tuple[fx.Node | None, fx.Node | None]:
    if weight is None and bias is not None:
        raise Mismatch("LayerNorm with a bias but without a weight")
    for name, node in (("weight", weight), ("bias", bias)):
        if node is None:
            continue
        if not isinstance(node, fx.Node):
            raise Mismatch(f"LayerNorm {name} is not a tensor")
        v = val(node)
        if v.dtype != dtype:
            raise Mismatch(
                f"LayerNorm {name} is {dtype_str(v.dtype)} but activations are {dtype_str(dtype)} "
                "(the fused op reads it in the activation dtype)"
            )
        if v.dim() != 1 or not same_shape(v.shape, (hidden,)):
            raise Mismatch(f"LayerNorm {name} has shape {shape_str(v.shape)}, not [{hidden}]")
    return weight, bias  # type: ignore[return-value]


def _decomposed(total: fx.Node, h: fx.Node) -> LayerNorm:
    ndim = val(total).dim()
    vm = find_user(h, lambda u: u.target is aten.var_mean.correction and u.args[0] is h)
    _check_var_mean(vm, ndim)
    items = {u.args[1]: u for u in vm.users if u.target is operator.getitem}
    if set(items) != {0, 1} or len(vm.users) != 2:
        raise NoLayerNorm("var_mean not read as (var, mean)")
    var, mean = items[0], items[1]
    plus_eps = next_user(var, lambda u: u.target in (aten.add.Tensor, aten.add.Scalar))
    eps = number_operand(plus_eps, var)
    if eps is None:
        raise Mismatch("the norm's epsilon is not a constant (a graph input?)")
    rsqrt = next_user(plus_eps, lambda u: u.target is aten.rsqrt.default)
    centred = next_user(mean, lambda u: u.target is aten.sub.Tensor and u.args[:2] == (h, mean))
    normed = next_user(centred, lambda u: u.target is aten.mul.Tensor and set(u.args[:2]) == {centred, rsqrt})
    if len(rsqrt.users) != 1:
        raise Mismatch(f"{rsqrt.name}, inside the LayerNorm, is also used outside it")
    own_h = h is not total
    if own_h and set(h.users) != {vm, centred}:
        raise Mismatch(f"the norm's fp32 upcast {h.name} is also used outside the norm")
    nodes = [h] if own_h else []
    nodes += [vm, var, mean, plus_eps, rsqrt, centred, normed]
    return _affine_tail(total, normed, nodes, eps)


def _manual(total: fx.Node, h: fx.Node) -> LayerNorm:
    """Cohere's ``CohereLayerNorm`` (and model code like it): ``mean = h.mean(-1, keepdim)``,
    ``var = (h - mean).pow(2).mean(-1, keepdim)``, ``(h - mean) * rsqrt(var + eps)``, then
    the weight (and bias); ``h - mean`` may be computed once or twice."""
    ndim = val(total).dim()
    mean = find_user(h, lambda u: u.target is aten.mean.dim and u.args[0] is h)
    _check_mean_dim(mean, ndim)
    subs = [u for u in mean.users if u.target is aten.sub.Tensor and u.args[:2] == (h, mean)]
    if not subs or len(subs) != len(mean.users):
        raise NoLayerNorm("the mean is not subtracted from its input")
    squares = [
        u
        for s in subs
        for u in s.users
        if (u.target is aten.pow.Tensor_Scalar and u.args[1] == 2)
        or (u.target is aten.mul.Tensor and u.args[:2] == (s, s))
    ]
    if len(squares) != 1:
        raise NoLayerNorm("no variance of the centred values")
    square = squares[0]
    var = next_user(square, lambda u: u.target is aten.mean.dim)
    _check_mean_dim(var, ndim)
    plus_eps = next_user(var, lambda u: u.target in (aten.add.Tensor, aten.add.Scalar))
    eps = number_operand(plus_eps, var)
    if eps is None:
        raise Mismatch("the norm's epsilon is not a constant (a graph input?)")
    rsqrt = next_user(plus_eps, lambda u: u.target is aten.rsqrt.default)
    normed = next_user(
        rsqrt, lambda u: u.target is aten.mul.Tensor and set(u.args[:2]) - {rsqrt} <= set(subs)
    )
    for s in subs:
        if set(s.users) - {square, normed}:
            raise Mismatch(f"{s.name}, inside the LayerNorm, is also used outside it")
    own_h = h is not total
    if own_h and set(h.users) != {mean, *subs}:
        raise Mismatch(f"the norm's fp32 upcast {h.name} is also used outside the norm")
    nodes = [h] if own_h else []
    nodes += [mean, *subs, square, var, plus_eps, rsqrt, normed]
    return _affine_tail(total, normed, nodes, eps)


def _check_mean_dim(node: fx.Node, ndim: int) -> None:
    dims = node.args[1] if len(node.args) > 1 else None
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if not keepdim or node.kwargs.get("dtype") is not None:
        raise NoLayerNorm("mean without keepdim")
    if not isinstance(dims, (list, tuple)) or sorted(int(d) % ndim for d in dims) != [ndim - 1]:  # type: ignore[call-overload]
        raise Mismatch(f"LayerNorm over dims {dims}, not the last (hidden) dim")


def _affine_tail(total: fx.Node, normed: fx.Node, nodes: list[fx.Node], eps: float) -> LayerNorm:
    """From the normalised fp32 value: the weight multiply, the optional bias add and the
    downcast to the activation dtype."""
    dtype = val(total).dtype
    scaled = next(iter(normed.users)) if len(normed.users) == 1 else None
    factor = tensor_other(scaled, normed) if scaled is not None and scaled.target is aten.mul.Tensor else None
    weight: fx.Node | None = None
    bias: fx.Node | None = None
    if factor is None or val(factor).dim() != 1:  # no affine part (OLMo's LayerNorm)
        out = normed
    else:
        weight, prep = _param(factor)
        nodes += [*prep, scaled]  # type: ignore[list-item]
        out = scaled  # type: ignore[assignment]
    add = next(iter(out.users)) if weight is not None and len(out.users) == 1 else None
    if add is not None and add.target is aten.add.Tensor and add.kwargs.get("alpha", 1) == 1:
        other = tensor_other(add, out)
        if other is not None and val(other).dim() == 1:
            bias, prep = _param(other)
            nodes += [*prep, add]
            out = add
    if dtype != torch.float32:
        down = next_user(out, lambda u: cast_dtype(u) == dtype)
        nodes.append(down)
        out = down
    oval = val(out)
    if oval.dtype != dtype or not same_shape(oval.shape, val(total).shape):
        raise Mismatch(f"norm output is {dtype_str(oval.dtype)} {shape_str(oval.shape)}, not like its input")
    weight, bias = _check_affine(weight, bias, dtype, val(total).shape[-1])
    return LayerNorm(weight, bias, float(eps), out, tuple(nodes))


def find_user(node: fx.Node, pred: Callable[[fx.Node], bool]) -> fx.Node:
    for user in node.users:
        if pred(user):
            return user
    raise NoLayerNorm()


def next_user(node: fx.Node, pred: Callable[[fx.Node], bool]) -> fx.Node:
    """The user of ``node`` inside the norm; ``node`` must have no other user."""
    found = find_user(node, pred)
    if len(node.users) > 1:
        raise Mismatch(f"{node.name}, inside the LayerNorm, is also used outside it")
    return found


def _check_var_mean(vm: fx.Node, ndim: int) -> None:
    dims = vm.args[1] if len(vm.args) > 1 else vm.kwargs.get("dim")
    correction = vm.kwargs.get("correction", 1)
    keepdim = vm.kwargs.get("keepdim", False)
    if not keepdim:
        raise NoLayerNorm("var_mean without keepdim")
    if correction != 0:
        raise NoLayerNorm(f"var_mean with correction {correction}")
    if not isinstance(dims, (list, tuple)) or sorted(int(d) % ndim for d in dims) != [ndim - 1]:  # type: ignore[call-overload]
        raise Mismatch(f"LayerNorm over dims {dims}, not the last (hidden) dim")


def _param(node: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """``node`` is a parameter or its fp32 upcast: the stored parameter, and the upcast if
    only the norm reads it (replaced with the norm)."""
    if cast_dtype(node) == torch.float32 and isinstance(node.args[0], fx.Node):
        return node.args[0], ([node] if len(node.users) == 1 else [])
    return node, []
