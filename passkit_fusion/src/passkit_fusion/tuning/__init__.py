"""Tuned decision tables, shared by the fusion passes, and how they are measured.

* :mod:`.tables`: the table model (when to fuse, one-shot or two-shot), the JSON tables
  shipped in ``tables/``, the user's tuned tables, lookups, and the rule that turns timed
  variants into rules.
* :mod:`.timing`: the CUDA-graph median timing helpers (tuning, benchmarks, the demo).
* :mod:`.cli`: the ``passkit tune`` command's arguments and its multi-GPU run; what it
  measures is handed in by the plugin (for now :func:`passkit_fusion.allreduce_rmsnorm.tune.tune`).

Nothing here imports a pass, flashinfer or torch.distributed at import time.
"""
