"""Run in a fresh process by test_warm_start_imports: build a passkit backend (and compile
a small function with it) as ``argv[1]`` says, and print which heavy modules were imported
at backend init and after the compile, as JSON.

argv[1]: ``none`` (``passkit.backend(passes=[])``), ``named`` (``backend="passkit"``, no
config), ``serving`` (the serving config at world size 1).
"""

from __future__ import annotations

import json
import sys

import torch

HEAVY = (
    "torch.ao.quantization.fx",
    "torch._inductor.compile_fx",
    "torch._inductor.fx_passes.micro_pipeline_tp",
    "flashinfer",
    "passkit_fusion.allreduce_rmsnorm.ops",
    "passkit_fusion.allreduce_rmsnorm.runtime",
    "passkit_fusion.sequence_parallel.ops",
    "passkit_fusion.sequence_parallel.rewrite",
    "passkit_fusion.async_tp.ops",
    "passkit_fusion.async_tp.runtime",
    "passkit_fusion.async_tp.host",
    "passkit_fusion.allreduce_overlap.ops",
    "passkit_fusion.allreduce_overlap.runtime",
    "passkit_fusion.patterns.sites",
    "passkit_fusion.collective",
    "passkit_fusion.tuning.tables",
)
SERVING = ["sequence_parallel", "async_tp", "allreduce_rmsnorm", "cleanup"]


def loaded() -> list[str]:
    return [name for name in HEAVY if name in sys.modules]


def fn(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(torch.relu(x @ x.T) + 1, (x.shape[0],))


import passkit  # noqa: E402  (after the baseline: torch alone)

variant = sys.argv[1]
if variant == "named":
    backend: object = "passkit"
else:
    backend = passkit.backend(passes=SERVING if variant == "serving" else [])
at_init = loaded()
x = torch.randn(8, 8)
torch._dynamo.mark_dynamic(x, 0)
torch.compile(fn, backend=backend)(x)
ran = [r.name for rep in passkit._pipeline.run.RECENT_REPORTS for r in rep.records if r.status == "ran"]
print(json.dumps({"at_init": at_init, "after_compile": loaded(), "ran": ran}))
