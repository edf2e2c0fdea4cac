"""The flashinfer API passkit calls, checked against the wheel of each supported release.

No GPU and no flashinfer import: the calls are read from passkit's own source
(``allreduce_rmsnorm/flashinfer_api.py``, every ``self._comm.<function>(...)`` and the
kernel entry point's ``handle.kernel(...)``, with the keywords each passes), and the
functions' signatures from the wheel's source (:mod:`flashinfer_wheels`). A keyword a
release no longer takes, a new parameter without a default, a function, pattern or
workspace attribute renamed: the test names the release and the call. Keywords passkit
passes only after probing them (``_accepts(fn, "weight_bias")``) may be absent.

The wheels are fetched once into ``~/.cache/passkit/flashinfer-wheels`` (about 170 MB for
the three releases); without a registry the test skips and says why.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from flashinfer_wheels import WheelApi, wheel
from passkit_fusion.allreduce_rmsnorm import flashinfer_api

RELEASES = ("0.6.11", "0.7.2.post1", "0.7.4")
"""The supported range's oldest release (``passkit-fusion[flashinfer]``'s floor: 0.6.11 is the
first whose ``create_allreduce_fusion_workspace`` takes ``group=``, which passkit passes), the
release the GPU suite ran on, and the newest."""

KERNEL = "kernel:trtllm_allreduce_fusion"
"""``trtllm_ar.get_trtllm_comm_module().trtllm_allreduce_fusion``, the entry point
:class:`~passkit_fusion.allreduce_rmsnorm.flashinfer_api.KernelApi` calls as ``handle.kernel``."""


@dataclasses.dataclass
class Call:
    where: str
    keywords: set[str] = dataclasses.field(default_factory=set)
    """Passed at every call."""
    conditional: set[str] = dataclasses.field(default_factory=set)
    """Passed through ``**extra`` (built in the same method) when a condition holds."""
    positional: int = 0
    """Arguments passed by position, before the keywords."""


def _is_name(node: ast.expr, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _target(func: ast.expr) -> str | None:
    """``self._comm.<name>`` -> ``name``; ``handle.kernel`` -> :data:`KERNEL`."""
    comm = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Attribute)
    if comm and _is_name(func.value.value, "self") and func.value.attr == "_comm":
        return func.attr
    if isinstance(func, ast.Attribute) and func.attr == "kernel" and isinstance(func.value, ast.Name):
        return KERNEL
    return None


def _extra_keywords(method: ast.FunctionDef) -> set[str]:
    """The keys a method puts into its ``extra`` dict: ``extra = {"k": ...}``,
    ``extra["k"] = ...``, ``extra.update(k=...)``."""
    keys: set[str] = set()
    for node in ast.walk(method):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name) and t.id == "extra" and node.value is not None:
                    for d in ast.walk(node.value):
                        if isinstance(d, ast.Dict):
                            keys |= {k.value for k in d.keys if isinstance(k, ast.Constant)}
                subscript = isinstance(t, ast.Subscript) and _is_name(t.value, "extra")
                if subscript and isinstance(t.slice, ast.Constant):
                    keys.add(t.slice.value)
        update = (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
        )
        if update and _is_name(node.func.value, "extra"):
            keys |= {k.arg for k in node.keywords if k.arg}
    return keys


def passkit_calls() -> tuple[dict[str, list[Call]], dict[str, set[str]], set[str]]:
    """What passkit's flashinfer adapter calls: ``({function: [Call]}, {function: probed
    keywords}, pattern names)`` read from its source."""
    tree = ast.parse(Path(flashinfer_api.__file__).read_text())
    calls: dict[str, list[Call]] = {}
    probed: dict[str, set[str]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for method in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            extra = _extra_keywords(method)
            for node in ast.walk(method):
                if not isinstance(node, ast.Call):
                    continue
                target = _target(node.func)
                if target is not None:
                    literal = {k.arg for k in node.keywords if k.arg}
                    spread = any(k.arg is None for k in node.keywords)
                    conditional = extra - literal if spread else set()
                    call = Call(f"{cls.name}.{method.name}", literal, conditional, len(node.args))
                    calls.setdefault(target, []).append(call)
    for node in ast.walk(tree):  # _accepts(comm.<function>, "keyword"), _accepts(kernel, "keyword")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_accepts":
            fn, keyword = node.args
            if not isinstance(keyword, ast.Constant):
                continue  # the kernel's KERNEL_PARAMETERS loop: all required
            name = fn.attr if isinstance(fn, ast.Attribute) else KERNEL
            probed.setdefault(name, set()).add(keyword.value)
    patterns = {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and re.fullmatch(r"kAR\w+", n.attr)
    }
    return calls, probed, patterns


def test_passkit_calls_are_read_from_its_source():
    """The reading above finds every call of the adapter (a change of its style would
    otherwise leave calls unchecked)."""
    calls, probed, patterns = passkit_calls()
    assert set(calls) == {
        "create_allreduce_fusion_workspace",
        "allreduce_fusion",
        KERNEL,
        "trtllm_create_ipc_workspace_for_all_reduce_fusion",
        "trtllm_allreduce_fusion",
        "trtllm_destroy_ipc_workspace_for_all_reduce_fusion",
    }
    kernel = calls[KERNEL][0]
    assert kernel.keywords == set(flashinfer_api.KERNEL_PARAMETERS)
    assert kernel.conditional == {"weight_bias"}
    assert {"quant_out", "scale_factor", "weight_bias"} <= calls["allreduce_fusion"][0].conditional
    assert probed["allreduce_fusion"] == {"weight_bias"} and probed[KERNEL] == {"weight_bias"}
    assert probed["trtllm_create_ipc_workspace_for_all_reduce_fusion"] == {"create_metadata"}
    assert patterns == {"kARResidualRMSNorm", "kARResidualRMSNormFP8Quant", "kARResidualRMSNormOutFP8Quant"}


def call_problems(api: WheelApi) -> list[str]:
    """Every call of passkit's adapter that this release would refuse, one line each."""
    calls, probed, patterns = passkit_calls()
    problems = []
    exports = api.exports()
    for name in ("trtllm_ar",):
        if not api.has_module(name):
            problems.append(f"flashinfer.comm.{name} is gone")
    for target, sites in calls.items():
        if target == KERNEL:
            sig = api.function("trtllm_ar", "trtllm_allreduce_fusion", within="get_trtllm_comm_module")
            label = "trtllm_ar.get_trtllm_comm_module().trtllm_allreduce_fusion"
        else:
            sig = api.exported_function(target)
            label = f"flashinfer.comm.{target}"
            if target not in exports:
                problems.append(f"{label} is not exported")
                continue
        if sig is None:
            problems.append(f"{label}: its definition is not found")
            continue
        for call in sites:
            by_position = set(sig.names[: min(call.positional, sig.positional)])
            if call.positional > sig.positional:
                problems.append(
                    f"{label} takes fewer than {call.positional} positional arguments ({call.where})"
                )
            for keyword in sorted(call.keywords | (call.conditional - probed.get(target, set()))):
                if not sig.accepts(keyword):
                    problems.append(f"{label} takes no {keyword!r} ({call.where} passes it)")
            for needed in sig.required:
                if needed not in call.keywords | by_position:
                    problems.append(f"{label} requires {needed!r}, which {call.where} does not pass")
    members = api.class_members("trtllm_ar", "AllReduceFusionPattern")
    problems += [f"AllReduceFusionPattern has no {p}" for p in sorted(patterns - members)]
    workspace = api.class_members("allreduce", "TRTLLMAllReduceFusionWorkspace")
    for attr in ("workspace_tensor", "destroy", "backend"):  # what KernelApi / UnifiedApi read
        if attr not in workspace:
            problems.append(f"the trtllm workspace (TRTLLMAllReduceFusionWorkspace) has no {attr!r}")
    return problems


@pytest.fixture(scope="module", params=RELEASES)
def release(request) -> WheelApi:
    found = wheel(request.param)
    if isinstance(found, str):
        pytest.skip(found)
    return WheelApi(found)


def test_every_call_matches_the_release(release):
    assert call_problems(release) == [], release.path.name


def test_probed_keywords_are_in_the_newest_release():
    """A keyword passkit probes for (``weight_bias``: absent from 0.6.11, present from 0.7.2.post1
    on) must still be there in the newest release: a probe of a keyword flashinfer dropped or
    renamed would turn its feature off without a word."""
    found = wheel(RELEASES[-1])
    if isinstance(found, str):
        pytest.skip(found)
    api = WheelApi(found)
    _, probed, _ = passkit_calls()
    kernel = api.function("trtllm_ar", "trtllm_allreduce_fusion", within="get_trtllm_comm_module")
    for target, keywords in probed.items():
        sig = kernel if target == KERNEL else api.exported_function(target)
        assert sig is not None, target
        assert {k for k in keywords if not sig.accepts(k)} == set(), target


def test_the_check_sees_a_renamed_keyword(tmp_path):
    """The check fails on a release that renamed a keyword passkit passes."""
    import zipfile

    found = wheel(RELEASES[-1])
    if isinstance(found, str):
        pytest.skip(found)
    renamed = tmp_path / found.name
    with zipfile.ZipFile(found) as src, zipfile.ZipFile(renamed, "w") as dst:
        for item in src.namelist():
            if item.startswith("flashinfer/comm/"):
                data = src.read(item)
                if item == "flashinfer/comm/allreduce.py":
                    data = data.replace(b"    rms_eps:", b"    rms_epsilon:")
                dst.writestr(item, data)
    problems = call_problems(WheelApi(renamed))
    assert any("flashinfer.comm.allreduce_fusion takes no 'rms_eps'" in p for p in problems), problems


def test_the_extra_floor_is_the_oldest_release_checked():
    pyproject = Path(flashinfer_api.__file__).parents[3] / "pyproject.toml"
    floor = re.search(r'"flashinfer-python>=([\w.]+)"', pyproject.read_text())
    assert floor is not None and floor.group(1) == RELEASES[0]
