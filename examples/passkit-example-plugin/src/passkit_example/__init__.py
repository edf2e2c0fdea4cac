"""Example passkit passes, as a third party would ship them."""

from .fold_double_neg import FoldDoubleNeg
from .fuse_addcmul import FuseAddcmul

__all__ = ["FoldDoubleNeg", "FuseAddcmul"]
