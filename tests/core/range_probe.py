"""Run in a fresh interpreter by test_ranges: compile a module with a range-restricted pass
at two token counts (two specializations: the first call's compiles inside Dynamo's compile,
the second at its first use) and print the FX-graph-cache counters and the
reports as JSON."""

from __future__ import annotations

import json

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
x = torch.arange(40.0).reshape(10, 4) / 40
outs = [f(x).sum().item(), f(torch.cat([x, x, x])).sum().item()]
inductor = counters["inductor"]
print(
    json.dumps(
        {
            "hit": inductor["fxgraph_cache_hit"],
            "miss": inductor["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "out": outs,
            "restored": sum(r.restored for r in backend.reports),
            "late": backend.last_dispatcher.late_compiles,
            "reports": sorted(
                [r.token_range, [(rec.name, rec.status, rec.matches) for rec in r.records]]
                for r in backend.reports
            ),
        }
    )
)
