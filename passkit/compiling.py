"""The graph a backend is compiling, for passes that key stored decisions by it.

A pass's :meth:`~passkit.Pass.token_constraint` sees only a :class:`~passkit.CompileContext`
(device, dtype, world size), not the graph: a decision measured for one model (e.g.
passkit-fusion's measured fuse decisions) must not apply to another. While a backend
compiles a Dynamo graph it opens :func:`scope`; passes read :func:`current`: the graph's
:func:`fingerprint` and the identities of the pipeline's passes (names, versions, options,
sources), both the same on every rank and in every process that compiles the same model
with the same passes.

:class:`passkit.Backend` opens the scope around each compile; :func:`scoped` wraps any
other backend callable so that it does too.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

if TYPE_CHECKING:
    from ._pipeline.build import Pipeline


class Compiling:
    """What is being compiled: ``graph`` (:func:`fingerprint` of the Dynamo graph) and
    ``passes`` (:func:`pass_identities` of the pipeline compiling it).

    Each is computed at its first read (:meth:`of`): a compile whose passes read neither (no
    pass enabled, or none that can run here, as the TP passes at world size 1) pays for
    neither (the fingerprint generates the graph's code)."""

    __slots__ = ("_graph", "_passes")

    def __init__(
        self,
        graph: str | Callable[[], str],
        passes: tuple[dict[str, Any], ...] | Callable[[], tuple[dict[str, Any], ...]],
    ):
        self._graph = graph
        self._passes = passes

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pipeline: Pipeline) -> Compiling:
        """``gm`` compiled by ``pipeline``, fingerprinted and identified when first read."""
        return cls(lambda: fingerprint(gm, example_inputs), lambda: pass_identities(pipeline))

    @property
    def graph(self) -> str:
        if callable(self._graph):
            self._graph = self._graph()  # the graph module is no longer held
        return self._graph

    @property
    def passes(self) -> tuple[dict[str, Any], ...]:
        if callable(self._passes):
            self._passes = self._passes()
        return self._passes

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Compiling):
            return NotImplemented
        return (self.graph, self.passes) == (other.graph, other.passes)

    def __hash__(self) -> int:
        return hash((self.graph, json.dumps(self.passes, sort_keys=True, default=str)))

    def __repr__(self) -> str:
        return f"Compiling(graph={self.graph!r}, passes={self.passes!r})"


_current: contextvars.ContextVar[Compiling | None] = contextvars.ContextVar("passkit_compiling", default=None)


def current() -> Compiling | None:
    """The compile under way (None outside a backend's :func:`scope`)."""
    return _current.get()


def fingerprint(gm: torch.fx.GraphModule, example_inputs: Sequence[Any] = ()) -> str:
    """A hash of a Dynamo graph: its code and each input's shape (symbolic sizes by name)
    and dtype. Weights' values are not part of it; their shapes are."""
    h = hashlib.sha256(gm.code.encode())
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
    if not any(v is not None for v in values):
        values = list(example_inputs)
    for value in values:
        if isinstance(value, torch.Tensor):
            h.update(f"T{tuple(str(s) for s in value.shape)}:{value.dtype};".encode())
        else:
            h.update(
                f"{type(value).__name__}:{value if isinstance(value, (int, float, bool)) else ''};".encode()
            )
    return h.hexdigest()[:32]


def pass_identities(pipeline: Pipeline) -> tuple[dict[str, Any], ...]:
    """Per pass of ``pipeline``: name, plugin version, options and source hash."""
    out = []
    for p in pipeline.passes:
        info = pipeline.plugins.info_for(p)
        ident = p.identity()
        out.append(
            {
                "name": p.name,
                "version": info.version if info else "in-process",
                "options": json.loads(ident["options"]),
                "source": ident["source"],
            }
        )
    return tuple(out)


@contextlib.contextmanager
def reentered(compiling: Compiling | None) -> Iterator[None]:
    """Within the block, :func:`current` is ``compiling`` again (a compile that happens
    after the backend returned, e.g. a specialization compiled at its first use)."""
    token = _current.set(compiling)
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def scope(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pipeline: Pipeline) -> Iterator[Compiling]:
    """Within the block, :func:`current` is ``gm`` compiled by ``pipeline`` (its fingerprint
    taken at the first read; at once where a pre-grad pass may change ``gm`` in place)."""
    compiling = Compiling.of(gm, example_inputs, pipeline)
    if any(p.stage.value == "pre_grad" for p in pipeline.passes):
        compiling.graph  # noqa: B018  (the graph as Dynamo handed it over)
    token = _current.set(compiling)
    try:
        yield compiling
    finally:
        _current.reset(token)


def scoped(backend: Any) -> Callable[[torch.fx.GraphModule, Sequence[Any]], Any]:
    """``backend`` (a :class:`passkit.Backend`) as a callable that opens :func:`scope`
    around each compile (torch.compile's ``mode``/``options`` are passed on); ``.backend``
    is the wrapped backend. Specializations compiled at their first use
    (``compile_at="first_use"``) compile outside it: until the backend opens the scope
    itself, they see no graph (the tables decide there)."""

    @functools.wraps(backend.__call__)
    def call(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        if _current.get() is not None:
            return backend(gm, example_inputs, **kwargs)
        with scope(gm, example_inputs, backend.pipeline):
            return backend(gm, example_inputs, **kwargs)

    call.backend = backend  # type: ignore[attr-defined]
    return call


__all__ = ["Compiling", "current", "fingerprint", "pass_identities", "reentered", "scope", "scoped"]
