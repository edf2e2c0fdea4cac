"""Find ``all_reduce -> (add residual) -> RMSNorm`` sites in post-grad ATen graphs.

The matcher is structural: from each functional all-reduce
(``_c10d_functional.wait_tensor(_c10d_functional.all_reduce(x, "sum", group))``, as
``torch.compile`` emits it for functional collectives and for DTensor alike, followed by
``aten.copy`` for an in-place ``dist.all_reduce``) it walks forward over the optional
residual add to ``s``, the all-reduce result or its sum with a residual, and recognises the
RMSNorm whose input is ``s`` through :func:`passkit_fusion.patterns.rmsnorm.match_rmsnorm`
(Llama's fp32 upcast, ``F.rms_norm``, Gemma's ``1 + weight``, ``x * x``, the weight on
either side of the downcast). Everything is decided from the graph and the process group's
size, never from rank-local state, so every rank finds the same sites.

With ``fp8=True`` the matcher also looks after the norm for a static per-tensor
``float8_e4m3fn`` quantization (:func:`passkit_fusion.patterns.fp8.match_fp8_quant`) and
records it in :attr:`Site.quant`; a quantization the kernel would compute differently
leaves the site fused without it, the reason in :attr:`Site.quant_skipped`.

A candidate the fused kernel would compute differently is rejected with a reason: a reduce
op other than sum, a norm over another dim, a weight in another dtype than the activations,
an intermediate (the all-reduce result included) also used outside the match, a residual
add that broadcasts or promotes, an unsupported dtype, hidden size or world size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.fx as fx

from ..patterns.fp8 import Fp8Quant, NoQuant, match_fp8_quant
from ..patterns.graph import (
    Mismatch,
    dtype_str,
    group_world_size,
    module_path,
    same_shape,
    shape_str,
    sole_user,
    val,
)
from ..patterns.rmsnorm import NoNorm, RMSNorm, match_rmsnorm

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_WORLD_SIZES = (2, 4, 8, 16)
"""World sizes of flashinfer's fused all-reduce kernels (16 runs one-shot only)."""
HIDDEN_MULTIPLE = 8
"""The kernel moves 16-byte vectors: 8 elements of a 16-bit dtype."""
MAX_HIDDEN = 16384
"""Largest hidden size the kernel is known to launch with (one token per thread block cluster)."""


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
    quant: Fp8Quant | None = None
    """The static FP8 quantization of the norm output the fused op also takes over (only
    when matched with ``fp8=True``); its nodes are not in :attr:`nodes`."""
    quant_skipped: str | None = None
    """Why an FP8 quantization after the norm is left out of the fusion, if one is."""
    need_norm_out: bool = True
    """Whether anything besides :attr:`quant` reads the norm output (then the fused op
    writes the norm output too); always True without a quantization."""


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A functional all-reduce that is not a site, and why."""

    all_reduce: fx.Node
    reason: str


def candidates(
    graph: fx.Graph, *, kernel_limits: bool = True, fp8: bool = False
) -> Iterator[Site | Rejection]:
    """Match each functional all-reduce of ``graph``, in graph order, lazily: the caller may
    replace a site before taking the next item (sites are disjoint, and a later site sees
    the earlier one's outputs where it used its nodes, e.g. as its residual).
    ``kernel_limits``, ``fp8``: see :func:`match_site`."""
    for node in list(graph.find_nodes(op="call_function", target=c10d.all_reduce.default)):
        try:
            yield match_site(node, kernel_limits=kernel_limits, fp8=fp8)
        except Mismatch as exc:
            yield Rejection(node, str(exc))


def find_sites(
    graph: fx.Graph, *, kernel_limits: bool = True, fp8: bool = False
) -> tuple[list[Site], list[Rejection]]:
    """Every site of ``graph`` and every rejected all-reduce, without changing the graph."""
    found = list(candidates(graph, kernel_limits=kernel_limits, fp8=fp8))
    return [c for c in found if isinstance(c, Site)], [c for c in found if isinstance(c, Rejection)]


def match_site(all_reduce: fx.Node, *, kernel_limits: bool = True, fp8: bool = False) -> Site:
    """The site starting at ``all_reduce``; raises :class:`Mismatch` with the reason if none.

    ``kernel_limits=False`` drops the fused kernel's own limits (hidden size, world sizes
    2/4/8/16): for rewrites that keep the norm in torch (``sequence_parallel``).
    ``fp8=True`` also matches a static FP8 quantization of the norm output."""
    x, reduce_op, group_name = all_reduce.args[:3]
    if str(reduce_op).lower() != "sum":
        raise Mismatch(f"reduce op {reduce_op!r}")
    if not isinstance(x, fx.Node) or not isinstance(group_name, str):
        raise Mismatch("all-reduce arguments not understood")
    wait = sole_user(all_reduce)
    if wait is None or wait.target is not c10d.wait_tensor.default:
        raise Mismatch("all-reduce result not awaited by exactly one wait_tensor")
    result = _in_place_copy(wait) or wait
    total, residual = _residual_add(result)
    norm = _match_norm(total, after_all_reduce=residual is None)
    dtype, shape = val(total).dtype, val(total).shape
    _check_residual(result, residual, shape)
    hidden = _check_supported(dtype, shape, kernel_limits)
    world_size = _world_size(group_name, kernel_limits)
    head = tuple(dict.fromkeys((all_reduce, wait, result, total)))
    quant, quant_skipped = None, None
    if fp8:
        try:
            quant = match_fp8_quant(norm.out, {all_reduce, *head, *norm.nodes})
        except NoQuant:
            pass
        except Mismatch as exc:
            quant_skipped = str(exc)
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
        quant=quant,
        quant_skipped=quant_skipped,
        need_norm_out=quant is None or any(u is not quant.nodes[0] for u in norm.out.users),
    )


# ---------------------------------------------------------------------------------------
# the all-reduce result and the residual add


def _in_place_copy(wait: fx.Node) -> fx.Node | None:
    """``copy(buffer, result)``, the functional form of an in-place ``dist.all_reduce(buffer)``
    when it is the result's only use: the copy then holds the all-reduce result."""
    copy = sole_user(wait)
    if copy is None or copy.target is not aten.copy.default or copy.args[1] is not wait:
        return None
    same = val(copy).dtype == val(wait).dtype and same_shape(val(copy).shape, val(wait).shape)
    return copy if same else None


def _residual_add(result: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    """``(add, residual)`` when the all-reduce result's only use is ``add(result, residual)``
    (either order), else ``(result, None)``: the norm must then start at the result itself."""
    add = sole_user(result)
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
    rval, wval = val(residual), val(result)
    if rval.dtype != wval.dtype:
        raise Mismatch(f"residual is {dtype_str(rval.dtype)} but the all-reduce is {dtype_str(wval.dtype)}")
    if not (same_shape(rval.shape, shape) and same_shape(wval.shape, shape)):
        raise Mismatch(f"residual add broadcasts ({shape_str(wval.shape)} + {shape_str(rval.shape)})")


# ---------------------------------------------------------------------------------------
# the RMSNorm (its forms: passkit_fusion.patterns.rmsnorm)


def _match_norm(total: fx.Node, *, after_all_reduce: bool) -> RMSNorm:
    """The RMSNorm whose input is ``total``. ``total``'s other users are fine (they will
    read ``residual_out``); every node inside the norm must be used only by the norm."""
    try:
        return match_rmsnorm(total)
    except NoNorm:
        shared = after_all_reduce and len(total.users) > 1
        if shared and any(u.target is aten.add.Tensor for u in total.users):
            raise Mismatch("all-reduce result is also used outside the residual add") from None
        raise


# ---------------------------------------------------------------------------------------
# what the kernel supports


def _check_supported(dtype: torch.dtype, shape: torch.Size, kernel_limits: bool = True) -> int:
    if dtype not in SUPPORTED_DTYPES:
        raise Mismatch(f"dtype {dtype_str(dtype)} not supported by the fused kernel")
    hidden = shape[-1]
    if not kernel_limits:
        return hidden  # type: ignore[return-value]
    if not isinstance(hidden, int):
        raise Mismatch(f"hidden size {hidden} is symbolic")
    if hidden % HIDDEN_MULTIPLE:
        raise Mismatch(f"hidden size {hidden} is not a multiple of {HIDDEN_MULTIPLE}")
    if hidden > MAX_HIDDEN:
        raise Mismatch(f"hidden size {hidden} is above {MAX_HIDDEN}")
    return hidden


def _world_size(group_name: str, kernel_limits: bool = True) -> int:
    size = group_world_size(group_name)
    if kernel_limits and size not in SUPPORTED_WORLD_SIZES:
        sizes = ", ".join(map(str, SUPPORTED_WORLD_SIZES))
        raise Mismatch(f"world size {size} not supported by the fused kernel ({sizes})")
    return size
