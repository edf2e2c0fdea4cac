"""passkit's pass for vLLM's command line, built from passkit's config when imported.

::

    PASSKIT_PASSES=allreduce_rmsnorm vllm serve MODEL --tensor-parallel-size 2 \\
      --compilation-config '{"inductor_passes": {"post_grad_custom_post_pass": "passkit_vllm.post_grad_pass"}}'

vLLM resolves that name with ``__import__("passkit_vllm").__dict__["post_grad_pass"]``, which
reaches attributes of top-level modules only: hence this module, shipped in the ``passkit``
distribution. Importing it imports vLLM and reads passkit's config sources (``passkit.toml``,
``[tool.passkit]``, ``PASSKIT_*``); a config that fails or enables no pass stops the
process with one line naming the field. See :mod:`passkit.hosts.vllm.command_line`.
"""

from passkit.hosts.vllm.command_line import pass_or_exit

post_grad_pass = pass_or_exit()
"""The vLLM ``InductorPass`` running the configured passkit pipeline."""

__all__ = ["post_grad_pass"]
