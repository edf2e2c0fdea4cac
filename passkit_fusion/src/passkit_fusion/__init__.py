"""passkit-fusion: fusion passes for distributed inference, as a passkit plugin.

The pass ``allreduce_rmsnorm`` replaces ``all_reduce -> (add residual) -> RMSNorm`` in
tensor-parallel graphs by ``torch.ops.passkit_fusion.allreduce_rmsnorm``, which runs
flashinfer's fused kernel on CUDA (``passkit-fusion[flashinfer]``) or a torch reference.
Enable it by name in a passkit config; passkit finds it through the ``passkit.passes``
entry point. Nothing heavy is imported here: flashinfer is imported on the first fused call.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
