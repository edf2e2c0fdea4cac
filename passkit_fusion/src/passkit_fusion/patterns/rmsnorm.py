"""Recognising an RMSNorm in a post-grad ATen graph, after a given node.

:func:`match_rmsnorm` finds the canonical ATen form of an RMSNorm whose input is a given
node ``s``::

    c   = convert_element_type(s, float32)          # absent when s is already fp32
    var = mean.dim(pow(c, 2) | mul(c, c), [-1], keepdim=True)
    n   = mul(c, rsqrt(add(var, eps)))        # or pow(add(var, eps), -0.5): Gemma-3n, Gemma-4
    out = mul(convert_element_type(n, dtype), W)     # weight after the downcast (Llama)
        | convert_element_type(mul(n, W), dtype)     # weight in fp32 (F.rms_norm, Gemma)
        | convert_element_type(n, dtype)             # no weight (nanochat, F.rms_norm(x, (d,)))
        | n                                          # no weight, fp32 activations

where ``W`` is the weight, optionally upcast, optionally plus a constant (Gemma's
``1 + weight``, returned as ``weight_bias``). Without a weight (no learnable scale:
nanochat's ``NanoChatRMSNorm``, ``F.rms_norm`` without ``weight``) the norm's output is the
normalised product, or its downcast, and :attr:`RMSNorm.weight` is None: a rewrite whose
op takes a weight passes a ones weight of the hidden size (the same value). That output
may have any number of users (the q/k/v projections...). Operands of commutative ops may
come in either order; the epsilon, the weight bias, the dims and the dtypes are read from
the graph. A norm the fused kernels would compute differently (over another dim, a weight in
another dtype than the activations, an intermediate used outside the norm) raises
:class:`~passkit_fusion.patterns.graph.Mismatch` with the reason; nothing shaped like an
RMSNorm raises :class:`NoNorm`. Used by ``allreduce_rmsnorm``'s matcher (after the
all-reduce and residual add) and meant for the other passes that end in an RMSNorm.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

import torch
import torch.fx as fx

from .graph import Mismatch, dtype_str, same_shape, shape_str, val

__all__ = [
    "NoNorm",
    "RMSNorm",
    "cast_dtype",
    "find_user",
    "match_rmsnorm",
    "match_rmsnorm_fp32",
    "next_user",
    "number_operand",
    "tensor_other",
]

aten = torch.ops.aten

_ADDS = (aten.add.Tensor, aten.add.Scalar)


class NoNorm(Mismatch):
    """Nothing shaped like an RMSNorm follows the node (the message keeps the
    ``allreduce_rmsnorm`` report's wording)."""

    def __init__(self, detail: str = "") -> None:
        super().__init__("no RMSNorm after the all-reduce" + (f" ({detail})" if detail else ""))


@dataclasses.dataclass(frozen=True)
class RMSNorm:
    """An RMSNorm found after a given node."""

    weight: fx.Node | None
    """The weight as stored (before any upcast), or None: a norm without a weight (its
    output is the normalised value; ``weight_bias`` is then 0)."""
    weight_bias: float
    eps: float
    out: fx.Node
    nodes: tuple[fx.Node, ...]
    """The norm's nodes after its input (weight preparation included), ``out`` last."""


def match_rmsnorm(total: fx.Node) -> RMSNorm:
    """The RMSNorm whose input is ``total``. ``total``'s other users are fine; every node
    inside the norm must be used only by the norm. Raises :class:`NoNorm` when nothing
    shaped like an RMSNorm follows ``total`` (the last such reason when several upcasts
    were tried), else the first other :class:`Mismatch`."""
    if val(total).dtype == torch.float32:
        starts = [total]
    else:
        starts = [u for u in total.users if cast_dtype(u) == torch.float32]
    first: Mismatch = NoNorm()
    for h in starts:
        try:
            return _norm_from_fp32(total, h)
        except Mismatch as exc:
            first = exc if isinstance(first, NoNorm) else first
    raise first


def match_rmsnorm_fp32(h: fx.Node, like: fx.Node, *, rounded: bool = True) -> RMSNorm:
    """The RMSNorm of ``h``, an fp32 value whose rounding ``like`` (a conversion of ``h``
    to the activation dtype) is read elsewhere: the form of a residual added in fp32
    (SGLang's and vLLM's native ``RMSNorm(x, residual)``: ``h = x.float() +
    residual.float()``, ``residual = h.to(dtype)``, the norm on ``h``). ``h``'s users must
    be ``like`` and the norm; the returned nodes start at the norm's first own node.

    ``rounded=False``: the graph has no rounding of ``h`` (nothing reads the new residual:
    the model's final norm); ``like`` is then a node of the activations' dtype and shape
    (the sum) and ``h``'s only users must be the norm's."""
    return _norm_from_fp32(like, h, also=like if rounded else None)


def _norm_from_fp32(total: fx.Node, h: fx.Node, also: fx.Node | None = None) -> RMSNorm:
    """Match from ``h``, the fp32 view of ``total`` (``total`` itself when it is fp32);
    ``also``: a user of ``h`` besides the norm that is allowed."""
    dtype = val(total).dtype
    square = find_user(h, lambda u: _is_square_of(u, h))
    mean = next_user(square, lambda u: u.target is aten.mean.dim)
    _check_mean(mean, val(total).dim())
    plus_eps = next_user(mean, lambda u: u.target in _ADDS)
    rsqrt = next_user(plus_eps, _is_rsqrt)
    eps = number_operand(plus_eps, mean)
    if eps is None:
        raise Mismatch("the norm's epsilon is not a constant (a graph input?)")
    normed = next_user(rsqrt, lambda u: _is_mul_of(u, h, rsqrt))
    if h is not total and set(h.users) - {also} != {square, normed}:
        raise Mismatch(f"the norm's fp32 upcast {h.name} is also used outside the norm")
    nodes = (
        [square, mean, plus_eps, rsqrt, normed]
        if h is total or also is not None
        else [h, square, mean, plus_eps, rsqrt, normed]
    )
    weight, bias, tail = _weight_tail(normed, dtype, val(total).shape[-1])
    out = tail[-1] if tail else normed  # fp32 without a weight: the normalised product
    if val(out).dtype != dtype or not same_shape(val(out).shape, val(total).shape):
        raise Mismatch(
            f"norm output is {dtype_str(val(out).dtype)} {shape_str(val(out).shape)}, not like its input"
        )
    return RMSNorm(weight, bias, eps, out, (*nodes, *tail))


def _check_mean(mean: fx.Node, ndim: int) -> None:
    dims = mean.args[1] if len(mean.args) > 1 else None
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if mean.kwargs.get("dtype") is not None or not keepdim:
        raise NoNorm("mean without keepdim")
    if not isinstance(dims, (list, tuple)):
        raise Mismatch("RMSNorm over all dims, not the last (hidden) dim")
    if sorted(int(d) % ndim for d in dims) != [ndim - 1]:  # type: ignore[call-overload]
        raise Mismatch(f"RMSNorm over dims {list(dims)}, not the last (hidden) dim")


def _weight_tail(
    normed: fx.Node, dtype: torch.dtype, hidden: int
) -> tuple[fx.Node | None, float, list[fx.Node]]:
    """From the normalised fp32 value to the output: the weight multiply and the downcast,
    in either order, or the downcast alone (no weight), or nothing (no weight, fp32).
    Returns ``(weight, weight_bias, nodes)``, the output last in ``nodes``; ``weight`` is
    None without a weight (the output, ``nodes[-1]`` or ``normed`` itself when ``nodes`` is
    empty, may then have many users)."""
    if dtype == torch.float32:
        muls = [u for u in normed.users if _is_weight_mul(u, normed)]
        if not muls:  # no weight: the normalised product is the output
            return None, 0.0, []
        user = next_user(normed, lambda u: u is muls[0])  # the weight multiply is the output
        weight, bias, prep = _weight(tensor_other(user, normed), dtype, hidden)  # type: ignore[arg-type]
        return weight, bias, [*prep, user]
    user = next_user(normed, lambda u: True)
    if cast_dtype(user) == dtype:  # downcast, then the weight (or no weight)
        muls = [u for u in user.users if _is_weight_mul(u, user)]
        if not muls:  # no weight: the downcast is the output
            return None, 0.0, [user]
        mul = next_user(user, lambda u: u is muls[0])
        factor: fx.Node = tensor_other(mul, user)  # type: ignore[assignment]
        if val(factor).dtype != dtype:
            raise Mismatch(
                f"norm weight is {dtype_str(val(factor).dtype)}: the weight multiply promotes the "
                f"{dtype_str(dtype)} norm output to {dtype_str(val(mul).dtype)}"
            )
        weight, bias, prep = _weight(factor, dtype, hidden)
        return weight, bias, [*prep, user, mul]
    if _is_weight_mul(user, normed, one_dim=False):  # weight in fp32 (a misshapen one: its reason)
        weight, bias, prep = _weight(tensor_other(user, normed), dtype, hidden)  # type: ignore[arg-type]
        down = next_user(user, lambda u: cast_dtype(u) == dtype)
        return weight, bias, [*prep, user, down]
    raise NoNorm(f"unexpected {user.target} after the normalisation")


def _is_weight_mul(node: fx.Node, value: fx.Node, one_dim: bool = True) -> bool:
    """``node`` multiplies ``value`` by another tensor: a norm weight, where it follows the
    normalisation. With ``one_dim``, only by a 1-D tensor: where the norm may also have no
    weight, a product with anything else is one of the output's users (the next norm's
    ``mul(x, rsqrt(...))`` on an fp32 output, a gate), outside the norm."""
    if node.target is not aten.mul.Tensor:
        return False
    other = tensor_other(node, value)
    if other is None:
        return False
    return not one_dim or (isinstance(other.meta.get("val"), torch.Tensor) and val(other).dim() == 1)


def _weight(factor: fx.Node, dtype: torch.dtype, hidden: int) -> tuple[fx.Node, float, list[fx.Node]]:
    """``factor`` is ``weight``, ``weight.float()``, or either plus a constant. The stored
    weight must be in the activations' dtype: the kernel reads it so, and upcasting it is
    exact.

    Returns the stored weight, the constant (``weight_bias``) and the preparation nodes
    used only by the norm (to be replaced with it)."""
    prep: list[fx.Node] = []
    bias = 0.0
    if factor.target in _ADDS and (constant := number_operand(factor, None)) is not None:
        bias = float(constant)
        prep.append(factor)
        factor = tensor_other(factor, None)  # type: ignore[assignment]
    if cast_dtype(factor) == torch.float32 and isinstance(factor.args[0], fx.Node):
        prep.append(factor)
        factor = factor.args[0]
    wval = val(factor)
    if wval.dtype != dtype:
        raise Mismatch(
            f"norm weight is {dtype_str(wval.dtype)} but activations are {dtype_str(dtype)} "
            "(the kernel reads the weight in the activation dtype)"
        )
    if wval.dim() != 1 or not same_shape(wval.shape, (hidden,)):
        raise Mismatch(f"norm weight has shape {shape_str(wval.shape)}, not [{hidden}]")
    # a weight preparation shared with other code stays; only the norm's own is replaced
    own: list[fx.Node] = []
    for node in prep:  # outermost first
        if len(node.users) != 1:
            break
        own.insert(0, node)
    return factor, bias, own


def find_user(node: fx.Node, pred: Callable[[fx.Node], bool]) -> fx.Node:
    for user in node.users:
        if pred(user):
            return user
    raise NoNorm()


def _is_rsqrt(node: fx.Node) -> bool:
    """``rsqrt(v)``, or ``pow(v, -0.5)`` (Gemma-3n's and Gemma-4's norms: ``torch.pow(mean
    + eps, -0.5)``, the same value)."""
    if node.target is aten.rsqrt.default:
        return True
    return node.target is aten.pow.Tensor_Scalar and len(node.args) > 1 and node.args[1] == -0.5


def next_user(node: fx.Node, pred: Callable[[fx.Node], bool]) -> fx.Node:
    """The user of ``node`` inside the norm; ``node`` must have no other user."""
    found = find_user(node, pred)
    if len(node.users) > 1:
        raise Mismatch(f"{node.name}, inside the RMSNorm, is also used outside it")
    return found


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype ``node`` casts to, if it is a pure dtype conversion."""
    if node.op != "call_function":
        return None
    if node.target is torch.ops.prims.convert_element_type.default:
        return node.args[1]  # type: ignore[return-value]
    if node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"}:
        return node.kwargs.get("dtype")  # type: ignore[return-value]
    return None


def _is_square_of(node: fx.Node, h: fx.Node) -> bool:
    if node.target is aten.pow.Tensor_Scalar:
        exponent = node.args[1]
        return node.args[0] is h and isinstance(exponent, numbers.Real) and exponent == 2
    return node.target is aten.mul.Tensor and node.args[:2] == (h, h)


def _is_mul_of(node: fx.Node, a: fx.Node, b: fx.Node) -> bool:
    return node.target is aten.mul.Tensor and set(node.args[:2]) == {a, b} and a is not b


def number_operand(node: fx.Node, other: fx.Node | None) -> float | None:
    """The constant operand of a binary op whose other operand is ``other`` (any node if
    ``None``), or ``None``."""
    a, b = node.args[:2]
    if node.kwargs.get("alpha", 1) != 1:
        return None
    for number, tensor in ((b, a), (a, b)):
        if (
            isinstance(number, numbers.Real)
            and not isinstance(number, bool)
            and isinstance(tensor, fx.Node)
            and (other is None or tensor is other)
        ):
            return float(number)
    return None


def tensor_other(node: fx.Node, known: fx.Node | None) -> fx.Node | None:
    """The node operand of a binary op that is not ``known``."""
    operands = [a for a in node.args[:2] if isinstance(a, fx.Node) and a is not known]
    return operands[0] if len(operands) == 1 else None
