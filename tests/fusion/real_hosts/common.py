"""What both host checks share: a fake 2-rank world, a coordinator registered in the
host's ``_groups`` under ``"tp:0"``, the inputs, and running a pass on a block."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

import passkit

EPS = 1e-6
PASSES = (
    {"name": "allreduce_rmsnorm", "implementation": "reference"},
    {"name": "sequence_parallel", "min_tokens": 1},
)


class Coordinator:
    """What the dialects (and SGLang's ops) read of a host's ``GroupCoordinator``."""

    unique_name = "tp:0"

    def __init__(self) -> None:
        self.device_group = dist.group.WORLD

    def _all_reduce_in_place(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.device_group)

    def _all_reduce_out_place(self, t: torch.Tensor, method: str = "") -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=self.device_group)
        return t


def fake_world(parallel_state: ModuleType) -> Coordinator:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    coordinator = Coordinator()
    parallel_state._groups["tp:0"] = weakref.ref(coordinator)  # as GroupCoordinator registers
    return coordinator


def inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(8, 64, generator=g).bfloat16() for _ in range(2))
    return x, r, torch.ones(64).bfloat16(), (0.1 * torch.randn(64, 64, generator=g)).bfloat16()


def check(fn: Callable[..., Any], sites: int, problems: list[str]) -> None:
    """Print and assert: no schema problem, ``sites`` matched by each pass."""
    print("schemas:", problems or "all match")
    assert not problems, problems
    for spec in PASSES:
        torch._dynamo.reset()
        backend = passkit.backend(passes=[spec], mode="eager", verify=True, on_error="raise")
        torch.compile(fn, backend=backend, fullgraph=True)(*inputs())
        record = backend.reports[0][spec["name"]]
        print(spec["name"], "matches", record.matches, record.notes)
        assert record.matches == sites, f"{spec['name']}: expected {sites} sites, matched {record.matches}"
