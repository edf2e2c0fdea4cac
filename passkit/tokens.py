"""The token axis: where a pass applies, and the ranges a compile is split into.

A serving stack compiles one model for 1 to thousands of tokens. A pass declares where it
applies with a :class:`TokenConstraint` (``min_tokens``, ``max_tokens``, ``multiple_of``);
the user may add boundaries (``compile_ranges``). :func:`split` cuts the token axis at every
bound into :class:`TokenRange` pieces, and :func:`plan_specializations` groups the pieces by
the set of passes that apply there, so that each distinct set compiles once; a graph with
static shapes serves one token count, and :func:`plan_static` says which passes it leaves out.

Pure arithmetic: no torch, no graphs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TokenRange:
    """The token counts ``lo..hi`` (inclusive; ``hi=None``: no upper bound), restricted to
    multiples of ``multiple_of``: what one specialization is compiled for."""

    lo: int = 1
    hi: int | None = None
    multiple_of: int = 1

    def contains(self, tokens: int) -> bool:
        return self.lo <= tokens and (self.hi is None or tokens <= self.hi) and tokens % self.multiple_of == 0

    def __str__(self) -> str:
        span = f"tokens >= {self.lo}" if self.hi is None else f"tokens {self.lo}..{self.hi}"
        if self.lo == self.hi:
            span = f"tokens {self.lo}"
        return span + (f", multiples of {self.multiple_of}" if self.multiple_of > 1 else "")


@dataclasses.dataclass(frozen=True)
class TokenConstraint:
    """Where a pass applies along the token dimension: ``min_tokens <= n <= max_tokens``
    (``max_tokens=None``: no upper bound) and ``n % multiple_of == 0``."""

    min_tokens: int = 1
    max_tokens: int | None = None
    multiple_of: int = 1

    def check(self, owner: str) -> TokenConstraint:
        """Return self, or raise :class:`ConfigError` naming ``owner`` (e.g. the pass) and
        the offending field."""
        for field in ("min_tokens", "max_tokens", "multiple_of"):
            value = getattr(self, field)
            if value is None and field == "max_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"{owner}: token constraint {field} must be a positive integer, got {value!r}"
                )
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ConfigError(
                f"{owner}: token constraint is empty: min_tokens={self.min_tokens} > "
                f"max_tokens={self.max_tokens}"
            )
        first = math.ceil(self.min_tokens / self.multiple_of) * self.multiple_of
        if self.max_tokens is not None and first > self.max_tokens:
            raise ConfigError(
                f"{owner}: token constraint multiple_of={self.multiple_of}: no token count in "
                f"{self.min_tokens}..{self.max_tokens} is a multiple of it"
            )
        return self

    @property
    def unconstrained(self) -> bool:
        return self.min_tokens == 1 and self.max_tokens is None and self.multiple_of == 1

    def covers(self, piece: TokenRange) -> bool:
        """Whether every size of ``piece`` (a range cut at this constraint's bounds) is
        inside ``min_tokens..max_tokens`` (divisibility is checked per call)."""
        return self.min_tokens <= piece.lo and (
            self.max_tokens is None or (piece.hi is not None and piece.hi <= self.max_tokens)
        )

    def holds_for(self, tokens: TokenRange) -> bool:
        """Whether the pass applies to every size of ``tokens`` (a compiled range)."""
        return self.covers(tokens) and tokens.multiple_of % self.multiple_of == 0

    def admits(self, tokens: int) -> bool:
        """Whether the pass applies to the one token count ``tokens`` (a static-shape graph)."""
        return self._bounds_hold(tokens) and tokens % self.multiple_of == 0

    def excludes_why(self, tokens: int) -> str:
        """Why the pass does not apply to the static token count ``tokens`` (not admitted)."""
        if self._bounds_hold(tokens):
            return f"static tokens {tokens} is not a multiple of {self.multiple_of} (its range: {self})"
        return f"static tokens {tokens} outside its range {self}"

    def _bounds_hold(self, tokens: int) -> bool:
        return self.min_tokens <= tokens and (self.max_tokens is None or tokens <= self.max_tokens)

    def ends(self) -> set[int]:
        """The last token counts of the ranges this constraint needs cut."""
        out = {self.min_tokens - 1} if self.min_tokens > 1 else set()
        if self.max_tokens is not None:
            out.add(self.max_tokens)
        return out

    def __str__(self) -> str:
        hi = "" if self.max_tokens is None else f"..{self.max_tokens}"
        span = f"tokens {self.min_tokens}{hi}" if hi else f"tokens >= {self.min_tokens}"
        return span + (f", multiples of {self.multiple_of}" if self.multiple_of > 1 else "")


def check_boundaries(ends: Sequence[int]) -> list[int]:
    """Validate user-given range ends: positive, strictly increasing integers."""
    for value in ends:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"every boundary must be a positive integer (not {value!r})")
    if list(ends) != sorted(set(ends)):
        raise ConfigError("boundaries must be strictly increasing")
    return list(ends)


def split(ends: Iterable[int]) -> list[TokenRange]:
    """Cut ``1..inf`` after each of ``ends``: ``[16, 256]`` -> ``1..16, 17..256, >= 257``."""
    pieces, lo = [], 1
    for end in sorted({e for e in ends if e >= 1}):
        pieces.append(TokenRange(lo, end))
        lo = end + 1
    pieces.append(TokenRange(lo, None))
    return pieces


@dataclasses.dataclass(frozen=True)
class Specialization:
    """One compile: the passes it runs and the token ranges it serves (pieces of the token
    axis with the same passes share it, except across the user's ``compile_ranges``, which
    always compile apart). ``divisible_by``: the ``multiple_of`` values the token count of
    every call it serves is a multiple of."""

    passes: tuple[str, ...]
    ranges: tuple[TokenRange, ...]
    divisible_by: tuple[int, ...] = ()
    left_out: tuple[tuple[str, str], ...] = ()
    """Enabled passes this compile runs without, each with why (``(name, reason)``): outside
    their token constraint, their sites taken by a pass that runs first, or waiting on a rewrite that does
    not happen here."""

    @property
    def label(self) -> str:
        multiple = math.lcm(*self.divisible_by) if self.divisible_by else 1
        return "; ".join(str(dataclasses.replace(r, multiple_of=multiple)) for r in self.ranges)

    @property
    def context_range(self) -> TokenRange:
        """One range standing for all of ``ranges`` (their hull): every pass of this
        specialization applies to all of it, since each pass applies to one interval."""
        lo = min(r.lo for r in self.ranges)
        his = [r.hi for r in self.ranges]
        hi = None if None in his else max(h for h in his if h is not None)
        multiple = math.lcm(*self.divisible_by) if self.divisible_by else 1
        return TokenRange(lo, hi, multiple)


@dataclasses.dataclass(frozen=True)
class RangeRule:
    """Dispatch for one piece of the token axis: its bounds, the divisors to test and the
    specialization index for each outcome (a tuple of booleans, one per divisor)."""

    lo: int
    hi: int | None
    divisors: tuple[int, ...]
    choice: Mapping[tuple[bool, ...], int]


@dataclasses.dataclass(frozen=True)
class PassRelations:
    """How enabled passes act on each other's rewrites, for planning.

    ``depends_on[p]``: passes whose rewrite ``p`` acts on (:attr:`passkit.Pass.depends_on`,
    only those enabled): ``p`` runs only where one of them runs. ``shares_sites[p]``: passes
    that rewrite the same sites as ``p`` (:attr:`passkit.Pass.shares_sites_with`, made
    symmetric): where two of them apply, the first in pipeline order takes every site.
    """

    depends_on: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    shares_sites: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def effective(self, applicable: Sequence[str]) -> tuple[tuple[str, ...], dict[str, str]]:
        """Of the passes whose own constraints hold (``applicable``, in pipeline order),
        those that act: a pass whose sites an earlier one takes and a pass whose
        dependencies all left are dropped (to a fixed point). Returns the kept names and
        ``{dropped: reason}``."""
        kept = list(applicable)
        dropped: dict[str, str] = {}
        changed = True
        while changed:
            changed = False
            for name in list(kept):
                earlier = kept[: kept.index(name)]
                by = next((s for s in earlier if s in self.shares_sites.get(name, ())), None)
                if by is not None:
                    dropped[name] = f"its sites are taken by {by}, which runs first here"
                elif (deps := self.depends_on.get(name)) and not any(d in kept for d in deps):
                    dropped[name] = f"acts on the rewrite of {' or '.join(deps)}, which does not run here"
                else:
                    continue
                kept.remove(name)
                changed = True
        return tuple(kept), dropped


def plan_specializations(
    constraints: Mapping[str, TokenConstraint | None],
    user_ends: Sequence[int] = (),
    relations: PassRelations | None = None,
) -> tuple[list[Specialization], list[RangeRule]]:
    """Group the token axis into specializations with equal pass sets.

    ``constraints``: the constraint of each pass that can run in this compile's context
    (None: applies everywhere), in pipeline order; ``relations``: which of them act on or
    compete for the same sites. Each piece of the axis gets the passes that act there
    (:meth:`PassRelations.effective`); pieces with the same passes share one specialization,
    so a bound that changes nothing compiles nothing. Returns the specializations (each
    distinct set of passes once) and, per piece of the token axis, how a call picks one.
    """
    relations = relations or PassRelations()
    ends = set(user_ends)
    for constraint in constraints.values():
        if constraint is not None:
            ends |= constraint.ends()
    user_pieces = split(user_ends)
    specs: dict[tuple[int, tuple[str, ...], tuple[int, ...]], list[TokenRange]] = {}
    left_out: dict[tuple[int, tuple[str, ...], tuple[int, ...]], dict[str, set[str]]] = {}
    rules: list[tuple[TokenRange, tuple[int, ...], dict[tuple[bool, ...], Any]]] = []
    for piece in split(ends):
        user_piece = next(
            i
            for i, u in enumerate(user_pieces)
            if u.lo <= piece.lo and (u.hi is None or (piece.hi is not None and piece.hi <= u.hi))
        )
        inside = {n: c for n, c in constraints.items() if c is None or c.covers(piece)}
        divisors = tuple(sorted({c.multiple_of for c in inside.values() if c and c.multiple_of > 1}))
        choice = {}
        for outcome in _outcomes(len(divisors)):
            holds = {d for d, ok in zip(divisors, outcome) if ok}
            if any(t % f == 0 for t in holds for f in set(divisors) - holds):
                continue  # impossible: a multiple of t is a multiple of its divisor f
            applicable = [
                n for n, c in inside.items() if c is None or c.multiple_of == 1 or c.multiple_of in holds
            ]
            passes, dropped = relations.effective(applicable)
            for n, c in constraints.items():
                if n not in applicable:
                    dropped[n] = f"applies to {c}"
            needed = tuple(
                sorted({c.multiple_of for n, c in inside.items() if n in passes and c and c.multiple_of > 1})
            )
            key = (user_piece, passes, needed)
            pieces = specs.setdefault(key, [])
            if pieces and pieces[-1].hi is not None and pieces[-1].hi + 1 == piece.lo:
                pieces[-1] = TokenRange(pieces[-1].lo, piece.hi)  # adjacent: one range
            elif not any(
                r.lo <= piece.lo and (r.hi is None or (piece.hi or math.inf) <= r.hi) for r in pieces
            ):
                pieces.append(piece)
            reasons = left_out.setdefault(key, {})
            for n, why in dropped.items():
                reasons.setdefault(n, set()).add(why)
            choice[outcome] = key
        rules.append((piece, divisors, choice))
    ordered = list(specs)
    index = {key: i for i, key in enumerate(ordered)}
    specializations = [
        Specialization(
            key[1],
            tuple(specs[key]),
            key[2],
            tuple((n, "; ".join(sorted(left_out[key][n]))) for n in constraints if n in left_out[key]),
        )
        for key in ordered
    ]
    range_rules = _merge_rules(
        [
            RangeRule(piece.lo, piece.hi, divisors, {o: index[k] for o, k in choice.items()})
            for piece, divisors, choice in rules
        ]
    )
    return specializations, range_rules


def plan_static(
    constraints: Mapping[str, TokenConstraint | None],
    tokens: int,
    relations: PassRelations | None = None,
) -> dict[str, str]:
    """The passes a graph with static shapes, serving ``tokens`` tokens only, compiles
    without, each with why (``{name: reason}``, in pipeline order): those whose constraint does
    not admit ``tokens``, then those :meth:`PassRelations.effective` drops among the rest.
    ``constraints`` as for :func:`plan_specializations`."""
    relations = relations or PassRelations()
    outside = {
        n: c.excludes_why(tokens) for n, c in constraints.items() if c is not None and not c.admits(tokens)
    }
    _, dropped = relations.effective([n for n in constraints if n not in outside])
    reasons = {**outside, **{n: f"{why} (static tokens {tokens})" for n, why in dropped.items()}}
    return {n: reasons[n] for n in constraints if n in reasons}


def _merge_rules(rules: list[RangeRule]) -> list[RangeRule]:
    """Simplify each rule (drop divisors whose outcome picks nothing different), then join
    neighbouring rules that dispatch alike: fewer comparisons per call."""
    simple: list[RangeRule] = []
    for rule in rules:
        divisors, choice = list(rule.divisors), dict(rule.choice)
        for i in reversed(range(len(divisors))):
            by_rest: dict[tuple[bool, ...], set[int]] = {}
            for outcome, spec in choice.items():
                by_rest.setdefault(outcome[:i] + outcome[i + 1 :], set()).add(spec)
            if all(len(specs) == 1 for specs in by_rest.values()):
                divisors.pop(i)
                choice = {o[:i] + o[i + 1 :]: s for o, s in choice.items()}
        simple.append(RangeRule(rule.lo, rule.hi, tuple(divisors), choice))
    merged: list[RangeRule] = []
    for rule in simple:
        last = merged[-1] if merged else None
        if last is not None and last.divisors == rule.divisors and dict(last.choice) == dict(rule.choice):
            merged[-1] = RangeRule(last.lo, rule.hi, last.divisors, last.choice)
        else:
            merged.append(rule)
    return merged


def _outcomes(n: int) -> list[tuple[bool, ...]]:
    if n == 0:
        return [()]
    rest = _outcomes(n - 1)
    return [(True, *r) for r in rest] + [(False, *r) for r in rest]
