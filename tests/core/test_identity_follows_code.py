"""A pass's cache identity changes with its code, also where no file can be read (a script
read from stdin) and where only a helper module changed (:mod:`passkit.code_identity`).

Before, such a pass hashed to a constant (its file ``<stdin>`` unreadable, or its own file
unchanged), so a warm Inductor cache served the code of the old pass after it was edited.
Each run is a fresh process, as a user's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
import torch, passkit
{helper_import}
aten = torch.ops.aten

{helper_def}

class Scale(passkit.GraphPass):
    name = "edited_scale"

    def run(self, gm, ctx):
        n = 0
        for node in gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor):
            node.update_arg(1, factor())
            n += 1
        return passkit.PassResult(modified=n > 0, matches=n)

class Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [Scale]

passkit.register(Plugin(), name="edited-plugin")
if sys.argv[1:] == ["compile"]:
    fn = lambda x: torch.relu(x * 3.0)
    backend = passkit.backend(passes=["edited_scale"])
    out = torch.compile(fn, backend=backend)(torch.ones(4))
    print("OUT", float(out[0]), "HIT", backend.last_report.cache_hit)
else:
    print("UUID", passkit.build_pipeline(passes=["edited_scale"]).uuid())
"""


def _script(factor: float) -> str:
    return SCRIPT.format(helper_import="", helper_def=f"def factor():\n    return {factor}")


def _run(args, *, stdin=None, cwd=None, env=None, timeout=300):
    env = {**os.environ, **(env or {})}
    env = {k: v for k, v in env.items() if not k.startswith("PASSKIT_") or k == "PASSKIT_CACHE_DIR"}
    out = subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("UUID", "OUT")))


def test_a_pass_read_from_stdin_gets_an_identity_that_follows_its_code(tmp_path):
    first = _run(["-", "uuid"], stdin=_script(2.0), cwd=tmp_path)["UUID"]
    again = _run(["-", "uuid"], stdin=_script(2.0), cwd=tmp_path)["UUID"]
    edited = _run(["-", "uuid"], stdin=_script(5.0), cwd=tmp_path)["UUID"]
    assert first == again  # stable across processes: a warm cache still serves it
    assert edited != first  # the edit is a new identity


def test_an_edited_helper_module_changes_the_identity(tmp_path):
    """The pass's own file is unchanged; the function it calls, in another module, changed."""
    (tmp_path / "the_pass.py").write_text(
        SCRIPT.format(helper_import="from scale_helpers import factor", helper_def="")
    )
    helper = tmp_path / "scale_helpers.py"
    helper.write_text("def factor():\n    return 2.0\n")
    first = _run(["the_pass.py", "uuid"], cwd=tmp_path)["UUID"]
    helper.write_text("def factor():\n    # a comment changes nothing\n    return 2.0\n")
    assert _run(["the_pass.py", "uuid"], cwd=tmp_path)["UUID"] == first
    helper.write_text("def factor():\n    return 5.0\n")
    assert _run(["the_pass.py", "uuid"], cwd=tmp_path)["UUID"] != first


@pytest.mark.slow
def test_an_edited_pass_read_from_stdin_runs_its_new_code_over_a_warm_inductor_cache(tmp_path):
    """Two fresh processes sharing one Inductor cache and one report cache: the second runs
    the edited pass (its output says so), not the first's compiled code."""
    env = {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "PASSKIT_CACHE_DIR": str(tmp_path / "reports"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
    }
    first = _run(["-", "compile"], stdin=_script(2.0), cwd=tmp_path, env=env, timeout=600)
    warm = _run(["-", "compile"], stdin=_script(2.0), cwd=tmp_path, env=env, timeout=600)
    edited = _run(["-", "compile"], stdin=_script(5.0), cwd=tmp_path, env=env, timeout=600)
    assert first["OUT"] == "2.0 HIT False"
    assert warm["OUT"] == "2.0 HIT True"  # the cache is warm and serves an unchanged pass
    assert edited["OUT"] == "5.0 HIT False"
