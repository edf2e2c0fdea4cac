"""An entry-point module that fails to import."""

raise RuntimeError("passkit-broken-plugin fails on import on purpose")
