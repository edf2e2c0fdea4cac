"""Run in a fresh process by test_integration: compile with a pass and print the Inductor
FX-graph-cache counters as JSON. argv: factor for the mul_to_scale pass."""

from __future__ import annotations

import json
import sys

import torch
from torch._dynamo.utils import counters

import passkit
from tests.core.support import register_all, small_fn

register_all()
backend = passkit.backend(passes=[{"name": "mul_to_scale", "factor": float(sys.argv[1])}, "cleanup"])
x = torch.arange(8.0).reshape(2, 4)
out = torch.compile(small_fn, backend=backend)(x)
inductor = counters["inductor"]
print(
    json.dumps(
        {
            "hit": inductor["fxgraph_cache_hit"],
            "miss": inductor["fxgraph_cache_miss"],
            "bypass": inductor["fxgraph_cache_bypass"],
            "out": out.tolist(),
            "reports": len(backend.reports),
            "cache_hit_reports": sum(r.cache_hit for r in backend.reports),
            "restored": sum(r.restored for r in backend.reports),
            "ran": [rec.name for r in backend.reports for rec in r.records if rec.status == "ran"],
        }
    )
)
