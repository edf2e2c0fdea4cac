"""Which all-reduce sites of a Hugging Face architecture the tensor-parallel passes take:
small random models sharded with ``tp_plan="auto"`` on a CPU gloo world (:mod:`.run`),
built from a config class or a user's ``config.json`` (:mod:`.configs`); the
``passkit explain-hf`` command (:mod:`.cli`) and ``benchmarks/coverage.py`` print it."""
