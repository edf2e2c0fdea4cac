"""The README's code must be the example plugin's real code (so it cannot rot)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/passkit-example-plugin/src/passkit_example"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_pass_example_is_the_example_plugin_code():
    blocks = python_blocks((ROOT / "README.md").read_text())
    pass_block = next(b for b in blocks if "class FoldDoubleNeg" in b)
    assert pass_block in (EXAMPLE / "fold_double_neg.py").read_text()
    plugin_block = next(b for b in blocks if "def passkit_register_passes" in b)
    body = "\n".join(line.split("#")[0].rstrip() for line in plugin_block.splitlines()) + "\n"
    assert body in (EXAMPLE / "plugin.py").read_text()


def test_readme_commands_are_the_ci_commands():
    readme = (ROOT / "README.md").read_text()
    assert "nox -s tests" in readme and "nox -s demo" in readme
    assert "nox -s tests" in (ROOT / ".ci/run").read_text()
