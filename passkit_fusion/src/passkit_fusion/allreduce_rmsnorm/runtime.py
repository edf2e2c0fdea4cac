"""The CUDA runtime behind passkit's fused all-reduce + residual add + RMSNorm op.

For ``x`` of shape ``[..., hidden]`` on every rank of a process group,
:func:`fused_allreduce_rmsnorm_cuda` returns ``(norm_out, residual_out)`` with::

    residual_out = all_reduce_sum(x) + residual          # residual may be None
    norm_out     = rms_norm(residual_out) * (weight + weight_bias)   # fp32 math, x.dtype out

:func:`fused_allreduce_rmsnorm_fp8_cuda` does the same and quantizes the norm output to
``float8_e4m3fn`` with a static per-tensor scale (``quant_out = fp8(norm_out / scale)``,
saturated), returning ``(quant_out, norm_out or an empty tensor, residual_out)``. It shares
everything with the unquantized op: the site per (group, hidden, dtype), its workspace (the
trtllm workspace holds the all-reduce's input, whatever the epilogue), the table's rules
and the rank checks; only flashinfer's pattern code and the outputs differ.

Each call runs flashinfer's fused kernel (one-shot or two-shot) or the unfused fallback
(``torch.distributed.all_reduce`` + add + RMSNorm in torch).  The choice depends only on the
tuning table, the configuration and the call's shape and dtype, so every rank takes the same
path. At the first call on each (process group, hidden size, dtype) the ranks compare these
inputs through :func:`passkit_fusion.collective.agree` (the group's store, a bounded wait):
a rank that differs or never arrives raises :class:`RankAgreementError` on every rank instead
of letting the collective hang. ``check_calls`` does the same for every call's token count.

flashinfer needs an IPC workspace per ``(process group, hidden, dtype)``.  It is created
lazily at the first fused call (a collective step) or eagerly by :func:`prepare`, never
during CUDA graph capture, always with flashinfer's ``trtllm`` backend (``"auto"`` may pick
the NVLink-multicast backend), and destroyed by :func:`destroy_workspaces` or at exit, each
step of that teardown bounded by ``teardown_timeout_s``.

This module holds the configuration, the routing, the statistics, the sites (one per group,
hidden size and dtype) and the rank checks; the flashinfer API adapters are in
:mod:`.flashinfer_api`, creating and freeing a workspace in :mod:`.workspaces`.
flashinfer is imported lazily: this module imports without it, and without CUDA.
This module keeps process-wide state and is not thread-safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..collective import (
    RankAgreementError,
    agree,
    compare_plans,
    plan_fingerprint,
    resolve_group,
)
from ..collective.resources import at_exit, outside_graph_pools
from ..collective.resources import capturing as _capturing
from ..reference import fp8_quantize, rms_norm
from ..timeouts import check_timeout
from ..tuning.tables import (
    Decision,
    Rule,
    Table,
    decide,
    default_table,
    dtype_name,
    max_fused_tokens,
    rules_fingerprint,
)
from . import workspaces
from .flashinfer_api import API_NAMES, ApiName, FlashinferApi, flashinfer_version, select_api, unavailable
from .workspaces import Workspace

__all__ = [
    "CallRecord",
    "CollectiveError",
    "RankAgreementError",
    "RuntimeConfig",
    "choose_path",
    "compare_plans",
    "configure",
    "current_config",
    "destroy_workspaces",
    "flashinfer_version",
    "forced",
    "fused_allreduce_rmsnorm_cuda",
    "fused_allreduce_rmsnorm_fp8_cuda",
    "last_decision",
    "plan_fingerprint",
    "prepare",
    "reset_stats",
    "stats",
    "unavailable_reason",
    "unfused_allreduce_rmsnorm",
    "unfused_allreduce_rmsnorm_fp8",
]

SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
SUPPORTED_WORLD_SIZES = frozenset({2, 4, 8, 16})
#: Two-shot needs one of these world sizes (16 runs one-shot only).
TWOSHOT_WORLD_SIZES = frozenset({2, 4, 8})
#: A workspace sized automatically from the table holds inputs of at most this many bytes
#: (8192 tokens at hidden 4096 in bf16); its memory is about 4 x world size x this.
AUTO_MAX_INPUT_BYTES = 64 * 2**20

FUSED_ONESHOT = "fused_oneshot"
FUSED_TWOSHOT = "fused_twoshot"
FALLBACK = "fallback"

_UNSET: Any = object()


# ----------------------------------------------------------------------------------------
# Configuration and observability
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Process-wide settings.  They must be identical on every rank.

    ``max_tokens``: token capacity of new workspaces; ``None`` sizes them to the largest
    token count the table fuses (inputs of at most :data:`AUTO_MAX_INPUT_BYTES`).
    ``check_rank_consistency``: compare the plan across ranks before the first call.
    ``table``: decision table; ``None`` uses the tables shipped with passkit-fusion.
    ``force``: take this decision for every call instead of the table's (benchmarks, tuning).
    ``flashinfer_api``: ``"kernel"`` (the unified API's workspace, the kernel's compiled entry
    point called directly: the least host time per call), ``"unified"``
    (``create_allreduce_fusion_workspace`` + ``allreduce_fusion``), ``"legacy"``
    (``trtllm_*``), or ``"auto"`` (the first of these that the installed flashinfer has).
    ``collective_timeout_s``: how long a rank waits for the others at a step passkit
    coordinates (plan check, workspace creation); ``None``: ``PASSKIT_FUSION_COLLECTIVE_TIMEOUT``
    or 180 s. A rank missing after it raises :class:`RankAgreementError` on every rank.
    ``teardown_timeout_s``: how long destroying workspaces waits for the GPU to finish the
    work that may still use them; past it the memory is left to the process's exit.
    ``check_calls``: agree on every call's token count and path across ranks before the
    collective (``PASSKIT_FUSION_CHECK_CALLS=1``): turns ranks that call with different
    shapes into an error instead of a hang, at the cost of a store round trip per call
    (a debugging aid, off by default).
    ``launch_with_pdl``: launch the fused kernel with programmatic dependent launch (it may
    start while the previous kernel finishes and waits for it before reading; Hopper and
    newer; ``PASSKIT_FUSION_PDL=1``). Off by default.
    """

    max_tokens: int | None = None
    check_rank_consistency: bool = True
    table: Table | None = None
    force: Decision | None = None
    flashinfer_api: ApiName = "auto"
    collective_timeout_s: float | None = None
    teardown_timeout_s: float = 10.0
    check_calls: bool = os.environ.get("PASSKIT_FUSION_CHECK_CALLS", "") not in ("", "0")
    launch_with_pdl: bool = os.environ.get("PASSKIT_FUSION_PDL", "") not in ("", "0")


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """The path one call took, and why it fell back (``reason`` is empty when fused)."""

    path: str
    reason: str
    tokens: int
    hidden: int
    dtype: str
    world_size: int
    variant: str = ""
    """``""`` (norm output), ``"fp8"`` (FP8 output) or ``"fp8+norm"`` (both)."""


class CollectiveError(RuntimeError):
    """A collective the op issued failed (a peer died or called something else)."""


_config = RuntimeConfig()
_stats: Counter[str] = Counter()
_last: tuple[_Site, int, str, str, str] | None = None


def configure(
    *,
    max_tokens: int | None = _UNSET,
    check_rank_consistency: bool = _UNSET,
    table: Table | None = _UNSET,
    force: Decision | None = _UNSET,
    flashinfer_api: ApiName = _UNSET,
    collective_timeout_s: float | None = _UNSET,
    teardown_timeout_s: float = _UNSET,
    check_calls: bool = _UNSET,
    launch_with_pdl: bool = _UNSET,
) -> RuntimeConfig:
    """Change the given settings (see :class:`RuntimeConfig`) and return the new config.

    Existing workspaces keep their size and API; the next eager call on each process group
    re-checks that the ranks agree.
    """
    global _config
    changes: dict[str, Any] = {
        name: value
        for name, value in (
            ("max_tokens", max_tokens),
            ("check_rank_consistency", check_rank_consistency),
            ("table", table),
            ("force", force),
            ("flashinfer_api", flashinfer_api),
            ("collective_timeout_s", collective_timeout_s),
            ("teardown_timeout_s", teardown_timeout_s),
            ("check_calls", check_calls),
            ("launch_with_pdl", launch_with_pdl),
        )
        if value is not _UNSET
    }
    new = dataclasses.replace(_config, **changes)
    _validate_config(new)
    _config = new
    for site in _sites.values():
        site.rules = None
        site.checked = False
        site.routes.clear()
    return new


def current_config() -> RuntimeConfig:
    """The settings in force."""
    return _config


@contextlib.contextmanager
def forced(decision: Decision | None) -> Iterator[None]:
    """Within the block, every call takes ``decision`` (still subject to the legality checks)."""
    previous = _config.force
    configure(force=decision)
    try:
        yield
    finally:
        configure(force=previous)


def stats() -> dict[str, int]:
    """Calls per path since the last reset: ``fused_oneshot``, ``fused_twoshot``,
    ``fallback`` and ``fallback:<reason>``.  Calls replayed from a CUDA graph are not seen
    (the graph's capture counts once)."""
    return dict(_stats)


def reset_stats() -> None:
    """Zero :func:`stats` and forget :func:`last_decision`."""
    global _last
    _stats.clear()
    _last = None


def last_decision() -> CallRecord | None:
    """The path taken by the most recent call in this process."""
    if _last is None:
        return None
    site, tokens, path, reason, variant = _last
    return CallRecord(path, reason, tokens, site.hidden, dtype_name(site.dtype), site.world_size, variant)


def _validate_config(config: RuntimeConfig) -> None:
    if config.max_tokens is not None and config.max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer or None, got {config.max_tokens}")
    if config.flashinfer_api not in API_NAMES:
        raise ValueError(f"flashinfer_api must be one of {API_NAMES}, got {config.flashinfer_api!r}")
    if config.table is not None and not isinstance(config.table, Table):
        raise TypeError(f"table must be a passkit_fusion.Table, got {type(config.table)}")
    for field in ("collective_timeout_s", "teardown_timeout_s"):
        value = getattr(config, field)
        if value is not None:
            check_timeout(field, value)
    if config.force is not None and not isinstance(config.force, Decision):
        raise TypeError(f"force must be a Decision or None, got {type(config.force)}")


def _record(site: _Site, tokens: int, path: str, reason: str, variant: str = "") -> None:
    global _last
    _stats[path] += 1
    if reason:
        _stats[f"{path}:{reason}"] += 1
    if variant:
        _stats[f"{variant}:{path}"] += 1
    _last = (site, tokens, path, reason, variant)


# ----------------------------------------------------------------------------------------
# The op
# ----------------------------------------------------------------------------------------


def fused_allreduce_rmsnorm_cuda(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce ``x`` over the group, add ``residual``, RMS-normalise; return
    ``(norm_out, residual_out)``, both shaped like ``x`` and of ``x.dtype``.

    ``residual`` and ``weight`` must be identical on every rank (as in tensor parallelism).
    Collective: every rank of the group calls it with the same shapes, in the same order.
    On the fused path the kernel reads ``weight`` rounded to ``x.dtype``.  Does not modify
    its inputs.
    """
    _check_args(x, residual, weight)
    x2d, res2d = _as_2d(x), None if residual is None else _as_2d(residual)
    site = _site(group_name, x.shape[-1], x.dtype)
    path = _call_path(site, x2d, weight_bias, "")
    if path == FALLBACK:
        norm_out, residual_out = unfused_allreduce_rmsnorm(x2d, res2d, weight, eps, weight_bias, site.group)
    else:
        norm_out, residual_out = _run_fused(
            site, x2d, res2d, weight, eps, weight_bias, oneshot=path == FUSED_ONESHOT
        )
    if x.dim() == 2:
        return norm_out, residual_out
    return norm_out.view(x.shape), residual_out.view(x.shape)


def fused_allreduce_rmsnorm_fp8_cuda(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    scale: torch.Tensor,
    group_name: str,
    need_norm_out: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fused_allreduce_rmsnorm_cuda`, then quantize the norm output to
    ``float8_e4m3fn`` with the static per-tensor dequantization scale ``scale`` (one element;
    ``quant_out * scale ~ norm_out``). Returns ``(quant_out, norm_out, residual_out)``,
    ``norm_out`` empty (shape ``[0]``) unless ``need_norm_out``.

    Fused: flashinfer's ``kARResidualRMSNormFP8Quant`` (or ``...OutFP8Quant`` with the norm
    output) on the same workspace as the unquantized op; the kernel reads ``scale`` from
    device memory at run time. Unfused fallback: the unquantized fallback, then
    :func:`passkit_fusion.reference.fp8_quantize`. Same routing, on every rank alike.
    """
    _check_args(x, residual, weight)
    if scale.numel() != 1 or not scale.dtype.is_floating_point:
        raise ValueError(
            f"scale must be a one-element floating tensor, got {tuple(scale.shape)} {scale.dtype}"
        )
    x2d, res2d = _as_2d(x), None if residual is None else _as_2d(residual)
    site = _site(group_name, x.shape[-1], x.dtype)
    path = _call_path(site, x2d, weight_bias, "fp8+norm" if need_norm_out else "fp8")
    if path == FALLBACK:
        quant_out, norm_out, residual_out = unfused_allreduce_rmsnorm_fp8(
            x2d, res2d, weight, eps, weight_bias, scale, site.group
        )
    else:
        quant_out, norm_out, residual_out = _run_fused_fp8(
            site, x2d, res2d, weight, eps, weight_bias, scale, need_norm_out, oneshot=path == FUSED_ONESHOT
        )
    if not need_norm_out:
        norm_out = x.new_empty((0,))
    if x.dim() != 2:
        quant_out, residual_out = quant_out.view(x.shape), residual_out.view(x.shape)
        if need_norm_out:
            norm_out = norm_out.view(x.shape)
    return quant_out, norm_out, residual_out


def unfused_allreduce_rmsnorm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    scale: torch.Tensor,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 fallback: :func:`unfused_allreduce_rmsnorm`, then the kernel's quantization."""
    norm_out, residual_out = unfused_allreduce_rmsnorm(x, residual, weight, eps, weight_bias, group)
    return fp8_quantize(norm_out, scale), norm_out, residual_out


def _call_path(site: _Site, x: torch.Tensor, weight_bias: float, variant: str) -> str:
    """The path of one call on ``site`` (``x`` is ``[tokens, hidden]``): checks the ranks
    agree at the site's first eager call, routes, agrees on every call with
    ``check_calls``, and records it.

    The route of a (token count, weight bias, variant) is kept on the site once its ranks
    agreed: without CUDA graphs a compiled forward calls the op at every site on every step,
    and the routing (the table's rules, the legality checks) would cost more host time
    than the kernel takes. :func:`configure` and a workspace's creation or destruction
    forget the kept routes."""
    tokens = x.shape[0]
    key = (tokens, weight_bias != 0, variant, x.is_cuda)
    route = site.routes.get(key)
    if route is None or _config.check_calls:
        capturing = _capturing()
        if not site.checked and not capturing:
            _check_ranks(site)
        route = _route(site, tokens, x, weight_bias, fp8=variant != "")
        if _config.check_calls and not capturing:
            path, reason = route
            _agree(
                site,
                "allreduce_rmsnorm:call",
                {"tokens": tokens, "path": path, "reason": reason, "variant": variant},
            )
        if site.checked:
            site.routes[key] = route
    _record(site, tokens, route[0], route[1], variant)
    return route[0]


def choose_path(
    decision: Decision,
    *,
    tokens: int,
    hidden: int,
    dtype: torch.dtype,
    world_size: int,
    max_tokens: int,
    unavailable: str | None = None,
) -> tuple[str, str]:
    """Which path a call takes: ``(path, reason)``, reason empty unless falling back.

    Pure: it depends on its arguments only, which are the same on every rank.
    ``unavailable`` is why the fused kernel cannot run in this process, if it cannot.
    A two-shot decision runs one-shot where two-shot is illegal (tokens <= world size,
    world size 16): one-shot is legal for every size the workspace holds.
    """
    if unavailable:
        return FALLBACK, unavailable
    if world_size not in SUPPORTED_WORLD_SIZES:
        return FALLBACK, "world_size_unsupported"
    if dtype not in SUPPORTED_DTYPES:
        return FALLBACK, "dtype_unsupported"
    if hidden % 8:
        return FALLBACK, "hidden_not_multiple_of_8"
    if not decision.use_fused:
        return FALLBACK, "table"
    if tokens < 1:
        return FALLBACK, "no_tokens"
    if tokens > max_tokens:
        return FALLBACK, "over_workspace"
    oneshot = decision.oneshot or tokens <= world_size or world_size not in TWOSHOT_WORLD_SIZES
    return (FUSED_ONESHOT if oneshot else FUSED_TWOSHOT), ""


def unfused_allreduce_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fallback: ``torch.distributed.all_reduce`` on a copy of ``x``, add, RMSNorm.

    A failing all-reduce (a peer died, or called another collective) raises
    :class:`CollectiveError` naming the group and the call."""
    reduced = x.clone()
    try:
        dist.all_reduce(reduced, group=group)
    except Exception as exc:
        raise CollectiveError(
            f"passkit_fusion: the all-reduce of the unfused all-reduce + RMSNorm path failed on "
            f"process group {group.group_name!r} (rank {dist.get_rank(group)} of "
            f"{dist.get_world_size(group)}, {tuple(x.shape)} {dtype_name(x.dtype)}): "
            f"{type(exc).__name__}: {exc}. A peer rank died, or called with another shape or "
            f"another collective (set PASSKIT_FUSION_CHECK_CALLS=1 to find which)."
        ) from exc
    residual_out = reduced if residual is None else reduced.add_(residual)
    return rms_norm(residual_out, weight, eps, weight_bias), residual_out


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous ``[tokens, hidden]`` tensor (itself when it already is one)."""
    if t.dim() == 2 and t.is_contiguous():
        return t
    return t.reshape(-1, t.shape[-1]).contiguous()


def _gamma(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The norm weight as the fused kernel reads it: contiguous, of the input's dtype."""
    if weight.dtype == dtype and weight.is_contiguous():
        return weight
    return weight.to(dtype).contiguous()


def _check_args(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must be [..., hidden] with hidden >= 1, got shape {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x in shape and dtype: x is {tuple(x.shape)} "
            f"{x.dtype}, residual is {tuple(residual.shape)} {residual.dtype}"
        )
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")


def _route(
    site: _Site, tokens: int, x: torch.Tensor, weight_bias: float, fp8: bool = False
) -> tuple[str, str]:
    """The FP8 variant follows the same rules: the fused kernel's cost barely changes (it
    writes 1-byte instead of 2-byte outputs), the unfused path adds a quantization kernel."""
    decision = _config.force or decide(_site_rules(site), tokens)
    return choose_path(
        decision,
        tokens=tokens,
        hidden=site.hidden,
        dtype=site.dtype,
        world_size=site.world_size,
        max_tokens=_capacity(site),
        unavailable=_call_unavailable(x, weight_bias) or (_fp8_unavailable() if fp8 else None),
    )


def _fp8_unavailable() -> str | None:
    return None if _api().supports_fp8 else "fp8_unsupported"


def _call_unavailable(x: torch.Tensor, weight_bias: float) -> str | None:
    reason = unavailable_reason()
    if reason:
        return reason
    if not x.is_cuda:
        return "not_cuda"
    if weight_bias and not _api().supports_weight_bias:
        return "weight_bias_unsupported"
    return None


def _run_fused(
    site: _Site,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    oneshot: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    norm_out, residual_out = torch.empty_like(x), torch.empty_like(x)
    _launch(
        site, x, residual, weight, eps, weight_bias, oneshot, norm_out=norm_out, residual_out=residual_out
    )
    return norm_out, residual_out


def _run_fused_fp8(
    site: _Site,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    scale: torch.Tensor,
    need_norm_out: bool,
    oneshot: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    quant_out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    norm_out = torch.empty_like(x) if need_norm_out else None
    residual_out = torch.empty_like(x)
    outputs = {"norm_out": norm_out, "residual_out": residual_out, "quant_out": quant_out}
    _launch(
        site, x, residual, weight, eps, weight_bias, oneshot, **outputs, scale_factor=_scale_factor(scale)
    )
    return quant_out, norm_out, residual_out


def _launch(
    site: _Site,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    oneshot: bool,
    **outputs: torch.Tensor | None,
) -> None:
    """One fused kernel call on ``site``'s workspace (created now if it has none), writing
    into the given output buffers (``norm_out``, ``residual_out``, and for FP8 ``quant_out``
    with its ``scale_factor``)."""
    workspace = site.workspace or _create_workspace_for_call(site)
    workspace.api.run(
        workspace.handle,
        x=x,
        residual=residual if residual is not None else torch.zeros_like(x),
        gamma=_gamma(weight, x.dtype),
        eps=eps,
        weight_bias=weight_bias,
        oneshot=oneshot,
        launch_with_pdl=_config.launch_with_pdl,
        **outputs,
    )


def _scale_factor(scale: torch.Tensor) -> torch.Tensor:
    """The scale as the kernel reads it: a one-element fp32 tensor (a view of ``scale`` when
    it already is one, so a CUDA graph reads its current value at each replay)."""
    flat = scale.reshape(1)
    return flat if flat.dtype == torch.float32 and flat.is_contiguous() else flat.float().contiguous()


# ----------------------------------------------------------------------------------------
# flashinfer access
# ----------------------------------------------------------------------------------------


def _api() -> FlashinferApi:
    api = select_api(_config.flashinfer_api)
    if api is None:
        raise RuntimeError(f"no usable flashinfer API: {unavailable_reason()}")
    return api


def unavailable_reason() -> str | None:
    """Why this process cannot run the fused kernel at all, or None if it can."""
    return unavailable(_config.flashinfer_api)


# ----------------------------------------------------------------------------------------
# Sites (one per process group, hidden size and dtype) and their workspaces
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Site:
    group: dist.ProcessGroup
    group_name: str
    rank: int
    world_size: int
    hidden: int
    dtype: torch.dtype
    max_tokens: int | None = None  # set by prepare()
    rules: tuple[Rule, ...] | None = None
    workspace: Workspace | None = None
    checked: bool = False
    routes: dict[tuple[int, bool, str, bool], tuple[str, str]] = dataclasses.field(default_factory=dict)
    """``(path, reason)`` per ``(tokens, weight_bias != 0, variant, on CUDA)`` (see ``_call_path``)."""


_sites: dict[tuple[str, int, torch.dtype], _Site] = {}


def prepare(group_name: str, hidden: int, dtype: torch.dtype, max_tokens: int | None = None) -> int:
    """Create the workspace for ``(group, hidden, dtype)`` now, e.g. before CUDA graph capture.

    Collective: every rank of the group calls it with the same arguments.  ``max_tokens``
    defaults to the configured or table-derived size; a larger value than an existing
    workspace's replaces it (do that before capturing graphs that use it).  Returns the
    workspace's token capacity, 0 when there is none because the fused kernel cannot run
    here (see :func:`unavailable_reason`) or the table never fuses this shape.
    """
    if _capturing():
        raise RuntimeError(
            "passkit_fusion.prepare() is collective and allocates memory: "
            "call it before CUDA graph capture, not during it"
        )
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    site = _site(group_name, hidden, dtype)
    if max_tokens is not None and max_tokens != site.max_tokens:
        site.max_tokens = max_tokens
        site.checked = False
    if not site.checked:
        _check_ranks(site)
    wanted = _planned_max_tokens(site)
    if _static_problem(site) or wanted < 1:
        return 0
    if site.workspace is not None and site.workspace.max_tokens >= wanted:
        return site.workspace.max_tokens
    _destroy_site_workspace(site)
    return _create_workspace(site).max_tokens


def destroy_workspaces() -> None:
    """Free every workspace and forget every process group seen.

    Call it only when no CUDA graph that uses a workspace will replay again.  Runs at exit.
    """
    try:
        for site in _sites.values():
            _destroy_site_workspace(site)
    finally:
        _sites.clear()


def _site(group_name: str, hidden: int, dtype: torch.dtype) -> _Site:
    key = (group_name, hidden, dtype)
    site = _sites.get(key)
    if site is None:
        group = resolve_group(group_name)
        site = _Site(group, group_name, dist.get_rank(group), dist.get_world_size(group), hidden, dtype)
        _sites[key] = site
    return site


def _site_rules(site: _Site) -> tuple[Rule, ...]:
    if site.rules is None:
        table = _config.table or default_table()
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        site.rules = table.resolve(gpu, site.world_size, site.hidden, site.dtype)
    return site.rules


def _planned_max_tokens(site: _Site) -> int:
    if site.max_tokens is not None:
        return site.max_tokens
    if _config.max_tokens is not None:
        return _config.max_tokens
    cap = AUTO_MAX_INPUT_BYTES // (site.hidden * site.dtype.itemsize)
    return min(max_fused_tokens(_site_rules(site)), cap)


def _capacity(site: _Site) -> int:
    return site.workspace.max_tokens if site.workspace is not None else _planned_max_tokens(site)


def _static_problem(site: _Site) -> str | None:
    """A reason no call on this site can be fused, independent of the token count."""
    path, reason = choose_path(
        Decision(True, True),
        tokens=1,
        hidden=site.hidden,
        dtype=site.dtype,
        world_size=site.world_size,
        max_tokens=1,
        unavailable=unavailable_reason(),
    )
    return reason if path == FALLBACK else None


def _create_workspace_for_call(site: _Site) -> Workspace:
    if _capturing():
        raise RuntimeError(
            f"passkit_fusion: no flashinfer workspace exists yet for process group "
            f"{site.group_name!r}, hidden={site.hidden}, dtype={dtype_name(site.dtype)}, and "
            f"one cannot be created during CUDA graph capture (creation is collective and "
            f"allocates IPC memory). Call passkit_fusion.prepare({site.group_name!r}, "
            f"{site.hidden}, torch.{dtype_name(site.dtype)}, max_tokens=...) before capturing, "
            f"or run one eager step first."
        )
    return _create_workspace(site)


def _create_workspace(site: _Site) -> Workspace:
    if not site.checked:
        _check_ranks(site)
    api, max_tokens = _api(), _planned_max_tokens(site)
    # every rank is here, for the same workspace, before flashinfer's collective set-up
    _agree(site, "allreduce_rmsnorm:workspace", {"api": api.name, "max_tokens": max_tokens})
    site.routes.clear()  # the capacity changes
    # outside any CUDA-graph pool: a first call inside Inductor's CUDA-graph warm-up would
    # otherwise leave the workspace's tensors in the graph's private pool
    site.workspace = outside_graph_pools(
        lambda: workspaces.create(
            api,
            group=site.group,
            group_name=site.group_name,
            rank=site.rank,
            world_size=site.world_size,
            hidden=site.hidden,
            dtype=site.dtype,
            max_tokens=max_tokens,
        ),
        "flashinfer workspace",
    )
    at_exit(destroy_workspaces, "passkit-fusion's flashinfer workspaces")
    return site.workspace


def _destroy_site_workspace(site: _Site) -> None:
    """Free ``site``'s workspace once the GPU is done with it, each step bounded by
    ``teardown_timeout_s`` (see :func:`.workspaces.destroy`)."""
    workspace, site.workspace = site.workspace, None
    site.routes.clear()
    if workspace is None:
        return
    what = f"workspace of group {site.group_name!r}, hidden {site.hidden}"
    workspaces.destroy(workspace, timeout_s=_config.teardown_timeout_s, what=what)


# ----------------------------------------------------------------------------------------
# Rank consistency
# ----------------------------------------------------------------------------------------


def _site_plan(site: _Site) -> dict[str, Any]:
    """Everything every rank's decisions on this site depend on."""
    api = select_api(_config.flashinfer_api)
    return {
        "world_size": site.world_size,
        "hidden": site.hidden,
        "dtype": dtype_name(site.dtype),
        "max_tokens": _planned_max_tokens(site),
        "workspace_tokens": _capacity(site),
        "table": rules_fingerprint(_site_rules(site)),
        "force": _config.force.label() if _config.force else None,
        "flashinfer": flashinfer_version(),
        "api": api.name if api is not None else None,
        "unavailable": unavailable_reason(),
    }


def _check_ranks(site: _Site) -> None:
    """Compare this site's plan across the group's ranks (bounded; raises on every rank)."""
    if _config.check_rank_consistency:
        _agree(site, "allreduce_rmsnorm:plan", _site_plan(site))
    site.checked = True


def _agree(site: _Site, step: str, plan: dict[str, Any]) -> None:
    agree(
        site.group,
        step,
        plan,
        timeout_s=_config.collective_timeout_s,
        describe=f"fused all-reduce + RMSNorm, hidden={site.hidden}, dtype={dtype_name(site.dtype)}",
    )
