"""Tuned decision tables, shared by the fusion passes, and how they are measured.

* :mod:`.tables`: the table model (when to fuse, one-shot or two-shot), the JSON tables
  shipped in ``tables/``, the user's tuned tables, lookups, and the rule that turns timed
  variants into rules.
* :mod:`.timing`: the CUDA-graph median timing helpers (tuning, benchmarks, the demo).
* :mod:`.decisions`: measured fuse decisions per model (which passes run in which token
  range): the rule, storage keyed by graph, passes and machine, and the ``Tunable`` mixin
  through which the passes take their token ranges from a decision.
* :mod:`.measure`: :func:`~.measure.tune_model`, timing the candidate pass sets on the
  user's model within a time budget, agreed across ranks (``passkit tune-model``).
* :mod:`.cli`: the ``passkit tune`` command's arguments and its multi-GPU run; what it
  measures is handed in by the plugin (for now :func:`passkit_fusion.allreduce_rmsnorm.tune.tune`);
  ``passkit tune-model``.

Nothing here imports a pass, flashinfer or torch.distributed at import time.
"""
