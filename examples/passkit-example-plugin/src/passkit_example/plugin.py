"""The ``example`` entry point in the ``passkit.passes`` group."""

import passkit

from .fold_double_neg import FoldDoubleNeg, FoldDoubleNegJoint
from .fuse_addcmul import FuseAddcmul
from .silu_from_sigmoid import SiluFromSigmoid


@passkit.hookimpl
def passkit_register_passes():
    return [FoldDoubleNeg, FoldDoubleNegJoint, FuseAddcmul, SiluFromSigmoid]
