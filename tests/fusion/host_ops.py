"""Stand-ins for the host ops the vLLM and SGLang dialects read, with the hosts' exact schemas.

The default suite never installs vLLM or SGLang: the ops are registered here from the
dialects' own ``SCHEMAS`` (so a stand-in can never drift from what the dialect expects;
``nox -s hosts`` checks those strings against the real hosts), with CPU implementations
that do what the host's op does on the process group resolved from its name, and fake
implementations for tracing:

* ``vllm::all_reduce / reduce_scatter / all_gather`` (out of place, group by name);
* ``vllm_ir::rms_norm / fused_add_rms_norm`` (vLLM IR's reference implementations, copied
  from ``vllm/ir/ops/layernorm.py``);
* ``_C::shm_allreduce`` (vLLM CPU's shared-memory all-reduce: in place, the group by
  the handle its communicator holds);
* ``sglang::outplace_all_reduce / flashinfer_allreduce`` (out of place),
  ``sglang::inplace_all_reduce`` and ``sglang::reg_all_gather_into_tensor /
  reg_reduce_scatter_tensor`` (mutating: functionalized in graphs).

:func:`host_registry` installs a minimal ``<host>.distributed.parallel_state`` module with
the host's ``_groups`` registry (name -> weakref to an object with ``device_group``), so
graphs can name groups as the host does (``"tp:0"``) and the dialects resolve them the way
they do in the real host. Import this module to register the ops (once per process).
"""

from __future__ import annotations

import contextlib
import sys
import types
import weakref
from collections.abc import Iterator

import torch
import torch.distributed as dist
from passkit_fusion.dialects.base import registered_schema
from passkit_fusion.dialects.sglang import SGLangDialect
from passkit_fusion.dialects.vllm import VllmDialect
from passkit_fusion.dialects.vllm_cpu import VllmCpuDialect

_LIBS: dict[str, torch.library.Library] = {}


def _group(host: str, name: str) -> dist.ProcessGroup:
    dialect = VllmDialect() if host == "vllm" else SGLangDialect()
    return dialect.resolve_group(name)


def _define(qualified: str, schema: str, impl, fake) -> None:
    """Register ``qualified`` with ``schema``, unless this process already has such an op
    (a test that registered a drifted one first)."""
    if registered_schema(qualified) is not None:
        return
    namespace, _, _ = qualified.partition("::")
    lib = _LIBS.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    lib.define(schema.partition("::")[2])
    lib.impl(qualified.partition("::")[2], impl, "CPU")
    torch.library.register_fake(qualified, fake, lib=lib)


# -- vLLM ---------------------------------------------------------------------------------


def _vllm_all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    out = tensor.clone()
    dist.all_reduce(out, group=_group("vllm", group_name))
    return out


def _vllm_reduce_scatter(tensor: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    group = _group("vllm", group_name)
    total = tensor.clone()
    dist.all_reduce(total, group=group)
    return total.chunk(world_size, dim)[dist.get_rank(group)].contiguous()


def _vllm_reduce_scatter_fake(
    tensor: torch.Tensor, dim: int, world_size: int, group_name: str
) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = shape[dim] // world_size
    return tensor.new_empty(shape)


def _vllm_all_gather(tensor: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=_group("vllm", group_name))
    return torch.cat(parts, dim)


def _vllm_all_gather_fake(tensor: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] = shape[dim] * world_size
    return tensor.new_empty(shape)


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
) -> torch.Tensor:
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x_var = x if variance_size is None else x[..., :variance_size]
    variance = x_var.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


def _fused_add_rms_norm(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x = x + x_residual.to(torch.float32)
    x_residual = x.to(orig_dtype)
    x_var = x if variance_size is None else x[..., :variance_size]
    variance = x_var.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype), x_residual


def _shm_allreduce(handle: int, data: torch.Tensor) -> None:
    """vLLM CPU's shared-memory all-reduce, in place, on the group holding ``handle``."""
    from passkit_fusion.dialects.vllm_cpu import SHM_GROUP, VllmCpuDialect

    dist.all_reduce(data, group=VllmCpuDialect().resolve_group(f"{SHM_GROUP}{handle}"))


# -- SGLang -------------------------------------------------------------------------------


def _sglang_outplace(tensor: torch.Tensor, group_name: str, outplace_all_reduce_method: str) -> torch.Tensor:
    out = tensor.clone()
    dist.all_reduce(out, group=_group("sglang", group_name))
    return out


def _sglang_flashinfer(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return _sglang_outplace(tensor, group_name, "flashinfer")


def _sglang_inplace(tensor: torch.Tensor, group_name: str) -> None:
    dist.all_reduce(tensor, group=_group("sglang", group_name))


def _sglang_all_gather(output: torch.Tensor, input: torch.Tensor, group_name: str) -> None:
    group = _group("sglang", group_name)
    parts = [torch.empty_like(input) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, input.contiguous(), group=group)
    output.copy_(torch.cat(parts, 0))


def _sglang_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group_name: str) -> None:
    group = _group("sglang", group_name)
    total = input.clone()
    dist.all_reduce(total, group=group)
    output.copy_(total.chunk(dist.get_world_size(group), 0)[dist.get_rank(group)])


def _fused_add_rms_norm_in_place(
    x: torch.Tensor,
    x_residual: torch.Tensor,
    weight: torch.Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM IR's ``maybe_inplace`` overload, as an in-place implementation may run it: the
    results are returned (new tensors) and its arguments are clobbered."""
    out, total = _fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size)
    x.copy_(out)
    x_residual.copy_(total)
    return out.clone(), total.clone()


def _nothing(*args: object) -> None:
    return None


def _like(tensor: torch.Tensor, *args: object) -> torch.Tensor:
    return torch.empty_like(tensor)


def register() -> None:
    """Register every stand-in (idempotent)."""
    v, s = VllmDialect.SCHEMAS, SGLangDialect.SCHEMAS
    _define("vllm::all_reduce", v["vllm::all_reduce"], _vllm_all_reduce, _like)
    _define(
        "vllm::reduce_scatter", v["vllm::reduce_scatter"], _vllm_reduce_scatter, _vllm_reduce_scatter_fake
    )
    _define("vllm::all_gather", v["vllm::all_gather"], _vllm_all_gather, _vllm_all_gather_fake)
    _define(
        "vllm_ir::rms_norm",
        v["vllm_ir::rms_norm"],
        _rms_norm,
        lambda x, weight, epsilon, variance_size=None: torch.empty_like(x),
    )
    _define(
        "vllm_ir::fused_add_rms_norm",
        v["vllm_ir::fused_add_rms_norm"],
        _fused_add_rms_norm,
        lambda x, x_residual, weight, epsilon, variance_size=None: (torch.empty_like(x), torch.empty_like(x)),
    )
    _define(
        "vllm_ir::fused_add_rms_norm.maybe_inplace",
        v["vllm_ir::fused_add_rms_norm.maybe_inplace"],
        _fused_add_rms_norm_in_place,
        lambda x, x_residual, weight, epsilon, variance_size=None: (torch.empty_like(x), torch.empty_like(x)),
    )
    c = VllmCpuDialect.SCHEMAS
    _define("_C::shm_allreduce", c["_C::shm_allreduce"], _shm_allreduce, _nothing)
    _define("sglang::outplace_all_reduce", s["sglang::outplace_all_reduce"], _sglang_outplace, _like)
    _define("sglang::flashinfer_allreduce", s["sglang::flashinfer_allreduce"], _sglang_flashinfer, _like)
    _define("sglang::inplace_all_reduce", s["sglang::inplace_all_reduce"], _sglang_inplace, _nothing)
    _define(
        "sglang::reg_all_gather_into_tensor",
        s["sglang::reg_all_gather_into_tensor"],
        _sglang_all_gather,
        _nothing,
    )
    _define(
        "sglang::reg_reduce_scatter_tensor",
        s["sglang::reg_reduce_scatter_tensor"],
        _sglang_reduce_scatter,
        _nothing,
    )


class _Coordinator:
    """What the dialects read of a host's ``GroupCoordinator`` (with ``handle``: vLLM CPU's
    communicator, whose shared-memory module holds that handle)."""

    def __init__(self, name: str, group: dist.ProcessGroup, handle: int | None = None) -> None:
        self.unique_name, self.device_group = name, group
        if handle is not None:
            shm = types.SimpleNamespace(handle=handle)
            self.device_communicator = types.SimpleNamespace(dist_module=shm)


_MODULES = {"vllm": "vllm.distributed.parallel_state", "sglang": "sglang.srt.distributed.parallel_state"}


@contextlib.contextmanager
def host_registry(
    host: str, groups: dict[str, dist.ProcessGroup], handles: dict[str, int] | None = None
) -> Iterator[None]:
    """A stand-in ``<host>...parallel_state`` module in ``sys.modules`` whose ``_groups``
    maps each name of ``groups`` to a coordinator of that torch group, as the host's
    registry does (``handles``: a name's vLLM CPU shared-memory handle); removed on exit."""
    path = _MODULES[host]
    parts = path.split(".")
    saved = {name: sys.modules.get(name) for name in (".".join(parts[: i + 1]) for i in range(len(parts)))}
    coordinators = {
        name: _Coordinator(name, group, (handles or {}).get(name)) for name, group in groups.items()
    }
    for name in saved:
        sys.modules[name] = types.ModuleType(name)
    sys.modules[path]._groups = {name: weakref.ref(c) for name, c in coordinators.items()}  # type: ignore[attr-defined]
    sys.modules[path]._coordinators = coordinators  # type: ignore[attr-defined]  # keeps the weakrefs alive
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


register()
