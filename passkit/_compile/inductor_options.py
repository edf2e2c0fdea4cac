"""torch.compile's ``mode`` and ``options``, turned into Inductor config patches.

``torch.compile(m, backend="passkit", mode="reduce-overhead", options={...})`` hands the
backend ``mode=`` and ``options=`` keyword arguments. Inductor's own wrapper
(``torch._TorchCompileInductorWrapper``) turns them into config patches
(``list_mode_options``: CUDA graphs, max-autotune...) and checks every option's name and
type; passkit reuses it, so each mode means exactly what it means for ``backend="inductor"``.

:func:`merge_patches` then joins, for one compile, the patches of torch.compile, of the
backend's ``inductor_config`` and of the pipeline (its custom-pass keys). A custom pass the
user put in a slot passkit uses is kept and runs first (composed, never overwritten); one
option given two different values by two sources is a :class:`ConfigError` naming both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.fx

from .._pipeline.run import _register_custom_pass_type
from ..config import suggest
from ..errors import ConfigError

CUSTOM_PASS_KEYS = ("post_grad_custom_pre_pass", "post_grad_custom_post_pass")
"""The Inductor options passkit's pipeline is installed through."""

__all__ = ["CUSTOM_PASS_KEYS", "ComposedPass", "compile_patches", "merge_patches", "uses_cudagraphs"]

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_patches(mode: str | None = None, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Inductor config patches ``torch.compile(mode=..., options=...)`` asks for, as
    ``backend="inductor"`` would apply them. Bad input is a :class:`ConfigError`."""
    if mode is not None and options:
        raise ConfigError(
            "torch.compile: give either mode or options, not both (as for backend='inductor'); "
            "put the mode's settings in options: torch._inductor.list_mode_options(mode)"
        )
    if mode is not None and not isinstance(mode, str):
        raise ConfigError(f"torch.compile mode must be a string, one of {list(MODES)}; got {mode!r}")
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(
            f"torch.compile options must be a dict of Inductor options, got {type(options).__name__}"
        )
    if mode is not None:
        from torch._inductor import list_mode_options

        known_modes = list(list_mode_options())
        if mode not in known_modes:
            raise ConfigError(
                f"torch.compile mode={mode!r} is not a mode{suggest(mode, known_modes)}: one of {known_modes}"
            )
    if options:
        _check_names(options, "torch.compile options")
    import torch

    try:
        wrapper = torch._TorchCompileInductorWrapper(mode, dict(options or {}), None)
    except RuntimeError as exc:  # a wrong type: Inductor's message names the option
        raise ConfigError(f"torch.compile options: {exc}") from None
    return dict(wrapper.config)


def merge_patches(
    compile_options: Mapping[str, Any],
    backend_options: Mapping[str, Any],
    pipeline_patches: Mapping[str, Any],
) -> dict[str, Any]:
    """One compile's config patches: torch.compile's, the backend's ``inductor_config``,
    then the pipeline's custom passes (composed after a pass already in the same slot)."""
    merged = dict(backend_options)
    for key, value in compile_options.items():
        if key in merged and merged[key] is not value and merged[key] != value:
            raise ConfigError(
                f"Inductor option {key!r} is set twice: torch.compile(options=...) gives "
                f"{_short(value)}, passkit.backend(inductor_config=...) gives {_short(merged[key])}"
            )
        merged[key] = value
    for key, ours in pipeline_patches.items():
        existing = merged.get(key)
        if existing is None:
            merged[key] = ours
        elif callable(existing) or isinstance(existing, (list, tuple)):
            merged[key] = ComposedPass(existing, ours)
        else:
            raise ConfigError(
                f"Inductor option {key!r} holds {_short(existing)}, not a graph pass: passkit "
                "installs its pipeline there and can only compose with a callable pass"
            )
    return merged


class ComposedPass:
    """Runs an existing custom pass, then ours; its uuid combines both."""

    def __init__(self, first: Any, second: Any):
        _register_custom_pass_type(ComposedPass)
        self.first, self.second = first, second

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self) -> Any:
        first = self.first.uuid() if hasattr(self.first, "uuid") else None
        if first is None:
            return None  # the existing pass is uncacheable, so is the composition
        return (first, self.second.uuid())

    def __deepcopy__(self, memo: dict[int, Any]) -> ComposedPass:
        return self  # see StagePass.__deepcopy__


def uses_cudagraphs(patches: Mapping[str, Any]) -> bool:
    """Whether a compile with these patches asks for Inductor's CUDA graphs."""
    if "triton.cudagraphs" in patches:
        return bool(patches["triton.cudagraphs"])
    import torch._inductor.config as config

    return bool(config.triton.cudagraphs)


def _check_names(options: Mapping[str, Any], where: str) -> None:
    import torch._inductor.config as config

    known = list(config.get_config_copy())
    for key in options:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: option names are strings, got {_short(key)}")
        if key.replace("-", "_") not in known:
            raise ConfigError(
                f"{where}: {_short(key)} is not an Inductor option{suggest(key, known)} "
                "(torch._inductor.list_options() lists them)"
            )


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
