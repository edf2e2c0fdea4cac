"""Generic graph-hygiene passes shipped with passkit, registered through the same
``passkit.passes`` entry point as any third-party plugin (see ``plugin.py``)."""

from .cleanup import Cleanup
from .noop_elimination import NoopElimination
from .reinplace import Reinplace

__all__ = ["Cleanup", "NoopElimination", "Reinplace"]
