"""Steps that could block forever, run with a time limit."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger("passkit_fusion")


def bounded(fn: Callable[[], object], timeout_s: float, what: str) -> bool:
    """Run ``fn`` in a daemon thread; True if it returned within ``timeout_s``.

    When it does not (a GPU kernel waiting for a peer that died, a driver call that never
    returns), log a warning naming ``what`` and return False: the thread is left behind,
    blocked, and cannot keep the process from exiting. An exception from ``fn`` is logged
    and also gives False.
    """
    error: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name=f"passkit-fusion: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("passkit_fusion: %s did not finish within %g s; skipped", what, timeout_s)
        return False
    if error:
        logger.warning("passkit_fusion: %s failed: %s: %s", what, type(error[0]).__name__, error[0])
        return False
    return True
