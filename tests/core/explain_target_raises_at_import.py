"""A target module that raises as it is imported (``passkit explain`` names it in one line)."""

SIZES = {"hidden": 12}
if SIZES["hidden"] % 8:
    raise RuntimeError("hidden size 12 is not a multiple of 8")
