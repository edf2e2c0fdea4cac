"""The ranks of a benchmark on one host, shared by the scripts (``benchmarks/`` is on
``sys.path`` when one runs as a script): a free loopback port, a rank joining the process
group (NCCL on its GPU, gloo on the CPU), ranks spawned as processes that hand rank 0's
results back through a queue, each rank's seconds from those results to its exit, and the
largest of a value over the ranks.

A benchmark's ranks end as users' programs do: ``destroy_process_group()`` and the
interpreter's exit, never ``os._exit`` (``tests/test_benchmarks.py`` checks it)."""

from __future__ import annotations

import queue as queues
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

# torch is imported where it is used: a parent that only launches rank processes (teardown.py)
# does not pay for it


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the ranks' rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def join(rank: int, world: int, port: int, *, cuda: bool = True) -> None:
    """This process joins the world as ``rank``: on GPU ``rank`` with NCCL (the device bound
    at init), or with gloo on the CPU, through ``tcp://127.0.0.1:port``."""
    import torch
    import torch.distributed as dist

    if not cuda:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        return
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )


def run_on_gpus(fn: Callable[..., Any], world: int, *args: Any) -> int:
    """``fn(rank, *args)`` on ``world`` local GPUs, one NCCL rank each, the process group torn
    down by ``destroy_process_group()`` when ``fn`` returns or raises; 1 (with a message)
    when there are fewer GPUs."""
    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < world:
        print(f"needs {world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    mp.spawn(_gpu_rank, args=(world, free_port(), fn, args), nprocs=world, join=True)
    return 0


def _gpu_rank(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    join(rank, world, port)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(target: Callable[..., Any], world: int, *args: Any) -> tuple[Any, list[Any]]:
    """``world`` processes (spawned, started) running ``target(rank, world, port, *args,
    queue)``: the queue, for rank 0's results, and the processes."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    return queue, procs


def rank0_results(queue: Any, procs: list[Any], limit: float = 1500.0) -> Any:
    """What rank 0 put on ``queue``; exits with an error as soon as a rank died without
    them, or after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=2.0)
        except queues.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"ranks died before reporting (rank, exit code): {dead}") from None
    raise SystemExit(f"no results within {limit:.0f} s")


def exit_times(procs: list[Any], results_at: float, limit: float = 120.0) -> list[float | None]:
    """Seconds from rank 0 handing over its results (its last line, at ``results_at`` on
    ``time.monotonic()``) to each rank's exit; None for a rank still alive after ``limit``
    seconds (then killed)."""
    exits: list[float | None] = []
    for p in procs:
        p.join(timeout=max(0.0, results_at + limit - time.monotonic()))
        exits.append(round(time.monotonic() - results_at, 2) if not p.is_alive() else None)
    for p in procs:
        if p.is_alive():
            p.kill()
    return exits


def max_over_ranks(value: float, digits: int = 1) -> float:
    """The largest ``value`` over the ranks (a step is as slow as its slowest rank), rounded."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return round(float(t.item()), digits)
