"""A third party's ``passkit_fusion_dialects`` hookimpl that raises or returns garbage (issue
27): isolated like every passkit hook (recorded with plugin and distribution, disabled), the
built-in dialects and the other plugins' dialects still load."""

from __future__ import annotations

from passkit_fusion.dialects import Dialect

import passkit
import passkit._plugins.registry
from passkit_fusion import dialects


class Raising:
    @passkit.hookimpl
    def passkit_fusion_dialects(self):
        raise RuntimeError("dialect hook crashed")


class Garbage:
    @passkit.hookimpl
    def passkit_fusion_dialects(self):
        return 42


class Good:
    class MyDialect(Dialect):
        name = "mine"

    @passkit.hookimpl
    def passkit_fusion_dialects(self):
        return [self.MyDialect]


def test_a_raising_or_garbage_dialect_hook_is_isolated_and_named() -> None:
    with passkit._plugins.registry.isolated():
        passkit.register(Raising(), name="acme-raising")
        passkit.register(Garbage(), name="acme-garbage")
        passkit.register(Good(), name="acme-good")
        plugins = passkit.get_plugins()
        names = [d.name for d in dialects.registered(plugins)]
        assert names == ["torch", "vllm", "vllm_cpu", "sglang", "mine"]
        (failure,) = plugins.hook_failures
        assert (failure.hook, failure.plugin) == ("passkit_fusion_dialects", "acme-raising")
        assert "RuntimeError: dialect hook crashed" in str(failure)
