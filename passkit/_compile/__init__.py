"""passkit's compile machinery (private): the ``torch.compile`` backend, token-range
specialization, the trace shared by specializations, Inductor's options and failures, Dynamo's
errors, the report cache. The public door is :func:`passkit.backend`."""
