"""Lost sites: an all-reduce that a norm follows but that no pattern matched, warned about.

A new release of a model library (a norm written another way, a node between the sum and
the norm) can leave a site unmatched. The pass's report gives the reason; a user who reads
no report would still see nothing but a slower model. So each site-rewriting pass calls
:func:`warn_lost_sites` with its rejections: those the matcher made
(:attr:`~.sites.Rejection.matcher`) whose all-reduce's sum reaches a norm (an ``rsqrt``,
``var_mean`` or one of torch's norm ops) through ops that keep its rows (copies, views,
scales, a norm's upcast and mean of squares, anything elementwise; no matmul, no other
collective, at most two adds: a shared term's and the residual's) are lost
sites. A :class:`LostSiteWarning` names each one's layer (the norm's module path, from
``nn_module_stack``) and the reason, once per process for each pass, layer and reason, and
is logged on passkit's logger.

Not lost: an all-reduce whose norm is the other norm pass's (the reason names it), one
that ends its graph (:func:`.sites.warn_graph_ends` warns about those), hyper-connection
streams (no norm reads the sum), and the sites a pass chose to leave (not the matcher's).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import torch
import torch.fx as fx

from .graph import module_path

__all__ = ["LostSite", "LostSiteWarning", "lost_sites", "reset_lost_site_warnings", "warn_lost_sites"]

aten = torch.ops.aten


class LostSiteWarning(UserWarning):
    """An enabled fusion pass left an all-reduce that a norm follows: no pattern matched it
    (the reason says where the matcher stopped). Emitted once per process for each pass,
    layer and reason."""


@dataclasses.dataclass(frozen=True)
class LostSite:
    """An all-reduce a norm follows that the matcher did not take."""

    all_reduce: fx.Node
    norm: fx.Node
    """The first node of the norm found after it (``rsqrt``, ``var_mean``, a norm op)."""
    layer: str
    """The norm's module path (``layers.1.input_layernorm``), else ``node <its name>``."""
    reason: str


_NOT_LOST = (
    "allreduce_layernorm's site",  # the other norm pass takes it (sites.LAYERNORM_NOT_HERE)
    "allreduce_rmsnorm's site",  # sites.RMSNORM_NOT_HERE
    "ends its graph",  # sites.ENDS_GRAPH: warned about on its own
    "residual streams",  # sites.HYPER_CONNECTIONS: no norm reads the sum
)
"""Reasons (substrings) of rejections that are not lost sites."""

_NORMS = frozenset(
    {
        aten.rsqrt.default,
        aten.var_mean.correction,
        aten.native_layer_norm.default,
        aten.layer_norm.default,
        aten.rms_norm.default,
        aten._fused_rms_norm.default,
    }
)
"""A node of one of these ops is a norm (of any form: its decomposition's ``rsqrt``)."""

_STOP = frozenset(
    {
        aten.mm.default,
        aten.bmm.default,
        aten.addmm.default,
        aten.baddbmm.default,
        aten.matmul.default,
        aten.linear.default,
        aten.embedding.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
    }
)
"""Ops the walk never passes: a matmul starts the next block's computation."""

MAX_ADDS = 2
"""Adds of rows walked through after the all-reduce (a shared term's and the residual's; a
norm's ``+ eps`` is not counted): further on the residual stream runs into later layers,
whose norms are not this all-reduce's."""


def lost_sites(rejected: Sequence[object], limit: int = 64) -> list[LostSite]:
    """The lost sites among ``rejected`` (:class:`~.sites.Rejection`): see the module's
    docstring. ``limit``: the most nodes walked from each all-reduce."""
    lost = []
    for rejection in rejected:
        if not getattr(rejection, "matcher", False):
            continue
        reason = rejection.reason  # type: ignore[attr-defined]
        if any(part in reason for part in _NOT_LOST):
            continue
        norm = norm_after(rejection.all_reduce, limit)  # type: ignore[attr-defined]
        if norm is not None:
            layer = module_path(norm) or f"node {norm.name}"
            lost.append(LostSite(rejection.all_reduce, norm, layer, reason))  # type: ignore[attr-defined]
    return lost


def norm_after(all_reduce: fx.Node, limit: int = 64) -> fx.Node | None:
    """The first norm node (:data:`_NORMS`) computed from the all-reduce's sum through ops that
    keep its rows (any op whose output keeps the sum's last dim or is one value per row, not a
    matmul or a collective; at most :data:`MAX_ADDS` adds); None when none is within
    ``limit`` nodes."""
    seen: set[fx.Node] = set()
    frontier: list[tuple[fx.Node, int]] = [(all_reduce, 0)]
    hidden = _last_dim(all_reduce)
    while frontier and len(seen) < limit:
        node, adds = frontier.pop(0)
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user.op != "call_function" or user.target in _STOP or _is_collective(user):
                continue
            if user.target in _NORMS:
                return user
            more = adds + (user.target is aten.add.Tensor and _last_dim(user) == hidden)
            if more <= MAX_ADDS and _keeps_rows(user, hidden):
                frontier.append((user, more))
    return None


def _last_dim(node: fx.Node) -> object:
    value = node.meta.get("val")
    return value.shape[-1] if isinstance(value, torch.Tensor) and value.dim() else None


def _keeps_rows(node: fx.Node, hidden: object) -> bool:
    """Whether ``node``'s output is rows of the hidden size, or one value per row (a norm's
    mean of squares); a tuple's (``var_mean``) first item decides."""
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    if not isinstance(value, torch.Tensor) or not value.dim() or hidden is None:
        return False
    return value.shape[-1] == hidden or value.shape[-1] == 1


def _is_collective(node: fx.Node) -> bool:
    namespace = getattr(node.target, "namespace", "")
    return namespace in ("_c10d_functional", "c10d") and "wait_tensor" not in str(node.target)


_warned: set[tuple[str, str, str]] = set()


def warn_lost_sites(pass_name: str, rejected: Sequence[object]) -> str | None:
    """Warn (:class:`LostSiteWarning`, and passkit's logger) about the lost sites among
    ``rejected`` not warned about yet in this process; returns the report note naming every
    lost site of this graph (None when there is none)."""
    lost = lost_sites(rejected)
    if not lost:
        return None
    listed = "; ".join(f"{site.layer}: {site.reason}" for site in lost)
    note = f"{len(lost)} site(s) lost (a norm follows the all-reduce, no pattern matched it): {listed}"
    new = [s for s in lost if (pass_name, s.layer, s.reason) not in _warned]
    if new:
        _warned.update((pass_name, s.layer, s.reason) for s in new)
        shown = "; ".join(f"{site.layer}: {site.reason}" for site in new)
        message = (
            f"passkit: pass {pass_name!r} left {len(new)} all-reduce(s) that a norm follows unfused "
            f"(no pattern matched them): {shown}. Where the reason is a form of the model's graph "
            "the matcher does not take, run `passkit explain-hf` on its config or report the graph "
            "(PASSKIT_DUMP_DIR=dir dumps it)"
        )
        from passkit import logs

        logs.log.warning("%s", message)
        warnings.warn(LostSiteWarning(message), stacklevel=3)
    return note


def reset_lost_site_warnings() -> None:
    """Forget what was warned (tests)."""
    _warned.clear()
