"""passkit's own errors, raised from inside ``torch.compile``, read as passkit's.

Dynamo wraps whatever a backend raises in ``BackendCompilerFailed`` and prints its own
frames, some 40 lines, before the message. :func:`surface` re-raises a
:class:`~passkit.errors.PasskitError` as an instance of the same class that is also a
Dynamo ``ShortenTraceback``, which Dynamo lets through unwrapped and trims to the frames
from passkit's backend on (``TORCHDYNAMO_VERBOSE=1`` still shows all); the message is
logged first, so the first line a user sees names the field and the value. The error's
``__cause__`` is kept (Inductor's error under a :class:`~passkit.errors.PassFailedError`).
"""

from __future__ import annotations

import functools
import types
from typing import NoReturn

from .. import logs
from ..errors import PasskitError


@functools.cache
def _shortened(cls: type[PasskitError]) -> type[PasskitError]:
    """``cls``, also a Dynamo ``ShortenTraceback`` (same name and module: it prints as ``cls``)."""
    from torch._dynamo.exc import ShortenTraceback

    return type(
        cls.__name__,
        (cls, ShortenTraceback),
        {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
    )


def surface(exc: PasskitError, frame: types.FrameType | None, what: str) -> NoReturn:
    """Log ``exc`` (``what``: where it happened) and raise it so Dynamo shows it as is,
    starting at ``frame`` (the backend's). Falls back to ``raise exc`` where Dynamo's
    exception classes moved."""
    try:
        from torch._dynamo.exc import ShortenTraceback

        if isinstance(exc, ShortenTraceback):  # surfaced already (a backend inside a backend)
            raise exc
    except ImportError:  # pragma: no cover - torch moved it: surface again below
        pass
    logs.log.error("passkit: %s: %s", what, exc)
    try:
        short = _shortened(type(exc))  # type: ignore[arg-type]  # classes are hashable
        err = short.__new__(short)
        err.__dict__.update(exc.__dict__)
        err.args = exc.args
        err.first_useful_frame = frame  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover - torch moved ShortenTraceback; keep the original
        raise exc from None
    raise err.with_traceback(None) from exc.__cause__  # e.g. Inductor's error under a PassFailedError
