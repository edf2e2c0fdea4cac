"""What vLLM makes of ``--compilation-config JSON`` (run by ``tests/hosts/test_vllm.py`` in a
fresh process, since ``passkit_vllm`` reads passkit's config when vLLM first imports it).

``python vllm_command_line_probe.py JSON [--worker] [--then PASSES ...]``: vLLM's own parser of ``vllm serve``'s
engine arguments (``EngineArgs.add_cli_args`` on a ``FlexibleArgumentParser``) reads the
argument, ``EngineArgs.from_cli_args`` builds the engine arguments (``CompilationConfig``
resolves ``inductor_passes`` there), and the pass found in its Inductor config is described
as JSON on stdout. ``--worker``: the ``VllmConfig`` goes to a spawned process, as vLLM sends
it to its engine core and workers, after this process's ``PASSKIT_PASSES`` was changed (the
pass must travel as its resolved config, not be rebuilt from the worker's environment).
``--then PASSES``: afterwards, a server started with ``PASSKIT_PASSES=PASSES`` (the argument
parsed again, ``passkit_vllm`` imported afresh), described under ``then``.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from typing import Any


def config_hash(config: Any) -> str:
    """vLLM's hash of a config (what names its compile-cache directory): ``compute_hash()``
    up to vLLM 0.33, ``vllm.config.utils.hash_config`` of its ``compile_factors()`` from 0.34."""
    if hasattr(config, "compute_hash"):
        return config.compute_hash()
    from vllm.config.utils import hash_config

    return hash_config(config)


def describe(vllm_config: Any) -> dict[str, Any]:
    found = vllm_config.compilation_config.inductor_compile_config.get("post_grad_custom_post_pass")
    pipeline = getattr(found, "pipeline", None)
    return {
        "type": f"{type(found).__module__}.{type(found).__qualname__}",
        "names": pipeline.names() if pipeline is not None else None,
        "options": pipeline.config.model_dump(mode="json")["passes"] if pipeline is not None else None,
        "uuid": found.uuid() if hasattr(found, "uuid") else None,
        "config_hash": config_hash(vllm_config.compilation_config),
        "inductor_passes": {k: str(v) for k, v in vllm_config.compilation_config.inductor_passes.items()},
        "is_passkit_vllm_attribute": found
        is getattr(sys.modules.get("passkit_vllm"), "post_grad_pass", None),
        "pid": os.getpid(),
    }


def in_worker(vllm_config: Any) -> dict[str, Any]:
    return {**describe(vllm_config), "worker_env_passes": os.environ.get("PASSKIT_PASSES")}


def parsed(argument: str) -> tuple[Any, Any]:
    """vLLM's parsed arguments and ``VllmConfig`` of ``--compilation-config argument``."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if not current_platform.device_type:  # no GPU: vLLM's UnspecifiedPlatform names no device,
        current_platform.device_type = "cpu"  # which the parser's defaults (DeviceConfig()) need
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--compilation-config", argument])
    engine_args = EngineArgs.from_cli_args(args)
    compilation = engine_args.compilation_config
    return args, VllmConfig(device_config=DeviceConfig(device="cpu"), compilation_config=compilation)


def main(argv: list[str]) -> None:
    args, vllm_config = parsed(argv[0])
    out: dict[str, Any] = {
        "parsed_type": type(args.compilation_config).__name__,  # what vLLM's parser made of the JSON
        "here": describe(vllm_config),
        "then": [],
    }
    if "--worker" in argv:
        os.environ["PASSKIT_PASSES"] = "cleanup"  # the worker inherits another config
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            out["worker"] = pool.apply(in_worker, (vllm_config,))
    for i, flag in enumerate(argv):
        if flag == "--then":
            os.environ["PASSKIT_PASSES"] = argv[i + 1]
            sys.modules.pop("passkit_vllm", None)  # a new server process imports it afresh
            out["then"].append(describe(parsed(argv[0])[1]))
    print("PROBE " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
