"""passkit-testing: what a pass author needs to test a passkit pass.

* :func:`run_passes`: compile a function with given passes (eager mode or Inductor) and get
  the outputs, the report and the graph before/after each pass.
* :func:`stage_graphs`, :func:`print_stage_graphs`: the graph each stage of torch.compile
  hands to passes for a given function (what a pass at that stage can match).
* :func:`count_ops`, :func:`assert_op_count`, :func:`assert_replaced`: ops in graphs.
* :func:`assert_close`, :func:`assert_no_worse_than`: dtype-aware numerical checks.
* :func:`fake_world`, :func:`gloo_world`: distributed worlds for CPU tests.
* :func:`run_world_program`: a whole program run as every rank of a world, as users run it
  (first compile of a fresh process, its own exit), hangs killed and reported.
* :func:`check_pass`, :func:`conformance_tests`: the properties every pass must have.

Installing the distribution also installs a pytest plugin (fixtures ``passkit_harness``,
``fake_world``, ``gloo_world``, ``passkit_isolated_plugins``; markers ``gpu``, ``slow``,
``requires_gpus(n)``).

Names are imported from their submodules on first use, so that pytest loading the plugin
(which imports this package) does not import torch in sessions that never use them. For
precise static types, import from the submodules (``passkit_testing.harness``, ...).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {
    "harness": (
        "HarnessResult",
        "PassGraphs",
        "PassSpec",
        "copy_graph_module",
        "resolve_passes",
        "run_passes",
    ),
    "conformance": (
        "PROPERTIES",
        "ConformanceError",
        "PassChecker",
        "PropertyResult",
        "Sample",
        "check_pass",
        "conformance_tests",
    ),
    "graphs": (
        "GraphLike",
        "OpLike",
        "assert_op_count",
        "assert_replaced",
        "count_ops",
        "find_ops",
        "op_counts",
        "op_name",
    ),
    "programs": ("ProgramRun", "RankProgram", "run_world_program"),
    "stages": ("STAGES", "print_stage_graphs", "stage_graphs"),
    "numerics": ("assert_close", "assert_no_worse_than", "relative_error", "tolerances"),
    "worlds": (
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
    ),
    "replay": ("gradients", "load_graph", "make_inputs", "replay_pass"),
}
"""Submodule -> the public names it defines (each submodule's ``__all__``)."""

_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
