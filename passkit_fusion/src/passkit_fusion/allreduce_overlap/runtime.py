"""What runs behind ``torch.ops.passkit_fusion.matmul_all_reduce``: a row-parallel matmul
whose all-reduce is carried by the GPUs' copy engines, chunk by chunk, beside the matmul.

NCCL's all-reduce is a kernel: run beside a GEMM it takes SMs and memory bandwidth from it
(on 2x H200 a chunk's all-reduce took 228-258 us beside a matmul against 136-141 us alone).
A copy between GPUs of one host is done by the copy engines instead, which take no SMs. So
for ``y = all_reduce(a @ b)`` on ``W`` ranks, with the rows (tokens) cut into ``k`` chunks::

    compute stream  barrier  mm_0   mm_1   ...  mm_k-1  [wait 0] sum_0 ... [wait k-1] sum_k-1
    copy lane                      push_0  push_1  ...  push_k-1
    signal stream                          barrier_0  ...  barrier_k-1

* chunk ``i``'s product goes to a plain tensor (``mine``); as soon as it is computed, the
  copy lane (``lanes`` streams, each a slice of the chunk; on 2x H200 the slices ran one
  after another, so one is the default) pushes it into this rank's slot of every peer's
  symmetric-memory buffer (``Tensor.copy_`` into peer-mapped memory: a copy-engine
  transfer over NVLink);
* after each push, a barrier on the signal stream (its own channel of the group's signal
  pads) says that every peer's chunk ``i`` has landed here. A barrier is a kernel: while
  the next chunk's GEMM holds every SM it waits, on a stream of its own, so it never holds
  up the next push (a first version waited on the copy stream: the copies then ran after
  the matmuls, not beside them);
* once the matmuls are done, the compute stream sums each chunk's partials as soon as its
  barrier has run, **in rank order on every rank** (``x_0 + x_1 + ...``: the same additions
  in the same order), so every rank holds bit-identical rows, and the sums of the first
  chunks run while the last chunk is still on the wire. :func:`matmul_all_reduce_rmsnorm`
  sums them in the kernel that also adds the residual and normalises
  (:mod:`.triton_kernel`), so the sum is never written and read back on its own;
* the barrier that opens the call makes every rank wait until the others have read what
  they received in the previous call (their reads come before the next call's opening
  barrier on their compute stream), so their buffers can be written again.

The streams are ordered with events kept per device (recorded anew by every call; a wait
already issued keeps the record it saw) and switched with ``torch.cuda.set_stream``: without
CUDA graphs a forward pays each call's host time, and ``with torch.cuda.stream()`` blocks,
``wait_stream`` and new events cost several times more (``benchmarks/overlap_op.py
--host-cost``).

What is not hidden: the last chunk's push and barrier, and the last chunk's sum. Every rank
pushes its chunk to every peer (``W - 1`` copies): the fewest steps, optimal bytes at
``W = 2``.

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
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import reference
from ..async_tp import torch_api
from ..async_tp.runtime import agree_on_symmetric_memory, target_bytes
from ..collective import resolve_group
from ..collective.resources import capturing as _capturing
from ..collective.resources import outside_graph_pools
from .triton_kernel import MAX_PARTS, RowsNorm, partials_add_rmsnorm  # Triton is imported at a launch

COPY_ENGINE = "copy_engine"
FALLBACK = "fallback"
STEP = "allreduce_overlap:symm_mem"
DEFAULT_RESERVE_TOKENS = 16384
"""Tokens a buffer is sized for when the pass sets no ``max_tokens`` (64 MiB a rank at hidden
4096 in bf16): growth, which allocates a second buffer, is then rare."""

_OPEN_CHANNEL = 0  # the compute stream's barrier at the start of a call
_FIRST_CHUNK_CHANNEL = 1  # chunk i's barrier after its push: channel 1 + i (torch has 32)


@dataclasses.dataclass
class _Buffer:
    tensor: torch.Tensor
    handle: Any  # torch's _SymmetricMemory for ``tensor``
    nbytes: int


@dataclasses.dataclass
class _Streams:
    """The side streams and events of a device's calls with one ``(chunks, lanes)``, made
    once and reused by every call (an event records anew each call: a wait already issued
    keeps the record it saw), so that a call makes no stream or event of its own."""

    signal: torch.cuda.Stream
    lanes: list[torch.cuda.Stream]
    computed: list[torch.cuda.Event]
    """per chunk: its matmul is done (the lanes wait for it)"""
    pushed: list[list[torch.cuda.Event]]
    """per chunk, per lane: its pushes are issued and done (the signal stream waits for them)"""
    landed: list[torch.cuda.Event]
    """per chunk: its barrier ran, every peer's rows of it are here (the compute stream waits)"""


_buffers: dict[str, _Buffer] = {}
"""The live buffer per process-group name."""
_retired: list[_Buffer] = []
"""Buffers replaced by larger ones: kept, since a captured CUDA graph may still use them."""
_streams: dict[int, list[torch.cuda.Stream]] = {}
"""Per device: the signal stream, then the copy lanes."""
_side: dict[tuple[int, int, int], _Streams] = {}
"""Per ``(device, chunks, lanes)``: the streams and events its calls reuse."""
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
    if (group_name, "matmul_all_reduce", b.shape[-1], a.dtype, chunks, lanes, max_tokens) not in _agreed:
        _check_op_plan(group_name, "matmul_all_reduce", a, b, chunks, lanes, max_tokens, timeout_s)
    handle = _handle_or_fallback(a, b, group_name, max_tokens, timeout_s)
    if handle is None:
        return unfused(a, b, group_name)
    parts, landed = _push_chunks(a, b, handle, chunks, lanes)
    out = torch.empty_like(parts[0])
    for start, end in _as_they_land(landed):
        first, *rest = (part[start:end] for part in parts)
        if not rest:  # a group of one rank
            out[start:end].copy_(first)
            continue
        torch.add(first, rest[0], out=out[start:end])
        for row in rest[1:]:
            out[start:end].add_(row)
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
    the partials, the residual and the norm in one kernel per chunk (:mod:`.triton_kernel`),
    each chunk's as soon as the peers' rows of it have landed. Collective, like
    :func:`matmul_all_reduce`."""
    if (
        group_name,
        "matmul_all_reduce_rmsnorm",
        b.shape[-1],
        a.dtype,
        chunks,
        lanes,
        max_tokens,
    ) not in _agreed:
        _check_op_plan(group_name, "matmul_all_reduce_rmsnorm", a, b, chunks, lanes, max_tokens, timeout_s)
    handle = _handle_or_fallback(a, b, group_name, max_tokens, timeout_s)
    if handle is None:
        x = torch.mm(a, b).view(residual.shape)
        return reference.allreduce_rmsnorm(x, residual, weight, eps, weight_bias, group_name)
    parts, landed = _push_chunks(a, b, handle, chunks, lanes)
    norm, total = torch.empty_like(parts[0]), torch.empty_like(parts[0])
    if len(parts) <= MAX_PARTS:  # checked once, a launch per chunk
        rows_norm = RowsNorm(parts, residual, weight, eps, weight_bias, (norm, total))
        for start, end in _as_they_land(landed):
            rows_norm(start, end)
    else:
        res2 = residual.reshape(-1, residual.shape[-1])
        for start, end in _as_they_land(landed):
            partials_add_rmsnorm(
                [part[start:end] for part in parts], res2[start:end], weight, eps, weight_bias,
                out=(norm[start:end], total[start:end]),
            )  # fmt: skip
    return norm.view(residual.shape), total.view(residual.shape)


def agreed_all_reduce(
    x: torch.Tensor, reduce_op: str, group_name: str, plan: str, timeout_s: float
) -> torch.Tensor:
    """The functional all-reduce of ``x`` (not waited: the graph's ``wait_tensor`` waits),
    after the ranks agreed on ``plan`` (:func:`check_plan`): the first chunk's all-reduce of
    a site the ``"nccl"`` transport split, so that ranks that split differently (or not at
    all) fail, bounded, instead of issuing all-reduces of different sizes."""
    check_plan(group_name, plan, timeout_s)
    return torch.ops._c10d_functional.all_reduce(x, reduce_op, group_name)


def check_plan(group_name: str, plan: str, timeout_s: float) -> None:
    """Agree ``plan`` (a JSON text: transport, chunks, ...) with every rank of the group, once
    per plan in this process (:func:`passkit_fusion.collective.agree`, at most ``timeout_s``;
    a :class:`~passkit_fusion.collective.RankAgreementError` on every rank when a rank differs
    or never arrives, e.g. one that runs the graph without the pass). Not during a CUDA graph
    capture (the first eager call, or the warm-up before it, agrees)."""
    key = (group_name, plan)
    if key in _agreed:
        return
    from ..collective import agree_plan_once

    describe = "allreduce_overlap's chunked matmul + all-reduce"
    if agree_plan_once(group_name, "allreduce_overlap:plan", plan, timeout_s, describe):
        _agreed.add(key)


def _check_op_plan(
    group_name: str,
    op: str,
    a: torch.Tensor,
    b: torch.Tensor,
    chunks: int,
    lanes: int,
    max_tokens: int,
    timeout_s: float,
) -> None:
    """:func:`check_plan` for a copy-engine op's call (its rows aside, which the graph gives
    every rank alike): the op, chunks, lanes, buffer size, columns and dtype; remembered by
    a tuple, so that a later call pays one set look-up (the hot path's host time)."""
    import json

    plan = {
        "transport": "copy_engine", "op": op, "columns": int(b.shape[-1]), "dtype": str(a.dtype),
        "chunks": chunks, "lanes": lanes, "max_tokens": max_tokens,
    }  # fmt: skip
    check_plan(group_name, json.dumps(plan, sort_keys=True), timeout_s)
    if (group_name, json.dumps(plan, sort_keys=True)) in _agreed:
        _agreed.add((group_name, op, b.shape[-1], a.dtype, chunks, lanes, max_tokens))


_agreed: set[tuple[Any, ...]] = set()
"""What the ranks agreed on in this process: (group, plan JSON) pairs, and the copy-engine
ops' call keys (group, op, columns, dtype, chunks, lanes, max_tokens)."""


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
        buf = _buffers.get(group_name)
        world = buf.handle.world_size if buf else dist.get_world_size(resolve_group(group_name))
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


def _push_chunks(
    a: torch.Tensor, b: torch.Tensor, handle: Any, chunks: int, lanes: int
) -> tuple[list[torch.Tensor], list[tuple[int, int, torch.cuda.Event]]]:
    """Every rank's ``a @ b`` on this rank, in rank order (``[rows, n]`` each: this rank's
    own, and views of the slots its peers pushed into), and per chunk ``(start, end,
    event)``: once the current stream waits for ``event``, rows ``start:end`` of every
    part have landed (the chunk's barrier ran on the signal stream)."""
    rows, n = a.shape[0], b.shape[1]
    rank, world = handle.rank, handle.world_size
    mine = torch.empty((rows, n), dtype=a.dtype, device=a.device)

    def slot(owner: int, writer: int, start: int, end: int) -> torch.Tensor:
        """Rows ``start:end`` of ``writer``'s slot in ``owner``'s buffer."""
        return handle.get_buffer(owner, (end - start, n), a.dtype, (writer * rows + start) * n)

    parts = [mine if r == rank else slot(rank, r, 0, rows) for r in range(world)]
    bounds = chunk_bounds(rows, chunks)
    if not bounds:
        return parts, []
    peers = [r for r in range(world) if r != rank]
    compute = torch.cuda.current_stream()
    side = _side_streams(a.device, len(bounds), lanes)
    handle.barrier(channel=_OPEN_CHANNEL)  # every peer has read what we pushed last call
    landed = []
    try:
        for i, (start, end) in enumerate(bounds):
            torch.mm(a[start:end], b, out=mine[start:end])
            side.computed[i].record(compute)
            for lane, pushed, (lo, hi) in zip(
                side.lanes, side.pushed[i], chunk_bounds(end - start, lanes), strict=False
            ):
                torch.cuda.set_stream(lane)
                lane.wait_event(side.computed[i])
                for peer in peers:
                    slot(peer, rank, start + lo, start + hi).copy_(mine[start + lo : start + hi])
                pushed.record(lane)
                side.signal.wait_event(pushed)
            torch.cuda.set_stream(side.signal)
            handle.barrier(channel=_FIRST_CHUNK_CHANNEL + i)  # the peers' pushes of chunk i landed
            side.landed[i].record(side.signal)
            torch.cuda.set_stream(compute)
            landed.append((start, end, side.landed[i]))
    finally:
        torch.cuda.set_stream(compute)
    # the last event follows every push: ``mine`` is not read by a copy any more once the
    # current stream has waited for it (the callers wait for every chunk's)
    return parts, landed


def _as_they_land(landed: list[tuple[int, int, torch.cuda.Event]]) -> Iterator[tuple[int, int]]:
    """Each chunk's ``(start, end)`` of :func:`_push_chunks`, once the current stream waits
    for its rows to have landed: what is issued before the next one runs as soon as they have."""
    compute = torch.cuda.current_stream()
    for start, end, event in landed:
        compute.wait_event(event)
        yield start, end


def _side_streams(device: torch.device, chunks: int, lanes: int) -> _Streams:
    """The signal stream, ``lanes`` copy streams and the events of ``device``'s calls of
    ``chunks`` chunks (made once, then reused): the per-chunk barriers wait on a stream of
    their own, so that a barrier waiting for a free SM (the next chunk's GEMM holds them all)
    never holds up the next push."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, chunks, lanes)
    if (made := _side.get(key)) is None:
        streams = _streams.setdefault(index, [])
        while len(streams) < lanes + 1:
            streams.append(torch.cuda.Stream(device=index))
        made = _side[key] = _Streams(
            signal=streams[0],
            lanes=streams[1 : lanes + 1],
            computed=[torch.cuda.Event() for _ in range(chunks)],
            pushed=[[torch.cuda.Event() for _ in range(lanes)] for _ in range(chunks)],
            landed=[torch.cuda.Event() for _ in range(chunks)],
        )
    return made


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
