"""passkit-fusion: fusion passes for distributed inference, as a passkit plugin.

* ``allreduce_rmsnorm``: ``all_reduce -> (add residual) -> RMSNorm [-> static FP8 quant]``
  becomes one call of flashinfer's fused kernel (``passkit-fusion[flashinfer]``) or a torch
  reference;
* ``allreduce_layernorm`` (opt-in, off by default until measured to pay): the same for
  ``all_reduce -> (add residual) -> LayerNorm``, torch's symmetric-memory one-shot all-reduce
  then a Triton residual add + LayerNorm kernel;
* ``allreduce_overlap`` (opt-in, experimental: 0.94-1.00x Inductor on 2x H200): a row-parallel matmul and its all-reduce split
  into token chunks, each chunk's all-reduce overlapping the next chunk's matmul;
* ``sequence_parallel``: the residual stream between tensor-parallel layers sharded along
  tokens (reduce-scatter -> add -> RMSNorm on 1/W of the tokens -> all-gather);
* ``async_tp``: all-gather -> matmul and matmul -> reduce-scatter become PyTorch's
  symmetric-memory overlapped ops.

Enable them by name in a passkit config; passkit finds them through the ``passkit.passes``
entry point and runs each only on the token counts where it pays. The passes read graphs
through host op *dialects* (:class:`Dialect`): torch's functional collectives, vLLM's and
SGLang's ops, and any a plugin adds through the ``passkit_fusion_dialects`` hook. Nothing
heavy is imported here: flashinfer is imported on the first fused call, a host never.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "AllReduceRMSNorm": "allreduce_rmsnorm",
    "AllReduceRMSNormOptions": "allreduce_rmsnorm",
    "AllReduceLayerNorm": "allreduce_layernorm",
    "AllReduceLayerNormOptions": "allreduce_layernorm",
    "AllReduceOverlap": "allreduce_overlap",
    "AllReduceOverlapOptions": "allreduce_overlap",
    "AsyncTP": "async_tp",
    "AsyncTPOptions": "async_tp",
    "SequenceParallel": "sequence_parallel",
    "SequenceParallelOptions": "sequence_parallel",
    "Dialect": "dialects",
    "check_schemas": "dialects",
    "registered_dialects": "dialects",
    "prepare": "allreduce_rmsnorm.runtime",
    "configure": "allreduce_rmsnorm.runtime",
    "destroy_workspaces": "allreduce_rmsnorm.runtime",
    "stats": "allreduce_rmsnorm.runtime",
    "CollectiveError": "allreduce_rmsnorm.runtime",
    "RankAgreementError": "collective",
    "report_failure": "collective",
    "Table": "tuning.tables",
    "tune_model": "tuning.measure",
    "FuseDecision": "tuning.decisions",
    "load_table": "tuning.tables",
    "save_table": "tuning.tables",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """Public names, imported on first use (so ``import passkit_fusion`` stays light)."""
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, "registered" if name == "registered_dialects" else name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
