"""Run a benchmark's function on ``world`` local GPUs, one NCCL rank each: spawned, the
device set, the process group up on a free loopback port, torn down by
``destroy_process_group()`` when the function returns or raises (no ``os._exit``)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_gpus(fn: Callable[..., Any], world: int, *args: Any) -> int:
    """``fn(rank, *args)`` on every rank; 1 (with a message) when there are fewer GPUs."""
    if torch.cuda.device_count() < world:
        print(f"needs {world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(world, port, fn, args), nprocs=world, join=True)
    return 0


def _rank(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
