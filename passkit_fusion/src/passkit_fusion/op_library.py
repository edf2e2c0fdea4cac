"""One way to define the ``passkit_fusion::*`` ops a compiled graph calls per site.

:func:`define` gives an op a schema, one implementation for every device and a fake, with
``torch.library.Library``, not ``torch.library.custom_op``: a compiled graph calls the op
once per site on every forward, and ``custom_op``'s Python wrappers (its autograd layer and
alias checks) cost two to three times the dispatcher's own call (15.7 vs 7.0 us on a busy
CPU core, ``benchmarks/op_host_cost.py``; about 50 us of the copy-engine op's 400 on an H200's
host, ``benchmarks/overlap_op.py --host-cost``), which a forward without CUDA graphs pays.

The ops are inference ops: they have no autograd formula (the passes that leave them run on
inference graphs only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NAMESPACE = "passkit_fusion"

_library = torch.library.Library(NAMESPACE, "FRAGMENT")


def define(schema: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> None:
    """Define ``passkit_fusion::<name>`` from ``schema`` (``"name(...) -> ..."``), ``impl``
    for every device, ``fake`` for tracing."""
    name = schema.split("(", 1)[0]
    _library.define(schema, tags=(torch.Tag.pt2_compliant_tag,))
    _library.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_library)
