"""The plan of one compile: the passes about to run on one graph, which plugins adjust
(``passkit_configure_pipeline``) before they run.

Its own module because the hook specifications name it (:mod:`passkit.hookspecs`) and the
pipeline makes it (:mod:`passkit._pipeline.run`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .names import same_pass
from .pass_base import Pass, validate_options


class PipelinePlan:
    """The passes about to run on one graph; plugins may adjust it (see hookspecs)."""

    def __init__(self, passes: list[Pass]):
        self.passes = list(passes)
        self.skipped: dict[str, str] = {}

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def get(self, name: str) -> Pass:
        """The pass ``name`` spells, bare or qualified (``passkit:cleanup``)."""
        for p in self.passes:
            if same_pass(p.name, name):
                return p
        raise KeyError(f"pass {name!r} is not in this pipeline (have {self.names})")

    def skip(self, name: str, reason: str) -> None:
        self.skipped[self.get(name).name] = reason

    def checkpoint(self) -> Callable[[], None]:
        """A function that puts the plan back as it is now (undoes a plugin hook that
        changed it, then raised)."""
        passes, skipped = list(self.passes), dict(self.skipped)

        def undo() -> None:
            self.passes, self.skipped = list(passes), dict(skipped)

        return undo

    def set_options(self, name: str, **options: Any) -> None:
        old = self.get(name)
        merged = {**old.options.model_dump(), **options}
        new = type(old)(validate_options(type(old), merged))
        self.passes[self.passes.index(old)] = new
