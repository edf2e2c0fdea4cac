"""The core demo: compile a small transformer-like block with passes enabled by name.

Shows the per-pass report, a before/after excerpt of the graph and checks the compiled
output against eager. Plugins add their own demos through the ``passkit_demos`` hook
(``passkit-fusion`` adds a TP=2 all-reduce + RMSNorm fusion demo).
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

DEMO_PASSES = ["noop_elimination", "cleanup"]


class TinyBlock(nn.Module):
    """Pre-norm attention + MLP block written the way model code often is: with reshapes
    that change nothing and reshape chains, which ``noop_elimination`` removes."""

    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(hidden, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden, eps=1e-6)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, h // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = att.transpose(1, 2).reshape(b, s, h).view(b, s, h)  # the view is a no-op
        x = x + self.proj(att)
        y = self.up(self.norm2(x)).reshape(b * s, -1).reshape(b, s, -1)  # a reshape chain
        return x + self.down(torch.nn.functional.gelu(y))


def _no_compile_caches() -> contextlib.AbstractContextManager[object]:
    import torch._functorch.config
    import torch._inductor.config

    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def excerpt(diff: str, lines: int = 16) -> str:
    body = [ln for ln in diff.splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
    shown = body[:lines]
    more = f"\n    ... {len(body) - lines} more changed lines" if len(body) > lines else ""
    return "\n".join("    " + ln for ln in shown) + more


def run_core_demo(mode: str = "inductor") -> int:
    import passkit

    torch.manual_seed(0)
    model = nn.Sequential(TinyBlock(), TinyBlock()).eval()
    x = torch.randn(2, 8, 64)
    with tempfile.TemporaryDirectory() as dump:
        backend = passkit.backend(passes=DEMO_PASSES, dump_dir=dump, mode=mode)
        print(f"== passkit demo: {len(DEMO_PASSES)} passes enabled by name: {', '.join(DEMO_PASSES)}")
        print(f"   model: 2 pre-norm transformer blocks, compiled with torch.compile (mode={mode})")
        torch._dynamo.reset()
        start = time.perf_counter()
        # caches off: a cache hit would skip the passes, and the demo is about showing them
        with torch.no_grad(), _no_compile_caches():
            compiled = torch.compile(model, backend=backend)
            out = compiled(x)
            ref = model(x)
        elapsed = time.perf_counter() - start
        report = backend.last_report
        assert report is not None
        print(report.format())
        diffs = sorted(Path(dump).glob("run-*/graph_*/*/01_*.diff"))
        if diffs:
            print(f"\n-- before/after excerpt ({diffs[0].name}):")
            print(excerpt(diffs[0].read_text()))
    err = (out - ref).abs().max().item()
    ok = torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    print(f"\nnumerics vs eager: max abs error {err:.2e} -> {'OK' if ok else 'MISMATCH'}")
    print(f"compile + first run: {elapsed:.1f} s; passes took {report.total_ms:.1f} ms in total")
    return 0 if ok else 1


def main(args: argparse.Namespace) -> int:
    import passkit

    from ._plugins.cli_hooks import plugin_demos

    demos = plugin_demos()
    wanted = list(dict.fromkeys(args.only or []))
    known = ["core", *demos]
    if unknown := [name for name in wanted if name not in known]:
        from .errors import suggest

        raise passkit.PasskitError(
            f"no demo named {unknown[0]!r}{suggest(unknown[0], known)}; demos: {', '.join(known)}"
        )
    status = run_core_demo(mode=args.mode) if not wanted or "core" in wanted else 0
    for name, fn in demos.items():
        if wanted and name not in wanted:
            continue
        print(f"\n== plugin demo: {name}")
        try:
            status = max(status, int(fn(args) or 0))
        except passkit.PasskitError:
            raise
        except Exception as exc:  # one broken demo must not hide the others
            print(f"plugin demo {name} failed: {type(exc).__name__}: {passkit.errors.cut(str(exc))}")
            status = max(status, 1)
    return status
