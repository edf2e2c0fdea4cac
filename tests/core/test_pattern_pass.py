"""PatternPass: lazy registration once per options, generic scalars, match counting."""

from __future__ import annotations

import pydantic
import torch

import passkit
from passkit.pattern_pass import PatternPass

calls = {"patterns": 0}


class NormOptions(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    scale: float = 1.0


def norm_search(x, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class FoldNorm(passkit.PatternPass):
    """Replace a hand-written RMSNorm (no weight) by torch's rms_norm, for any eps."""

    name = "fold_norm"
    Options = NormOptions

    def patterns(self):
        calls["patterns"] += 1
        scale = self.options.scale

        def replace(x, eps):
            return (torch.rms_norm(x.float(), [x.shape[-1]], eps=eps) * scale).to(x.dtype)

        yield passkit.Pattern(
            norm_search, replace, [torch.empty(4, 16)], scalars={"eps": 1.2345e-4}, name="rmsnorm"
        )


class Plugin:
    @passkit.hookimpl
    def passkit_register_passes(self):
        return [FoldNorm]


def model(x):
    a = norm_search(x, 1e-6)
    b = norm_search(x + 1, 1e-5)  # another eps value: the same registered pattern matches
    return a + b


def test_pattern_matches_any_eps_and_counts(clean_env):
    passkit.register(Plugin())
    PatternPass._registered.clear()
    calls["patterns"] = 0
    x = torch.randn(8, 16)
    for _ in range(2):
        torch._dynamo.reset()
        b = passkit.backend(passes=["fold_norm"], mode="eager", verify=True)
        out = torch.compile(model, backend=b)(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
        assert b.last_report["fold_norm"].matches == 2
    assert calls["patterns"] == 1  # registered once per process and options

    torch._dynamo.reset()
    b = passkit.backend(passes=[{"name": "fold_norm", "scale": 2.0}], mode="eager")
    out = torch.compile(model, backend=b)(x)
    torch.testing.assert_close(out, 2 * model(x), rtol=1e-5, atol=1e-5)  # the replacement ran
    assert calls["patterns"] == 2  # new options, new registration


def test_pattern_pass_without_match_changes_nothing(clean_env):
    passkit.register(Plugin())
    b = passkit.backend(passes=["fold_norm"], mode="eager")
    torch.compile(lambda t: t.relu() + 1, backend=b)(torch.randn(4, 16))
    rec = b.last_report["fold_norm"]
    assert rec.matches == 0 and not rec.modified and rec.nodes_before == rec.nodes_after
