"""Telling Ctrl-C from a plugin's own ``KeyboardInterrupt`` while passkit runs plugin code.

A ``KeyboardInterrupt`` raised while a plugin's entry point is imported (or its
``passkit_register_passes`` runs) is one of two things:

* the user pressed Ctrl-C (SIGINT) while the import was under way: it must stop the
  program, as everywhere else; passkit re-raises it, and says on stderr which plugin was
  being loaded (a slow import then has a name);
* the plugin's code raised it itself, no key pressed: a bug in the plugin. Re-raised, it
  would end every compile of the process with a bare ``KeyboardInterrupt`` naming nothing;
  passkit records it as the plugin's load failure instead (``passkit list`` names it, the
  other plugins load).

:func:`watch_sigint` tells them apart by wrapping the SIGINT handler for the duration: a
SIGINT that arrived is seen. Where it cannot wrap the handler (not the main thread, or a
handler that is not Python's), it cannot tell, and the interrupt is treated as Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["from_the_user", "say_interrupted", "watch_sigint"]


@contextlib.contextmanager
def watch_sigint() -> Iterator[Callable[[], bool | None]]:
    """Within the block, SIGINTs are counted (and handled as before); yields a function
    saying whether one arrived (None: not known, the handler could not be wrapped)."""
    seen: list[int] = []
    previous: Any = None
    installed = False
    if threading.current_thread() is threading.main_thread():
        try:
            previous = signal.getsignal(signal.SIGINT)
        except (ValueError, OSError):
            previous = None
        if callable(previous):

            def counting(signum: int, frame: Any) -> Any:
                seen.append(signum)
                return previous(signum, frame)

            try:
                signal.signal(signal.SIGINT, counting)
                installed = True
            except (ValueError, OSError):
                installed = False
        elif previous in (signal.SIG_IGN, signal.SIG_DFL):
            # no SIGINT can become a KeyboardInterrupt here: one raised is the code's own
            installed = True

    def arrived() -> bool | None:
        return bool(seen) if installed else None

    try:
        yield arrived
    finally:
        if installed and callable(previous):
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGINT, previous)


def from_the_user(arrived: Callable[[], bool | None]) -> bool:
    """Whether a ``KeyboardInterrupt`` seen in :func:`watch_sigint`'s block is Ctrl-C
    (or may be: not known counts as Ctrl-C)."""
    return arrived() is not False


def say_interrupted(what: str) -> None:
    """One line on stderr naming what the interrupt stopped (never raises)."""
    with contextlib.suppress(Exception):
        sys.stderr.write(f"passkit: interrupted while {what}\n")
        sys.stderr.flush()
