"""The rewrite counter: every rewrite a pass makes can be counted, and refused past a limit.

A pass asks before rewriting each site::

    for site in sites:
        if not ctx.may_rewrite(f"all-reduce {site.name}"):
            continue  # refused: leave the site as it is
        rewrite(site)

With ``bisect_limit`` (``PASSKIT_BISECT_LIMIT``) unset, :func:`may_rewrite` returns True and
counts nothing. With it set to N, the rewrites of a process are numbered 1, 2, ... in compile
order (across graphs, stages, token ranges and passes); the first N are allowed and logged
(``passkit bisect: rewrite 3: pass=..., stage=..., graph=..., site=...``), every later one
refused. ``passkit bisect`` searches that limit for the first rewrite that breaks a model.

:class:`~passkit.PatternPass` counts each match with no code from its author; a pass that never
calls :func:`may_rewrite` is counted once per run (the whole pass is one rewrite: refused, its
change to the graph is undone).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import re
import time
from collections.abc import Iterator

from . import logs

__all__ = ["CountedRewrite", "counted_rewrites", "may_rewrite", "reset"]


@dataclasses.dataclass(frozen=True)
class CountedRewrite:
    """One counted rewrite: its index in the process, who made it, where, and whether the
    limit allowed it."""

    index: int
    pass_name: str
    stage: str
    graph: str
    site: str
    allowed: bool
    location: str = ""
    """Where in the model's source the site's node came from (``model.py:24 in forward``,
    from its ``stack_trace``), when the site names a node of the graph that has one."""

    def line(self) -> str:
        """The log line (``passkit bisect: rewrite 3: pass=..., ...``)."""
        refused = "" if self.allowed else " REFUSED"
        return (
            f"passkit bisect: rewrite {self.index}{refused}: pass={self.pass_name}, stage={self.stage}, "
            f"graph={self.graph}, site={self.site}"
        )

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Scope:
    """The pass running under a limit: who counts, and what it asked so far."""

    limit: int
    pass_name: str
    stage: str
    graph: str
    asked: int = 0
    refused: int = 0
    graph_module: object = None
    nodes: dict[str, object] | None = None


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("passkit_rewrite_scope", default=None)
_counted: list[CountedRewrite] = []
_announced: set[int] = set()

NONCE = f"{os.getpid()}:{time.time_ns()}"
"""Part of a pipeline's cache identity while a limit is set: a compile made under a limit
(which depends on every rewrite counted before it in the process) is never served from a
cache to another process, whatever its limit."""


def may_rewrite(site: str) -> bool:
    """Whether the pass running may rewrite ``site`` (a short description: ``"all-reduce
    all_reduce_3"``, ``"pattern 'mul_add' at add_2"``). Always True with no ``bisect_limit``
    (nothing is counted); else this rewrite gets the next index of the process and is
    allowed while the index is within the limit. A refused site must be left as it was.
    Also :meth:`passkit.CompileContext.may_rewrite`."""
    scope = _scope.get()
    if scope is None:
        return True
    return _count(scope, str(site)).allowed


def _count(scope: _Scope, site: str) -> CountedRewrite:
    scope.asked += 1
    index = len(_counted) + 1
    rewrite = CountedRewrite(
        index, scope.pass_name, scope.stage, scope.graph, site, index <= scope.limit, _location(scope, site)
    )
    _counted.append(rewrite)
    if rewrite.allowed and index == scope.limit:  # the last one allowed: shown without log config
        logs.log.warning("%s (the last allowed: limit %d)", rewrite.line(), scope.limit)
    elif rewrite.allowed:
        logs.log.info("%s", rewrite.line())
    else:
        scope.refused += 1
        if scope.limit not in _announced:
            _announced.add(scope.limit)
            logs.log.warning(
                "passkit bisect: limit %d reached: %s; this and every later rewrite is refused",
                scope.limit,
                rewrite.line().removeprefix("passkit bisect: "),
            )
        else:
            logs.log.debug("%s", rewrite.line())
    return rewrite


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _location(scope: _Scope, site: str) -> str:
    """The source location of the node ``site`` names last (``neg neg_5``, ``pattern 'p' at
    add_2``, ``... all-reduce all_reduce_3``), from its ``stack_trace``; ``""`` without one."""
    gm = scope.graph_module
    if gm is None:
        return ""
    if scope.nodes is None:
        try:
            scope.nodes = {n.name: n for n in gm.graph.nodes}  # type: ignore[attr-defined]
        except Exception:
            scope.nodes = {}
    words = site.replace(",", " ").split()
    node = scope.nodes.get(words[-1]) if words else None
    trace = getattr(node, "meta", {}).get("stack_trace") or ""
    frames = _FRAME.findall(trace)
    if not frames:
        return ""
    path, line, function = frames[-1]
    return f"{path}:{line} in {function}"


@contextlib.contextmanager
def counting(limit: int, pass_name: str, stage: str, graph: str, gm: object = None) -> Iterator[_Scope]:
    """Within the block, :func:`may_rewrite` counts for ``pass_name`` (the runner opens it
    around each pass's ``run`` when a limit is set, with the graph module ``gm``, whose nodes
    the sites name: their source location is recorded)."""
    scope = _Scope(limit, pass_name, stage, graph, graph_module=gm)
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def count_whole_pass(scope: _Scope) -> CountedRewrite:
    """Count a pass that changed the graph without asking (pass granularity)."""
    return _count(scope, "the whole pass (it does not call ctx.may_rewrite)")


def counted_rewrites() -> list[CountedRewrite]:
    """The rewrites counted in this process so far (empty with no limit set), in order."""
    return list(_counted)


def reset() -> None:
    """Start counting from 1 again (tests, a fresh bisect probe in the same process)."""
    _counted.clear()
    _announced.clear()
