"""Run in a fresh process by test_report_cache_environments: compile with a pass whose decision
depends on the torch version, in an environment that pretends to be torch ``argv[1]`` (torch's
source hash, which Inductor's cache key holds, and ``torch.__version__`` patched), and print
what the compile did and what its report says, as JSON."""

from __future__ import annotations

import hashlib
import json
import sys

import torch
import torch._inductor.codecache as codecache
from torch._dynamo.utils import counters

import passkit

FAKE_VERSION = sys.argv[1]
codecache.torch_key = lambda: hashlib.sha256(f"torch {FAKE_VERSION}".encode()).digest()
aten = torch.ops.aten


class VersionGated(passkit.GraphPass):
    """Rewrites ``x * 3.0`` into ``x * 2.0`` on "torch 2.14" only (as a dialect that can read
    one torch's graphs and declines another's)."""

    name = "version_gated"

    def run(self, gm, ctx):
        if FAKE_VERSION < "2.14":
            return passkit.PassResult.unchanged(f"declined on torch {FAKE_VERSION}")
        n = 0
        for node in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor):
            if node.args[1] == 3.0:
                node.update_arg(1, 2.0)
                n += 1
        return passkit.PassResult(modified=n > 0, matches=n, notes=[f"fused {n} on torch {FAKE_VERSION}"])


class Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [VersionGated]


passkit.register(Plugin(), name="version-gated")
backend = passkit.backend(passes=["version_gated"])
out = torch.compile(lambda x: torch.relu(x * 3.0) + 1.0, backend=backend)(torch.arange(8.0).reshape(2, 4))
(report,) = backend.reports
print(
    json.dumps(
        {
            "hit": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
            "out": out.tolist(),
            "restored": report.restored,
            "matches": report["version_gated"].matches if "version_gated" in report else None,
            "notes": report["version_gated"].notes if "version_gated" in report else None,
        }
    )
)
