"""What every collective fusion of passkit-fusion needs, written once.

* :mod:`.groups`: process groups by name, the device their collectives use, their store.
* :mod:`.agreement`: :func:`agree`, the bounded-wait exchange through which ranks check
  that they took the same decision before a collective step; a missing, late or diverging
  rank becomes a :class:`RankAgreementError` on every rank instead of a hang.
* :mod:`.hosts`: which host each rank of a group is on, exchanged through the agreement;
  fusions that map peer GPUs' memory decline on a group that spans hosts.
* :mod:`.teardown`: steps that may block on a GPU or a peer (waiting for the device before
  freeing memory shared with other ranks) run with a time limit and are skipped, with a
  log line, when they cannot finish.
* :mod:`.resources`: freeing GPU memory shared with peer ranks (flashinfer workspaces,
  later symmetric-memory buffers) only once the GPU is idle, leaking it rather than
  hanging, and freeing what is left at exit.

Nothing here imports flashinfer or needs CUDA.
"""

from ..timeouts import MAX_TIMEOUT_S, TimeoutSeconds, check_timeout
from .agreement import (
    DEFAULT_TIMEOUT_S,
    RankAgreementError,
    agree,
    agree_plan_once,
    compare_plans,
    exchange,
    plan_fingerprint,
    report_failure,
)
from .groups import collective_device, group_store, is_fake_group, resolve_group
from .hosts import HOST_ID_ENV, hosts_of, spans_hosts
from .hosts import publish as publish_host
from .teardown import bounded

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "HOST_ID_ENV",
    "MAX_TIMEOUT_S",
    "RankAgreementError",
    "TimeoutSeconds",
    "agree",
    "agree_plan_once",
    "bounded",
    "check_timeout",
    "collective_device",
    "compare_plans",
    "exchange",
    "group_store",
    "hosts_of",
    "is_fake_group",
    "plan_fingerprint",
    "publish_host",
    "report_failure",
    "resolve_group",
    "spans_hosts",
]
