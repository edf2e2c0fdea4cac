"""The graph as it was before the next pass: what a failing pass is undone to, and what its
change and its outputs are measured against.

A :class:`Baseline` is a snapshot (:func:`passkit.graph_utils.snapshot`), a fingerprint
(:func:`passkit._pipeline.graph_diff.fingerprint`) taken at the same moment and the output signatures
(:func:`passkit._pipeline.output_check.outputs`). Taking one costs a copy of the graph; most passes
find nothing to do on most graphs, so :class:`Baselines` keeps the same baseline from one
pass to the next for as long as the graph does not change, and takes a new one only before a
pass that follows a change. A pass then costs one measurement of what it changed
(``benchmarks/output_check.py``), not a copy of the graph.

Plugin hooks run between passes (``passkit_before_pass``, ``passkit_after_pass``) may touch
the graph too: when any is implemented, a kept baseline is checked against the graph (one
more measurement) before it is used again.

The baseline follows the :class:`~torch.fx.GraphModule`, not a graph object: a pass may
install a new graph (``gm.graph = new_graph``, a normal FX idiom), and then its change is
measured on the graph the module now holds (every node new), and a restore puts the
baseline's graph object back into the module, with its nodes and its code.
"""

from __future__ import annotations

import dataclasses

import torch.fx

from ..graph_utils import restore, snapshot
from . import graph_diff, output_check


@dataclasses.dataclass
class Baseline:
    saved: torch.fx.Graph
    """An independent copy of the graph (what :meth:`Baselines.restore` puts back)."""
    fingerprint: graph_diff.Fingerprint
    """Of the graph at the moment ``saved`` was taken (same nodes, same order)."""
    outputs: list[output_check.Signature]
    """What the graph returned then."""

    @classmethod
    def take(cls, graph: torch.fx.Graph) -> Baseline:
        return cls(snapshot(graph), graph_diff.fingerprint(graph), output_check.outputs(graph))


class Baselines:
    """The baseline of one module's graph through one stage's passes (see the module
    docstring).

    ``recheck``: something other than the passes may change the graph between passes (a
    plugin hook): a kept baseline is measured against the graph before it is reused.
    """

    def __init__(self, gm: torch.fx.GraphModule, *, recheck: bool = False):
        self.gm = gm
        self.recheck = recheck
        self.graph_object: torch.fx.Graph = gm.graph
        """The graph object the baseline was taken of (what a restore puts back)."""
        self._current: Baseline | None = None
        self.taken = 0
        """How many baselines were taken (a snapshot each): for tests and benchmarks."""

    def before_pass(self) -> Baseline:
        """The baseline for the pass about to run: the kept one if the graph is unchanged."""
        kept = self._current
        stale = (
            kept is not None
            and (self.recheck or self.gm.graph is not self.graph_object)
            and (
                self.gm.graph is not self.graph_object
                or graph_diff.measure(self.graph, kept.fingerprint, kept.saved).modified
            )
        )
        if stale:
            kept = None
        if kept is None:
            self.graph_object = self.gm.graph
            kept = self._current = Baseline.take(self.graph)
            self.taken += 1
        return kept

    @property
    def graph(self) -> torch.fx.Graph:
        """The graph the module holds now (a pass may have installed another)."""
        return self.gm.graph

    def after_pass(self, change: graph_diff.GraphDiff) -> None:
        """The pass kept its change: the baseline no longer describes the graph."""
        if change.modified:
            self._current = None

    def restore(self) -> None:
        """Undo the last pass: the module holds the baseline's graph object again (a pass
        may have installed another), with the baseline's nodes (new node objects, so the
        fingerprint is retaken; the snapshot still describes the graph), and its code is
        regenerated from it."""
        kept = self._current
        if kept is None:
            raise RuntimeError("passkit: no baseline to restore (before_pass was not called)")
        graph = self.graph_object
        restore(graph, kept.saved)
        if self.gm.graph is not graph:
            self.gm.graph = graph  # the setter recompiles: the code that runs is the baseline's
        else:
            self.gm.recompile()
        kept.fingerprint = graph_diff.fingerprint(graph)


__all__ = ["Baseline", "Baselines"]
