"""Run in a fresh interpreter by test_no_silent_faults: compile a module with a
range-restricted pass, first called at the token counts given on the command line, and print
the FX-graph-cache counters and the reports as JSON (a warm start whose first call has another
count in the same range must restore the same records)."""

from __future__ import annotations

import json
import sys

import torch
from torch._dynamo.utils import counters

import passkit
from passkit._pipeline.build import Pipeline
from passkit._plugins.registry import get_plugins
from passkit.config import load_config
from tests.core.test_ranges import Everywhere, SmallRelu, model

pipeline = Pipeline(load_config({}), get_plugins(), [SmallRelu(), Everywhere()])
backend = passkit.Backend(pipeline=pipeline)
f = torch.compile(model, backend=backend, dynamic=True)
outs = [f(torch.arange(4.0 * n).reshape(n, 4) / 40).sum().item() for n in map(int, sys.argv[1:])]
print(
    json.dumps(
        {
            "hit": counters["inductor"]["fxgraph_cache_hit"],
            "miss": counters["inductor"]["fxgraph_cache_miss"],
            "restored": sum(r.restored for r in backend.reports),
            "reports": sorted(
                [r.token_range, [(rec.name, rec.status, rec.matches) for rec in r.records]]
                for r in backend.reports
            ),
        }
    )
)
