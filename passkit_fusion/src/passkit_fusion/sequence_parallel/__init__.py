"""``sequence_parallel``: the residual stream between tensor-parallel layers sharded along
tokens (reduce-scatter + add + RMSNorm on 1/W of the tokens + all-gather).

* :mod:`.pass_`: the pass, its options, token constraint and report notes;
* :mod:`.rewrite`: the graph rewrite and the token-count checks;
* :mod:`.ops`: ``torch.ops.passkit_fusion.token_shard`` (this rank's rows, no communication);
* :mod:`.marks`: marks on rewritten nodes, so other passes can say a site was taken.
"""

from .pass_ import SequenceParallel, SequenceParallelOptions

__all__ = ["SequenceParallel", "SequenceParallelOptions"]
