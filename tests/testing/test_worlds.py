"""Tests of passkit_testing.worlds.

The rank functions are module-level so that the ranks' spawned interpreters can import them;
every rank imports this module, so it imports nothing heavy (torch._dynamo) at module level.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx
from passkit_testing.graphs import count_ops
from passkit_testing.worlds import (
    SEED,
    GlooWorldError,
    fake_world,
    gloo_world,
    nccl_world,
    requires_gpus,
    run_in_gloo_world,
    run_in_nccl_world,
)

# --------------------------------------------------------------------------- rank functions


def _all_reduce_ranks(rank: int, world_size: int) -> torch.Tensor:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t


def _report_rank_setup(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "sum": _all_reduce_ranks(rank, world_size),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "random": torch.rand(3),
        "env": os.environ.get("PASSKIT_WORLD_TEST"),
        "nvls": os.environ.get("NCCL_NVLS_ENABLE"),
    }


def _raise_on_rank_1(rank: int, world_size: int) -> torch.Tensor:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    return _all_reduce_ranks(rank, world_size)  # waits for rank 1, which never joins


def _hang_on_rank_1(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    dist.barrier()  # both ranks connected: rank 0 leaving first must not fail rank 1's setup
    if rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL stops this one
        time.sleep(3600)
    return rank


def _exit_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def _fail_with_message(rank: int, world_size: int, message: str) -> None:
    raise RuntimeError(message)


def _all_reduce_on_gpu(rank: int, world_size: int) -> torch.Tensor:
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    return t


# --------------------------------------------------------------------------- fake world


def _forward_graphs(fn: Callable[..., Any], *inputs: torch.Tensor) -> list[torch.fx.GraphModule]:
    """Compile ``fn`` like ``backend="aot_eager"`` does and return the forward ATen graphs."""
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(fn, backend=aot_autograd(fw_compiler=record), fullgraph=True)(*inputs)
    return graphs


def test_fake_world_sets_up_and_tears_down_a_process_group() -> None:
    with fake_world(world_size=4, rank=3) as world:
        assert (dist.get_world_size(), dist.get_rank(), dist.get_backend()) == (4, 3, "fake")
        assert (world.world_size, world.rank) == (4, 3)
        assert world.group is dist.group.WORLD
        assert world.group_name == world.group.group_name
    assert not dist.is_initialized()


@pytest.mark.parametrize("by_name", [False, True], ids=["group", "group_name"])
def test_fake_world_traces_functional_all_reduce(by_name: bool) -> None:
    with fake_world(world_size=2) as world:
        group = world.group_name if by_name else world.group

        def fn(x: torch.Tensor) -> torch.Tensor:
            return funcol.all_reduce(x * 2, "sum", group) + 1

        (graph,) = _forward_graphs(fn, torch.randn(8))
    assert count_ops(graph, "_c10d_functional.all_reduce") == 1
    assert count_ops(graph, "_c10d_functional.wait_tensor") == 1


def test_fake_world_mesh_traces_tensor_parallel_modules() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with fake_world(world_size=4) as world:
        assert world.mesh is world.mesh  # created once
        assert world.mesh.size() == 4
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        parallelize_module(mlp, world.mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        (graph,) = _forward_graphs(mlp, torch.randn(2, 8))
    assert count_ops(graph, "aten.addmm") == 2
    assert count_ops(graph, "_c10d_functional.all_reduce") == 1  # after the row-wise linear


def test_fake_world_refuses_an_initialised_process_group() -> None:
    with fake_world(world_size=2):
        with pytest.raises(RuntimeError, match="already exists"), fake_world(world_size=4):
            pass
        assert dist.get_world_size() == 2  # the outer world is untouched


def test_fake_world_cleans_up_after_an_exception() -> None:
    with pytest.raises(ZeroDivisionError), fake_world():
        _ = 1 / 0
    assert not dist.is_initialized()


@pytest.mark.parametrize(("world_size", "rank"), [(0, 0), (2, 2), (2, -1)])
def test_fake_world_rejects_bad_ranks(world_size: int, rank: int) -> None:
    with pytest.raises(ValueError, match="0 <= rank < world_size"), fake_world(world_size, rank):
        pass


# --------------------------------------------------------------------------- gloo worlds


def test_gloo_world_runs_every_rank_with_the_same_setup() -> None:
    values = gloo_world(_report_rank_setup, 2, env={"PASSKIT_WORLD_TEST": "hello"})
    expected_random = torch.rand(3, generator=torch.Generator().manual_seed(SEED))
    for value in values:
        assert torch.equal(value["sum"], torch.tensor([3.0]))
        assert value["backend"] == "gloo"
        assert value["threads"] == 1
        assert torch.equal(value["random"], expected_random)
        assert value["env"] == "hello"
        assert value["nvls"] == "0"


@pytest.mark.parametrize("world_size", [4, 8])
def test_gloo_worlds_of_4_and_8_ranks_all_reduce(world_size: int) -> None:
    expected = torch.tensor([world_size * (world_size + 1) / 2])
    assert all(torch.equal(v, expected) for v in gloo_world(_all_reduce_ranks, world_size))


def test_a_raising_rank_is_reported_with_its_traceback() -> None:
    results = run_in_gloo_world(_raise_on_rank_1, 2, timeout=300)
    assert [r.rank for r in results] == [0, 1]
    assert results[1].error == "ValueError: rank 1 fails on purpose"
    assert (
        results[1].traceback is not None
        and 'raise ValueError("rank 1 fails on purpose")' in results[1].traceback
    )
    assert not results[0].ok  # failed in all_reduce, or timed out


def test_gloo_world_raises_with_every_failed_rank() -> None:
    with pytest.raises(
        GlooWorldError, match=r"1 of 1 ranks failed in a gloo world\n--- rank 0: RuntimeError: bad"
    ) as info:
        gloo_world(_fail_with_message, 1, args=("bad",))
    assert "Traceback" in str(info.value)
    assert [r.error for r in info.value.results] == ["RuntimeError: bad"]


def test_a_hung_rank_is_killed_at_the_timeout() -> None:
    start = time.monotonic()
    results = run_in_gloo_world(_hang_on_rank_1, 2, timeout=30)
    elapsed = time.monotonic() - start
    # rank 0 returns at once; on a loaded machine its start alone may outlast the timeout
    assert (results[0].ok and results[0].value == 0) or results[0].error == "timed out after 30s"
    assert results[1].error == "timed out after 30s"
    # not before the timeout; after it, SIGKILL ends a rank that ignores SIGTERM (without it
    # the call would never return: the upper bound is a hang limit, not a stopwatch)
    assert 30 <= elapsed < 30 + 120


def test_a_rank_that_dies_without_a_result_is_reported() -> None:
    results = run_in_gloo_world(_exit_on_rank_1, 2, timeout=300)
    assert results[0].ok
    assert results[1].error == "exited with code 3 without reporting a result"


def test_unpicklable_functions_are_refused_before_spawning() -> None:
    with pytest.raises(TypeError, match="must be picklable"):
        run_in_gloo_world(lambda rank, world_size: rank, 2)


@pytest.mark.parametrize(("world_size", "timeout"), [(0, 1.0), (2, 0.0)])
def test_bad_world_arguments_are_refused(world_size: int, timeout: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        run_in_gloo_world(_all_reduce_ranks, world_size, timeout=timeout)


# --------------------------------------------------------------------------- nccl worlds


@requires_gpus(2)
def test_nccl_world_all_reduces_on_gpus() -> None:
    values = nccl_world(_all_reduce_on_gpu, 2, timeout=300)
    assert all(torch.equal(v, torch.full((4,), 3.0)) for v in values)


def test_requires_gpus_skips_with_the_counts() -> None:
    found = torch.cuda.device_count()
    mark = requires_gpus(found + 1)
    assert mark.args == (True,)
    assert mark.kwargs["reason"] == f"needs {found + 1} CUDA GPUs, found {found}"
    assert requires_gpus(found).args == (False,)


def test_nccl_world_refuses_to_start_without_enough_gpus() -> None:
    with pytest.raises(RuntimeError, match=r"NCCL|GPUs"):
        run_in_nccl_world(_all_reduce_on_gpu, torch.cuda.device_count() + 1)
