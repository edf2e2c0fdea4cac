"""The GPU suite runs as one command, several modules at a time (``benchmarks/gpu_gate.sh``'s
``suite`` step: ``pytest tests/gpu -n N --dist loadgroup``). A module whose tests share one
world (a module-scoped fixture that runs every scenario once) keeps its tests on one xdist
worker, so the world is set up once; the users'-order cases, each its own program, spread."""

from __future__ import annotations

import pytest

SPREAD = {"test_users_order_gpu"}
"""Modules whose tests are independent programs: xdist may spread them over its workers."""


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist registers the marker; without it (CI, a CPU) the marker is inert but known
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rpartition(".")[2] if item.module else ""
        if module not in SPREAD:
            item.add_marker(pytest.mark.xdist_group(module))
