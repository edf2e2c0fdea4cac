"""The ``record_graph`` pass: writes each graph a real host hands passkit to a folder (run
first in the pipeline, by ``record_vllm.py`` / ``record_sglang.py`` in the host's own
environment). :data:`SETTINGS` says where, and what names the TP group in the graph."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import passkit

SETTINGS: dict[str, Any] = {}
"""``folder`` (the graphs go to ``<folder>/graph<N>.json``), ``host``, ``scenario``,
``groups`` (a callable returning ``(group_names, handles)``, called in the rank)."""
_COUNTER = itertools.count()


class RecordGraph(passkit.GraphPass):
    """Saves the graph it is given (:func:`host_graphs.save`), unchanged."""

    name = "record_graph"

    def run(self, gm, ctx):
        import host_graphs

        if not SETTINGS:
            return passkit.PassResult.unchanged("not recording (no SETTINGS)")
        names, handles = SETTINGS["groups"]()
        path = Path(SETTINGS["folder"]) / f"graph{next(_COUNTER)}.json"
        host_graphs.save(
            gm,
            path,
            host=SETTINGS["host"],
            scenario=SETTINGS["scenario"],
            group_names=tuple(names),
            handles=tuple(handles),
            in_host={"token_range": str(ctx.token_range) if ctx.token_range else None},
        )
        return passkit.PassResult.unchanged(f"recorded to {path}")


class _Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [RecordGraph]


PLUGIN = _Plugin()
