"""A pass built on Inductor's pattern matcher.

Declare replacements in :meth:`PatternPass.patterns`; passkit traces and registers them the
first time the pass runs, once per process and set of options, in a
``PatternMatcherPass`` owned by the pass (never Inductor's global pattern tables, never its
private ``_seen_patterns``). Scalars named in ``Pattern.scalars`` (an epsilon, a scale)
become wildcards: one registered pattern matches every value, and the replacement receives
the matched value as the argument of that name.

Each match is one rewrite for the rewrite counter (``bisect_limit``, ``passkit bisect``): a
match past the limit is left as it was, with no code from the pass's author.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from .pass_base import Pass, PassResult
from .rewrite_counter import may_rewrite

if TYPE_CHECKING:
    import torch.fx

    from .context import CompileContext


@dataclasses.dataclass
class Pattern:
    """One search -> replacement rule.

    Attributes:
        search: function whose traced ATen graph is searched for.
        replace: function traced to build the replacement; same arguments as ``search``.
        example_inputs: one distinct tensor per tensor argument of ``search``, in argument
            order. Scalar arguments are not listed here: name them in ``scalars``, after
            the tensor arguments in ``search``'s signature.
        scalars: scalar arguments of ``search`` whose values are wildcards, mapped to the
            example value used while tracing (pick a value that appears nowhere else in
            the pattern, e.g. ``{"eps": 1.2345e-6}``).
        extra_check: ``f(match) -> bool`` run on each candidate match with real shapes.
        name: a label for reports and errors.
    """

    search: Callable[..., Any]
    replace: Callable[..., Any]
    example_inputs: Sequence[Any]
    scalars: dict[str, float | int] = dataclasses.field(default_factory=dict)
    extra_check: Callable[[Any], bool] | None = None
    name: str | None = None


class PatternPass(Pass):
    """Subclass and implement :meth:`patterns`; :meth:`run` applies them and counts matches."""

    _registered: ClassVar[dict[tuple[type, str], Any]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def patterns(self) -> Iterable[Pattern]:
        raise NotImplementedError(f"pattern pass {self.name!r} does not implement patterns()")

    def matcher(self) -> Any:
        """The ``PatternMatcherPass`` holding this pass's patterns, registered on first use."""
        key = (type(self), self.options_json())
        with self._lock:
            pm = PatternPass._registered.get(key)
            if pm is None:
                pm = self._register()
                PatternPass._registered[key] = pm
        return pm

    def _register(self) -> Any:
        from torch._inductor.pattern_matcher import (
            PatternMatcherPass,
            fwd_only,
            register_replacement,
        )

        pm = PatternMatcherPass(pass_name=f"passkit.{self.name}")
        supported = inspect.signature(register_replacement).parameters
        for i, pat in enumerate(self.patterns()):
            _check_pattern(self.name, pat, i)
            kwargs: dict[str, Any] = {}
            if "skip_duplicates" in supported:  # torch >= 2.12: tolerate equal patterns
                kwargs["skip_duplicates"] = True
            if pat.extra_check is not None:
                kwargs["extra_check"] = pat.extra_check
            before = _entries(pm)
            try:
                register_replacement(
                    pat.search,
                    pat.replace,
                    list(pat.example_inputs),
                    fwd_only,
                    pm,
                    scalar_workaround=dict(pat.scalars) or None,
                    **kwargs,
                )
            except Exception as exc:
                label = pat.name or getattr(pat.search, "__name__", f"#{i}")
                raise type(exc)(f"{self.name}: registering pattern {label!r} failed: {exc}") from exc
            label = pat.name or getattr(pat.search, "__name__", f"#{i}")
            for key, entry in _entries(pm).items():
                if key not in before:
                    entry.extra_check = _counted_check(entry.extra_check, label)
        return pm

    def run(self, gm: torch.fx.GraphModule, ctx: CompileContext) -> PassResult:
        count = int(self.matcher().apply(gm.graph) or 0)
        return PassResult(modified=count > 0, matches=count)


def _entries(pm: Any) -> dict[int, Any]:
    """The entries a ``PatternMatcherPass`` holds, by id."""
    return {id(e): e for entries in pm.patterns.values() for e in entries}


def _counted_check(check: Callable[[Any], bool], label: str) -> Callable[[Any], bool]:
    """``check``, then the rewrite counter (:func:`passkit.rewrite_counter.may_rewrite`):
    Inductor replaces a match only when its entry's check passes, so each match is counted
    once, as the last check before it is rewritten, and a refused one is left alone."""

    from torch.fx.experimental.symbolic_shapes import guard_or_false

    def counted(match: Any) -> bool:
        if not guard_or_false(check(match)):  # as Inductor reads a check (a SymBool too)
            return False
        try:
            at = ", ".join(n.name for n in match.output_nodes() if n is not None)
        except Exception:  # a match without outputs to name: its pattern names it
            at = "?"
        return may_rewrite(f"pattern {label!r} at {at}")

    return counted


def _check_pattern(pass_name: str, pat: Pattern, index: int) -> None:
    """Reject pattern declarations Inductor would silently never match."""
    import torch

    label = pat.name or getattr(pat.search, "__name__", f"#{index}")
    where = f"{pass_name}: pattern {label!r}"
    tensors = list(pat.example_inputs)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{where}: example_inputs must all be tensors; name scalars in `scalars`")
    if len({id(t) for t in tensors}) != len(tensors):
        raise ValueError(f"{where}: example_inputs repeats a tensor object; give each argument its own")
    params = list(inspect.signature(pat.search).parameters)
    if params[: len(tensors)] and set(pat.scalars) & set(params[: len(tensors)]):
        raise ValueError(f"{where}: scalars must come after the tensor arguments of search()")
    missing = [name for name in pat.scalars if name not in params]
    if missing:
        raise ValueError(f"{where}: scalars {missing} are not arguments of search()")
