"""The passes a compile runs without because Inductor failed on the graph they changed.

The state :mod:`passkit._compile.inductor_failures` (which retries a failed compile) shares with
:mod:`passkit._pipeline.run` (which runs the passes): which passes the compile under way leaves
out (:func:`left_out`, set by :func:`leaving_out`), and the reports a guarded compile watches
(:data:`watching`, filled by :func:`opened`). A module of its own so that the pipeline reads
it without importing the retry logic, which reads the pipeline.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..report import Report


@dataclasses.dataclass(frozen=True)
class LeftOut:
    """A pass left out of a compile because Inductor failed on the graph it changed."""

    reason: str
    reproducer: str | None = None


_EMPTY: Mapping[str, LeftOut] = MappingProxyType({})
_left_out: contextvars.ContextVar[Mapping[str, LeftOut]] = contextvars.ContextVar(
    "passkit_left_out_after_inductor_failure", default=_EMPTY
)
watching: contextvars.ContextVar[list[Report] | None] = contextvars.ContextVar(
    "passkit_reports_of_guarded_compile", default=None
)
"""The reports the pipeline opens during the guarded compile under way (None: none is)."""


def left_out() -> Mapping[str, LeftOut]:
    """Passes the compile under way runs without (pass name -> why), because Inductor
    failed on the graph they changed in an earlier attempt of the same compile."""
    return _left_out.get()


def opened(report: Report) -> None:
    """Called by the pipeline for each report it opens: a guarded compile watches them."""
    watched = watching.get()
    if watched is not None:
        watched.append(report)


@contextlib.contextmanager
def leaving_out(passes: Mapping[str, LeftOut]) -> Iterator[None]:
    """Within the block, pipelines run without ``passes`` (recorded ``failed``); their
    cache identity includes them."""
    token = _left_out.set(MappingProxyType({**_left_out.get(), **passes}))
    try:
        yield
    finally:
        _left_out.reset(token)


__all__ = ["LeftOut", "leaving_out", "left_out", "opened", "watching"]
