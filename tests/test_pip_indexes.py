"""``.ci/pip_indexes.py``: nox leaves out a package index this machine cannot reach (pip
would retry it for every package), tried once, for a bounded time. Local sockets only."""

from __future__ import annotations

import ast
import importlib.util
import socket
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pip_indexes():
    spec = importlib.util.spec_from_file_location("pip_indexes", ROOT / ".ci/pip_indexes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.fixture
def closed_port():
    """A port on 127.0.0.1 nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def open_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_an_unreachable_extra_index_is_dropped_and_the_others_kept(pip_indexes, closed_port, open_port):
    dead, alive = f"http://127.0.0.1:{closed_port}/whl/cpu", f"http://127.0.0.1:{open_port}/simple"
    env = {"PIP_EXTRA_INDEX_URL": f"{dead} {alive} file:///opt/local/simple"}
    start = time.monotonic()
    keep, unreachable = pip_indexes.reachable_indexes(env, timeout=2.0)
    assert time.monotonic() - start < 2.0  # a refused connection is known at once
    assert keep == {"PIP_EXTRA_INDEX_URL": [alive, "file:///opt/local/simple"]}
    assert [(u.variable, u.url) for u in unreachable] == [("PIP_EXTRA_INDEX_URL", dead)]
    line = pip_indexes.describe(unreachable)
    assert "\n" not in line and dead in line and "extra index left out" in line


def test_an_unreachable_main_index_is_named_as_the_main_one(pip_indexes, closed_port):
    keep, unreachable = pip_indexes.reachable_indexes({"PIP_INDEX_URL": f"https://127.0.0.1:{closed_port}/"})
    assert keep == {"PIP_INDEX_URL": []} and unreachable[0].variable == "PIP_INDEX_URL"
    assert "PIP_RETRIES=0" in pip_indexes.describe(unreachable)


def test_nothing_is_tried_without_indexes_or_behind_a_proxy(pip_indexes, closed_port):
    assert pip_indexes.reachable_indexes({}) == ({}, [])
    env = {"PIP_EXTRA_INDEX_URL": f"http://127.0.0.1:{closed_port}/", "HTTPS_PROXY": "http://proxy:3128"}
    assert pip_indexes.reachable_indexes(env) == ({"PIP_EXTRA_INDEX_URL": [env["PIP_EXTRA_INDEX_URL"]]}, [])


def test_every_nox_session_that_installs_leaves_unreachable_indexes_out():
    """Read from noxfile.py (nox is not installed in the test environment)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    sessions = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and any("session" in ast.unparse(d) for d in node.decorator_list)
    ]
    assert len(sessions) >= 8
    for node in sessions:
        source = ast.unparse(node)
        if "session.install(" in source or "install(session" in source or "pip" in source:
            assert "skip_unreachable_indexes(session)" in source or "install(session" in source, node.name
    install = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "install")
    assert "skip_unreachable_indexes(session)" in ast.unparse(install)
