"""Distributed worlds for tests: a fake one in-process, and real gloo/NCCL ones in subprocesses.

:func:`fake_world` initialises torch's *fake* process group in the calling process: every
collective "succeeds" without communicating, which is what tracing and compiling need. Use it
to check what a pass does to graphs with collectives (``_c10d_functional.all_reduce`` +
``wait_tensor``, DTensor / tensor-parallel models) without spawning anything::

    with fake_world(world_size=4) as world:

        def fn(x):
            return funcol.all_reduce(x, "sum", world.group_name)

        torch.compile(fn, backend=recording_backend)(torch.randn(8))

:func:`run_in_gloo_world` and :func:`run_in_nccl_world` run a module-level function on every
rank of a real world of processes and return each rank's :class:`RankResult`; they never hang
(a rank still running after ``timeout`` is terminated and reported as timed out). The default
``timeout``, :data:`DEFAULT_TIMEOUT_S` (300 s), is a hang limit, not a stopwatch: spawning
8 interpreters that import torch takes over a minute on a loaded 2-core machine.
:func:`gloo_world` and :func:`nccl_world` return the values and raise :class:`WorldError`
(:class:`GlooWorldError`, :class:`NcclWorldError`) when any rank failed::

    def add_ranks(rank, world_size):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item()

    assert gloo_world(add_ranks, 2) == [1.0, 1.0]

Ranks run in fresh interpreters (``multiprocessing`` "spawn"), so ``fn`` and ``args`` must be
picklable: define ``fn`` at module level of an importable module, such as a test module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnContext, SpawnProcess

    import pytest
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SEED",
    "FakeWorld",
    "GlooWorldError",
    "NcclWorldError",
    "RankResult",
    "WorldError",
    "fake_world",
    "gloo_world",
    "nccl_world",
    "requires_gpus",
    "run_in_gloo_world",
    "run_in_nccl_world",
]

Backend = Literal["gloo", "nccl"]

SEED = 1234
"""Every rank calls ``torch.manual_seed(SEED)`` before running the function."""

DEFAULT_TIMEOUT_S = 300.0
"""The worlds' default ``timeout``: a hang limit, generous enough for a loaded 2-core machine
(where 8 ranks take over a minute to start), not a measure of speed."""

_CHILD_ENV_DEFAULTS = {"OMP_NUM_THREADS": "1"}
"""Environment of every rank unless the caller's ``env`` says otherwise."""

_CHILD_ENV_FORCED = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
"""Environment of every rank that ``env`` cannot override: NVLink multicast stays off, as it
can take a shared host's GPUs down."""

_EXIT_GRACE_S = 5.0
"""How long a rank that reported its result gets to tear down its process group and exit."""

_KILL_GRACE_S = 2.0
"""How long a terminated (SIGTERM) rank gets before it is killed (SIGKILL)."""


# --------------------------------------------------------------------------- fake world


@dataclasses.dataclass
class FakeWorld:
    """The fake distributed world that :func:`fake_world` set up in this process."""

    world_size: int
    rank: int
    group: dist.ProcessGroup
    """The default process group (``dist.group.WORLD``)."""

    @property
    def group_name(self) -> GroupName:
        """The c10d name of :attr:`group`, as functional collectives take it."""
        return self.group.group_name

    @functools.cached_property
    def mesh(self) -> DeviceMesh:
        """A 1-D CPU :class:`~torch.distributed.device_mesh.DeviceMesh` over the whole world.

        Created on first use; DTensor and ``torch.distributed.tensor.parallel``
        (``ColwiseParallel``, ``RowwiseParallel``) trace and compile on it.
        """
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (self.world_size,))


@contextlib.contextmanager
def fake_world(world_size: int = 2, rank: int = 0) -> Iterator[FakeWorld]:
    """Initialise torch.distributed with the fake backend for the duration of the block.

    Collectives do not communicate (their results are wrong), but code using them runs and
    traces: ``torch.compile`` of ``_functional_collectives.all_reduce(x, "sum", group)``
    yields ``_c10d_functional.all_reduce`` + ``_c10d_functional.wait_tensor`` nodes. The
    process group is destroyed on exit, exceptions included.

    Raises:
        ValueError: if ``world_size`` or ``rank`` is out of range.
        RuntimeError: if a process group is already initialised in this process.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 1 and 0 <= rank < world_size, got {world_size=}, {rank=}")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world() needs an uninitialised torch.distributed, but a process group "
            f"(backend {dist.get_backend()!r}, world size {dist.get_world_size()}) already exists; "
            "destroy it first (dist.destroy_process_group())"
        )
    # Importing fake_pg registers the "fake" backend on torch versions that lack it built in.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield FakeWorld(world_size=world_size, rank=rank, group=_default_group())
    finally:
        dist.destroy_process_group()


def _default_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None, "init_process_group() left no default group"
    return group


# --------------------------------------------------------------------------- real worlds


@dataclasses.dataclass(frozen=True)
class RankResult:
    """What one rank of a world returned, or why it did not."""

    rank: int
    value: Any = None
    """``fn``'s return value, with tensors detached and moved to the CPU."""
    error: str | None = None
    """``None`` when the rank succeeded; else a one-line reason (``"ValueError: boom"``,
    ``"timed out after 10s"``, ``"exited with code 1 without reporting a result"``)."""
    traceback: str | None = None
    """The formatted traceback when the rank raised."""

    @property
    def ok(self) -> bool:
        """Whether the rank returned normally."""
        return self.error is None

    def describe(self) -> str:
        """A human-readable summary: the value, or the error and traceback."""
        if self.ok:
            return f"rank {self.rank}: ok: {self.value!r}"
        return f"rank {self.rank}: {self.error}" + (f"\n{self.traceback.rstrip()}" if self.traceback else "")


class WorldError(RuntimeError):
    """Some ranks of a world failed; :attr:`results` holds every rank's :class:`RankResult`."""

    backend: Backend

    def __init__(self, results: Sequence[RankResult]) -> None:
        self.results = list(results)
        failed = [r for r in self.results if not r.ok]
        header = f"{len(failed)} of {len(self.results)} ranks failed in a {self.backend} world"
        super().__init__("\n".join([header, *(f"--- {r.describe()}" for r in failed)]))


class GlooWorldError(WorldError):
    """Some ranks of a :func:`gloo_world` failed."""

    backend = "gloo"


class NcclWorldError(WorldError):
    """Some ranks of an :func:`nccl_world` failed."""

    backend = "nccl"


def run_in_gloo_world(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on each rank of a gloo world of CPU processes.

    Every rank is a fresh "spawn" process with a gloo default process group (rendezvous
    through a store on 127.0.0.1, gloo bound to the loopback interface),
    ``OMP_NUM_THREADS=1`` and ``torch.manual_seed(SEED)``. ``env`` adds environment
    variables. Returns one :class:`RankResult` per rank, in rank order. Ranks still running
    ``timeout`` seconds after the start are terminated and reported as timed out.
    """
    return _run_world("gloo", fn, world_size, args, timeout, env)


def run_in_nccl_world(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> list[RankResult]:
    """Like :func:`run_in_gloo_world`, with NCCL and one GPU per rank (``cuda:<rank>``).

    Each rank calls ``torch.cuda.set_device(rank)`` before initialising its process group.
    NVLink multicast is disabled in every rank (``NCCL_NVLS_ENABLE=0``, whatever ``env``
    says). Raises ``RuntimeError`` without spawning anything when NCCL is not available or
    there are fewer GPUs than ranks; guard tests with :func:`requires_gpus`.
    """
    if not dist.is_nccl_available():
        raise RuntimeError("run_in_nccl_world() needs a torch build with NCCL")
    if (found := torch.cuda.device_count()) < world_size:
        raise RuntimeError(f"run_in_nccl_world() needs {world_size} GPUs (one per rank), found {found}")
    return _run_world("nccl", fn, world_size, args, timeout, env)


def gloo_world(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """:func:`run_in_gloo_world`, returning the ranks' values.

    Raises:
        GlooWorldError: if any rank failed; the message holds every failed rank's error and
            traceback.
    """
    results = run_in_gloo_world(fn, world_size, args=args, timeout=timeout, env=env)
    return _values_or_raise(results, GlooWorldError)


def nccl_world(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """:func:`run_in_nccl_world`, returning the ranks' values.

    Raises:
        NcclWorldError: if any rank failed.
    """
    results = run_in_nccl_world(fn, world_size, args=args, timeout=timeout, env=env)
    return _values_or_raise(results, NcclWorldError)


def requires_gpus(n: int) -> pytest.MarkDecorator:
    """A ``pytest.mark.skipif`` that skips a test when fewer than ``n`` CUDA GPUs are visible."""
    import pytest

    found = torch.cuda.device_count()
    return pytest.mark.skipif(found < n, reason=f"needs {n} CUDA GPUs, found {found}")


def _values_or_raise(results: list[RankResult], error: type[WorldError]) -> list[Any]:
    if not all(r.ok for r in results):
        raise error(results)
    return [r.value for r in results]


# --------------------------------------------------------------------------- spawning engine


@dataclasses.dataclass(frozen=True)
class _WorldSpec:
    """Everything a rank's process needs to know (pickled into it)."""

    backend: Backend
    world_size: int
    port: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    timeout: float


def _run_world(
    backend: Backend,
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    timeout: float,
    env: Mapping[str, str] | None,
) -> list[RankResult]:
    """Spawn one process per rank, collect their results, and never leave one running."""
    _check_world_args(fn, world_size, args, timeout)
    deadline = time.monotonic() + timeout
    store = _loopback_store(timeout)  # serves the rendezvous until this function returns
    spec = _WorldSpec(backend, world_size, store.port, fn, tuple(args), timeout)
    ctx = multiprocessing.get_context("spawn")
    procs: list[SpawnProcess] = []
    receivers: dict[Connection, int] = {}
    received: dict[int, RankResult | None] = {}
    try:
        with _patched_environ(_child_environ(backend, env)):
            for rank in range(world_size):
                proc, receiver = _start_rank(ctx, spec, rank)
                procs.append(proc)
                receivers[receiver] = rank
        _collect(dict(receivers), deadline, into=received)
    finally:
        _stop(procs, finished=received.keys())
        for receiver in receivers:
            receiver.close()
    return [_final_result(rank, received, procs[rank], timeout) for rank in range(world_size)]


def _check_world_args(fn: Callable[..., Any], world_size: int, args: Sequence[Any], timeout: float) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    try:
        pickle.dumps((fn, tuple(args)))
    except Exception as exc:
        raise TypeError(
            f"fn and args must be picklable to reach the ranks' processes (define fn at module "
            f"level of an importable module): {exc}"
        ) from exc


def _loopback_store(timeout: float) -> dist.TCPStore:
    """A TCPStore server on a free port of 127.0.0.1 (bound by us, so no port race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store owns the socket from here on
        use_libuv=True,
    )


def _child_environ(backend: Backend, env: Mapping[str, str] | None) -> dict[str, str]:
    """The environment variables set in every rank: defaults < ``env`` < forced."""
    defaults = dict(_CHILD_ENV_DEFAULTS)
    if backend == "gloo" and (loopback := _loopback_interface()) is not None:
        defaults["GLOO_SOCKET_IFNAME"] = loopback
    return {**defaults, **(env or {}), **_CHILD_ENV_FORCED}


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), None)


@contextlib.contextmanager
def _patched_environ(overrides: Mapping[str, str]) -> Iterator[None]:
    """Set ``overrides`` in ``os.environ`` while processes are started, then restore it.

    A spawned interpreter inherits the parent's environment when it starts, and imports torch
    (reading e.g. ``OMP_NUM_THREADS``) before any code of ours runs in it.
    """
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_rank(ctx: SpawnContext, spec: _WorldSpec, rank: int) -> tuple[SpawnProcess, Connection]:
    """Start rank ``rank``; return its process and the receiving end of its result pipe."""
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_rank_main, args=(spec, rank, sender), name=f"{spec.backend}-rank{rank}")
    proc.start()
    sender.close()  # only the child holds the sending end: its exit makes `receiver` readable
    return proc, receiver


def _collect(waiting: dict[Connection, int], deadline: float, into: dict[int, RankResult | None]) -> None:
    """Receive results until every rank reported or exited, or ``deadline`` passes.

    Fills ``into`` (filled in place, so that an interrupted wait leaves what it got) with each
    finished rank's result, or ``None`` when its process ended without sending one (a crash,
    ``sys.exit``). Ranks missing from ``into`` timed out.
    """
    while waiting and (remaining := deadline - time.monotonic()) > 0:
        for conn in multiprocessing.connection.wait(list(waiting), remaining):
            assert isinstance(conn, multiprocessing.connection.Connection)
            rank = waiting.pop(conn)
            into[rank] = _receive(conn, rank)


def _receive(conn: Connection, rank: int) -> RankResult | None:
    try:
        data = conn.recv_bytes()
    except EOFError:
        return None
    try:
        result = pickle.loads(data)
    except Exception as exc:
        return RankResult(rank, error=f"its result cannot be unpickled here: {type(exc).__name__}: {exc}")
    assert isinstance(result, RankResult)
    return result


def _stop(procs: list[SpawnProcess], finished: Collection[int]) -> None:
    """Give finished ranks a moment to exit, terminate the others, kill stragglers."""
    grace_end = time.monotonic() + _EXIT_GRACE_S
    for rank, proc in enumerate(procs):
        if rank in finished:
            proc.join(max(0.0, grace_end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    kill_end = time.monotonic() + _KILL_GRACE_S
    for proc in procs:
        proc.join(max(0.0, kill_end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _final_result(
    rank: int, received: dict[int, RankResult | None], proc: SpawnProcess, timeout: float
) -> RankResult:
    if rank not in received:
        return RankResult(rank, error=f"timed out after {timeout:g}s")
    result = received[rank]
    if result is None:
        return RankResult(rank, error=f"{_describe_exit(proc.exitcode)} without reporting a result")
    return result


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}"


# --------------------------------------------------------------------------- inside a rank


def _rank_main(spec: _WorldSpec, rank: int, sender: Connection) -> None:
    """Entry point of a rank's process: join the world, run ``spec.fn``, send the result.

    The result is sent before the process group is destroyed, as tearing it down may wait
    on ranks that failed.
    """
    with sender:
        try:
            _join_world(spec, rank)
        except Exception as exc:
            sender.send_bytes(_pickled(_failure(rank, exc)))
            return
        try:
            sender.send_bytes(_pickled(_call(spec, rank)))
        finally:
            dist.destroy_process_group()


def _join_world(spec: _WorldSpec, rank: int) -> None:
    torch.manual_seed(SEED)
    device_id = None
    if spec.backend == "nccl":
        torch.cuda.set_device(rank)
        device_id = torch.device("cuda", rank)
    timeout = datetime.timedelta(seconds=spec.timeout)
    store = dist.TCPStore("127.0.0.1", spec.port, is_master=False, timeout=timeout)
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=rank,
        world_size=spec.world_size,
        timeout=timeout,
        device_id=device_id,
    )


def _call(spec: _WorldSpec, rank: int) -> RankResult:
    try:
        value = spec.fn(rank, spec.world_size, *spec.args)
    except Exception as exc:
        return _failure(rank, exc)
    return RankResult(rank, value=pytree.tree_map_only(torch.Tensor, _detached_cpu, value))


def _detached_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu()


def _failure(rank: int, exc: BaseException) -> RankResult:
    return RankResult(rank, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())


def _pickled(result: RankResult) -> bytes:
    """``result`` pickled by value (tensors included, so they outlive this process)."""
    try:
        return pickle.dumps(result)
    except Exception as exc:
        reason = f"its result cannot be pickled: {type(exc).__name__}: {exc}"
        return pickle.dumps(RankResult(result.rank, error=reason))
