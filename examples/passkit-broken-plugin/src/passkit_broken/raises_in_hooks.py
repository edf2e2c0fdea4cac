"""An entry-point module that loads fine, but whose hooks raise while a model compiles."""

import passkit


@passkit.hookimpl
def passkit_before_pass(pass_, gm, context):
    raise RuntimeError(f"passkit-broken-plugin's before-pass hook fails on purpose ({pass_.name})")


@passkit.hookimpl
def passkit_report(report):
    raise KeyError("passkit-broken-plugin's report hook fails on purpose")
