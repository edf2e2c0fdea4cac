"""``async_tp``: all-gather + matmul and matmul + reduce-scatter as PyTorch's
symmetric-memory micro-pipelined ops, with passkit's lazy, bounded, rank-agreed set-up.

* :mod:`.passes`: the pass (:class:`AsyncTP`, :class:`AsyncTPOptions`);
* :mod:`.ops`: ``torch.ops.passkit_fusion.async_tp_*``, the ops left in the graph;
* :mod:`.runtime`: symmetric-memory set-up at first call, fallback, stats;
* :mod:`.torch_api`: every private torch API used, and what is missing on this torch.
"""

from .passes import AsyncTP, AsyncTPOptions

__all__ = ["AsyncTP", "AsyncTPOptions"]
