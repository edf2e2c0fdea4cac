"""The ``allreduce_overlap`` pass: a row-parallel matmul and its all-reduce, in token chunks.

* :mod:`.pass_`: the pass (:class:`AllReduceOverlap`, :class:`AllReduceOverlapOptions`).
* :mod:`.rewrite`: finding ``mm -> (views) -> all_reduce -> wait`` and splitting it.

Importing this package imports the pass class only.
"""

from .pass_ import AllReduceOverlap, AllReduceOverlapOptions

__all__ = ["AllReduceOverlap", "AllReduceOverlapOptions"]
