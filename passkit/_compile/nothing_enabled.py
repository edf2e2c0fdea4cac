"""Saying so when passkit's backend runs no pass.

``torch.compile(m, backend="passkit")`` with no pass configured anywhere compiles as the
compiler alone would, and makes no report: without a word, that looks like passkit ran and
found nothing to do. :func:`warn` says it once per process (per situation), with where
passkit looked for ``passes`` and what it found there. Its words come from what the config
already knows (the sources that set each field): no file is read again.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import ENV_ORIGIN, ENV_PREFIX, Config
from ..errors import cut, warn_config

PYTHON = "Python config"
"""How the config names the backend's own arguments as a source."""


def warn(config: Config, compiler: str) -> None:
    """Warn (:class:`~passkit.ConfigWarning`, once per process) that ``config`` enables no
    pass, unless the backend's arguments asked for none (``passkit.backend(passes=[])``)."""
    if config.passes or (config.passes_from == PYTHON and not config.disable):
        return
    warn_config(message(config, compiler))


def message(config: Config, compiler: str) -> str:
    """Why no pass runs, where passkit looked, what it found."""
    if config.passes_from is None:
        why = "no config source sets `passes`"
    elif config.disable:
        why = f"`passes` from {cut(config.passes_from)} lists none that is not disabled (disable = {config.disable})"
    else:
        why = f"`passes` from {cut(config.passes_from)} is empty"
    explicit = os.environ.get(f"{ENV_PREFIX}CONFIG")
    toml = f"{ENV_PREFIX}CONFIG={cut(explicit)}" if explicit else "passkit.toml"
    variables = sorted(k for k in os.environ if k.startswith(ENV_PREFIX))
    origins = set(config._origins.values())
    files = sorted(o for o in origins if o not in (ENV_ORIGIN, PYTHON))
    python = sorted(f for f, o in config._origins.items() if o == PYTHON)
    return (
        f"no pass is enabled ({why}): the backend compiles with {compiler} alone and makes no "
        "report (passkit.last_report() stays None). passkit looked for `passes` in "
        f"{toml} and pyproject.toml [tool.passkit] from {Path.cwd()} upward (files that set "
        f"anything: {cut(', '.join(files)) if files else 'none'}), the {ENV_PREFIX}* environment "
        f"(set: {cut(', '.join(variables)) if variables else 'none'}) and the backend's arguments "
        f"(given: {', '.join(python) if python else 'none'}); set `passes` in one of them, e.g. "
        f"{ENV_PREFIX}PASSES=cleanup"
    )
