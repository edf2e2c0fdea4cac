"""passkit's pipeline machinery (private): building a pipeline from a config and the plugin set
(``build``), running its passes (``run``), and the checks that follow the graph a pass leaves
(baseline, graph diff, schema, output, input-mutation and numeric checks, verify), dumps and
declined sites. The public door is :class:`passkit.Pipeline` and :func:`passkit.build_pipeline`."""
