"""FX graph patterns shared by the passes' matchers.

* :mod:`.graph`: node values, module paths, symbolic shape comparison, formatting for
  rejection reasons, a graph's process group's world size, :class:`~.graph.Mismatch`.
* :mod:`.rmsnorm`: recognising the RMSNorm forms that follow a given node.
* :mod:`.fp8`: recognising a static per-tensor ``float8_e4m3fn`` quantization after a node.
* :mod:`.sites`: the ``all_reduce -> (add residual) -> RMSNorm`` sites of a graph, in every
  host's dialect (:mod:`passkit_fusion.dialects`), for ``allreduce_rmsnorm`` and
  ``sequence_parallel``.

Pure graph inspection: no process group is created, nothing is imported from a pass or a host.
"""
