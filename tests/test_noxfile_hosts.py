"""``nox -s hosts`` keeps each host's own transformers (it cannot run here: it installs the
hosts, ~10 GB): read from noxfile.py without importing nox."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _constants() -> dict[str, object]:
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return out


def test_each_host_keeps_the_transformers_it_pins():
    constants = _constants()
    hosts, pins = constants["HOSTS"], constants["HOST_TRANSFORMERS"]
    assert set(pins) == set(hosts)  # type: ignore[arg-type]
    assert pins == {"vllm": "transformers<5.21.0", "sglang": "transformers==5.19.0"}
    source = (ROOT / "noxfile.py").read_text()
    hosts_session = source[source.index("def hosts(") :]
    # one resolver run with the host's pin and without the test deps' transformers==5.24.0
    assert (
        "session.install(HOSTS[host], HOST_TRANSFORMERS[host], *PACKAGES, *EXAMPLE, *HOST_TEST_DEPS)"
        in hosts_session
    )
    assert "*TEST_DEPS" not in hosts_session
    assert '"pip", "check"' in hosts_session
