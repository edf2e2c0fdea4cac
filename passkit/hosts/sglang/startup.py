"""Whether an SGLang server's arguments compile anything passkit sees (no SGLang import).

Read from SGLang 0.5.23's code: a phase's CUDA-graph backend is ``full``, ``breakable`` or
``disabled`` (``model_executor/cuda_graph_config.py``; ``tc_piecewise``, the torch.compile
piecewise backend that runs ``SGLangBackend``, is rejected by both parsers), and none of them
calls Inductor. Only ``--enable-torch-compile`` does: SGLang then wraps the model in
``torch.compile`` per captured decode batch size, inside its decode graph capture (on a GPU
a disabled decode backend captures nothing, so nothing is compiled either). A server whose
arguments compile nothing never runs a pass: :func:`nothing_compiled_reason` names the flag.
"""

from __future__ import annotations

from typing import Any

__all__ = ["nothing_compiled_reason"]

ADD_FLAG = (
    "add --enable-torch-compile (with --torch-compile-max-bs N: the decode batch sizes up to N are compiled)"
)


def nothing_compiled_reason(server_args: Any) -> str | None:
    """Why SGLang compiles nothing through Inductor with ``server_args`` (its parsed
    ``ServerArgs``), naming the flag to change, or None when it compiles."""
    if not getattr(server_args, "enable_torch_compile", False):
        return (
            "SGLang compiles nothing through torch.compile without --enable-torch-compile (its "
            f"CUDA-graph backends full, breakable and disabled capture without Inductor): {ADD_FLAG}"
        )
    if getattr(server_args, "device", None) == "cpu":
        return None
    off = [
        flag
        for flag, attribute in (
            ("--disable-cuda-graph", "disable_cuda_graph"),
            ("--disable-decode-cuda-graph", "disable_decode_cuda_graph"),
        )
        if getattr(server_args, attribute, False)
    ]
    if getattr(server_args, "cuda_graph_backend_decode", None) == "disabled":
        off.append("--cuda-graph-backend-decode disabled")
    if off:
        return (
            "SGLang compiles --enable-torch-compile's graphs inside its decode CUDA-graph capture, "
            f"which {' and '.join(off)} turns off: drop it"
        )
    return None
