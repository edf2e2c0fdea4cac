"""The ``passkit tune`` command: its arguments, and the run on N local GPUs.

:func:`run_tune` spawns one process per GPU in an NCCL world, calls the ``tune`` function
it is handed once per hidden size (collectively, on every rank), merges the tables and has
rank 0 save them where :func:`~passkit_fusion.tuning.tables.default_table` finds them. What
is measured belongs to the pass: the plugin hands in
:func:`passkit_fusion.allreduce_rmsnorm.tune.tune` and the runtime's cleanup, so this module
imports no pass.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from passkit import PasskitError

from .tables import DEFAULT_MARGIN, DEFAULT_TUNE_TOKENS, USER_TABLES_DIR, Table, save_table

__all__ = ["TUNE_HELP", "Tuner", "add_tune_arguments", "run_tune"]

TUNE_HELP = "Measure fused vs unfused all-reduce+RMSNorm on this machine's GPUs and store a decision table."


class Tuner(Protocol):
    """Measure one hidden size on an initialised process group; collective over ``group``."""

    def __call__(
        self, group: Any, hidden: int, dtype: torch.dtype, token_counts: Sequence[int], *, margin: float
    ) -> Table: ...


def run_tune(args: argparse.Namespace, tune: Tuner, cleanup: Callable[[], object]) -> int:
    """Run ``passkit tune`` with parsed arguments (see :func:`add_tune_arguments`).

    ``tune`` measures a table per hidden size on every rank; ``cleanup`` runs on every rank
    before its process group is destroyed (e.g. freeing the workspaces ``tune`` created).
    Both must be importable module-level functions (they travel to spawned processes)."""
    if args.output is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        slug = "-".join("".join(c if c.isalnum() else " " for c in gpu.lower()).split())
        args.output = USER_TABLES_DIR / f"{slug}_w{args.world_size or torch.cuda.device_count()}.json"
    available = torch.cuda.device_count()
    world_size = args.world_size or available
    if not 2 <= world_size <= available:
        raise PasskitError(
            f"needs 2 to {available} local CUDA GPUs (this machine has {available}); asked for {world_size}"
        )
    import torch.multiprocessing as mp

    mp.spawn(_tune_worker, args=(world_size, _free_port(), args, tune, cleanup), nprocs=world_size, join=True)
    print(f"wrote {args.output}")
    return 0


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=0, help="GPUs to use (default: all local GPUs)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TUNE_TOKENS))
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"table file (default: {USER_TABLES_DIR}/<gpu>_w<N>.json, "
        "which the fused op loads automatically)",
    )


def _tune_worker(
    rank: int,
    world_size: int,
    port: int,
    args: argparse.Namespace,
    tune: Tuner,
    cleanup: Callable[[], object],
) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        device_id=torch.device("cuda", rank),
    )
    try:
        group = dist.group.WORLD
        table = Table()
        for hidden in args.hidden:
            table = table.merged(
                tune(group, hidden, getattr(torch, args.dtype), args.tokens, margin=args.margin)
            )
        if rank == 0:
            save_table(table, args.output)
    finally:
        cleanup()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
