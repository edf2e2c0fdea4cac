"""Run by tests/hosts/test_sglang.py in a fresh process, with no CPU stand-ins (SGLang's
piecewise backend then fails to import, as on a CPU-only install): load SGLang's plugins with
``PASSKIT_PASSES`` from the environment, compile a small module through SGLang's
``--enable-torch-compile`` path when passkit is on (or call it, to see the error, when it is
off) and print what happened as JSON. argv[1]: the repository root."""

from __future__ import annotations

import json
import logging
import sys
import types

records: list[dict[str, object]] = []


class _Capture(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        records.append(
            {
                "logger": record.name,
                "level": record.levelname,
                "message": record.getMessage(),
                "traceback": bool(record.exc_info),
            }
        )


logging.getLogger().addHandler(_Capture())
logging.getLogger().setLevel(logging.INFO)
sys.path.insert(0, sys.argv[1])

import torch  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

import passkit  # noqa: E402
import passkit.hosts.sglang as host  # noqa: E402
import passkit.logs  # noqa: E402
from tests.core import broken_passes, support  # noqa: E402

passkit.register(broken_passes.PLUGIN, name="broken-passes")
passkit.register(support.PLUGIN, name="core-test-passes")
passkit.logs.log.addHandler(_Capture())  # passkit's logger hands records to torch's logging
load_plugins()
adapter = host.active()
out: dict[str, object] = {
    "active": adapter is not None,
    "error": str(host._error) if host._error else None,
    "hooked": sorted(HookRegistry._hooks),
    "paths": sorted(host._registered_paths),
}


class Tiny(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 3.0) + 1.0


from sglang.srt.compilation import torch_compile_decoration  # noqa: E402

x = torch.randn(4, 8)
try:
    tp_group = types.SimpleNamespace(ca_comm=None)  # what patch_model reads of the group
    with torch_compile_decoration.patch_model(Tiny(), True, num_tokens=4, tp_group=tp_group) as forward:
        got = forward(x)
    out["wrapped"] = getattr(forward, "passkit_pipeline", None) is not None
    out["error_vs_expected"] = float((got - (torch.relu(x * 2.0) + 1.0)).abs().max())
except passkit.PasskitError as exc:
    out["raised"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
if adapter is not None:
    out["reports"] = [{r.name: [r.status, r.reason] for r in report.records} for report in adapter.reports]
out["tracebacks"] = [r for r in records if r["traceback"]]
out["logged"] = [str(r["message"]) for r in records if str(r["logger"]).startswith("passkit")]
print(json.dumps(out))
