"""A pass's notes less the dialects' version notes, for tests that compare notes exactly.

A torch (or host) release other than the recorded ones adds one line to the notes of every
fusion pass that reads its ops: ``"torch dialect: schemas recorded for torch 2.10.0, ...,
running 2.16.0: sites matched where the ops' schemas agree"``
(:meth:`~passkit_fusion.dialects.base.Dialect.version_note`), alone or after a
``"host already fused: ..."`` part (``"; "`` between them). :func:`pass_notes` takes out
exactly those parts, so that a test asserting a pass's own notes holds on such a release and
still fails on any other extra or missing note (``test_version_notes_are_stripped_exactly``).
"""

from __future__ import annotations

from typing import Any

from passkit_fusion.dialects import builtin


def version_notes() -> set[str]:
    """What each shipped dialect notes about the running host's version (none for a
    recorded version, nor for a host not imported)."""
    return {note for cls in builtin() if (note := cls().version_note())}


def pass_notes(record: Any) -> list[str]:
    """``record.notes`` (a pass's report record) without :func:`version_notes`."""
    drop = version_notes()
    kept = []
    for note in record.notes:
        parts = [part for part in note.split("; ") if part not in drop]
        if parts:
            kept.append("; ".join(parts))
    return kept
