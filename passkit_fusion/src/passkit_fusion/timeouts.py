"""The timeouts passkit-fusion's passes take as options (``collective_timeout_s``, ...) and
check: finite, more than 0, at most a day. A module of its own, light to import: a pass's
options are built with the backend, before any collective step is near (the
:mod:`passkit_fusion.collective` package is imported only when a pass runs)."""

from __future__ import annotations

import math
from typing import Annotated, Any

import pydantic

__all__ = ["MAX_TIMEOUT_S", "TimeoutSeconds", "check_timeout", "timeout_problem"]

MAX_TIMEOUT_S = 24 * 3600.0
"""The longest wait a timeout option takes (a day): every wait must end, and one of more
than a day is a typo (``1e999`` reads as infinity)."""


def timeout_problem(value: Any) -> str | None:
    """Why ``value`` is no timeout (seconds, finite, more than 0, at most
    :data:`MAX_TIMEOUT_S`), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"expected a number of seconds, got {type(value).__name__}"
    if not math.isfinite(value):
        return f"{value!r} is not a finite number of seconds (every wait must end)"
    if not 0 < value <= MAX_TIMEOUT_S:
        return f"{value!r} s: must be more than 0 and at most {MAX_TIMEOUT_S:g} s (a day)"
    return None


def check_timeout(name: str, value: float) -> float:
    """``value`` when it is a timeout (:func:`timeout_problem`), else a ValueError naming ``name``."""
    problem = timeout_problem(value)
    if problem:
        raise ValueError(f"{name}: {problem}")
    return float(value)


TimeoutSeconds = Annotated[float, pydantic.Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)]
"""The type of the passes' ``*_timeout_s`` options: finite, more than 0, at most a day."""
