"""What runs behind ``torch.ops.passkit_fusion.matmul_all_reduce``: a row-parallel matmul
whose all-reduce is carried by the GPUs' copy engines, chunk by chunk, beside the matmul.

NCCL's all-reduce is a kernel: run beside a GEMM it takes SMs and memory bandwidth from it
(on 2x H200 a chunk's all-reduce took 228-258 us beside a matmul against 136-141 us alone).
A copy between GPUs of one host is done by the copy engines instead, which take no SMs. So
for ``y = all_reduce(a @ b)`` on ``W`` ranks, with the rows (tokens) cut into ``k`` chunks::

    compute stream  barrier  mm_0   mm_1   ...  mm_k-1                      add (rank order)
    copy lanes                     push_0  push_1  ...  push_k-1  barrier

* chunk ``i``'s product goes to a plain tensor (``mine``); as soon as it is computed, the
  copy lanes (``lanes`` streams, each a slice of the chunk, so that several copy engines
  work at once) push it into this rank's slot of every peer's symmetric-memory buffer
  (``Tensor.copy_`` into peer-mapped memory: a copy-engine transfer over NVLink);
* no signal is needed per chunk, so nothing on the copy lanes waits for an SM while the
  GEMM holds them all (a barrier kernel there would start only when the next matmul ends);
  one barrier on the group's signal pads after the last push (the GEMMs are done by then)
  says that every peer's pushes to this rank have landed;
* the compute stream then adds the partials **in rank order on every rank**
  (``x_0 + x_1 + ...``: the same additions in the same order), so every rank holds
  bit-identical rows; :func:`matmul_all_reduce_rmsnorm` adds them in the kernel that also
  adds the residual and normalises (:mod:`.triton_kernel`), so the sum is never written
  and read back on its own;
* the barrier that opens the call makes every rank wait until the others have finished
  adding what they received in the previous call (the add comes before the next call's
  opening barrier on their compute stream), so their buffers can be written again.

Only the last chunk's push, the closing barrier and the add are not hidden. Every rank pushes
its chunk to every peer (``W - 1`` copies): the fewest steps, optimal bytes at ``W = 2``.

The buffer is set up as the other fused ops' resources are: never during CUDA-graph capture
(a call captured before it is large enough runs :func:`unfused`, which is capturable), after
:func:`passkit_fusion.collective.agree` (a bounded wait; every rank the same size, torch and
passkit-fusion versions), sized for ``max_tokens`` tokens when given, to a power of two. A
buffer is never freed while the process runs: a CUDA graph captured over it may replay
(growing allocates a new one and keeps the old referenced).

Off CUDA (gloo, the CPU tests) and where symmetric memory is not available, :func:`unfused`
computes the same sum with a functional all-reduce. Process-wide state, not thread-safe.
Imports without CUDA.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from .. import reference
from ..async_tp import torch_api
from ..async_tp.runtime import agree_on_symmetric_memory, target_bytes
from ..collective import resolve_group
from ..collective.resources import capturing as _capturing
from ..collective.resources import outside_graph_pools

COPY_ENGINE = "copy_engine"
FALLBACK = "fallback"
STEP = "allreduce_overlap:symm_mem"
DEFAULT_RESERVE_TOKENS = 16384
"""Tokens a buffer is sized for when the pass sets no ``max_tokens`` (64 MiB a rank at hidden
4096 in bf16): growth, which allocates a second buffer, is then rare."""

_OPEN_CHANNEL = 0  # the compute stream's barrier at the start of a call
_CLOSE_CHANNEL = 1  # the copy lanes' barrier after the last push


@dataclasses.dataclass
class _Buffer:
    tensor: torch.Tensor
    handle: Any  # torch's _SymmetricMemory for ``tensor``
    nbytes: int


_buffers: dict[str, _Buffer] = {}
"""The live buffer per process-group name."""
_retired: list[_Buffer] = []
"""Buffers replaced by larger ones: kept, since a captured CUDA graph may still use them."""
_lanes: dict[int, list[torch.cuda.Stream]] = {}
_stats: Counter[str] = Counter()


def stats() -> dict[str, int]:
    """Calls per path (``copy_engine``, ``fallback``, ``fallback:<reason>``) since the last
    reset. Calls replayed from a CUDA graph are not seen (its capture counts once)."""
    return dict(_stats)


def reset_stats() -> None:
    _stats.clear()


def reserved_bytes(group_name: str) -> int:
    """The buffer size agreed for ``group_name`` so far (0: none)."""
    buf = _buffers.get(group_name)
    return buf.nbytes if buf else 0


def chunk_bounds(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: ``rows`` cut into ``min(chunks, rows)`` contiguous pieces of
    ``rows // k`` rows, the last one up to the end (none for 0 rows)."""
    k = max(1, min(chunks, rows))
    size = rows // k
    return [(i * size, rows if i == k - 1 else (i + 1) * size) for i in range(k)] if rows else []


# ------------------------------------------------------------------------------ calls --


def matmul_all_reduce(
    a: torch.Tensor,
    b: torch.Tensor,
    group_name: str,
    chunks: int,
    lanes: int,
    max_tokens: int,
    timeout_s: float,
) -> torch.Tensor:
    """``all_reduce_sum(a @ b)`` over ``group_name`` (``a``: ``[rows, k]``, ``b``: ``[k, n]``).
    Collective: every rank calls it with the same shapes, in the same order."""
    handle = _handle_or_fallback(a, b, group_name, max_tokens, timeout_s)
    if handle is None:
        return unfused(a, b, group_name)
    parts = _pushed_partials(a, b, handle, chunks, lanes)
    out = torch.add(parts[0], parts[1])
    for part in parts[2:]:
        out.add_(part)
    return out


def matmul_all_reduce_rmsnorm(
    a: torch.Tensor,
    b: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_bias: float,
    group_name: str,
    chunks: int,
    lanes: int,
    max_tokens: int,
    timeout_s: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_out, residual_out)`` of ``residual_out = all_reduce_sum(a @ b) + residual``
    (the sum viewed as ``residual``'s shape) and its RMSNorm with ``weight + weight_bias``;
    the partials, the residual and the norm in one kernel (:mod:`.triton_kernel`).
    Collective, like :func:`matmul_all_reduce`."""
    handle = _handle_or_fallback(a, b, group_name, max_tokens, timeout_s)
    if handle is None:
        x = torch.mm(a, b).view(residual.shape)
        return reference.allreduce_rmsnorm(x, residual, weight, eps, weight_bias, group_name)
    from .triton_kernel import partials_add_rmsnorm

    parts = _pushed_partials(a, b, handle, chunks, lanes)
    return partials_add_rmsnorm(parts, residual, weight, eps, weight_bias)


def unfused(a: torch.Tensor, b: torch.Tensor, group_name: str) -> torch.Tensor:
    """``all_reduce_sum(a @ b)`` with a functional all-reduce (any backend; capturable)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(torch.mm(a, b), "sum", group_name))


def _handle_or_fallback(
    a: torch.Tensor, b: torch.Tensor, group_name: str, max_tokens: int, timeout_s: float
) -> Any:
    """The group's symmetric-memory handle, its buffer large enough for this call; None
    (recorded with the reason) where the call takes the functional all-reduce instead."""
    reason = _why_unfused(a, b)
    if not reason:
        world = dist.get_world_size(resolve_group(group_name))
        need = world * a.shape[0] * b.shape[1] * a.element_size()  # a slot per rank
        reason = _ensure_buffer(group_name, need, a.shape[0], max_tokens, timeout_s)
    if reason:
        _record(FALLBACK, reason)
        return None
    _record(COPY_ENGINE)
    return _buffers[group_name].handle


def _why_unfused(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.device.type != "cuda":
        return "not_cuda"
    if a.dtype != b.dtype:
        return "mixed_dtypes"
    return ""


def _pushed_partials(
    a: torch.Tensor, b: torch.Tensor, handle: Any, chunks: int, lanes: int
) -> list[torch.Tensor]:
    """Every rank's ``a @ b`` on this rank, in rank order (``[rows, n]`` each; this rank's
    own, and views of the slots its peers pushed into), ready on the current stream."""
    rows, n = a.shape[0], b.shape[1]
    rank, world = handle.rank, handle.world_size
    mine = torch.empty((rows, n), dtype=a.dtype, device=a.device)
    bounds = chunk_bounds(rows, chunks)

    def slot(owner: int, writer: int, start: int, end: int) -> torch.Tensor:
        """Rows ``start:end`` of ``writer``'s slot in ``owner``'s buffer."""
        return handle.get_buffer(owner, (end - start, n), a.dtype, (writer * rows + start) * n)

    if not bounds:
        return [mine] * world
    peers = [r for r in range(world) if r != rank]
    compute = torch.cuda.current_stream()
    copies = _copy_lanes(a.device, lanes)
    handle.barrier(channel=_OPEN_CHANNEL)  # every peer has added what we pushed last call
    for start, end in bounds:
        torch.mm(a[start:end], b, out=mine[start:end])
        for lane, (lo, hi) in zip(copies, chunk_bounds(end - start, len(copies)), strict=False):
            lane.wait_stream(compute)
            with torch.cuda.stream(lane):
                for peer in peers:
                    slot(peer, rank, start + lo, start + hi).copy_(mine[start + lo : start + hi])
    first = copies[0]
    for lane in copies[1:]:
        first.wait_stream(lane)
    with torch.cuda.stream(first):
        handle.barrier(channel=_CLOSE_CHANNEL)  # every peer's pushes to us have landed
    compute.wait_stream(first)  # also: ``mine`` is not read by a copy any more once freed
    return [mine if r == rank else slot(rank, r, 0, rows) for r in range(world)]


def _copy_lanes(device: torch.device, lanes: int) -> list[torch.cuda.Stream]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    streams = _lanes.setdefault(index, [])
    while len(streams) < lanes:
        streams.append(torch.cuda.Stream(device=index))
    return streams[:lanes]


def _record(path: str, reason: str = "") -> None:
    _stats[path] += 1
    if reason:
        _stats[f"{path}:{reason}"] += 1


# ------------------------------------------------------------------------------ set-up --


def _ensure_buffer(group_name: str, need: int, tokens: int, max_tokens: int, timeout_s: float) -> str:
    """Make sure ``group_name`` has a buffer of ``need`` bytes; ``""`` or why not.
    Collective when it allocates (every rank calls it with the same shapes)."""
    if need <= reserved_bytes(group_name):
        return ""
    if torch_api.symm_mem_unavailable():  # asked only while no buffer serves the call
        return "no_symmetric_memory"
    if _capturing():
        return "buffer_not_ready_in_capture"
    size = target_bytes(need, tokens, max_tokens or max(tokens, DEFAULT_RESERVE_TOKENS))
    agree_on_symmetric_memory(group_name, STEP, size, timeout_s, "symmetric-memory buffer")
    device = torch.device("cuda", torch.cuda.current_device())
    buf = outside_graph_pools(lambda: _allocate(group_name, size, device), "symmetric-memory buffer")
    if (old := _buffers.get(group_name)) is not None:
        _retired.append(old)
    _buffers[group_name] = buf
    return ""


def _allocate(group_name: str, nbytes: int, device: torch.device) -> _Buffer:
    sm = torch_api.symm_mem()
    torch_api.enable_group(group_name)
    tensor = sm.empty(nbytes, dtype=torch.uint8, device=device)
    return _Buffer(tensor, sm.rendezvous(tensor, group_name), nbytes)
