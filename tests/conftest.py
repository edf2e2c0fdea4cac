"""Shared fixtures for the repository's own tests."""

from __future__ import annotations

import os
import tempfile

import pytest

# the suite's caches go to one throw-away folder, not ~/.cache and /tmp/torchinductor_<user>:
# passkit's report cache and Inductor's together. The ranks and programs the tests start
# inherit both; kept apart (a fresh report cache over a warm Inductor cache), a second run of
# the GPU suite got graphs from Inductor's cache whose reports were in no report cache.
_CACHES = tempfile.mkdtemp(prefix="passkit-test-caches-")
os.environ.setdefault("PASSKIT_CACHE_DIR", os.path.join(_CACHES, "reports"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHES, "inductor"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (no Inductor/AOTAutograd cache hits, which would skip
    the passes) and leaves no plugin registered in-process."""
    import torch._functorch.config
    import torch._inductor.config

    import passkit._plugins.registry

    torch._dynamo.reset()
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        passkit._plugins.registry.isolated(),
    ):
        yield
    torch._dynamo.reset()


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No PASSKIT_* variables and an empty working directory (no config files)."""
    import os

    for name in list(os.environ):
        if name.startswith("PASSKIT_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """passkit warns of a config mistake once per process: once per test here."""
    import passkit._pipeline.dump
    import passkit.errors

    monkeypatch.setattr(passkit.errors, "_warned", set())
    monkeypatch.setattr(passkit._pipeline.dump, "_unwritable", set())
