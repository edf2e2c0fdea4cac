"""The ``allreduce_rmsnorm`` pass: all-reduce -> (add residual) -> RMSNorm becomes one op.

* :mod:`.pass_`: the pass (:class:`AllReduceRMSNorm`, :class:`AllReduceRMSNormOptions`).
* the sites come from :mod:`passkit_fusion.patterns.sites` (all-reduce and residual add in
  every host dialect; the RMSNorm forms from :mod:`passkit_fusion.patterns.rmsnorm`).
* :mod:`.ops`: the ``torch.ops.passkit_fusion.allreduce_rmsnorm`` custom op.
* :mod:`.runtime`: the op's CUDA implementation: configuration, per-call routing (fused
  one-shot / two-shot / unfused), statistics, rank checks, ``prepare`` and
  ``destroy_workspaces``.
* :mod:`.flashinfer_api`: adapters over flashinfer's two all-reduce fusion APIs.
* :mod:`.workspaces`: creating and freeing flashinfer's IPC workspaces.
* :mod:`.tune`: measuring the op for decision tables (``passkit tune``).

Importing this package imports the pass class only: :mod:`.ops` is imported when the pass
runs or when the op is first looked up (:mod:`passkit_fusion.lazy_ops`), flashinfer and the
runtime at the op's first flashinfer call.
"""

from .pass_ import AllReduceRMSNorm, AllReduceRMSNormOptions

__all__ = ["AllReduceRMSNorm", "AllReduceRMSNormOptions"]
