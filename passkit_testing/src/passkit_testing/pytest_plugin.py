"""The pytest plugin of passkit-testing (entry point ``passkit`` in the ``pytest11`` group).

Installing ``passkit-testing`` makes these available in every test session:

Fixtures
    ``passkit_harness``: :func:`passkit_testing.run_passes`.
    ``fake_world``: a fake 2-rank process group (rank 0) for the test's duration; other sizes
    through indirect parametrization: ``@pytest.mark.parametrize("fake_world", [4,
    {"world_size": 4, "rank": 1}], indirect=True)``.
    ``gloo_world``: :func:`passkit_testing.gloo_world`, to run a function on every rank of a
    real gloo world of processes.
    ``passkit_isolated_plugins``: the test sees only the plugins installed through entry
    points, plus what it registers; registrations are undone and discovery is redone after.

Markers
    ``gpu``: needs a CUDA GPU. ``requires_gpus(n)``: needs ``n`` CUDA GPUs. Both skip the
    test when fewer are visible. ``slow``: a test taking over ~15 s on a 2-core machine
    (deselect with ``-m "not slow"``).

Logs
    pytest attaches its log capture to every logger that does not propagate, torch's
    structured-trace logger ``torch.__trace`` included, which turns torch's structured
    tracing on (it then serializes graphs at every compile) and fills a failing test's
    "Captured log" with dozens of empty ``DEBUG torch.__trace`` lines (the trace's payload is
    not in the message). The plugin takes pytest's handlers off that one logger during each
    test; passkit's log (``passkit``) and every other logger are captured as before.

torch and passkit are imported only when a fixture or marker needs them: loading the plugin
costs nothing in sessions that do not use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .worlds import FakeWorld

MARKERS = (
    "gpu: needs a CUDA GPU; skipped when none is visible",
    "requires_gpus(n): needs at least n CUDA GPUs; skipped when fewer are visible",
    "slow: takes over ~15 s on a 2-core machine; deselect with -m 'not slow'",
)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Turn ``gpu`` and ``requires_gpus(n)`` into skip conditions on the GPU count."""
    for item in items:
        needed = [_gpus_needed(item, marker) for marker in item.iter_markers("requires_gpus")]
        if item.get_closest_marker("gpu") is not None:
            needed.append(1)
        if needed:
            from .worlds import requires_gpus

            item.add_marker(requires_gpus(max(needed)))


TORCH_TRACE_LOGGER = "torch.__trace"
"""torch's structured-trace logger (``TORCH_TRACE``, tlparse): records without a message."""


def _uncapture_torch_trace(config: pytest.Config) -> None:
    """Take pytest's log-capture handlers off :data:`TORCH_TRACE_LOGGER` (its own handlers,
    ``TORCH_TRACE``'s file, stay)."""
    logging_plugin = config.pluginmanager.get_plugin("logging-plugin")
    if logging_plugin is None:
        return
    pytests = {
        id(getattr(logging_plugin, attr, None))
        for attr in ("caplog_handler", "report_handler", "log_cli_handler", "log_file_handler")
    }
    trace = logging.getLogger(TORCH_TRACE_LOGGER)
    for handler in [h for h in trace.handlers if id(h) in pytests]:
        trace.removeHandler(handler)


# innermost of the wrappers: after pytest's logging plugin attached its handlers for the phase
@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _uncapture_torch_trace(item.config)
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _uncapture_torch_trace(item.config)
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    _uncapture_torch_trace(item.config)
    return (yield)


def _gpus_needed(item: pytest.Item, marker: pytest.Mark) -> int:
    n = marker.args[0] if len(marker.args) == 1 and not marker.kwargs else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise pytest.UsageError(
            f"{item.nodeid}: requires_gpus takes one positive int, the number of GPUs "
            f"(@pytest.mark.requires_gpus(2)); got args={marker.args} kwargs={marker.kwargs}"
        )
    return n


@pytest.fixture
def passkit_harness() -> Callable[..., Any]:
    """:func:`passkit_testing.run_passes`: compile with given passes and see what they did."""
    from .harness import run_passes

    return run_passes


@pytest.fixture
def fake_world(request: pytest.FixtureRequest) -> Iterator[FakeWorld]:
    """A fake process group for the test: 2 ranks, this process rank 0, by default.

    Parametrize indirectly with a world size or ``{"world_size": ..., "rank": ...}``.
    """
    from .worlds import fake_world as make_fake_world

    param = getattr(request, "param", {})
    options = {"world_size": param} if isinstance(param, int) else dict(param)
    with make_fake_world(**options) as world:
        yield world


@pytest.fixture
def gloo_world() -> Callable[..., list[Any]]:
    """:func:`passkit_testing.gloo_world`: ``gloo_world(fn, world_size)`` runs
    ``fn(rank, world_size)`` on every rank of a gloo world and returns their values."""
    from .worlds import gloo_world as run_gloo_world

    return run_gloo_world


@pytest.fixture
def passkit_isolated_plugins() -> Iterator[None]:
    """Only entry-point plugins, plus what the test registers with ``passkit.register``.

    In-process registrations made before the test are hidden during it and restored after;
    those the test makes are undone. Plugin discovery is redone on both sides, so a
    distribution installed by the test is seen, and forgotten afterwards.
    """
    from passkit import plugins

    with plugins.isolated():
        yield
