"""What a pass name and a distribution name mean, wherever they are written.

One place decides it, so that ``passes``, ``disable``, block and allow lists, the config files
and the environment agree:

- A pass is spelled bare (``cleanup``) or qualified by the distribution that registers it
  (``passkit:cleanup``, ``Acme_Passes:fuse``). :func:`same_pass` says whether two spellings
  can name one pass: the bare names are equal and, where both are qualified, so are the
  owners (normalized). A config cannot know which distribution a bare name belongs to, so
  ``cleanup`` and ``passkit:cleanup`` are one pass to it (the registry tells an enabled bare
  name that two distributions register apart: an error).
- A distribution is the same however it is spelled: PEP 503 normalization
  (:func:`normalize_distribution`, ``Acme_Passes`` is ``acme-passes``).
- A pass name must fit everywhere passkit writes it (:func:`pass_name_problem`): a dump's
  file name, a log line, the report table, ``PASSKIT_PASSES``' list syntax.
"""

from __future__ import annotations

import re
import unicodedata

MAX_PASS_NAME = 100
"""The longest pass name (characters): it is part of file names in the dump folder."""

_SEPARATORS = {
    "/": "separates folders in a dump's file names",
    "\\": "separates folders in a dump's file names on Windows",
    ":": "separates a distribution from a pass name (`acme-passes:my_pass`)",
    ",": "separates the passes of PASSKIT_PASSES / PASSKIT_DISABLE",
    "=": "separates an option from its value in PASSKIT_PASSES (`name:option=value`)",
}


def normalize_distribution(name: str) -> str:
    """A distribution's name as PEP 503 compares it: ``Acme_Passes`` -> ``acme-passes``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def split_pass_name(name: str) -> tuple[str | None, str]:
    """``(owner, bare name)`` of a pass spelling: ``"Acme_Passes:x"`` -> ``("acme-passes",
    "x")``, the owner normalized (``in-process:<plugin>`` kept as written); a bare name has
    owner ``None``."""
    if ":" not in name:
        return None, name
    who, _, bare = name.rpartition(":")
    if not who.startswith("in-process:"):
        who = normalize_distribution(who)
    return who, bare


def same_pass(a: str, b: str) -> bool:
    """Whether the spellings ``a`` and ``b`` can name one pass (see the module docstring)."""
    owner_a, bare_a = split_pass_name(a)
    owner_b, bare_b = split_pass_name(b)
    return bare_a == bare_b and (owner_a is None or owner_b is None or owner_a == owner_b)


def pass_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a pass's name, or None when it can."""
    if not isinstance(name, str) or not name:
        return "a pass's name must be a non-empty string"
    if len(name) > MAX_PASS_NAME:
        return f"is {len(name)} characters long (at most {MAX_PASS_NAME}: it is part of dump file names)"
    for char, why in _SEPARATORS.items():
        if char in name:
            return f"contains {char!r}, which {why}"
    for char in name:
        if char.isspace() or unicodedata.category(char).startswith("C"):
            return (
                f"contains {char!a} (whitespace or a control character: a log line, the report "
                "table and a file name cannot hold it)"
            )
    if name.startswith("."):
        return "starts with '.' (a hidden or relative name in the dump folder)"
    return None
