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

It holds the module's state beside its graph too (:mod:`passkit._pipeline.module_state`:
attributes, parameters, buffers, submodules, tensor constants and the values of the small
ones): a restore puts the module back whole, and a pass that changed only the module (a
constant written in place) is a change like any other. Checking that state costs a walk of
the module's attributes and version counters per pass (``benchmarks/output_check.py``).
"""

from __future__ import annotations

import dataclasses
import weakref

import torch.fx

from ..graph_utils import restore, snapshot
from . import graph_diff, output_check
from .module_state import ModuleState


@dataclasses.dataclass
class Baseline:
    saved: torch.fx.Graph
    """An independent copy of the graph (what :meth:`Baselines.restore` puts back)."""
    fingerprint: graph_diff.Fingerprint
    """Of the graph at the moment ``saved`` was taken (same nodes, same order)."""
    outputs: list[output_check.Signature]
    """What the graph returned then."""
    module: ModuleState
    """The module's attributes, submodules and tensors then (what a restore puts back)."""

    @classmethod
    def take(cls, gm: torch.fx.GraphModule, reuse: ModuleState | None = None) -> Baseline:
        graph = gm.graph
        return cls(
            snapshot(graph),
            graph_diff.fingerprint(graph),
            output_check.outputs(graph),
            ModuleState.take(gm, reuse),
        )


_LAST_STATES: weakref.WeakKeyDictionary[torch.fx.GraphModule, ModuleState] = weakref.WeakKeyDictionary()
"""Per graph module, the last state taken of it: the stages after the first reuse its copies."""


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
        self._module: ModuleState | None = _LAST_STATES.get(gm)
        """The module state last taken (its tensor copies serve the next one, at this stage
        or the next)."""
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
        if stale or (kept is not None and self.recheck and kept.module.changed(self.gm)):
            kept = None
        if kept is None:
            self.graph_object = self.gm.graph
            kept = self._current = Baseline.take(self.gm, self._module)
            self._module = _LAST_STATES[self.gm] = kept.module
            self.taken += 1
        return kept

    @property
    def graph(self) -> torch.fx.Graph:
        """The graph the module holds now (a pass may have installed another)."""
        return self.gm.graph

    def after_pass(self, change: graph_diff.GraphDiff, module_changed: bool = False) -> None:
        """The pass kept its change: the baseline no longer describes the graph (or the
        module's state)."""
        if change.modified or module_changed:
            self._current = None

    def restore(self) -> list[str]:
        """Undo the last pass: the module's attributes, submodules and tensors as they were
        (:meth:`ModuleState.restore`), the baseline's graph object in it again (a pass may
        have installed another), with the baseline's nodes (new node objects, so the
        fingerprint is retaken; the snapshot still describes the graph), and its code
        regenerated from it. Returns the tensors written in place that could not be put
        back (no copy kept: :meth:`ModuleState.unrestorable`); empty when restored whole."""
        kept = self._current
        if kept is None:
            raise RuntimeError("passkit: no baseline to restore (before_pass was not called)")
        lost = kept.module.unrestorable()
        kept.module.restore()
        graph = self.graph_object
        restore(graph, kept.saved)
        if self.gm.graph is not graph:
            self.gm.graph = graph  # the setter recompiles: the code that runs is the baseline's
        else:
            self.gm.recompile()
        kept.fingerprint = graph_diff.fingerprint(graph)
        return lost


__all__ = ["Baseline", "Baselines"]
