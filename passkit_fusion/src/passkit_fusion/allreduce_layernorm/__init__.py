"""The ``allreduce_layernorm`` pass: all-reduce -> (add residual) -> LayerNorm becomes one op.

* :mod:`.pass_`: the pass (:class:`AllReduceLayerNorm`, :class:`AllReduceLayerNormOptions`);
  the sites come from :mod:`passkit_fusion.patterns.sites` with ``norm="layer"`` (the
  LayerNorm forms: :mod:`passkit_fusion.patterns.layernorm`).
* :mod:`.ops`: the ``torch.ops.passkit_fusion.allreduce_add_layernorm`` custom op.
* :mod:`.runtime`: its CUDA implementation: the symmetric-memory one-shot all-reduce into a
  persistent buffer, the NCCL fallback, ``prepare`` / ``destroy_buffers``.
* :mod:`.triton_kernel`: residual add + LayerNorm in one Triton kernel (imported on the GPU
  path only).

Importing this package imports the pass class only.
"""

from .pass_ import AllReduceLayerNorm, AllReduceLayerNormOptions

__all__ = ["AllReduceLayerNorm", "AllReduceLayerNormOptions"]
