"""Run in a fresh process by test_report_cache_identity: compile with a pass whose skip depends
on whether a kernel module (``passkit_probe_kernel``, written to a folder on ``PYTHONPATH`` by
the test, or absent) is importable, and print what the compile did and what its report says,
as JSON. The pass declares the module (``environment_modules``): its cache identity holds
whether it is importable, so a compile cached while it was missing is not served once it is
there."""

from __future__ import annotations

import importlib.util
import json

import torch
from torch._dynamo.utils import counters

import passkit

aten = torch.ops.aten
KERNEL = "passkit_probe_kernel"


class NeedsKernel(passkit.GraphPass):
    """Rewrites ``x * 3.0`` into ``x * 2.0`` where the kernel module is importable."""

    name = "needs_kernel"
    environment_modules = (KERNEL,)

    def skip_reason(self, ctx):
        if importlib.util.find_spec(KERNEL) is None:
            return f"{KERNEL} is not installed"
        return None

    def run(self, gm, ctx):
        n = 0
        for node in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor):
            if node.args[1] == 3.0:
                node.update_arg(1, 2.0)
                n += 1
        return passkit.PassResult(modified=n > 0, matches=n)


class Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [NeedsKernel]


if __name__ == "__main__":
    passkit.register(Plugin(), name="needs-kernel")
    backend = passkit.backend(passes=["needs_kernel"])
    out = torch.compile(lambda x: torch.relu(x * 3.0) + 1.0, backend=backend)(torch.arange(8.0).reshape(2, 4))
    (report,) = backend.reports
    record = next((r for r in report.records if r.name == "needs_kernel"), None)
    print(
        json.dumps(
            {
                "hit": counters["inductor"]["fxgraph_cache_hit"]
                + counters["aot_autograd"]["autograd_cache_hit"],
                "out": out.tolist(),
                "restored": report.restored,
                "status": record.status if record else None,
                "matches": record.matches if record else None,
                "reason": record.reason if record else None,
                "notes": report.notes,
            }
        )
    )
