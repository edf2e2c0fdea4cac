"""An entry-point module whose hookimpl does not match the hookspec."""

import passkit

from .well_formed import WellFormed


@passkit.hookimpl
def passkit_register_passes(config):  # the hookspec takes no argument named "config"
    return [WellFormed]
