"""One site's error declines that site, not the pass.

A fusion pass handles a graph's sites one by one. An unexpected error while matching or
rewriting one of them (a form the matcher did not foresee: vLLM's final
``fused_add_rms_norm`` whose residual output nothing reads once raised ``AttributeError``)
used to fail the whole pass, leaving every other site unfused. Now:

* matching reads the graph without changing it: an error there rejects that all-reduce
  with the error as its reason (:func:`error_reason`; :func:`.sites.candidates`);
* a rewrite is guarded by :class:`SiteRewrite`: if it fails before it changed any node of
  the graph (only inserted new ones), the new nodes are removed and the site is declined
  with the error as its reason; if it already changed the graph, the graph may be
  inconsistent and the pass fails as before (:class:`SiteRewriteError`; passkit restores
  the graph as it was before the pass). ``allreduce_rmsnorm`` and ``allreduce_layernorm``
  guard each site's rewrite; ``sequence_parallel`` does not (its sites share residual shards
  and a final gather): an error in its rewrite still fails that pass, while an error
  matching one of its sites rejects that site only.

The reason names the exception, its message and where it was raised, and each distinct
reason is warned about once per process: it is passkit's bug, to be reported.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

import torch.fx as fx

import passkit

_WARNED: set[str] = set()


class SiteRewriteError(RuntimeError):
    """A site's rewrite failed after it had changed the graph: the pass fails (its graph
    is restored by passkit)."""


def error_reason(stage: str, exc: BaseException, pass_name: str | None = None) -> str:
    """``"internal error matching this site (AttributeError: ... at sites.py:541): site
    left unfused, please report it"``: one line, without ``"; "`` (reports join reasons
    with it). Warns once per process for each distinct reason."""
    message = " ".join(str(exc).split()).replace("; ", ", ")
    if len(message) > 200:
        message = message[:197] + "..."
    where = _where(exc)
    reason = (
        f"internal error {stage} this site ({type(exc).__name__}: {message}{where}): "
        "site left unfused, the other sites are unaffected (please report it)"
    )
    if reason not in _WARNED:
        _WARNED.add(reason)
        prefix = f"passkit {pass_name}: " if pass_name else "passkit: "
        warnings.warn(prefix + reason, RuntimeWarning, stacklevel=3)
    return reason


def _where(exc: BaseException) -> str:
    """`` at file.py:line`` of the innermost frame in passkit_fusion (else the innermost)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    ours = [f for f in frames if "passkit_fusion" in f.filename]
    frame = (ours or frames)[-1]
    return f" at {Path(frame.filename).name}:{frame.lineno}"


class SiteRewrite:
    """Record what a site's rewrite may change, to undo a rewrite that failed early.

    ``nodes``: the nodes the rewrite replaces (the site's and its quantization's). Their
    arguments and their users' are remembered, with the graph's nodes: after a failure,
    :meth:`undo` removes the nodes the rewrite inserted when none of those was changed or
    erased, and says whether it could."""

    def __init__(self, graph: fx.Graph, nodes: Iterable[fx.Node]):
        self.graph = graph
        self.before = set(graph.nodes)
        touched = set(nodes)
        touched.update(u for n in list(touched) for u in n.users)
        self.inputs = {n: (n.args, n.kwargs) for n in touched}

    def undo(self) -> bool:
        """Remove the inserted nodes; False (nothing done) when the rewrite had already
        changed or erased a node of the graph, or an existing node reads a new one."""
        for node, (args, kwargs) in self.inputs.items():
            if getattr(node, "_erased", False) or node.args is not args or node.kwargs is not kwargs:
                return False
        new = [n for n in self.graph.nodes if n not in self.before]
        inserted = set(new)
        if any(u not in inserted for n in new for u in n.users):
            return False
        for node in reversed(new):
            self.graph.erase_node(node)
        return True

    def decline(self, exc: BaseException, pass_name: str, site_name: str) -> str:
        """After ``exc`` in the rewrite: undo it and return the reason to decline the site
        with, or raise :class:`SiteRewriteError` (from ``exc``) when it cannot be undone."""
        if not self.undo():
            raise SiteRewriteError(
                f"{pass_name}: rewriting the site at {site_name} failed after it changed the graph "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        return error_reason("rewriting", exc, pass_name)


def rewrite_or_decline(
    graph: fx.Graph, nodes: Iterable[fx.Node], rewrite: Callable[[], bool], pass_name: str, site_name: str
) -> bool | str:
    """``rewrite()`` guarded by a :class:`SiteRewrite` over ``nodes``: its result, or the
    reason to decline the site with (a ``str``) when it failed before changing the graph;
    :class:`SiteRewriteError` when it failed after. Each site is one rewrite for passkit's
    rewrite counter (``bisect_limit``): one it refuses is declined, the graph left as it was."""
    if not passkit.may_rewrite(f"{pass_name} at all-reduce {site_name}"):
        return "refused by bisect_limit (passkit bisect)"
    guard = SiteRewrite(graph, nodes)
    try:
        return rewrite()
    except Exception as exc:  # undone and declined, or the pass fails (graph restored)
        return guard.decline(exc, pass_name, site_name)
