"""The ``passkit tune`` and ``passkit tune-model`` commands: arguments, runs on N ranks.

``passkit tune-model`` (:func:`run_tune_model`) measures fuse decisions for the user's
model (:func:`passkit_fusion.tuning.measure.tune_model`) on N local GPUs (NCCL), or on N
CPU processes (gloo, ``--cpu``: plumbing and smoke runs), and stores them where later
compiles of that model find them.

:func:`run_tune` spawns one process per GPU in an NCCL world, calls the ``tune`` function
it is handed once per hidden size (collectively, on every rank), merges the tables and has
rank 0 save them where :func:`~passkit_fusion.tuning.tables.default_table` finds them. What
is measured belongs to the pass: the plugin hands in
:func:`passkit_fusion.allreduce_rmsnorm.tune.tune` and the runtime's cleanup, so this module
imports no pass.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from passkit import PasskitError

from .tables import DEFAULT_MARGIN, DEFAULT_TUNE_TOKENS, USER_TABLES_DIR, Table, save_table

if TYPE_CHECKING:
    import torch

__all__ = [
    "TUNE_HELP",
    "TUNE_MODEL_HELP",
    "Tuner",
    "add_tune_arguments",
    "add_tune_model_arguments",
    "run_tune",
    "run_tune_model",
]

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
    import torch

    if args.output is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        slug = "-".join("".join(c if c.isalnum() else " " for c in gpu.lower()).split())
        args.output = USER_TABLES_DIR / f"{slug}_w{args.world_size or torch.cuda.device_count()}.json"
    check_tune_arguments(args)
    world_size = _world_size(args.world_size, torch.cuda.device_count())
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
    import torch
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


def _world_size(asked: int, available: int, cpu_hint: str = "") -> int:
    """The ranks to run: ``asked`` (0: every local GPU), which must be 2 or more and at most
    ``available``; else a :class:`PasskitError` saying which of the two is wrong."""
    if asked and asked < 2:
        raise PasskitError(f"--world-size {asked}: needs 2 or more ranks{cpu_hint}")
    if available < 2:
        raise PasskitError(f"needs 2 or more local CUDA GPUs; this machine has {available}{cpu_hint}")
    if asked > available:
        raise PasskitError(f"--world-size {asked}: this machine has {available} local CUDA GPUs{cpu_hint}")
    return asked or available


DEFAULT_CPU_RANKS = 2
"""``--cpu`` without ``--world-size``: two gloo ranks (the smallest world a collective pass
changes anything in)."""


def cpu_rank_limit() -> int:
    """The most gloo ranks a ``--cpu`` run may start: one per CPU core this process may run
    on (at least :data:`DEFAULT_CPU_RANKS`). Every rank compiles and runs a model copy, so
    more ranks than cores only thrash (and each costs hundreds of MB)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(DEFAULT_CPU_RANKS, cores)


def _cpu_world_size(asked: int) -> int:
    """The gloo ranks of a ``--cpu`` run: ``asked`` (0: :data:`DEFAULT_CPU_RANKS`), 2 or more
    and at most :func:`cpu_rank_limit`; else a :class:`PasskitError` naming the bound."""
    if asked and asked < 2:
        raise PasskitError(f"--world-size {asked}: needs 2 or more ranks")
    limit = cpu_rank_limit()
    if asked > limit:
        raise PasskitError(
            f"--world-size {asked} --cpu: at most {limit} gloo ranks here (one per CPU core this "
            f"process may use); give --world-size {limit} or less"
        )
    return asked or DEFAULT_CPU_RANKS


def _positive_ints(flag: str, values: Sequence[int]) -> None:
    bad = [v for v in values if v < 1]
    if bad:
        raise PasskitError(
            f"{flag} {' '.join(map(str, values))}: every value must be 1 or more (got {bad[0]})"
        )


def _finite(flag: str, value: float, *, low: float, high: float, low_open: bool = False) -> None:
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"{'more than' if low_open else 'at least'} {low:g} and at most {high:g}"
        raise PasskitError(f"{flag} {value!r}: must be a finite number {bound}")


MAX_BUDGET_S = 7 * 24 * 3600.0
"""The largest ``--budget`` taken (a week): a budget bounds how long the ranks measure."""


def check_tune_arguments(args: argparse.Namespace) -> None:
    """``passkit tune``'s numbers checked before any process starts."""
    if args.world_size < 0:
        raise PasskitError(f"--world-size {args.world_size}: needs 2 or more ranks")
    _positive_ints("--hidden", args.hidden)
    _positive_ints("--tokens", args.tokens)
    _finite("--margin", args.margin, low=0.0, high=1.0)


def check_tune_model_arguments(args: argparse.Namespace) -> None:
    """``passkit tune-model``'s arguments checked before any process starts: a wrong one is a
    :class:`PasskitError` naming the flag."""
    if args.world_size < 0:
        raise PasskitError(f"--world-size {args.world_size}: needs 2 or more ranks")
    _positive_ints("--tokens", args.tokens)
    _finite("--budget", args.budget, low=0.0, high=MAX_BUDGET_S, low_open=True)
    _finite("--margin", args.margin, low=0.0, high=1.0)
    for candidate in args.candidates or ():
        names = candidate.split("+")
        if not all(n.strip() for n in names):
            raise PasskitError(
                f"--candidates {candidate!r}: an empty pass name (write pass names joined by '+', "
                "e.g. sequence_parallel+async_tp)"
            )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


TUNE_MODEL_HELP = (
    "Measure which fusion passes pay in which token range on your model and this machine, "
    "and store the decision later compiles use."
)


def add_tune_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target",
        help="module:function building the model on each rank: function(rank, world_size, device) "
        "-> passkit_fusion.tuning.measure.Target (e.g. passkit_fusion.model:tuning_target)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=0,
        help=f"ranks (default: all local GPUs; {DEFAULT_CPU_RANKS} with --cpu, at most one per CPU core)",
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TUNE_TOKENS))
    parser.add_argument("--budget", type=float, default=600.0, help="seconds of measuring (default 600)")
    parser.add_argument(
        "--margin", type=float, default=0.01, help="ties within this fraction go to fewer passes"
    )
    parser.add_argument(
        "--candidates",
        nargs="+",
        default=None,
        help="pass sets to time besides Inductor, each as names joined by '+' (default: each pass, "
        "sequence_parallel+async_tp, all of them)",
    )
    parser.add_argument("--mode", choices=["inductor", "eager"], default="inductor")
    parser.add_argument(
        "--compile-mode",
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        default=None,
        help="torch.compile's mode for every candidate, as your program compiles the model "
        "(reduce-overhead: calls timed with their own CUDA graphs)",
    )
    parser.add_argument(
        "--timing",
        choices=["graphs", "calls"],
        default=None,
        help="how each candidate is timed on GPUs: graphs (CUDA-graph replays, the host's time not "
        "counted: for a program that replays the model in its own CUDA graphs; the default without "
        "reduce-overhead) or calls (each call as it runs, its host time counted: for a program that "
        "calls the model without CUDA graphs; the default with reduce-overhead)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="gloo ranks on the CPU, wall-clock timing (smoke runs)"
    )


def run_tune_model(args: argparse.Namespace) -> int:
    """Run ``passkit tune-model`` with parsed arguments: one process per rank."""
    import torch

    from passkit.cli import import_target

    from .measure import resolve_timing

    check_tune_model_arguments(args)
    resolve_timing(args.compile_mode, args.timing)  # a conflict fails here, before any rank starts
    # loaded here to fail early (the working directory importable, as for `passkit explain`);
    # each rank loads it again (spawned processes inherit this sys.path)
    factory = import_target(args.target)
    if not callable(factory):
        raise PasskitError(f"{args.target} is a {type(factory).__name__}, not a function")
    _check_factory_signature(args.target, factory)  # before any rank starts: one line, not N tracebacks
    if args.cpu:
        world_size = _cpu_world_size(args.world_size)
    else:
        world_size = _world_size(
            args.world_size, torch.cuda.device_count(), " (--cpu runs gloo ranks instead)"
        )
    import torch.multiprocessing as mp

    del factory
    with tempfile.TemporaryDirectory(prefix="passkit-tune-model-") as errors:
        try:
            mp.spawn(
                _tune_model_worker,
                args=(world_size, _free_port(), args, errors),
                nprocs=world_size,
                join=True,
            )
        except Exception:
            named = _rank_error(Path(errors))
            if named is None:
                raise
            raise PasskitError(named) from None
    return 0


def _check_factory_signature(target: str, factory: Any) -> None:
    """A :class:`PasskitError` naming ``target`` when it cannot be called as each rank calls
    it, ``factory(rank, world_size, device)``."""
    import inspect

    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (a builtin): the ranks will say
        return
    try:
        signature.bind(0, 1, "cpu")
    except TypeError as exc:
        raise PasskitError(
            f"{target}{signature} cannot be called as each rank calls it, "
            f"{target.rpartition(':')[2]}(rank, world_size, device): {exc}"
        ) from None


def _rank_error(folder: Path) -> str | None:
    """The first named error (:class:`PasskitError`) a rank wrote into ``folder``, or None."""
    for path in sorted(folder.glob("rank*.txt")):
        text = path.read_text(errors="replace").strip()
        if text:
            return text
    return None


def _tune_model_worker(rank: int, world_size: int, port: int, args: argparse.Namespace, errors: str) -> None:
    """One rank of ``passkit tune-model``; a :class:`PasskitError` (the user's mistake, named)
    is written to ``errors`` for the parent's one-line error before it ends the rank."""
    try:
        _tune_model_rank(rank, world_size, port, args)
    except PasskitError as exc:
        Path(errors, f"rank{rank}.txt").write_text(f"rank {rank}: {exc}" if world_size > 1 else str(exc))
        raise


def _tune_model_rank(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from passkit.cli import import_target

    from .measure import tune_model

    factory = import_target(args.target)
    device = "cpu" if args.cpu else "cuda"
    kwargs: dict[str, Any] = {}
    if not args.cpu:
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        "gloo" if args.cpu else "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        **kwargs,
    )
    try:
        target = factory(rank, world_size, device)
        missing = [a for a in ("model", "inputs", "passes") if not hasattr(target, a)]
        if missing:
            raise PasskitError(
                f"{args.target}(rank, world_size, device) returned {type(target).__name__}, not a "
                "passkit_fusion.tuning.measure.Target (model, inputs, passes)"
            )
        candidates = [c.split("+") for c in args.candidates] if args.candidates else None
        result = tune_model(
            target.model,
            target.inputs,
            target.passes,
            token_counts=args.tokens,
            budget_s=args.budget,
            candidates=candidates,
            margin=args.margin,
            mark_dynamic=target.mark_dynamic,
            mode=args.mode,
            compile_mode=args.compile_mode,
            timing=args.timing,
        )
        if rank == 0:
            print(result.format(), flush=True)
    finally:
        dist.destroy_process_group()
