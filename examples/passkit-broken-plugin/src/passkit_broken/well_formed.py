"""A correct pass, shipped by a plugin that cannot register it."""

import passkit


class WellFormed(passkit.GraphPass):
    """Does nothing."""

    name = "well_formed"

    def run(self, gm, ctx):
        return passkit.PassResult.unchanged()
