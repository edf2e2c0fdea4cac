"""passkit inside vLLM: one line adds a passkit pipeline to vLLM's post-grad pass manager.

::

    import passkit.hosts.vllm
    from vllm import LLM

    llm = LLM(model, compilation_config={"inductor_compile_config": {
        "post_grad_custom_post_pass": passkit.hosts.vllm.post_grad_pass(passes=["allreduce_rmsnorm"])}})

vLLM's ``PostGradPassManager`` runs its own passes, then the one object in
``inductor_compile_config["post_grad_custom_post_pass"]`` (which must be an instance of its
``InductorPass``), then lowers its IR ops. :func:`post_grad_pass` builds that object: a
:class:`passkit.hosts.vllm.inductor_pass.VllmPass` running a passkit :class:`~passkit.Pipeline`
(config from Python, ``PASSKIT_*``, ``passkit.toml``, ``[tool.passkit]`` as everywhere).

vLLM splits the token axis into compile ranges itself (``compile_ranges_endpoints``,
``compile_sizes``) and compiles each apart; the pass reads the range of the compile under
way from vLLM's pass context and runs the pipeline restricted to it (:func:`token_range`), so
passkit never splits ranges a second time: a pass whose token constraint does not hold on
the whole range is skipped, with the reason in the report. vLLM asks
``is_applicable_for_range`` first; the answer (:func:`applies`) is whether any enabled pass's
constraint holds there.

The adapter is this package, its imports in one direction: :mod:`.ranges` (vLLM's ranges as
passkit token ranges, report notes; no vLLM import) below :mod:`.inductor_pass` (the
``InductorPass`` subclass, which imports vLLM), both below this module, which re-exports
:mod:`.ranges` and imports :mod:`.inductor_pass` only in :func:`post_grad_pass`: importing
``passkit.hosts.vllm`` imports no vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ... import logs
from ..._pipeline.build import build_pipeline
from ...config import Config
from .. import OnUnknown, check_version
from .ranges import (
    HOST_FUSIONS,
    applies,
    constraints,
    endpoints,
    host_fusion_notes,
    range_label,
    range_notes,
    token_range,
)

if TYPE_CHECKING:
    from .inductor_pass import VllmPass

HOST = "vllm"


def post_grad_pass(
    config: Config | dict[str, Any] | None = None,
    *,
    on_unknown_version: OnUnknown = "warn",
    **overrides: Any,
) -> VllmPass:
    """The vLLM ``InductorPass`` running passkit's pipeline: put it in
    ``compilation_config["inductor_compile_config"]["post_grad_custom_post_pass"]``.

    ``config``/``overrides`` as for :func:`passkit.backend` (``passes=[...]``...). A vLLM
    version passkit was not tested with warns (``on_unknown_version="raise"``: a
    :class:`~passkit.hosts.HostError`) naming the found and supported versions.
    """
    version = check_version(HOST, on_unknown=on_unknown_version)
    logs.register_with_torch()
    try:
        from .inductor_pass import VllmPass
    except ImportError as exc:
        from .. import HostError

        raise HostError(
            f"passkit.hosts.vllm: vLLM {version} lacks an API the adapter needs ({exc}); "
            f"passkit supports the versions in passkit.hosts.HOSTS['vllm']"
        ) from None
    return VllmPass(build_pipeline(config, **overrides), version=version)


__all__ = [
    "HOST",
    "HOST_FUSIONS",
    "applies",
    "constraints",
    "endpoints",
    "host_fusion_notes",
    "post_grad_pass",
    "range_label",
    "range_notes",
    "token_range",
]
