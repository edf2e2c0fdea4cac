"""Find ``all_reduce -> (add residual) -> RMSNorm`` sites in post-grad ATen graphs.

The matcher is structural: from each functional all-reduce
(``_c10d_functional.wait_tensor(_c10d_functional.all_reduce(x, "sum", group))``, as
``torch.compile`` emits it for functional collectives and for DTensor alike, followed by
``aten.copy`` for an in-place ``dist.all_reduce``) it walks forward and recognises the
canonical ATen form of an RMSNorm::

    c   = convert_element_type(s, float32)          # absent when s is already fp32
    var = mean.dim(pow(c, 2) | mul(c, c), [-1], keepdim=True)
    n   = mul(c, rsqrt(add(var, eps)))
    out = mul(convert_element_type(n, dtype), W)     # weight after the downcast (Llama)
        | convert_element_type(mul(n, W), dtype)     # weight in fp32 (F.rms_norm, Gemma)

where ``s`` is the all-reduce result or its sum with a residual, and ``W`` is the weight,
optionally upcast, optionally plus a constant (Gemma's ``1 + weight``, the kernel's
``weight_bias``). Operands of commutative ops may come in either order; the epsilon, the
weight bias, the dims and the dtypes are read from the graph, so one matcher covers every
value. Everything is decided from the graph and the process group's size, never from
rank-local state, so every rank finds the same sites.

A candidate the fused kernel would compute differently is rejected with a reason: a reduce
op other than sum, a norm over another dim, a weight in another dtype than the activations,
an intermediate (the all-reduce result included) also used outside the match, a residual
add that broadcasts or promotes, an unsupported dtype, hidden size or world size.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.fx as fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
"""World sizes of flashinfer's fused all-reduce kernels (16 runs one-shot only)."""
HIDDEN_MULTIPLE = 8
"""The kernel moves 16-byte vectors: 8 elements of a 16-bit dtype."""
MAX_HIDDEN = 16384
"""Largest hidden size the kernel is known to launch with (one token per thread block cluster)."""

_ADDS = (aten.add.Tensor, aten.add.Scalar)


class Mismatch(Exception):
    """Why a candidate all-reduce is not a site (the message is the report's reason)."""


class NoNorm(Mismatch):
    """Nothing shaped like an RMSNorm follows the all-reduce."""

    def __init__(self, detail: str = "") -> None:
        super().__init__("no RMSNorm after the all-reduce" + (f" ({detail})" if detail else ""))


@dataclasses.dataclass(frozen=True)
class Site:
    """One all-reduce -> (add residual) -> RMSNorm that the fused op can replace."""

    all_reduce: fx.Node
    x: fx.Node
    """The all-reduce's input."""
    group_name: str
    world_size: int
    residual: fx.Node | None
    total: fx.Node
    """The node whose value ``residual_out`` takes over: the residual add, or the all-reduce
    result (``wait_tensor``, or the copy of an in-place all-reduce) without a residual."""
    weight: fx.Node
    """The norm weight as stored (before any upcast); its dtype is the activations'."""
    weight_bias: float
    eps: float
    out: fx.Node
    """The norm's output node."""
    nodes: tuple[fx.Node, ...]
    """Every node the fused op replaces (``total`` and ``out`` included); all of them are
    used only inside the site, except ``total`` and ``out``."""
    hidden: int
    dtype: torch.dtype
    module: str
    """Where the norm lives in the model (``layers.0.post_attention_layernorm``), or ``""``."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A functional all-reduce that is not a site, and why."""

    all_reduce: fx.Node
    reason: str


def candidates(graph: fx.Graph) -> Iterator[Site | Rejection]:
    """Match each functional all-reduce of ``graph``, in graph order, lazily: the caller may
    replace a site before taking the next item (sites are disjoint, and a later site sees
    the earlier one's outputs where it used its nodes, e.g. as its residual)."""
    for node in list(graph.find_nodes(op="call_function", target=c10d.all_reduce.default)):
        try:
            yield match_site(node)
        except Mismatch as exc:
            yield Rejection(node, str(exc))


def find_sites(graph: fx.Graph) -> tuple[list[Site], list[Rejection]]:
    """Every site of ``graph`` and every rejected all-reduce, without changing the graph."""
    found = list(candidates(graph))
    return [c for c in found if isinstance(c, Site)], [c for c in found if isinstance(c, Rejection)]


def match_site(all_reduce: fx.Node) -> Site:
    """The site starting at ``all_reduce``; raises :class:`Mismatch` with the reason if none."""
    x, reduce_op, group_name = all_reduce.args[:3]
    if str(reduce_op).lower() != "sum":
        raise Mismatch(f"reduce op {reduce_op!r}")
    if not isinstance(x, fx.Node) or not isinstance(group_name, str):
        raise Mismatch("all-reduce arguments not understood")
    wait = _sole_user(all_reduce)
    if wait is None or wait.target is not c10d.wait_tensor.default:
        raise Mismatch("all-reduce result not awaited by exactly one wait_tensor")
    result = _in_place_copy(wait) or wait
    total, residual = _residual_add(result)
    norm = _match_norm(total, after_all_reduce=residual is None)
    dtype, shape = _val(total).dtype, _val(total).shape
    _check_residual(result, residual, shape)
    hidden = _check_supported(dtype, shape)
    world_size = _world_size(group_name)
    head = tuple(dict.fromkeys((all_reduce, wait, result, total)))
    return Site(
        all_reduce=all_reduce,
        x=x,
        group_name=group_name,
        world_size=world_size,
        residual=residual,
        total=total,
        weight=norm.weight,
        weight_bias=norm.weight_bias,
        eps=norm.eps,
        out=norm.out,
        nodes=(*head, *norm.nodes),
        hidden=hidden,
        dtype=dtype,
        module=module_path(norm.out),
    )


# ---------------------------------------------------------------------------------------
# the all-reduce result and the residual add


def _in_place_copy(wait: fx.Node) -> fx.Node | None:
    """``copy(buffer, result)``, the functional form of an in-place ``dist.all_reduce(buffer)``
    when it is the result's only use: the copy then holds the all-reduce result."""
    copy = _sole_user(wait)
    if copy is None or copy.target is not aten.copy.default or copy.args[1] is not wait:
        return None
    same = _val(copy).dtype == _val(wait).dtype and _same_shape(_val(copy).shape, _val(wait).shape)
    return copy if same else None


def _residual_add(result: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """``(add, residual)`` when the all-reduce result's only use is ``add(result, residual)``
    (either order), else ``(result, None)``: the norm must then start at the result itself."""
    add = _sole_user(result)
    if add is None or add.target is not aten.add.Tensor or add.kwargs.get("alpha", 1) != 1:
        return result, None
    a, b = add.args[:2]
    residual = b if a is result else a
    if not isinstance(residual, fx.Node) or residual is result:
        return result, None
    return add, residual


def _check_residual(result: fx.Node, residual: fx.Node | None, shape: torch.Size) -> None:
    if residual is None:
        return
    rval, wval = _val(residual), _val(result)
    if rval.dtype != wval.dtype:
        raise Mismatch(f"residual is {_dtype(rval.dtype)} but the all-reduce is {_dtype(wval.dtype)}")
    if not (_same_shape(rval.shape, shape) and _same_shape(wval.shape, shape)):
        raise Mismatch(f"residual add broadcasts ({_shape(wval.shape)} + {_shape(rval.shape)})")


# ---------------------------------------------------------------------------------------
# the RMSNorm


@dataclasses.dataclass(frozen=True)
class _Norm:
    weight: fx.Node
    weight_bias: float
    eps: float
    out: fx.Node
    nodes: tuple[fx.Node, ...]
    """The norm's nodes after its input (weight preparation included), ``out`` last."""


def _match_norm(total: fx.Node, *, after_all_reduce: bool) -> _Norm:
    """The RMSNorm whose input is ``total``. ``total``'s other users are fine (they will
    read ``residual_out``); every node inside the norm must be used only by the norm."""
    if _val(total).dtype == torch.float32:
        starts = [total]
    else:
        starts = [u for u in total.users if _cast_dtype(u) == torch.float32]
    first: Mismatch = NoNorm()
    for h in starts:
        try:
            return _norm_from_fp32(total, h)
        except Mismatch as exc:
            first = exc if isinstance(first, NoNorm) else first
    shared = after_all_reduce and len(total.users) > 1
    if isinstance(first, NoNorm) and shared and any(u.target is aten.add.Tensor for u in total.users):
        raise Mismatch("all-reduce result is also used outside the residual add")
    raise first


def _norm_from_fp32(total: fx.Node, h: fx.Node) -> _Norm:
    """Match from ``h``, the fp32 view of ``total`` (``total`` itself when it is fp32)."""
    dtype = _val(total).dtype
    square = _find_user(h, lambda u: _is_square_of(u, h))
    mean = _next(square, lambda u: u.target is aten.mean.dim)
    _check_mean(mean, _val(total).dim())
    plus_eps = _next(mean, lambda u: u.target in _ADDS)
    rsqrt = _next(plus_eps, lambda u: u.target is aten.rsqrt.default)
    eps = _number_operand(plus_eps, mean)
    if eps is None:
        raise Mismatch("the norm's epsilon is not a constant (a graph input?)")
    normed = _next(rsqrt, lambda u: _is_mul_of(u, h, rsqrt))
    if h is not total and set(h.users) != {square, normed}:
        raise Mismatch(f"the norm's fp32 upcast {h.name} is also used outside the norm")
    nodes = (
        [square, mean, plus_eps, rsqrt, normed] if h is total else [h, square, mean, plus_eps, rsqrt, normed]
    )
    weight, bias, tail = _weight_tail(normed, dtype, _val(total).shape[-1])
    out = tail[-1]
    if _val(out).dtype != dtype or not _same_shape(_val(out).shape, _val(total).shape):
        raise Mismatch(
            f"norm output is {_dtype(_val(out).dtype)} {_shape(_val(out).shape)}, not like its input"
        )
    return _Norm(weight, bias, eps, out, (*nodes, *tail))


def _check_mean(mean: fx.Node, ndim: int) -> None:
    dims = mean.args[1] if len(mean.args) > 1 else None
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if mean.kwargs.get("dtype") is not None or not keepdim:
        raise NoNorm("mean without keepdim")
    if not isinstance(dims, (list, tuple)):
        raise Mismatch("RMSNorm over all dims, not the last (hidden) dim")
    if sorted(int(d) % ndim for d in dims) != [ndim - 1]:  # type: ignore[call-overload]
        raise Mismatch(f"RMSNorm over dims {list(dims)}, not the last (hidden) dim")


def _weight_tail(normed: fx.Node, dtype: torch.dtype, hidden: int) -> tuple[fx.Node, float, list[fx.Node]]:
    """From the normalised fp32 value to the output: the weight multiply and the downcast,
    in either order. Returns ``(weight, weight_bias, nodes)``, the output last in ``nodes``."""
    user = _next(normed, lambda u: True)
    if dtype != torch.float32 and _cast_dtype(user) == dtype:  # downcast, then weight
        muls = [u for u in user.users if u.target is aten.mul.Tensor and _tensor_other(u, user) is not None]
        if not muls:
            raise Mismatch("RMSNorm without a weight")
        mul = _next(user, lambda u: u is muls[0])
        factor: fx.Node = _tensor_other(mul, user)  # type: ignore[assignment]
        if _val(factor).dtype != dtype:
            raise Mismatch(
                f"norm weight is {_dtype(_val(factor).dtype)}: the weight multiply promotes the "
                f"{_dtype(dtype)} norm output to {_dtype(_val(mul).dtype)}"
            )
        weight, bias, prep = _weight(factor, dtype, hidden)
        return weight, bias, [*prep, user, mul]
    if user.target is aten.mul.Tensor and _tensor_other(user, normed) is not None:  # weight in fp32
        weight, bias, prep = _weight(_tensor_other(user, normed), dtype, hidden)  # type: ignore[arg-type]
        if dtype == torch.float32:
            return weight, bias, [*prep, user]
        down = _next(user, lambda u: _cast_dtype(u) == dtype)
        return weight, bias, [*prep, user, down]
    if _cast_dtype(user) == dtype or dtype == torch.float32:
        raise Mismatch("RMSNorm without a weight")
    raise NoNorm(f"unexpected {user.target} after the normalisation")


def _weight(factor: fx.Node, dtype: torch.dtype, hidden: int) -> tuple[fx.Node, float, list[fx.Node]]:
    """``factor`` is ``weight``, ``weight.float()``, or either plus a constant. The stored
    weight must be in the activations' dtype: the kernel reads it so, and upcasting it is
    exact.

    Returns the stored weight, the constant (``weight_bias``) and the preparation nodes
    used only by the norm (to be replaced with it)."""
    prep: list[fx.Node] = []
    bias = 0.0
    if factor.target in _ADDS and (constant := _number_operand(factor, None)) is not None:
        bias = float(constant)
        prep.append(factor)
        factor = _tensor_other(factor, None)  # type: ignore[assignment]
    if _cast_dtype(factor) == torch.float32 and isinstance(factor.args[0], fx.Node):
        prep.append(factor)
        factor = factor.args[0]
    wval = _val(factor)
    if wval.dtype != dtype:
        raise Mismatch(
            f"norm weight is {_dtype(wval.dtype)} but activations are {_dtype(dtype)} "
            "(the kernel reads the weight in the activation dtype)"
        )
    if wval.dim() != 1 or not _same_shape(wval.shape, (hidden,)):
        raise Mismatch(f"norm weight has shape {_shape(wval.shape)}, not [{hidden}]")
    # a weight preparation shared with other code stays; only the norm's own is replaced
    own: list[fx.Node] = []
    for node in prep:  # outermost first
        if len(node.users) != 1:
            break
        own.insert(0, node)
    return factor, bias, own


# ---------------------------------------------------------------------------------------
# what the kernel supports


def _check_supported(dtype: torch.dtype, shape: torch.Size) -> int:
    if dtype not in SUPPORTED_DTYPES:
        raise Mismatch(f"dtype {_dtype(dtype)} not supported by the fused kernel")
    hidden = shape[-1]
    if not isinstance(hidden, int):
        raise Mismatch(f"hidden size {hidden} is symbolic")
    if hidden % HIDDEN_MULTIPLE:
        raise Mismatch(f"hidden size {hidden} is not a multiple of {HIDDEN_MULTIPLE}")
    if hidden > MAX_HIDDEN:
        raise Mismatch(f"hidden size {hidden} is above {MAX_HIDDEN}")
    return hidden


def _world_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        size = _resolve_process_group(group_name).size()  # type: ignore[arg-type]
    except Exception as exc:
        raise Mismatch(f"process group {group_name!r} cannot be resolved ({type(exc).__name__})") from None
    if size not in SUPPORTED_WORLD_SIZES:
        sizes = ", ".join(map(str, SUPPORTED_WORLD_SIZES))
        raise Mismatch(f"world size {size} not supported by the fused kernel ({sizes})")
    return size


# ---------------------------------------------------------------------------------------
# small helpers


def module_path(node: fx.Node) -> str:
    """The innermost module ``node`` was traced in, as a dotted path (``""`` if unknown)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    for prefix in ("L['self'].", "L['self']", "self."):
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path


def _val(node: fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise Mismatch(f"{node.name} has no tensor metadata")
    return val


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(shape: Iterable[object]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _same_shape(a: Iterable[object], b: Iterable[object]) -> bool:
    """Shapes equal for every value of their symbols (no guard is added)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _sole_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _find_user(node: fx.Node, pred: Callable[[fx.Node], bool]) -> fx.Node:
    for user in node.users:
        if pred(user):
            return user
    raise NoNorm()


def _next(node: fx.Node, pred: Callable[[fx.Node], bool]) -> fx.Node:
    """The user of ``node`` inside the norm; ``node`` must have no other user."""
    found = _find_user(node, pred)
    if len(node.users) > 1:
        raise Mismatch(f"{node.name}, inside the RMSNorm, is also used outside it")
    return found


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
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


def _number_operand(node: fx.Node, other: fx.Node | None) -> float | None:
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


def _tensor_other(node: fx.Node, known: fx.Node | None) -> fx.Node | None:
    """The node operand of a binary op that is not ``known``."""
    operands = [a for a in node.args[:2] if isinstance(a, fx.Node) and a is not known]
    return operands[0] if len(operands) == 1 else None
