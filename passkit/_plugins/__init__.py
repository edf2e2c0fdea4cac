"""passkit's plugin machinery (private): the plugin set and its registry, hooks called in
isolation, the checks of a plugin's mistakes, the CLI's hooks and options docs. The public door
is :mod:`passkit.plugins`."""
